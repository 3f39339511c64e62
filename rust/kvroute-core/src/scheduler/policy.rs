//! Routing policies: pure functions from per-worker candidates to a choice.
//!
//! `kvroute` (the default) estimates each worker's time-to-first-token for this request and takes
//! the smallest; the others are faithful re-implementations of peers' published policies
//! (`shared/docs/landscape.md`), kept so benchmarks compare policies on one code path.
use super::ledger::Load;
use crate::{Error, Result, WorkerId};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    Kvroute,
    RoundRobin,
    Random,
    LeastLoaded,
    RayPrefixAffinity,
    SglangCacheAware,
    DynamoCost,
    LlmDWeighted,
    PrebleE2,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 9] = [
        PolicyKind::Kvroute,
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::LeastLoaded,
        PolicyKind::RayPrefixAffinity,
        PolicyKind::SglangCacheAware,
        PolicyKind::DynamoCost,
        PolicyKind::LlmDWeighted,
        PolicyKind::PrebleE2,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Kvroute => "kvroute",
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastLoaded => "least_loaded",
            PolicyKind::RayPrefixAffinity => "ray_prefix_affinity",
            PolicyKind::SglangCacheAware => "sglang_cache_aware",
            PolicyKind::DynamoCost => "dynamo_cost",
            PolicyKind::LlmDWeighted => "llm_d_weighted",
            PolicyKind::PrebleE2 => "preble_e2",
        }
    }

    pub fn parse(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| Error::UnknownPolicy(name.to_string()))
    }

    /// Policies that route on their own tree of past decisions instead of engine events.
    pub fn uses_approx_tree(self) -> bool {
        matches!(
            self,
            PolicyKind::RayPrefixAffinity | PolicyKind::SglangCacheAware
        )
    }
}

/// Knobs of the policies. Times in seconds, sizes in tokens or blocks as named.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyParams {
    // kvroute's time-to-first-token model (defaults: an 8B model on one H100, see README).
    /// Prefill compute time per uncached token.
    pub prefill_s_per_token: f64,
    /// Fixed cost of one engine step.
    pub step_s: f64,
    /// Extra step time per running decode sequence (decode interferes with prefill).
    pub decode_s_per_seq: f64,
    /// Tokens one engine step can take (vLLM `max_num_batched_tokens`).
    pub max_batched_tokens: u32,
    /// Attention time per (new token, context token) pair of a prefill: what makes a long
    /// prompt cost more than linearly, and a long cached prefix worth more than its length.
    pub attn_s_per_token_pair: f64,
    /// Time to load one token's KV from the CPU tier (well below recompute).
    pub cpu_load_s_per_token: f64,
    /// How many times its recompute cost a token pushed out by KV-memory overflow is charged.
    pub kv_pressure_factor: f64,
    /// How many times its prefill time each computed token that evicts cached blocks is charged
    /// as cache pollution (the hits later requests lose).
    pub pollution_factor: f64,
    /// How many times its prefill time each computed token is charged for the compute it takes
    /// from the fleet (work later requests queue behind), evicting or not.
    pub compute_factor: f64,
    /// Fraction of the time since a worker's current prefill started that is credited as done
    /// queued prefill work (1 = the engine did nothing else); 0 = the booked queue as is.
    pub prefill_drain: f64,
    /// Time constant (seconds) of the prefix heat: how long a reuse of a prefix keeps counting.
    pub heat_window_s: f64,
    /// With peer routers: how strongly to hedge against peers' concurrent decisions (ghost
    /// weight multiplier, see [`super::hedge`]); 0 = off.
    pub peer_hedge: f64,
    /// With peer routers: a peer reservation arriving this long (seconds) after one of this
    /// router's decisions was decided concurrently with it (about the fan-out latency).
    pub peer_window_s: f64,
    /// With peer routers deciding concurrently: the longest a request waits for the next
    /// decision window (seconds, see [`super::hedge::Hedge::pace`]); 0 = never wait.
    pub peer_pace_max_s: f64,
    // Ray Serve PrefixCacheAffinityRouter
    pub ray_imbalanced_threshold: f64,
    pub ray_match_rate_threshold: f64,
    // SGLang cache_aware
    pub sglang_balance_abs: f64,
    pub sglang_balance_rel: f64,
    pub sglang_cache_threshold: f64,
    // Dynamo KV router
    pub dynamo_overlap_weight: f64,
    pub dynamo_cpu_credit: f64,
    pub dynamo_active_weight: f64,
    // llm-d
    pub llmd_prefix_weight: f64,
    pub llmd_queue_weight: f64,
    pub llmd_kv_weight: f64,
    pub llmd_cpu_credit: f64,
    // Preble E2
    pub preble_rebalance_ratio: f64,
}

