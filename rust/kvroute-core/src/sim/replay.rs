//! Trace replay on virtual time: a Mooncake trace through a [`Cluster`], summarised as a report.
//!
//! Arrivals are the trace's timestamps divided by `speedup`. Engines use the `xxh3` block hash
//! (their event hashes are then the router's content hashes, and hashing is cheap) and 512-token
//! trace blocks are synthesised as stable token blocks ([`TokenSynth`]). The only wall-clock read
//! in the simulator is the report's own `wall_time_s`.
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use super::blockhash::HashAlgo;
use super::cluster::{policy_reads_index, Cluster, ClusterConfig};
use super::engine::{EngineConfig, RequestOutput};
use super::request::NewRequest;
use super::trace::{load_mooncake, TokenSynth, TraceRecord};
use crate::scheduler::PolicyKind;
use crate::{Error, Result};

/// What to replay on.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayConfig {
    pub replicas: usize,
    /// A routing policy name ([`PolicyKind::parse`]).
    pub policy: String,
    /// An engine preset ([`crate::sim::preset::PRESETS`]).
    pub preset: String,
    /// Arrival-time divisor (2 = twice the trace's request rate).
    pub speedup: f64,
    pub num_gpu_blocks: Option<usize>,
    pub num_cpu_blocks: usize,
    pub block_size: Option<usize>,
    pub event_delay_s: f64,
    /// Replay only the first `limit` records.
    pub limit: Option<usize>,
    /// Seeds prompts, generated tokens and the policy's tie-breaking.
    pub seed: u64,
    pub metrics_interval_s: f64,
    /// Apply KV events to the router's index: `None` = only when the policy reads it.
    pub feed_index: Option<bool>,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            replicas: 8,
            policy: "round_robin".into(),
            preset: super::preset::DEFAULT_PRESET.into(),
            speedup: 1.0,
            num_gpu_blocks: None,
            num_cpu_blocks: 0,
            block_size: None,
            event_delay_s: 0.005,
            limit: None,
            seed: 0,
            metrics_interval_s: 0.1,
            feed_index: None,
        }
    }
}

/// Latency, throughput and cache figures of one replay (times in milliseconds unless named).
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayReport {
    pub policy: String,
    pub preset: String,
    pub replicas: usize,
    pub num_requests: usize,
    pub mean_ttft_ms: f64,
    pub p50_ttft_ms: f64,
    pub p90_ttft_ms: f64,
    pub p99_ttft_ms: f64,
    pub mean_e2e_ms: f64,
    pub p99_e2e_ms: f64,
    /// Virtual time from the first arrival to the last completion, seconds.
    pub duration_s: f64,
    pub request_throughput_rps: f64,
    pub output_tokens_per_s: f64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// Prompt tokens found on the GPU at first scheduling / prompt tokens.
    pub gpu_hit_ratio: f64,
    /// Prompt tokens loaded from the CPU tier / prompt tokens.
    pub cpu_hit_ratio: f64,
    pub requests_per_replica: Vec<u64>,
    /// Busiest replica's request count over the mean.
    pub load_imbalance: f64,
    pub preemptions: u64,
    pub engine_steps: u64,
    pub kv_event_batches: u64,
    pub wall_time_s: f64,
}

impl ReplayReport {
    /// The integer figures by name.
    pub fn counts(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("replicas", self.replicas as u64),
            ("num_requests", self.num_requests as u64),
            ("prompt_tokens", self.prompt_tokens),
            ("output_tokens", self.output_tokens),
            ("preemptions", self.preemptions),
            ("engine_steps", self.engine_steps),
            ("kv_event_batches", self.kv_event_batches),
        ]
    }

    /// The real-valued figures by name.
    pub fn figures(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("mean_ttft_ms", self.mean_ttft_ms),
            ("p50_ttft_ms", self.p50_ttft_ms),
            ("p90_ttft_ms", self.p90_ttft_ms),
            ("p99_ttft_ms", self.p99_ttft_ms),
            ("mean_e2e_ms", self.mean_e2e_ms),
            ("p99_e2e_ms", self.p99_e2e_ms),
            ("duration_s", self.duration_s),
            ("request_throughput_rps", self.request_throughput_rps),
            ("output_tokens_per_s", self.output_tokens_per_s),
            ("gpu_hit_ratio", self.gpu_hit_ratio),
            ("cpu_hit_ratio", self.cpu_hit_ratio),
            ("load_imbalance", self.load_imbalance),
            ("wall_time_s", self.wall_time_s),
        ]
    }
}

/// Replays a Mooncake JSONL file.
pub fn replay_mooncake(path: &Path, cfg: &ReplayConfig) -> Result<ReplayReport> {
    let records = load_mooncake(path, cfg.limit)?;
    replay_records(&records, cfg)
}

fn engine_config(cfg: &ReplayConfig) -> Result<EngineConfig> {
    let mut e = EngineConfig::from_preset(&cfg.preset)?;
    e.block_size = cfg.block_size.unwrap_or(e.block_size);
    e.num_gpu_blocks = cfg.num_gpu_blocks.unwrap_or(e.num_gpu_blocks);
    e.num_cpu_blocks = cfg.num_cpu_blocks;
    e.hash_algo = HashAlgo::Xxh3;
    e.seed = cfg.seed;
    e.validate()?;
    Ok(e)
}

/// Per-request timeline.
#[derive(Debug, Clone, Copy)]
struct Timeline {
    arrival: f64,
    first: f64,
    done: f64,
    outputs: u32,
}

