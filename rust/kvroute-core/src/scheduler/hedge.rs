//! Hedging against peer routers' unseen decisions.
//!
//! Router replicas share their reservations by fan-out, but a decision made at the same instant
//! as a peer's cannot see it: when requests arrive in bursts (a client fan-out, a batch job, a
//! trace with coarse timestamps), every router computes the same best worker from the same view
//! and they all take it. Fan-out cannot prevent that; only deciding differently can.
//!
//! Each router measures how many peer decisions turn out to have been *concurrent* with its own
//! (a peer reservation that arrives within `peer_window_s` after one of its decisions: neither
//! router saw the other's). When that expectation is material, the routers first take *turns*
//! ([`Hedge::pace`]): one decision per window each, staggered by rank, so that each sees the
//! earlier ones' fan-out. A decision that cannot wait for its turn (or whose earlier turns'
//! fan-out has not arrived) plans one
//! *round*: the same greedy placement every router computes from the shared view, one slot per
//! active router for an average request, slot k for the router of rank k. It then books
//! *ghosts* (average-sized placeholders) on the slots of the other routers, scaled by how many
//! concurrent decisions it expects, and scores its own request against ledger plus ghosts. So
//! routers deciding together tile the fleet instead of piling onto one worker, a request with a
//! cached prefix still goes to its cache when that is cheaper, and with no concurrency (steady
//! arrivals) nothing changes. A ghost ends when that peer's real reservation arrives or the
//! window closes.
use std::collections::VecDeque;

use super::ledger::Load;
use super::policy::Candidate;
use crate::{Nanos, WorkerId};

/// A peer not heard from for this long no longer counts as an active router.
const PEER_ACTIVE: Nanos = 30_000_000_000;
/// Weight of one decision's observed concurrency in the running estimate.
const ALPHA: f64 = 0.125;
/// Ghost weights below this are not worth booking.
const MIN_WEIGHT: f64 = 0.1;
/// Bound on this router's decisions awaiting their concurrency count.
const MAX_OWN: usize = 4096;

#[derive(Debug, Clone, Copy)]
struct Ghost {
    /// The peer router whose unseen decision this stands for.
    origin: u64,
    worker: WorkerId,
    /// Fraction of an average request.
    weight: f64,
    expires: Nanos,
}

/// Per-router state of the hedge (kept under the scheduler's lock).
#[derive(Debug, Default)]
pub struct Hedge {
    /// Peer routers and when each was last heard from.
    peers: Vec<(u64, Nanos)>,
    /// This router's recent decisions and the peer reservations that arrived within the window
    /// after each.
    own: VecDeque<(Nanos, u32)>,
    /// Running estimate: peer decisions concurrent with one of this router's.
    concurrency: f64,
    ghosts: Vec<Ghost>,
    /// The current burst window: open until this time.
    window_until: Nanos,
    /// This router's decisions in the window so far, less one.
    round: u32,
    /// The candidates when the window opened, by worker id, and the slots planned on each.
    base: Vec<Candidate>,
    planned: Vec<f64>,
    /// Running averages of a booked request: prefill work, prefill tokens, KV blocks.
    avg_work: f64,
    avg_tokens: f64,
    avg_blocks: f64,
    /// The earliest time of this router's next paced decision, and the turns granted.
    next_slot: Nanos,
    /// (turn time, start of its round) for every turn granted and not yet taken.
    granted: VecDeque<(Nanos, Nanos)>,
    /// When each peer's last reservation arrived.
    reserved_at: Vec<(u64, Nanos)>,
    /// Decisions taken with ghosts booked.
    pub hedged: u64,
    /// Decisions deferred to a later window.
    pub paced: u64,
}

impl Hedge {
    /// Expected peer decisions concurrent with one of this router's.
    pub fn concurrency(&self) -> f64 {
        self.concurrency
    }

    /// How much a decision now should expect concurrent peer decisions, 0..1 per peer.
    fn expectation(&self, now: Nanos) -> f64 {
        match self.active_peers(now) {
            0 => 0.0,
            n => (self.concurrency / n as f64).min(1.0),
        }
    }