impl Default for PolicyParams {
    fn default() -> Self {
        PolicyParams {
            prefill_s_per_token: 5.0e-5,
            step_s: 0.006,
            decode_s_per_seq: 5.0e-5,
            max_batched_tokens: 8192,
            attn_s_per_token_pair: 1.2e-9,
            cpu_load_s_per_token: 5.0e-6,
            kv_pressure_factor: 1.0,
            pollution_factor: 13.0,
            compute_factor: 0.0,
            prefill_drain: 0.0,
            heat_window_s: 10.0,
            peer_hedge: 1.0,
            peer_window_s: 0.005,
            peer_pace_max_s: 0.02,
            ray_imbalanced_threshold: 10.0,
            ray_match_rate_threshold: 0.1,
            sglang_balance_abs: 64.0,
            sglang_balance_rel: 1.5,
            sglang_cache_threshold: 0.3,
            dynamo_overlap_weight: 1.0,
            dynamo_cpu_credit: 0.75,
            dynamo_active_weight: 0.0,
            llmd_prefix_weight: 2.0,
            llmd_queue_weight: 2.0,
            llmd_kv_weight: 1.0,
            llmd_cpu_credit: 0.8,
            preble_rebalance_ratio: 1.5,
        }
    }
}

macro_rules! params_by_name {
    ($($f:ident),* $(,)?) => {
        impl PolicyParams {
            /// Names of every knob, as accepted by [`PolicyParams::set`].
            pub const NAMES: &'static [&'static str] = &["max_batched_tokens", $(stringify!($f)),*];

            /// Sets one knob by name (configuration files, CLI, bindings).
            pub fn set(&mut self, name: &str, value: f64) -> Result<()> {
                if !value.is_finite() || value < 0.0 {
                    return Err(Error::InvalidArgument(format!("{name} must be a finite number >= 0, got {value}")));
                }
                match name {
                    "max_batched_tokens" => self.max_batched_tokens = value.max(1.0) as u32,
                    $(stringify!($f) => self.$f = value,)*
                    _ => return Err(Error::InvalidArgument(format!("unknown policy parameter {name:?}"))),
                }
                Ok(())
            }

            /// Every knob and its value.
            pub fn items(&self) -> Vec<(&'static str, f64)> {
                let mut v = vec![("max_batched_tokens", f64::from(self.max_batched_tokens))];
                $(v.push((stringify!($f), self.$f));)*
                v
            }
        }
    };
}

params_by_name!(
    prefill_s_per_token,
    attn_s_per_token_pair,
    step_s,
    decode_s_per_seq,
    cpu_load_s_per_token,
    kv_pressure_factor,
    pollution_factor,
    compute_factor,
    prefill_drain,
    heat_window_s,
    peer_hedge,
    peer_window_s,
    peer_pace_max_s,
    ray_imbalanced_threshold,
    ray_match_rate_threshold,
    sglang_balance_abs,
    sglang_balance_rel,
    sglang_cache_threshold,
    dynamo_overlap_weight,
    dynamo_cpu_credit,
    dynamo_active_weight,
    llmd_prefix_weight,
    llmd_queue_weight,
    llmd_kv_weight,
    llmd_cpu_credit,
    preble_rebalance_ratio,
);

/// Engine-reported load (vLLM `/metrics`), when the caller has it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineMetrics {
    pub running: u32,
    pub waiting: u32,
    /// `vllm:kv_cache_usage_perc`, 0..1.
    pub kv_usage: f64,
}