/// Replays parsed records (in file order; timestamps must not decrease).
pub fn replay_records(records: &[TraceRecord], cfg: &ReplayConfig) -> Result<ReplayReport> {
    let started = Instant::now();
    if cfg.replicas == 0 {
        return Err(Error::InvalidArgument("replicas must be positive".into()));
    }
    if !(cfg.speedup.is_finite() && cfg.speedup > 0.0) {
        return Err(Error::InvalidArgument(format!(
            "speedup must be positive, got {}",
            cfg.speedup
        )));
    }
    let engine = engine_config(cfg)?;
    let synth = TokenSynth::new(cfg.seed, engine.vocab_size);
    let policy = PolicyKind::parse(&cfg.policy)?;
    let mut cluster = Cluster::new(&ClusterConfig {
        replicas: cfg.replicas,
        engine,
        policy,
        event_delay_s: cfg.event_delay_s,
        feed_index: cfg.feed_index.unwrap_or_else(|| policy_reads_index(policy)),
        metrics_interval_s: cfg.metrics_interval_s,
        seed: cfg.seed,
    })?;
    let blank = Timeline {
        arrival: 0.0,
        first: f64::NAN,
        done: f64::NAN,
        outputs: 0,
    };
    let mut tl = vec![blank; records.len()];
    let mut per_replica = vec![0u64; cfg.replicas];
    let mut last_ts = 0.0f64;
    for (i, rec) in records.iter().enumerate() {
        if rec.timestamp_ms < last_ts {
            return Err(Error::InvalidArgument(format!(
                "trace record {i} goes back in time"
            )));
        }
        last_ts = rec.timestamp_ms;
        let now = rec.timestamp_ms / 1000.0 / cfg.speedup;
        cluster.run_until(now, &mut |_, o, t| record(&mut tl, o, t));
        let mut prompt = Vec::new();
        synth.prompt(rec, &mut prompt);
        let req = NewRequest {
            id: Arc::from(i.to_string()),
            tag: i as u64,
            prompt,
            max_tokens: rec.output_length as u32,
            lora: None,
            salt: None,
            ignore_eos: true,
            eos_token_id: None,
        };
        tl[i].arrival = now;
        let w = cluster.submit(now, req, rec.output_length as u32)?;
        per_replica[w as usize] += 1;
    }
    cluster.run_until(f64::INFINITY, &mut |_, o, t| record(&mut tl, o, t));
    Ok(summarise(cfg, records, &tl, &cluster, per_replica, started))
}

fn record(tl: &mut [Timeline], o: &RequestOutput, t: f64) {
    let r = &mut tl[o.tag as usize];
    r.outputs += u32::from(o.token.is_some());
    if o.first {
        r.first = t;
    }
    if o.finish.is_some() {
        r.done = t;
    }
}

/// Linear-interpolation percentile (NumPy's default) of sorted values.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let pos = q / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn summarise(
    cfg: &ReplayConfig,
    records: &[TraceRecord],
    tl: &[Timeline],
    cluster: &Cluster,
    per_replica: Vec<u64>,
    started: Instant,
) -> ReplayReport {
    let mut ttft: Vec<f64> = tl.iter().map(|r| (r.first - r.arrival) * 1e3).collect();
    let mut e2e: Vec<f64> = tl.iter().map(|r| (r.done - r.arrival) * 1e3).collect();
    ttft.sort_by(f64::total_cmp);
    e2e.sort_by(f64::total_cmp);
    let start = tl.first().map_or(0.0, |r| r.arrival);
    let end = tl.iter().map(|r| r.done).fold(start, f64::max);
    let duration = (end - start).max(f64::MIN_POSITIVE);
    let output_tokens: u64 = tl.iter().map(|r| u64::from(r.outputs)).sum();
    let metrics: Vec<_> = cluster.engines().iter().map(|e| e.metrics()).collect();
    let queries: u64 = metrics.iter().map(|m| m.prefix_cache_queries).sum();
    let ratio = |x: u64| {
        if queries == 0 {
            0.0
        } else {
            x as f64 / queries as f64
        }
    };
    let mean_load = per_replica.iter().sum::<u64>() as f64 / per_replica.len() as f64;
    let max_load = per_replica.iter().copied().max().unwrap_or(0) as f64;
    ReplayReport {
        policy: cfg.policy.clone(),
        preset: cfg.preset.clone(),
        replicas: cfg.replicas,
        num_requests: tl.len(),
        mean_ttft_ms: mean(&ttft),
        p50_ttft_ms: percentile(&ttft, 50.0),
        p90_ttft_ms: percentile(&ttft, 90.0),
        p99_ttft_ms: percentile(&ttft, 99.0),
        mean_e2e_ms: mean(&e2e),
        p99_e2e_ms: percentile(&e2e, 99.0),
        duration_s: duration,
        request_throughput_rps: tl.len() as f64 / duration,
        output_tokens_per_s: output_tokens as f64 / duration,
        prompt_tokens: records.iter().map(|r| r.input_length as u64).sum(),
        output_tokens,
        gpu_hit_ratio: ratio(metrics.iter().map(|m| m.prefix_cache_hits).sum()),
        cpu_hit_ratio: ratio(metrics.iter().map(|m| m.external_prefix_cache_hits).sum()),
        requests_per_replica: per_replica,
        load_imbalance: if mean_load > 0.0 {
            max_load / mean_load
        } else {
            0.0
        },
        preemptions: metrics.iter().map(|m| m.preemptions).sum(),
        engine_steps: metrics.iter().map(|m| m.steps).sum(),
        kv_event_batches: cluster.batches_delivered,
        wall_time_s: started.elapsed().as_secs_f64(),
    }
}
