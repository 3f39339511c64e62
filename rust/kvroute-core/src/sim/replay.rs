//! Workload replay on virtual time: a trace or generated workload through a [`Cluster`],
//! summarised as a report.
//!
//! Arrivals come from the workload or an [`Arrival`] process, then are compressed by `speedup`
//! (or scaled to a mean `rate`). Engines use the `xxh3` block hash (their event hashes are then
//! the router's content hashes, and hashing is cheap) and id blocks are synthesised as stable
//! token blocks ([`TokenSynth`]). The only wall-clock read in the simulator is the report's own
//! `wall_time_s`.
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use super::arrival::Arrival;
use super::blockhash::HashAlgo;
use super::cluster::{policy_reads_index, Cluster, ClusterConfig};
use super::engine::{EngineConfig, RequestOutput};
use super::request::NewRequest;
use super::trace::{TokenSynth, TraceRecord, MOONCAKE_BLOCK_TOKENS};
use super::workload::Workload;
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
    /// Arrival-time divisor (2 = twice the workload's request rate).
    pub speedup: f64,
    /// Instead of `speedup`: compress arrivals to this mean rate (requests per second).
    pub rate: Option<f64>,
    /// Where arrival times come from before scaling.
    pub arrival: Arrival,
    pub num_gpu_blocks: Option<usize>,
    pub num_cpu_blocks: usize,
    pub block_size: Option<usize>,
    pub event_delay_s: f64,
    /// Replay only the first `limit` records.
    pub limit: Option<usize>,
    /// Seeds prompts, generated tokens, arrival draws and the policy's tie-breaking.
    pub seed: u64,
    pub metrics_interval_s: f64,
    /// Apply KV events to the routers' indexes: `None` = only when the policy reads them.
    pub feed_index: Option<bool>,
    /// Router replicas, each with its own scheduler and index.
    pub routers: usize,
    /// Peer fan-out delay between routers (`None`: no fan-out).
    pub fanout_delay_s: Option<f64>,
    /// Policy knobs to override, by name.
    pub params: Vec<(String, f64)>,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            replicas: 8,
            policy: "round_robin".into(),
            preset: super::preset::DEFAULT_PRESET.into(),
            speedup: 1.0,
            rate: None,
            arrival: Arrival::Trace,
            num_gpu_blocks: None,
            num_cpu_blocks: 0,
            block_size: None,
            event_delay_s: 0.005,
            limit: None,
            seed: 0,
            metrics_interval_s: 0.1,
            feed_index: None,
            routers: 1,
            fanout_delay_s: None,
            params: Vec::new(),
        }
    }
}

/// Latency, throughput and cache figures of one replay (times in milliseconds unless named).
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayReport {
    pub policy: String,
    pub preset: String,
    pub workload: String,
    pub replicas: usize,
    pub routers: usize,
    pub num_requests: usize,
    /// The arrival-time divisor applied.
    pub speedup: f64,
    /// Mean arrival rate after scaling, requests per second.
    pub offered_rps: f64,
    pub mean_ttft_ms: f64,
    pub p50_ttft_ms: f64,
    pub p90_ttft_ms: f64,
    pub p99_ttft_ms: f64,
    pub mean_e2e_ms: f64,
    pub p50_e2e_ms: f64,
    pub p90_e2e_ms: f64,
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
    /// Prompt tokens each replica computed (prefill work, preemption recompute included).
    pub prefill_tokens_per_replica: Vec<u64>,
    /// Busiest replica's request count over the mean.
    pub load_imbalance: f64,
    /// Busiest replica's computed prefill tokens over the mean.
    pub work_imbalance: f64,
    pub preemptions: u64,
    pub engine_steps: u64,
    pub kv_event_batches: u64,
    pub peer_messages: u64,
    pub wall_time_s: f64,
}