    /// How long a request arriving at `now` should wait before its decision, for router `me`.
    ///
    /// While peers decide concurrently, the routers take turns: each router takes at most one
    /// decision per `window`, and a burst's first decision at the router of rank k (among the
    /// active routers, by id) waits k × `window` / routers. So within a burst every decision is
    /// taken after the fan-out of every earlier one has arrived (when the fan-out is faster than
    /// `window` / routers): the fleet is routed as by one router, for a few milliseconds of
    /// waiting. A request that would wait more than `max_wait` is decided at once, hedged by the
    /// plan and its ghosts ([`Self::plan`]), so a sustained high rate is never throttled.
    pub fn pace(&mut self, me: u64, now: Nanos, window: Nanos, max_wait: Nanos) -> Nanos {
        if window == 0 || self.expectation(now) < MIN_WEIGHT {
            return 0;
        }
        let routers = self.routers(me, now);
        let rank = routers.iter().position(|&r| r == me).unwrap_or(0) as u64;
        let offset = rank * window / routers.len() as u64;
        let at = if now >= self.next_slot {
            now.saturating_add(offset)
        } else {
            self.next_slot
        };
        let wait = at - now;
        if wait > max_wait {
            return 0;
        }
        self.next_slot = at.saturating_add(window);
        self.paced += u64::from(wait > 0);
        let i = self.granted.partition_point(|&(g, _)| g <= at);
        self.granted.insert(i, (at, at.saturating_sub(offset)));
        wait
    }

