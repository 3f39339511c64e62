//! N simulated engines behind one or more production routers, on virtual time.
//!
//! Each router is kvroute's own [`Scheduler`] (any policy) over its own [`PrefixIndex`]; every
//! engine's KV-event batches reach every router's index `event_delay_s` after the step that
//! produced them ends (as ZMQ subscribers see them), and the request lifecycle is reported to the
//! router that routed it as a proxy would: `prefill_done` at the first token, `release` at the
//! end. Requests are spread over the routers round robin (an L4 balancer in front of them).
//!
//! With several routers and `fanout_delay_s` set, each router tells the others about its
//! reservations through [`Scheduler::apply_remote`] (book, prefill done, finished), delivered
//! after that delay; without it, a router sees only its own in-flight load, which is how
//! independent router replicas herd onto the same replicas.
//!
//! Time only moves through [`Cluster::run_until`]: a binary heap holds each busy engine's next
//! wake-up (the end of its current step) and two FIFOs hold event batches and peer messages in
//! flight (one fixed delay each, so delivery order is production order). An engine that finishes
//! a step with work left starts the next one at once; an idle engine starts when a request
//! arrives.
use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use parking_lot::Mutex;

use super::engine::{Engine, EngineConfig, RequestOutput, StepResult};
use super::latency::StepShape;
use super::request::NewRequest;
use crate::events::EventBatch;
use crate::hashing::block_hashes;
use crate::index::PrefixIndex;
use crate::scheduler::{
    EngineMetrics, PolicyKind, RemoteReservation, RemoteUpdate, Request, Scheduler,
    SchedulerConfig, WorkerInfo,
};
use crate::{Nanos, Result, WorkerId};

/// Shortest step the driver lets an engine take, so time always moves.
const MIN_STEP_S: f64 = 1e-6;

/// How the cluster is built.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    pub replicas: usize,
    pub engine: EngineConfig,
    pub policy: PolicyKind,
    /// Delay between a step's end and its events reaching the router's index.
    pub event_delay_s: f64,
    /// Apply event batches to the index. Batches are produced, delayed and counted either way;
    /// applying them is pure overhead for policies that never read the index
    /// ([`policy_reads_index`]).
    pub feed_index: bool,
    /// How often (virtual seconds) each engine's `/metrics` gauges reach the scheduler.
    pub metrics_interval_s: f64,
    pub seed: u64,
    /// Router replicas (at least 1), each with its own scheduler and index.
    pub routers: usize,
    /// Delay of the peer fan-out between routers; `None`: routers do not talk to each other.
    pub fanout_delay_s: Option<f64>,
    /// Policy knobs set after calibration ([`crate::scheduler::PolicyParams::set`] names).
    pub params: Vec<(String, f64)>,
}

/// One router replica.
struct Router {
    scheduler: Scheduler,
    index: Arc<Mutex<PrefixIndex>>,
}