/// Everything a policy may look at for one eligible worker.
#[derive(Debug, Clone, Copy, Default)]
pub struct Candidate {
    pub worker: WorkerId,
    /// Cached prefix in the exact (event-driven) index, in blocks.
    pub gpu_blocks: u32,
    pub cpu_blocks: u32,
    /// Cached prefix in the policy's own approximate tree (Ray, SGLang), in blocks.
    pub approx_blocks: u32,
    /// Entries of this worker in the approximate tree (Ray's "smallest tree").
    pub approx_entries: u64,
    /// Blocks the exact index holds for this worker (any tier, speculative included): how full
    /// its cache is.
    pub resident_blocks: u64,
    /// Seconds since the worker's current prefill started (its queue became non-empty, or a
    /// prefill left it), 0 if none: part of the queued work is already done.
    pub prefill_elapsed_s: f64,
    pub load: Load,
    /// KV capacity in blocks (0 = unknown).
    pub capacity_blocks: u32,
    pub metrics: Option<EngineMetrics>,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct RequestInfo {
    pub prompt_tokens: u32,
    pub expected_output_tokens: u32,
    /// Full blocks in the prompt.
    pub blocks: u32,
    pub block_size: u32,
    /// How many other requests recently reused the same cached prefix (decayed count, see
    /// [`PolicyParams::heat_window_s`]): 0 for a prefix only this request's own history shares.
    pub prefix_heat: f64,
}

/// Why a worker was chosen: the terms of kvroute's TTFT model for it (computed for every
/// policy, so logs and metrics compare policies on one scale) and the policy's own score.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Breakdown {
    /// The policy's own score for the chosen worker (its units depend on the policy).
    pub score: f64,
    /// kvroute's estimate of the time to first token on the chosen worker, seconds, plus its
    /// cache-pollution charge (kvroute's score).
    pub est_ttft_s: f64,
    /// Prefill tokens queued ahead of this request there.
    pub queued_prefill_tokens: u64,
    /// Prompt tokens that must be computed there.
    pub uncached_tokens: u64,
    /// Their prefill work in token-equivalents: the uncached tokens plus their attention over
    /// the cached prefix and each other, at `prefill_s_per_token` (what the ledger books).
    pub work_tokens: u64,
    /// Prompt tokens loaded from the CPU tier there.
    pub cpu_tokens: u64,
    pub active: u32,
    pub decoding: u32,
    /// Fraction of KV capacity booked there (0 if unknown).
    pub kv_usage: f64,
}

/// Prefill work of `uncached` new tokens after `cached` ones, in token-equivalents: each new
/// token attends to the cached prefix and to the new tokens before it.
pub fn work_tokens(p: &PolicyParams, uncached: u64, cached: u64) -> u64 {
    if p.attn_s_per_token_pair <= 0.0 || p.prefill_s_per_token <= 0.0 {
        return uncached;
    }
    let (u, c) = (uncached as f64, cached as f64);
    let pairs = u * c + u * (u + 1.0) / 2.0;
    uncached + (pairs * p.attn_s_per_token_pair / p.prefill_s_per_token) as u64
}

/// Terms of the TTFT estimate for one worker.
pub fn ttft_terms(p: &PolicyParams, req: &RequestInfo, c: &Candidate) -> Breakdown {
    let bs = u64::from(req.block_size.max(1));
    let prompt = u64::from(req.prompt_tokens);
    let gpu_tok = (u64::from(c.gpu_blocks) * bs).min(prompt);
    let cpu_tok = (u64::from(c.cpu_blocks) * bs).min(prompt - gpu_tok);
    let uncached = prompt - gpu_tok - cpu_tok;
    let own = work_tokens(p, uncached, gpu_tok + cpu_tok);
    let mut queued = c.load.prefill_tokens;
    let mut booked = c.load.prefill_work.max(queued);
    if p.prefill_drain > 0.0
        && booked > 0
        && c.prefill_elapsed_s > 0.0
        && p.prefill_s_per_token > 0.0
    {
        let done = (c.prefill_elapsed_s * p.prefill_drain / p.prefill_s_per_token) as u64;
        let left = booked.saturating_sub(done);
        queued = (queued as f64 * left as f64 / booked as f64) as u64;
        booked = left;
    }
    let work = booked + own;
    let chunk = u64::from(p.max_batched_tokens.max(1));
    let steps = work.div_ceil(chunk).max(1) as f64;
    let mut t = work as f64 * p.prefill_s_per_token
        + cpu_tok as f64 * p.cpu_load_s_per_token
        + steps * (p.step_s + f64::from(c.load.decoding) * p.decode_s_per_seq);
    let mut usage = 0.0;
    if c.capacity_blocks > 0 {
        let cap = f64::from(c.capacity_blocks);
        let booked = c.load.kv_blocks as f64 / cap;
        usage = c.metrics.map_or(booked, |m| booked.max(m.kv_usage));
        let need = (prompt + u64::from(req.expected_output_tokens)).div_ceil(bs) as f64
            - f64::from(c.gpu_blocks);
        let free = cap * (1.0 - usage);
        if need > free {
            // Blocks that do not fit push running requests out (preemption and recompute).
            t += (need - free) * bs as f64 * p.prefill_s_per_token * p.kv_pressure_factor;
        }
    }
    // Not time this request waits: the cache its computed tokens take from later requests. A
    // copy of a prefix other requests keep reusing (a hot system prompt) is not waste, so the
    // charge fades with the prefix's heat.
    // Only the tokens that push cached blocks out pollute: none while the cache has room.
    let evicting = if c.capacity_blocks > 0 {
        let over = (c.resident_blocks + uncached.div_ceil(bs))
            .saturating_sub(u64::from(c.capacity_blocks));
        uncached.min(over * bs)
    } else {
        uncached
    };
    let pollution = (evicting as f64 * p.pollution_factor + uncached as f64 * p.compute_factor)
        * p.prefill_s_per_token
        * (-req.prefix_heat).exp();
    // The reported estimate is the policy's score: TTFT plus this charge (both in seconds).
    Breakdown {
        score: t + pollution,
        est_ttft_s: t + pollution,
        queued_prefill_tokens: queued,
        uncached_tokens: uncached,
        work_tokens: own,
        cpu_tokens: cpu_tok,
        active: c.load.active,
        decoding: c.load.decoding,
        kv_usage: usage,
    }
}

