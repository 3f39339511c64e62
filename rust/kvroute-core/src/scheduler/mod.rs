//! The scheduler: worker registry, in-flight ledger, routing policies and the atomic
//! select-and-reserve.
//!
//! [`Scheduler::select_and_reserve`] scores every eligible worker, picks one, books the
//! reservation and records speculative index entries under one lock, so two concurrent requests
//! can never both see a worker as idle and both take it. Event ingestion only takes the index
//! lock; the scheduler always takes its own lock first and the index second.
pub mod hedge;
pub mod ledger;
pub mod policy;

use std::sync::Arc;

use parking_lot::Mutex;

use crate::hashing::block_hashes;
use crate::index::{IndexConfig, PrefixIndex, WorkerMatch};
use crate::{Error, Nanos, Result, WorkerId};
use hedge::Hedge;
pub use ledger::{Key, Ledger, Load, Phase, Reservation};
use policy::{choose, ttft_terms, work_tokens, PolicyState, Rng};
pub use policy::{Breakdown, Candidate, EngineMetrics, PolicyKind, PolicyParams, RequestInfo};

const SECOND: Nanos = 1_000_000_000;

#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    pub policy: PolicyKind,
    pub params: PolicyParams,
    pub block_size: u32,
    /// This router's id: the origin of its reservations in peer messages.
    pub router_id: u64,
    /// A reservation whose completion is never reported is dropped this long after its last update.
    pub reservation_ttl: Nanos,
    /// Finished keys are remembered this long, so late peer messages cannot resurrect them.
    pub tombstone_ttl: Nanos,
    /// Speculative index entries for routed blocks live this long (0 = none). Used by the
    /// policies that route on the exact index (kvroute, llm-d, preble).
    pub speculative_ttl: Nanos,
    /// Size budget, in (block, worker) entries, of the approximate tree of Ray/SGLang policies.
    pub approx_tree_entries: u64,
    /// Admission limit: in-flight requests per worker (0 = unlimited).
    pub max_inflight_per_worker: u32,
    pub seed: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            policy: PolicyKind::Kvroute,
            params: PolicyParams::default(),
            block_size: 16,
            router_id: 0,
            reservation_ttl: 600 * SECOND,
            tombstone_ttl: 600 * SECOND,
            speculative_ttl: 5 * SECOND,
            approx_tree_entries: 4_000_000,
            max_inflight_per_worker: 0,
            seed: 0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerInfo {
    pub id: WorkerId,
    /// GPU KV capacity in blocks (0 = unknown).
    pub capacity_blocks: u32,
    /// CPU offload capacity in blocks (0 = none or unknown).
    pub cpu_capacity_blocks: u32,
    pub healthy: bool,
    pub metrics: Option<EngineMetrics>,
}

/// One routing request. Block hashes are kvroute content hashes ([`crate::hashing`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Request<'a> {
    pub hashes: &'a [u64],
    pub prompt_tokens: u32,
    pub expected_output_tokens: u32,
    pub exclude: &'a [WorkerId],
}

/// The outcome of one select-and-reserve.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    pub worker: WorkerId,
    /// Reservation id at this router (its key is `(router_id, reservation)`).
    pub reservation: u64,
    pub gpu_blocks: u32,
    pub cpu_blocks: u32,
    /// Prompt tokens the chosen worker is expected to compute.
    pub prefill_tokens: u32,
    /// Workers that were eligible.
    pub candidates: u32,
    pub breakdown: Breakdown,
}