    /// Peer routers heard from in the last 30 s.
    fn active(&self, now: Nanos) -> impl Iterator<Item = u64> + '_ {
        self.peers
            .iter()
            .filter(move |(_, t)| now.saturating_sub(*t) <= PEER_ACTIVE)
            .map(|(o, _)| *o)
    }

    /// Active routers, this one included, by id.
    fn routers(&self, me: u64, now: Nanos) -> Vec<u64> {
        let mut routers: Vec<u64> = self.active(now).collect();
        routers.push(me);
        routers.sort_unstable();
        routers
    }

    /// Whether a decision at `now` takes a turn granted by [`Self::pace`] (consumes it): the
    /// start of the turn's round if so.
    fn takes_turn(&mut self, now: Nanos, window: Nanos) -> Option<Nanos> {
        while self
            .granted
            .front()
            .is_some_and(|&(g, _)| g.saturating_add(window) < now)
        {
            self.granted.pop_front();
        }
        if self.granted.front().is_some_and(|&(g, _)| g <= now) {
            return self.granted.pop_front().map(|(_, start)| start);
        }
        None
    }

    /// Whether peer `origin` has reported a reservation since `since`.
    fn reported_since(&self, origin: u64, since: Nanos) -> bool {
        self.reserved_at
            .iter()
            .any(|&(o, t)| o == origin && t >= since)
    }

    /// Active peer routers (heard from in the last 30 s).
    pub fn active_peers(&self, now: Nanos) -> usize {
        self.active(now).count()
    }

    /// Any message from peer `origin`.
    pub fn heard(&mut self, origin: u64, now: Nanos) {
        match self.peers.iter_mut().find(|(o, _)| *o == origin) {
            Some(p) => p.1 = p.1.max(now),
            None => self.peers.push((origin, now)),
        }
    }

    /// A booked reservation (own or a peer's): keeps the average request size.
    pub fn observe(&mut self, work: u64, tokens: u64, blocks: u64) {
        let a = if self.avg_work == 0.0 { 1.0 } else { ALPHA };
        self.avg_work += a * (work as f64 - self.avg_work);
        self.avg_tokens += a * (tokens as f64 - self.avg_tokens);
        self.avg_blocks += a * (blocks as f64 - self.avg_blocks);
    }

    /// A peer's reservation arrived: it counts as concurrent with this router's decisions of the
    /// last `window` (they could not see each other), and it replaces that peer's oldest ghost.
    pub fn peer_reserved(&mut self, origin: u64, now: Nanos, window: Nanos) {
        self.heard(origin, now);
        match self.reserved_at.iter_mut().find(|(o, _)| *o == origin) {
            Some(p) => p.1 = p.1.max(now),
            None => self.reserved_at.push((origin, now)),
        }
        for (t, n) in self.own.iter_mut() {
            if *t < now && now - *t <= window {
                *n += 1;
            }
        }
        if let Some(i) = self.ghosts.iter().position(|g| g.origin == origin) {
            self.ghosts.remove(i);
        }
    }

    /// Folds decisions older than `window` into the estimate and drops expired ghosts.
    pub fn settle(&mut self, now: Nanos, window: Nanos) {
        while let Some(&(t, n)) = self.own.front() {
            if now.saturating_sub(t) <= window && self.own.len() < MAX_OWN {
                break;
            }
            self.own.pop_front();
            self.concurrency += ALPHA * (f64::from(n) - self.concurrency);
        }
        self.ghosts.retain(|g| g.expires > now);
        // Router ids are per process: forget routers long gone.
        let keep = |t: Nanos| now.saturating_sub(t) <= 10 * PEER_ACTIVE;
        self.peers.retain(|(_, t)| keep(*t));
        self.reserved_at.retain(|(_, t)| keep(*t));
    }

    /// Ghost load on `worker`, to add to its booked load before scoring.
    pub fn ghost_load(&self, worker: WorkerId) -> Load {
        let w: f64 = self
            .ghosts
            .iter()
            .filter(|g| g.worker == worker)
            .map(|g| g.weight)
            .sum();
        if w == 0.0 {
            return Load::default();
        }
        Load {
            prefill_tokens: (w * self.avg_tokens) as u64,
            prefill_work: (w * self.avg_work) as u64,
            kv_blocks: (w * self.avg_blocks) as u64,
            active: 0,
            decoding: 0,
        }
    }

    /// Before a decision at `now` by router `me`: if peers are expected to decide concurrently,
    /// plans this router's next round and books ghosts on the other routers' slots.
    ///
    /// The plan is the same for every router: a greedy placement of average requests, one per
    /// active router per round, over the candidates as they stood when the burst window opened
    /// (`cands`, read only then), ties to the lower worker id; this router's k-th decision in the
    /// window is round k. `cost(candidate, extra)` is the cost of an average request on it with
    /// `extra` average requests planned there. `strength` scales the ghosts (1 = one average
    /// request per expected concurrent decision). Returns this router's own slot in the round
    /// (the worker peers expect it to take: it wins ties), `None` when nothing is planned.
    pub fn plan(
        &mut self,
        me: u64,
        now: Nanos,
        window: Nanos,
        cands: &[Candidate],
        strength: f64,
        mut cost: impl FnMut(&Candidate, f64) -> f64,
    ) -> Option<WorkerId> {
        self.own.push_back((now, 0));
        // A decision in its turn sees the earlier ones of the burst (when the fan-out is faster
        // than a turn): it hedges only against those not arrived yet, and it takes its round of
        // the plan (and its slot on ties), so a burst larger than the turns keeps every router's
        // rounds in step.
        let turn = self.takes_turn(now, window);
        if self.avg_work <= 0.0 || cands.len() < 2 {
            return None;
        }
        let routers = self.routers(me, now);
        if routers.len() < 2 {
            return None;
        }
        if now >= self.window_until {
            self.window_until = now.saturating_add(window);
            self.round = 0;
            self.base.clear();
            self.base.extend_from_slice(cands);
            self.base.sort_unstable_by_key(|c| c.worker);
            self.planned.clear();
            self.planned.resize(self.base.len(), 0.0);
        } else {
            self.round += 1;
        }
        // The first decision of a window hedges as far as concurrency is expected; a later one
        // is itself evidence of a burst, which the balancer in front spreads over every router.
        let expect = self.expectation(now);
        if expect < MIN_WEIGHT {
            return None;
        }
        let weight = if self.round == 0 { expect } else { 1.0 };
        let me_rank = routers.iter().position(|&r| r == me).unwrap_or(0);
        let mut mine = None;
        for (rank, &origin) in routers.iter().enumerate() {
            let mut best = (f64::INFINITY, 0usize);
            for (i, c) in self.base.iter().enumerate() {
                let k = cost(c, self.planned[i]);
                if k < best.0 - 1e-12 {
                    best = (k, i);
                }
            }
            self.planned[best.1] += 1.0;
            if origin == me {
                mine = Some(self.base[best.1].worker);
            } else if match turn {
                // In its turn a decision waits only for the earlier turns of the round: a peer
                // among them whose reservation has not arrived yet (a fan-out slower than a
                // turn) is hedged; the later ones will see this decision.
                Some(start) => rank < me_rank && !self.reported_since(origin, start),
                None => true,
            } {
                self.ghosts.push(Ghost {
                    origin,
                    worker: self.base[best.1].worker,
                    weight: weight * strength,
                    expires: self.window_until,
                });
            }
        }
        self.hedged += u64::from(turn.is_none());
        mine
    }

    /// The average request's size in tokens and prefill work.
    pub fn average(&self) -> (f64, f64) {
        (self.avg_tokens, self.avg_work)
    }
}