/// A tiny seeded generator (splitmix64): policies never touch a global RNG.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x853c_49e6_748f_ea9b)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

/// Mutable policy state (round-robin cursor, generator).
#[derive(Debug, Clone)]
pub struct PolicyState {
    pub rr: u64,
    pub rng: Rng,
}

/// Index of the minimum of `key` over `cands`, ties broken at random.
fn argmin_by(
    cands: &[Candidate],
    rng: &mut Rng,
    mut key: impl FnMut(&Candidate) -> f64,
) -> (usize, f64) {
    let mut best = f64::INFINITY;
    let mut ties = 0usize;
    let mut pick = 0usize;
    for (i, c) in cands.iter().enumerate() {
        let k = key(c);
        if k < best - 1e-12 {
            best = k;
            pick = i;
            ties = 1;
        } else if (k - best).abs() <= 1e-12 {
            ties += 1;
            // Reservoir sampling over the tied set.
            if rng.below(ties) == 0 {
                pick = i;
            }
        }
    }
    (pick, best)
}

fn least_active(cands: &[Candidate], rng: &mut Rng) -> (usize, f64) {
    argmin_by(cands, rng, |c| f64::from(c.load.active))
}

/// Picks a candidate. `cands` is non-empty.
pub fn choose(
    kind: PolicyKind,
    p: &PolicyParams,
    req: &RequestInfo,
    cands: &[Candidate],
    st: &mut PolicyState,
) -> (usize, f64) {
    debug_assert!(!cands.is_empty());
    let rng = &mut st.rng;
    match kind {
        PolicyKind::Kvroute => argmin_by(cands, rng, |c| ttft_terms(p, req, c).score),
        PolicyKind::RoundRobin => {
            let i = (st.rr % cands.len() as u64) as usize;
            st.rr += 1;
            (i, 0.0)
        }
        PolicyKind::Random => (rng.below(cands.len()), 0.0),
        PolicyKind::LeastLoaded => least_active(cands, rng),
        PolicyKind::RayPrefixAffinity => ray(p, req, cands, rng),
        PolicyKind::SglangCacheAware => sglang(p, req, cands, rng),
        PolicyKind::DynamoCost => argmin_by(cands, rng, |c| {
            let credit = f64::from(c.gpu_blocks) + p.dynamo_cpu_credit * f64::from(c.cpu_blocks);
            let prefill = (f64::from(req.blocks) - credit).max(0.0);
            p.dynamo_overlap_weight * prefill
                + c.load.kv_blocks as f64
                + p.dynamo_active_weight * f64::from(c.load.active)
        }),
        PolicyKind::LlmDWeighted => llm_d(p, req, cands, rng),
        PolicyKind::PrebleE2 => preble(p, req, cands, rng),
    }
}

/// Ray Serve: longest match when balanced and the match rate clears the threshold, else the
/// smallest tree; under imbalance, power of two choices on queue length.
fn ray(p: &PolicyParams, req: &RequestInfo, cands: &[Candidate], rng: &mut Rng) -> (usize, f64) {
    let q = |c: &Candidate| f64::from(c.load.active);
    let max = cands.iter().map(q).fold(f64::MIN, f64::max);
    let min = cands.iter().map(q).fold(f64::MAX, f64::min);
    if max - min > p.ray_imbalanced_threshold {
        let a = rng.below(cands.len());
        let b = rng.below(cands.len());
        let i = if q(&cands[a]) <= q(&cands[b]) { a } else { b };
        return (i, q(&cands[i]));
    }
    let (i, best) = argmin_by(cands, rng, |c| -f64::from(c.approx_blocks));
    let rate = -best / f64::from(req.blocks.max(1));
    if req.blocks > 0 && rate >= p.ray_match_rate_threshold {
        (i, rate)
    } else {
        argmin_by(cands, rng, |c| c.approx_entries as f64)
    }
}