impl ReplayReport {
    /// The integer figures by name.
    pub fn counts(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("replicas", self.replicas as u64),
            ("routers", self.routers as u64),
            ("num_requests", self.num_requests as u64),
            ("prompt_tokens", self.prompt_tokens),
            ("output_tokens", self.output_tokens),
            ("preemptions", self.preemptions),
            ("engine_steps", self.engine_steps),
            ("kv_event_batches", self.kv_event_batches),
            ("peer_messages", self.peer_messages),
        ]
    }

    /// The real-valued figures by name.
    pub fn figures(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("speedup", self.speedup),
            ("offered_rps", self.offered_rps),
            ("mean_ttft_ms", self.mean_ttft_ms),
            ("p50_ttft_ms", self.p50_ttft_ms),
            ("p90_ttft_ms", self.p90_ttft_ms),
            ("p99_ttft_ms", self.p99_ttft_ms),
            ("mean_e2e_ms", self.mean_e2e_ms),
            ("p50_e2e_ms", self.p50_e2e_ms),
            ("p90_e2e_ms", self.p90_e2e_ms),
            ("p99_e2e_ms", self.p99_e2e_ms),
            ("duration_s", self.duration_s),
            ("request_throughput_rps", self.request_throughput_rps),
            ("output_tokens_per_s", self.output_tokens_per_s),
            ("gpu_hit_ratio", self.gpu_hit_ratio),
            ("cpu_hit_ratio", self.cpu_hit_ratio),
            ("load_imbalance", self.load_imbalance),
            ("work_imbalance", self.work_imbalance),
            ("wall_time_s", self.wall_time_s),
        ]
    }
}

/// Replays a Mooncake JSONL file.
pub fn replay_mooncake(path: &Path, cfg: &ReplayConfig) -> Result<ReplayReport> {
    let w = Workload::mooncake(path, cfg.limit)?;
    replay_workload(&w, cfg, &mut |_, _| true)
}