/// A reservation booked by another router, as carried by peer fan-out.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteReservation {
    pub origin: u64,
    pub id: u64,
    pub worker: WorkerId,
    pub prefill_tokens: u64,
    /// Their prefill work in token-equivalents (0: unknown, derived from `prefill_tokens`).
    pub prefill_work: u64,
    pub prompt_blocks: u64,
    pub hashes: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RemoteUpdate {
    Reserve(RemoteReservation),
    PrefillDone {
        origin: u64,
        id: u64,
    },
    Progress {
        origin: u64,
        id: u64,
        generated: u64,
    },
    Finished {
        origin: u64,
        id: u64,
    },
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerCounters {
    pub decisions: u64,
    pub no_eligible: u64,
    pub saturated: u64,
    pub released: u64,
    pub expired: u64,
    pub remote_applied: u64,
    pub remote_ignored: u64,
    /// Decisions hedged against concurrent peer decisions (ghosts booked).
    pub hedged: u64,
    /// Requests told to wait for the next decision window.
    pub paced: u64,
}

struct State {
    workers: Vec<WorkerInfo>,
    ledger: Ledger,
    policy: PolicyState,
    approx: Option<PrefixIndex>,
    next_id: u64,
    counters: SchedulerCounters,
    matches: Vec<WorkerMatch>,
    approx_matches: Vec<WorkerMatch>,
    cands: Vec<Candidate>,
    heat: Heat,
    hedge: Hedge,
}

/// Decayed reuse counts of the deepest cached prefix requests matched, by its last block hash.
#[derive(Default)]
struct Heat {
    map: hashbrown::HashMap<u64, (f64, Nanos)>,
}

impl Heat {
    /// The count of `key` decayed to `now` with time constant `window_s`.
    fn get(&self, key: u64, now: Nanos, window_s: f64) -> f64 {
        match self.map.get(&key) {
            Some(&(count, at)) if window_s > 0.0 => {
                count * (-(now.saturating_sub(at) as f64 / 1e9) / window_s).exp()
            }
            _ => 0.0,
        }
    }

    /// Records one more reuse of `key` (its decayed count was `heat`). Bounded: past 65,536
    /// keys, the oldest half is dropped.
    fn bump(&mut self, key: u64, heat: f64, now: Nanos) {
        if self.map.len() >= 1 << 16 {
            let mut ages: Vec<Nanos> = self.map.values().map(|v| v.1).collect();
            let mid = ages.len() / 2;
            let (_, cut, _) = ages.select_nth_unstable(mid);
            let cut = *cut;
            self.map.retain(|_, v| v.1 > cut);
        }
        self.map.insert(key, (heat + 1.0, now));
    }
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    index: Arc<Mutex<PrefixIndex>>,
    state: Mutex<State>,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, index: Arc<Mutex<PrefixIndex>>) -> Result<Self> {
        if cfg.block_size == 0 {
            return Err(Error::InvalidArgument("block_size must be positive".into()));
        }
        let approx = cfg.policy.uses_approx_tree().then(|| {
            PrefixIndex::new(IndexConfig {
                max_entries: cfg.approx_tree_entries,
                ..Default::default()
            })
        });
        let state = State {
            workers: Vec::new(),
            ledger: Ledger::default(),
            policy: PolicyState {
                rr: 0,
                rng: Rng::new(cfg.seed),
            },
            approx,
            next_id: 1,
            counters: SchedulerCounters::default(),
            matches: Vec::new(),
            approx_matches: Vec::new(),
            cands: Vec::new(),
            heat: Heat::default(),
            hedge: Hedge::default(),
        };
        Ok(Scheduler {
            cfg,
            index,
            state: Mutex::new(state),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn index(&self) -> &Arc<Mutex<PrefixIndex>> {
        &self.index
    }

    /// Adds a worker or updates its capacities and health.
    pub fn upsert_worker(&self, info: WorkerInfo) -> Result<()> {
        let mut st = self.state.lock();
        self.index.lock().add_worker(info.id)?;
        match st.workers.iter_mut().find(|w| w.id == info.id) {
            Some(w) => *w = info,
            None => st.workers.push(info),
        }
        Ok(())
    }

    /// Removes a worker: its reservations are dropped and its index residency purged.
    pub fn remove_worker(&self, id: WorkerId, now: Nanos) -> Result<usize> {
        let mut st = self.state.lock();
        let before = st.workers.len();
        st.workers.retain(|w| w.id != id);
        if st.workers.len() == before {
            return Err(Error::UnknownWorker(id));
        }
        let dropped = st
            .ledger
            .drop_worker(id, now.saturating_add(self.cfg.tombstone_ttl), now);
        if let Some(a) = st.approx.as_mut() {
            a.remove_worker(id);
        }
        self.index.lock().remove_worker(id);
        Ok(dropped)
    }

    pub fn set_healthy(&self, id: WorkerId, healthy: bool) -> Result<()> {
        self.with_worker(id, |w| w.healthy = healthy)
    }

    pub fn set_metrics(&self, id: WorkerId, metrics: Option<EngineMetrics>) -> Result<()> {
        self.with_worker(id, |w| w.metrics = metrics)
    }

    fn with_worker(&self, id: WorkerId, f: impl FnOnce(&mut WorkerInfo)) -> Result<()> {
        let mut st = self.state.lock();
        let w = st
            .workers
            .iter_mut()
            .find(|w| w.id == id)
            .ok_or(Error::UnknownWorker(id))?;
        f(w);
        Ok(())
    }

    pub fn workers(&self) -> Vec<WorkerInfo> {
        self.state.lock().workers.clone()
    }

    /// Hashes `tokens` into full blocks with this scheduler's block size, then routes.
    pub fn select_and_reserve_tokens(
        &self,
        tokens: &[u32],
        lora: Option<&str>,
        salt: Option<&str>,
        expected_output_tokens: u32,
        exclude: &[WorkerId],
        now: Nanos,
    ) -> Result<Decision> {
        let hashes = block_hashes(tokens, self.cfg.block_size as usize, lora, salt);
        let req = Request {
            hashes: &hashes,
            prompt_tokens: tokens.len() as u32,
            expected_output_tokens,
            exclude,
        };
        self.select_and_reserve(&req, now)
    }

    /// Scores every eligible worker, picks one and books the reservation, atomically.
    pub fn select_and_reserve(&self, req: &Request<'_>, now: Nanos) -> Result<Decision> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let tomb = now.saturating_add(self.cfg.tombstone_ttl);
        st.counters.expired += st.ledger.expire(now, tomb).len() as u64;
        let peer_window = self.peer_window();
        st.hedge.settle(now, peer_window);
        let mut index = self.index.lock();
        index.find_matches_into(req.hashes, now, &mut st.matches);
        if let Some(a) = st.approx.as_mut() {
            a.find_matches_into(req.hashes, now, &mut st.approx_matches);
        }
        let limit = self.cfg.max_inflight_per_worker;
        st.cands.clear();
        let mut any_eligible = false;
        st.matches.sort_unstable_by_key(|m| m.worker);
        st.approx_matches.sort_unstable_by_key(|m| m.worker);
        for w in &st.workers {
            if !w.healthy || req.exclude.contains(&w.id) {
                continue;
            }
            any_eligible = true;
            let load = st.ledger.load(w.id);
            if limit > 0 && load.active >= limit {
                continue;
            }
            let load = load.plus(&st.hedge.ghost_load(w.id));
            let m = lookup(&st.matches, w.id);
            let a = lookup(&st.approx_matches, w.id);
            st.cands.push(Candidate {
                worker: w.id,
                gpu_blocks: m.map_or(0, |m| m.gpu),
                cpu_blocks: m.map_or(0, |m| m.cpu),
                approx_blocks: a.map_or(0, |m| m.gpu + m.cpu),
                approx_entries: st.approx.as_ref().map_or(0, |x| x.worker_entries(w.id)),
                resident_blocks: index.worker_entries(w.id),
                prefill_elapsed_s: if self.cfg.params.prefill_drain > 0.0 {
                    st.ledger
                        .prefill_started(w.id)
                        .map_or(0.0, |a| now.saturating_sub(a) as f64 / 1e9)
                } else {
                    0.0
                },
                load,
                capacity_blocks: w.capacity_blocks,
                metrics: w.metrics,
            });
        }
        if st.cands.is_empty() {
            return Err(if any_eligible {
                st.counters.saturated += 1;
                Error::Saturated
            } else {
                st.counters.no_eligible += 1;
                Error::NoEligibleWorker
            });
        }
        // The deepest prefix some worker holds: its heat says whether other requests reuse it.
        let deepest = st.matches.iter().map(|m| m.gpu + m.cpu).max().unwrap_or(0) as usize;
        let key = deepest
            .checked_sub(1)
            .and_then(|i| req.hashes.get(i))
            .copied();
        let window = self.cfg.params.heat_window_s;
        let heat = key.map_or(0.0, |k| st.heat.get(k, now, window));
        let info = RequestInfo {
            prompt_tokens: req.prompt_tokens,
            expected_output_tokens: req.expected_output_tokens,
            blocks: req.hashes.len() as u32,
            block_size: self.cfg.block_size,
            prefix_heat: heat,
        };
        let slot = if self.hedges() {
            self.hedge(st, &info, now, peer_window)
        } else {
            None
        };
        let (mut i, mut score) = choose(
            self.cfg.policy,
            &self.cfg.params,
            &info,
            &st.cands,
            &mut st.policy,
        );
        // Among equally good workers, the one the peers' plan leaves to this router.
        if let Some(j) = slot.and_then(|w| st.cands.iter().position(|c| c.worker == w)) {
            let mine = ttft_terms(&self.cfg.params, &info, &st.cands[j]).score;
            if j != i && mine <= score + 1e-9 {
                (i, score) = (j, mine);
            }
        }
        let c = st.cands[i];
        let mut breakdown = ttft_terms(&self.cfg.params, &info, &c);
        breakdown.score = score;
        let id = st.next_id;
        st.next_id += 1;
        let r = Reservation {
            worker: c.worker,
            prefill_tokens: breakdown.uncached_tokens,
            prefill_work: breakdown.work_tokens,
            prompt_blocks: u64::from(req.prompt_tokens).div_ceil(u64::from(self.cfg.block_size)),
            generated: 0,
            block_size: u64::from(self.cfg.block_size),
            phase: Phase::Prefill,
            expires_at: now.saturating_add(self.cfg.reservation_ttl),
        };
        st.hedge
            .observe(r.prefill_work, r.prefill_tokens, r.prompt_blocks);
        st.ledger.book((self.cfg.router_id, id), r, now);
        if let Some(k) = key {
            st.heat.bump(k, heat, now);
        }
        if self.speculates() {
            index.speculate(
                c.worker,
                req.hashes,
                now.saturating_add(self.cfg.speculative_ttl),
                now,
            )?;
        }
        drop(index);
        if let Some(a) = st.approx.as_mut() {
            a.speculate(c.worker, req.hashes, Nanos::MAX, now)?;
        }
        st.counters.decisions += 1;
        Ok(Decision {
            worker: c.worker,
            reservation: id,
            gpu_blocks: c.gpu_blocks,
            cpu_blocks: c.cpu_blocks,
            prefill_tokens: breakdown.uncached_tokens as u32,
            candidates: st.cands.len() as u32,
            breakdown,
        })
    }

    /// How long a request arriving now should wait before [`Self::select_and_reserve`]: zero
    /// unless peer routers are deciding concurrently (a burst), when this router takes one
    /// decision per `peer_window_s` so each sees the peers' previous ones (at most
    /// `peer_pace_max_s`). The caller waits, then routes; the slot is booked by this call.
    pub fn pace(&self, now: Nanos) -> Nanos {
        if !self.hedges() {
            return 0;
        }
        let max = (self.cfg.params.peer_pace_max_s.max(0.0) * 1e9) as Nanos;
        if max == 0 {
            return 0;
        }
        let window = self.peer_window();
        self.state
            .lock()
            .hedge
            .pace(self.cfg.router_id, now, window, max)
    }

    /// Expected peer decisions concurrent with one of this router's (a running estimate).
    pub fn peer_concurrency(&self) -> f64 {
        self.state.lock().hedge.concurrency()
    }

    fn hedges(&self) -> bool {
        self.cfg.policy == PolicyKind::Kvroute && self.cfg.params.peer_hedge > 0.0
    }

    fn peer_window(&self) -> Nanos {
        (self.cfg.params.peer_window_s.max(0.0) * 1e9) as Nanos
    }

    /// Plans a round against peers' concurrent decisions (see [`hedge`]), adds any ghosts it
    /// booked to the candidates' loads, and returns this router's slot in the plan.
    fn hedge(
        &self,
        st: &mut State,
        info: &RequestInfo,
        now: Nanos,
        window: Nanos,
    ) -> Option<WorkerId> {
        let p = &self.cfg.params;
        let (tokens, work) = st.hedge.average();
        let avg = RequestInfo {
            prompt_tokens: tokens as u32,
            blocks: (tokens as u32).div_ceil(info.block_size.max(1)),
            prefix_heat: 0.0,
            ..*info
        };
        let slot = st.hedge.plan(
            self.cfg.router_id,
            now,
            window,
            &st.cands,
            p.peer_hedge,
            |c, extra| {
                let mut c = *c;
                c.gpu_blocks = 0;
                c.cpu_blocks = 0;
                c.load.prefill_work += (extra * work) as u64;
                c.load.prefill_tokens += (extra * tokens) as u64;
                ttft_terms(p, &avg, &c).score
            },
        );
        if slot.is_some() {
            for c in st.cands.iter_mut() {
                c.load = st
                    .ledger
                    .load(c.worker)
                    .plus(&st.hedge.ghost_load(c.worker));
            }
        }
        slot
    }

    fn speculates(&self) -> bool {
        self.cfg.speculative_ttl > 0
            && matches!(
                self.cfg.policy,
                PolicyKind::Kvroute | PolicyKind::LlmDWeighted | PolicyKind::PrebleE2
            )
    }

    /// The request produced its first token: its prefill no longer queues ahead of others.
    pub fn prefill_done(&self, id: u64, now: Nanos) -> bool {
        self.update((self.cfg.router_id, id), now, |r| r.phase = Phase::Decode)
    }

    /// The request has generated `generated` tokens so far (its KV footprint grows).
    pub fn decode_progress(&self, id: u64, generated: u64, now: Nanos) -> bool {
        self.update((self.cfg.router_id, id), now, |r| {
            r.phase = Phase::Decode;
            r.generated = r.generated.max(generated);
        })
    }

    fn update(&self, key: Key, now: Nanos, f: impl FnOnce(&mut Reservation)) -> bool {
        self.state
            .lock()
            .ledger
            .update(&key, self.cfg.reservation_ttl, now, f)
    }

    /// Ends a reservation (completion, error, disconnect). Idempotent: false if already gone.
    pub fn release(&self, id: u64, now: Nanos) -> bool {
        let mut st = self.state.lock();
        let done = st
            .ledger
            .finish(
                &(self.cfg.router_id, id),
                now.saturating_add(self.cfg.tombstone_ttl),
                now,
            )
            .is_some();
        st.counters.released += u64::from(done);
        done
    }

    /// Applies a peer router's update. Idempotent; a router's own messages and messages about
    /// finished (tombstoned) reservations are ignored. Returns whether anything changed.
    pub fn apply_remote(&self, update: &RemoteUpdate, now: Nanos) -> Result<bool> {
        let mut st = self.state.lock();
        let tomb = now.saturating_add(self.cfg.tombstone_ttl);
        let ttl = self.cfg.reservation_ttl;
        let origin = match update {
            RemoteUpdate::Reserve(r) => r.origin,
            RemoteUpdate::PrefillDone { origin, .. }
            | RemoteUpdate::Progress { origin, .. }
            | RemoteUpdate::Finished { origin, .. } => *origin,
        };
        if origin != self.cfg.router_id {
            st.hedge.heard(origin, now);
        }
        let window = self.peer_window();
        let applied = origin != self.cfg.router_id
            && match update {
                RemoteUpdate::Reserve(r) => {
                    let known = st.workers.iter().any(|w| w.id == r.worker);
                    let res = Reservation {
                        worker: r.worker,
                        prefill_tokens: r.prefill_tokens,
                        prefill_work: if r.prefill_work > 0 {
                            r.prefill_work
                        } else {
                            work_tokens(&self.cfg.params, r.prefill_tokens, 0)
                        },
                        prompt_blocks: r.prompt_blocks,
                        generated: 0,
                        block_size: u64::from(self.cfg.block_size),
                        phase: Phase::Prefill,
                        expires_at: now.saturating_add(ttl),
                    };
                    let size = (res.prefill_work, res.prefill_tokens, res.prompt_blocks);
                    let booked = known && st.ledger.book((r.origin, r.id), res, now);
                    if booked {
                        st.hedge.observe(size.0, size.1, size.2);
                        st.hedge.peer_reserved(origin, now, window);
                    }
                    if booked && self.speculates() {
                        self.index.lock().speculate(
                            r.worker,
                            &r.hashes,
                            now.saturating_add(self.cfg.speculative_ttl),
                            now,
                        )?;
                    }
                    booked
                }
                RemoteUpdate::PrefillDone { origin, id } => {
                    st.ledger
                        .update(&(*origin, *id), ttl, now, |r| r.phase = Phase::Decode)
                }
                RemoteUpdate::Progress {
                    origin,
                    id,
                    generated,
                } => st.ledger.update(&(*origin, *id), ttl, now, |r| {
                    r.phase = Phase::Decode;
                    r.generated = r.generated.max(*generated);
                }),
                RemoteUpdate::Finished { origin, id } => {
                    st.ledger.finish(&(*origin, *id), tomb, now).is_some()
                }
            };
        if applied {
            st.counters.remote_applied += 1;
        } else {
            st.counters.remote_ignored += 1;
        }
        Ok(applied)
    }

    /// Expires overdue reservations and speculative entries; returns the expired reservations.
    pub fn expire(&self, now: Nanos) -> usize {
        let mut st = self.state.lock();
        let n = st
            .ledger
            .expire(now, now.saturating_add(self.cfg.tombstone_ttl))
            .len();
        st.counters.expired += n as u64;
        drop(st);
        self.index.lock().expire(now);
        n
    }

    pub fn load(&self, worker: WorkerId) -> Load {
        self.state.lock().ledger.load(worker)
    }

    /// Every worker's booked load, in registration order.
    pub fn loads(&self) -> Vec<(WorkerId, Load)> {
        let st = self.state.lock();
        st.workers
            .iter()
            .map(|w| (w.id, st.ledger.load(w.id)))
            .collect()
    }

    pub fn reservations(&self) -> usize {
        self.state.lock().ledger.len()
    }

    pub fn reservation(&self, origin: u64, id: u64) -> Option<Reservation> {
        self.state.lock().ledger.get(&(origin, id)).cloned()
    }

    pub fn counters(&self) -> SchedulerCounters {
        let st = self.state.lock();
        SchedulerCounters {
            hedged: st.hedge.hedged,
            paced: st.hedge.paced,
            ..st.counters.clone()
        }
    }

    /// Ledger consistency (tests).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.state.lock().ledger.check()
    }
}

/// The match of `worker` in `matches` (sorted by worker).
fn lookup(matches: &[WorkerMatch], worker: WorkerId) -> Option<&WorkerMatch> {
    matches
        .binary_search_by_key(&worker, |m| m.worker)
        .ok()
        .map(|i| &matches[i])
}

#[cfg(test)]
mod tests;