/// SGLang `cache_aware`: least loaded when imbalanced; else the longest match if it covers more
/// than `cache_threshold` of the request, else the least loaded.
fn sglang(p: &PolicyParams, req: &RequestInfo, cands: &[Candidate], rng: &mut Rng) -> (usize, f64) {
    let q = |c: &Candidate| f64::from(c.load.active);
    let max = cands.iter().map(q).fold(f64::MIN, f64::max);
    let min = cands.iter().map(q).fold(f64::MAX, f64::min);
    if max - min > p.sglang_balance_abs && max > p.sglang_balance_rel * min {
        return least_active(cands, rng);
    }
    let (i, best) = argmin_by(cands, rng, |c| -f64::from(c.approx_blocks));
    let rate = -best / f64::from(req.blocks.max(1));
    if req.blocks > 0 && rate > p.sglang_cache_threshold {
        (i, rate)
    } else {
        least_active(cands, rng)
    }
}

/// llm-d: weighted sum of normalised prefix, queue and KV-utilisation scores; highest wins.
fn llm_d(p: &PolicyParams, req: &RequestInfo, cands: &[Candidate], rng: &mut Rng) -> (usize, f64) {
    let queue = |c: &Candidate| match c.metrics {
        Some(m) => f64::from(m.waiting),
        None => f64::from(c.load.active - c.load.decoding),
    };
    let kv = |c: &Candidate| match (c.metrics, c.capacity_blocks) {
        (Some(m), _) => m.kv_usage,
        (None, 0) => 0.0,
        (None, cap) => (c.load.kv_blocks as f64 / f64::from(cap)).min(1.0),
    };
    let qmax = cands.iter().map(queue).fold(f64::MIN, f64::max);
    let qmin = cands.iter().map(queue).fold(f64::MAX, f64::min);
    let (i, s) = argmin_by(cands, rng, |c| {
        let prefix = if req.blocks == 0 {
            0.0
        } else {
            (f64::from(c.gpu_blocks) + p.llmd_cpu_credit * f64::from(c.cpu_blocks))
                / f64::from(req.blocks)
        };
        let qs = if qmax > qmin {
            (qmax - queue(c)) / (qmax - qmin)
        } else {
            1.0
        };
        let ks = 1.0 - kv(c);
        -(p.llmd_prefix_weight * prefix + p.llmd_queue_weight * qs + p.llmd_kv_weight * ks)
    });
    (i, -s)
}

/// Preble E2: exploit the longest cached prefix when it covers more than would be recomputed
/// (rebalancing away from a worker loaded past `rebalance_ratio` x the lightest), else explore
/// the worker with the lowest load cost.
fn preble(p: &PolicyParams, req: &RequestInfo, cands: &[Candidate], rng: &mut Rng) -> (usize, f64) {
    let bs = f64::from(req.block_size.max(1));
    let prompt = f64::from(req.prompt_tokens);
    let cost = |c: &Candidate| {
        let cached = (f64::from(c.gpu_blocks) * bs).min(prompt);
        let missed = prompt - cached;
        (c.load.prefill_tokens as f64 + missed) * p.prefill_s_per_token
            + f64::from(c.load.decoding) * (p.step_s + p.decode_s_per_seq)
    };
    let load = |c: &Candidate| {
        c.load.prefill_tokens as f64 * p.prefill_s_per_token + f64::from(c.load.decoding) * p.step_s
    };
    let best_cached = cands
        .iter()
        .map(|c| (f64::from(c.gpu_blocks) * bs).min(prompt))
        .fold(0.0, f64::max);
    if best_cached > 0.0 && best_cached > prompt - best_cached {
        let (i, _) = argmin_by(cands, rng, |c| {
            if (f64::from(c.gpu_blocks) * bs).min(prompt) >= best_cached {
                load(c)
            } else {
                f64::INFINITY
            }
        });
        let lightest = cands.iter().map(load).fold(f64::MAX, f64::min);
        if load(&cands[i]) > p.preble_rebalance_ratio * lightest.max(p.step_s) {
            return argmin_by(cands, rng, load);
        }
        return (i, cost(&cands[i]));
    }
    argmin_by(cands, rng, cost)
}