/// The engine configuration a replay runs (preset, overrides, `xxh3` hashes).
pub fn engine_config(cfg: &ReplayConfig) -> Result<EngineConfig> {
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

/// Replays parsed Mooncake records (in file order; timestamps must not decrease).
pub fn replay_records(records: &[TraceRecord], cfg: &ReplayConfig) -> Result<ReplayReport> {
    let w = Workload {
        name: "trace".into(),
        block_tokens: MOONCAKE_BLOCK_TOKENS,
        records: records.to_vec(),
    };
    replay_workload(&w, cfg, &mut |_, _| true)
}

/// Arrival times in seconds after the arrival process and the load scaling, and the speedup.
fn arrival_times(w: &Workload, cfg: &ReplayConfig) -> Result<(Vec<f64>, f64)> {
    let mut records = w.records.clone();
    cfg.arrival.apply(&mut records, cfg.seed)?;
    for (i, pair) in records.windows(2).enumerate() {
        if pair[1].timestamp_ms < pair[0].timestamp_ms {
            return Err(Error::InvalidArgument(format!(
                "trace record {} goes back in time",
                i + 1
            )));
        }
    }
    let span = match (records.first(), records.last()) {
        (Some(a), Some(b)) => (b.timestamp_ms - a.timestamp_ms) / 1000.0,
        _ => 0.0,
    };
    let speedup = match cfg.rate {
        Some(rate) if rate.is_finite() && rate > 0.0 => {
            if span <= 0.0 || records.len() < 2 {
                1.0
            } else {
                rate * span / (records.len() - 1) as f64
            }
        }
        Some(rate) => {
            return Err(Error::InvalidArgument(format!(
                "rate must be positive, got {rate}"
            )))
        }
        None => cfg.speedup,
    };
    if !(speedup.is_finite() && speedup > 0.0) {
        return Err(Error::InvalidArgument(format!(
            "speedup must be positive, got {speedup}"
        )));
    }
    let times = records
        .iter()
        .map(|r| r.timestamp_ms / 1000.0 / speedup)
        .collect();
    Ok((times, speedup))
}

/// Replays a workload. `progress(done, total)` is called every few hundred arrivals and at the
/// end; returning false stops the replay with an error.
pub fn replay_workload(
    w: &Workload,
    cfg: &ReplayConfig,
    progress: &mut dyn FnMut(usize, usize) -> bool,
) -> Result<ReplayReport> {
    let started = Instant::now();
    if cfg.replicas == 0 {
        return Err(Error::InvalidArgument("replicas must be positive".into()));
    }
    if cfg.routers == 0 {
        return Err(Error::InvalidArgument("routers must be positive".into()));
    }
    let records = &w.records[..cfg
        .limit
        .map_or(w.records.len(), |l| l.min(w.records.len()))];
    let w = Workload {
        name: w.name.clone(),
        block_tokens: w.block_tokens,
        records: records.to_vec(),
    };
    let (times, speedup) = arrival_times(&w, cfg)?;
    let engine = engine_config(cfg)?;
    let synth = TokenSynth::with_block_tokens(cfg.seed, engine.vocab_size, w.block_tokens);
    let policy = PolicyKind::parse(&cfg.policy)?;
    let mut cluster = Cluster::new(&ClusterConfig {
        replicas: cfg.replicas,
        engine,
        policy,
        event_delay_s: cfg.event_delay_s,
        feed_index: cfg.feed_index.unwrap_or_else(|| policy_reads_index(policy)),
        metrics_interval_s: cfg.metrics_interval_s,
        seed: cfg.seed,
        routers: cfg.routers,
        fanout_delay_s: cfg.fanout_delay_s,
        params: cfg.params.clone(),
    })?;
    let blank = Timeline {
        arrival: 0.0,
        first: f64::NAN,
        done: f64::NAN,
        outputs: 0,
    };
    let n = w.records.len();
    let mut tl = vec![blank; n];
    let stopped = || Error::InvalidArgument("replay stopped by its progress callback".into());
    for (i, rec) in w.records.iter().enumerate() {
        let now = times[i];
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
        cluster.submit(now, req, rec.output_length as u32)?;
        if i % 512 == 511 && !progress(i + 1, n) {
            return Err(stopped());
        }
    }
    cluster.run_until(f64::INFINITY, &mut |_, o, t| record(&mut tl, o, t));
    if let Some(e) = cluster.take_error() {
        return Err(e);
    }
    let per_replica = cluster.routed_per_replica.clone();
    if !progress(n, n) {
        return Err(stopped());
    }
    let offered = if n > 1 && times[n - 1] > times[0] {
        (n - 1) as f64 / (times[n - 1] - times[0])
    } else {
        f64::INFINITY
    };
    let mut r = summarise(cfg, &w.records, &tl, &cluster, per_replica, started);
    r.workload = w.name.clone();
    r.speedup = speedup;
    r.offered_rps = offered;
    r.wall_time_s = started.elapsed().as_secs_f64();
    Ok(r)
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
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let pos = q / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// Largest over mean (0 for no data).
pub fn imbalance(v: &[u64]) -> f64 {
    let mean = v.iter().sum::<u64>() as f64 / v.len().max(1) as f64;
    let max = v.iter().copied().max().unwrap_or(0) as f64;
    if mean > 0.0 {
        max / mean
    } else {
        0.0
    }
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
    let work: Vec<u64> = metrics.iter().map(|m| m.prompt_tokens_computed).collect();
    ReplayReport {
        policy: cfg.policy.clone(),
        preset: cfg.preset.clone(),
        workload: String::new(),
        replicas: cfg.replicas,
        routers: cfg.routers,
        num_requests: tl.len(),
        speedup: 1.0,
        offered_rps: 0.0,
        mean_ttft_ms: mean(&ttft),
        p50_ttft_ms: percentile(&ttft, 50.0),
        p90_ttft_ms: percentile(&ttft, 90.0),
        p99_ttft_ms: percentile(&ttft, 99.0),
        mean_e2e_ms: mean(&e2e),
        p50_e2e_ms: percentile(&e2e, 50.0),
        p90_e2e_ms: percentile(&e2e, 90.0),
        p99_e2e_ms: percentile(&e2e, 99.0),
        duration_s: duration,
        request_throughput_rps: tl.len() as f64 / duration,
        output_tokens_per_s: output_tokens as f64 / duration,
        prompt_tokens: records.iter().map(|r| r.input_length as u64).sum(),
        output_tokens,
        gpu_hit_ratio: ratio(metrics.iter().map(|m| m.prefix_cache_hits).sum()),
        cpu_hit_ratio: ratio(metrics.iter().map(|m| m.external_prefix_cache_hits).sum()),
        load_imbalance: imbalance(&per_replica),
        work_imbalance: imbalance(&work),
        requests_per_replica: per_replica,
        prefill_tokens_per_replica: work,
        preemptions: metrics.iter().map(|m| m.preemptions).sum(),
        engine_steps: metrics.iter().map(|m| m.steps).sum(),
        kv_event_batches: cluster.batches_delivered,
        peer_messages: cluster.peer_messages,
        wall_time_s: started.elapsed().as_secs_f64(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0, 10.0];
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 50.0), 3.0);
        assert_eq!(percentile(&v, 100.0), 10.0);
        // numpy.percentile([1, 2, 3, 4, 10], 90) == 7.6
        assert!((percentile(&v, 90.0) - 7.6).abs() < 1e-12);
        assert!((percentile(&v, 99.0) - 9.76).abs() < 1e-12);
        assert_eq!(percentile(&[], 50.0), 0.0);
        assert_eq!(percentile(&[5.0], 99.0), 5.0);
    }

    #[test]
    fn imbalance_is_max_over_mean() {
        assert_eq!(imbalance(&[10, 10, 10, 10]), 1.0);
        assert_eq!(imbalance(&[30, 10, 10, 10]), 2.0);
        assert_eq!(imbalance(&[0, 0]), 0.0);
        assert_eq!(imbalance(&[]), 0.0);
    }
}