/// A time that orders totally (virtual seconds).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Time(f64);
impl Eq for Time {}
impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Time {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

fn nanos(t: f64) -> Nanos {
    (t.max(0.0) * 1e9) as Nanos
}

pub struct Cluster {
    engines: Vec<Engine>,
    /// The step each engine is executing (applied when it ends).
    inflight: Vec<StepResult>,
    busy: Vec<bool>,
    last_scrape: Vec<f64>,
    wakeups: BinaryHeap<Reverse<(Time, u32)>>,
    kv_queue: VecDeque<(f64, u32, EventBatch)>,
    /// Peer messages in flight: (delivery time, sending router, update).
    peer_queue: VecDeque<(f64, u32, RemoteUpdate)>,
    routers: Vec<Router>,
    /// Requests waiting for their router's next decision window (see [`Scheduler::pace`]):
    /// (decision time, router, request, expected output), in time order.
    deferred: VecDeque<(f64, u32, NewRequest, u32)>,
    /// The first error of a deferred decision (surfaced by [`Cluster::take_error`]).
    error: Option<crate::Error>,
    /// Requests routed to each replica.
    pub routed_per_replica: Vec<u64>,
    /// Per request tag, its router and reservation there while in flight.
    routed: Vec<Option<(u32, u64)>>,
    arrivals: u64,
    block_size: usize,
    event_delay_s: f64,
    fanout_delay_s: Option<f64>,
    feed_index: bool,
    metrics_interval_s: f64,
    /// Event batches delivered (to every router's index).
    pub batches_delivered: u64,
    /// Peer messages delivered (each to every other router).
    pub peer_messages: u64,
}

impl Cluster {
    pub fn new(cfg: &ClusterConfig) -> Result<Self> {
        let mut routers = Vec::with_capacity(cfg.routers.max(1));
        for r in 0..cfg.routers.max(1) {
            let index = Arc::new(Mutex::new(PrefixIndex::default()));
            let mut sc = SchedulerConfig {
                policy: cfg.policy,
                block_size: cfg.engine.block_size as u32,
                router_id: r as u64,
                seed: cfg.seed.wrapping_add(r as u64),
                ..Default::default()
            };
            calibrate(&mut sc, &cfg.engine);
            for (k, v) in &cfg.params {
                sc.params.set(k, *v)?;
            }
            let scheduler = Scheduler::new(sc, index.clone())?;
            for w in 0..cfg.replicas {
                scheduler.upsert_worker(WorkerInfo {
                    id: w as WorkerId,
                    capacity_blocks: (cfg.engine.num_gpu_blocks - 1) as u32,
                    cpu_capacity_blocks: cfg.engine.num_cpu_blocks as u32,
                    healthy: true,
                    metrics: None,
                })?;
            }
            routers.push(Router { scheduler, index });
        }
        let engines = (0..cfg.replicas)
            .map(|_| Engine::new(cfg.engine.clone()))
            .collect::<Result<Vec<_>>>()?;
        Ok(Cluster {
            inflight: vec![StepResult::default(); cfg.replicas],
            busy: vec![false; cfg.replicas],
            last_scrape: vec![f64::NEG_INFINITY; cfg.replicas],
            engines,
            wakeups: BinaryHeap::new(),
            kv_queue: VecDeque::new(),
            peer_queue: VecDeque::new(),
            routers,
            deferred: VecDeque::new(),
            error: None,
            routed_per_replica: vec![0; cfg.replicas],
            routed: Vec::new(),
            arrivals: 0,
            block_size: cfg.engine.block_size,
            event_delay_s: cfg.event_delay_s.max(0.0),
            fanout_delay_s: cfg.fanout_delay_s.filter(|_| cfg.routers > 1),
            feed_index: cfg.feed_index,
            metrics_interval_s: cfg.metrics_interval_s,
            batches_delivered: 0,
            peer_messages: 0,
        })
    }

    pub fn engines(&self) -> &[Engine] {
        &self.engines
    }

    /// The first router's scheduler.
    pub fn scheduler(&self) -> &Scheduler {
        &self.routers[0].scheduler
    }

    /// Every router's scheduler.
    pub fn schedulers(&self) -> impl Iterator<Item = &Scheduler> {
        self.routers.iter().map(|r| &r.scheduler)
    }

    /// A request arriving at `now` goes to the next router, which routes it and queues it on the
    /// chosen engine at once (returns the worker) or, pacing a burst of concurrent peer
    /// decisions, a few milliseconds later (returns `None`). The request's `tag` must be unique
    /// (it keys the bookkeeping).
    pub fn submit(
        &mut self,
        now: f64,
        req: NewRequest,
        expected_output: u32,
    ) -> Result<Option<WorkerId>> {
        self.deliver(now);
        let r = (self.arrivals % self.routers.len() as u64) as u32;
        self.arrivals += 1;
        let wait = self.routers[r as usize].scheduler.pace(nanos(now));
        if wait > 0 {
            let at = now + wait as f64 / 1e9;
            let i = self.deferred.partition_point(|(t, ..)| *t <= at);
            self.deferred.insert(i, (at, r, req, expected_output));
            return Ok(None);
        }
        self.route(r, now, req, expected_output).map(Some)
    }

    /// An error a deferred decision met, if any (the replay stops on it).
    pub fn take_error(&mut self) -> Option<crate::Error> {
        self.error.take()
    }

    fn route(
        &mut self,
        r: u32,
        now: f64,
        req: NewRequest,
        expected_output: u32,
    ) -> Result<WorkerId> {
        let hashes = block_hashes(
            &req.prompt,
            self.block_size,
            req.lora.as_deref(),
            req.salt.as_deref(),
        );
        let request = Request {
            hashes: &hashes,
            prompt_tokens: req.prompt.len() as u32,
            expected_output_tokens: expected_output,
            exclude: &[],
        };
        let sched = &self.routers[r as usize].scheduler;
        let d = sched.select_and_reserve(&request, nanos(now))?;
        let w = d.worker as usize;
        let tag = req.tag as usize;
        if self.routed.len() <= tag {
            self.routed.resize(tag + 1, None);
        }
        self.routed[tag] = Some((r, d.reservation));
        let prompt_blocks = req.prompt.len().div_ceil(self.block_size) as u64;
        if let Err(e) = self.engines[w].add_request(req) {
            sched.release(d.reservation, nanos(now));
            self.routed[tag] = None;
            return Err(e);
        }
        if let Some(delay) = self.fanout_delay_s {
            let msg = RemoteUpdate::Reserve(RemoteReservation {
                origin: u64::from(r),
                id: d.reservation,
                worker: d.worker,
                prefill_tokens: u64::from(d.prefill_tokens),
                prefill_work: d.breakdown.work_tokens,
                prompt_blocks,
                hashes,
            });
            self.peer_queue.push_back((now + delay, r, msg));
        }
        self.routed_per_replica[w] += 1;
        if !self.busy[w] {
            self.start_step(w, now);
        }
        Ok(d.worker)
    }

    /// When the next thing happens (a step ends or a batch reaches the index), if anything will.
    pub fn next_time(&self) -> Option<f64> {
        let wake = self.wakeups.peek().map(|Reverse((t, _))| t.0);
        let kv = self.kv_queue.front().map(|(t, _, _)| *t);
        let peer = self.peer_queue.front().map(|(t, _, _)| *t);
        let deferred = self.deferred.front().map(|(t, ..)| *t);
        [wake, kv, peer, deferred]
            .into_iter()
            .flatten()
            .reduce(f64::min)
    }

    /// Processes everything that happens up to and including `until`, in time order (at equal
    /// times, deliveries first). `sink` sees every request output with its engine and time.
    pub fn run_until(&mut self, until: f64, sink: &mut impl FnMut(usize, &RequestOutput, f64)) {
        while let Some(t) = self.next_time().filter(|&t| t <= until) {
            let due = |q: Option<f64>| q.is_some_and(|k| k <= t);
            if due(self.kv_queue.front().map(|x| x.0)) || due(self.peer_queue.front().map(|x| x.0))
            {
                self.deliver(t);
                continue;
            }
            if self.deferred.front().is_some_and(|(k, ..)| *k <= t) {
                let (_, r, req, out) = self.deferred.pop_front().expect("checked");
                if let Err(e) = self.route(r, t, req, out) {
                    self.error.get_or_insert(e);
                }
                continue;
            }
            let Some(Reverse((_, w))) = self.wakeups.pop() else {
                break;
            };
            self.end_step(w as usize, t, sink);
        }
    }

    /// Applies every event batch and peer message due by `now`.
    fn deliver(&mut self, now: f64) {
        while self.kv_queue.front().is_some_and(|(t, _, _)| *t <= now) {
            let (t, w, batch) = self.kv_queue.pop_front().expect("checked");
            if self.feed_index {
                for r in &self.routers {
                    r.index
                        .lock()
                        .apply_batch(WorkerId::from(w), &batch, nanos(t))
                        .expect("workers are registered at start");
                }
            }
            self.batches_delivered += 1;
        }
        while self.peer_queue.front().is_some_and(|(t, _, _)| *t <= now) {
            let (t, from, msg) = self.peer_queue.pop_front().expect("checked");
            for (i, r) in self.routers.iter().enumerate() {
                if i as u32 != from {
                    // Workers are registered and hashes well formed: nothing here can fail.
                    let _ = r.scheduler.apply_remote(&msg, nanos(t));
                }
            }
            self.peer_messages += 1;
        }
    }

    fn start_step(&mut self, w: usize, now: f64) {
        self.engines[w].step_into(now, &mut self.inflight[w]);
        let dur = self.inflight[w].duration_s.max(MIN_STEP_S);
        self.busy[w] = true;
        self.wakeups.push(Reverse((Time(now + dur), w as u32)));
    }

    /// Engine `w`'s step ends at `t`: its outputs and events take effect, the next step starts.
    fn end_step(&mut self, w: usize, t: f64, sink: &mut impl FnMut(usize, &RequestOutput, f64)) {
        let step = &mut self.inflight[w];
        for o in &step.outputs {
            if let Some((r, id)) = self.routed.get(o.tag as usize).copied().flatten() {
                let sched = &self.routers[r as usize].scheduler;
                let origin = u64::from(r);
                if o.first {
                    sched.prefill_done(id, nanos(t));
                    if let Some(delay) = self.fanout_delay_s {
                        let msg = RemoteUpdate::PrefillDone { origin, id };
                        self.peer_queue.push_back((t + delay, r, msg));
                    }
                }
                if o.finish.is_some() {
                    sched.release(id, nanos(t));
                    self.routed[o.tag as usize] = None;
                    if let Some(delay) = self.fanout_delay_s {
                        let msg = RemoteUpdate::Finished { origin, id };
                        self.peer_queue.push_back((t + delay, r, msg));
                    }
                }
            }
            sink(w, o, t);
        }
        if let Some(batch) = step.events.take() {
            self.kv_queue
                .push_back((t + self.event_delay_s, w as u32, batch));
        }
        if t - self.last_scrape[w] >= self.metrics_interval_s {
            self.last_scrape[w] = t;
            let m = self.engines[w].metrics();
            let em = EngineMetrics {
                running: m.running as u32,
                waiting: m.waiting as u32,
                kv_usage: m.kv_cache_usage,
            };
            for r in &self.routers {
                // The worker is registered; an error here would be a bug in this driver.
                let _ = r.scheduler.set_metrics(w as WorkerId, Some(em));
            }
        }
        if self.engines[w].has_work() {
            self.start_step(w, t);
        } else {
            self.busy[w] = false;
        }
    }
}

/// Whether `policy` routes on the event-fed prefix index (the others use load only, or their
/// own tree of past decisions).
pub fn policy_reads_index(policy: PolicyKind) -> bool {
    !matches!(
        policy,
        PolicyKind::RoundRobin
            | PolicyKind::Random
            | PolicyKind::LeastLoaded
            | PolicyKind::RayPrefixAffinity
            | PolicyKind::SglangCacheAware
    )
}

/// Gives kvroute's TTFT model the engine preset's own costs: per-token prefill cost at a full
/// chunk, the cost of a decode step, the batch size and the CPU load cost.
fn calibrate(sc: &mut SchedulerConfig, e: &EngineConfig) {
    let chunk = e.max_num_batched_tokens as u64;
    let mut prefill = StepShape::default();
    prefill.add_prefill(chunk, 0);
    let mut decode = StepShape {
        sampled: 1,
        ..Default::default()
    };
    decode.add_decode(1);
    let p = &mut sc.params;
    p.step_s = e.latency.step_time(&decode);
    // Linear cost only: the attention of a chunk over itself is the policy's attention term.
    let attn = prefill.prefill_pairs * e.latency.attn_s_per_token_pair;
    p.prefill_s_per_token =
        (e.latency.step_time(&prefill) - e.latency.step_overhead_s - attn) / chunk as f64;
    p.decode_s_per_seq = e.latency.decode_s_per_seq;
    p.cpu_load_s_per_token = e.latency.cpu_load_s_per_token;
    p.attn_s_per_token_pair = e.latency.attn_s_per_token_pair;
    p.max_batched_tokens = e.max_num_batched_tokens as u32;
}
