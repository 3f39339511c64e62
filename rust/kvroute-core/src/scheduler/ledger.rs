//! The in-flight ledger: every reservation this router (or a peer router) has booked, and the
//! per-worker load they add up to.
//!
//! Invariant: each worker's [`Load`] is exactly the sum over its live reservations, so once every
//! reservation is released or expired the ledger is back to zero. Keys are `(origin, id)` — the
//! router that booked it and its id there — so reservations from several routers never collide;
//! finished keys are tombstoned for a while so a late peer message never resurrects them.
use hashbrown::HashMap;
use std::collections::VecDeque;

use crate::{Nanos, WorkerId};

/// A reservation's global key: (origin router id, id at that router).
pub type Key = (u64, u64);

/// Load one worker carries, as booked in the ledger.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    /// Prefill tokens reserved and not yet computed (requests before their first token).
    pub prefill_tokens: u64,
    /// Their prefill work in token-equivalents (tokens plus attention, see
    /// [`super::policy::work_tokens`]): what the TTFT estimate queues behind.
    pub prefill_work: u64,
    /// KV blocks held by in-flight requests (prompt blocks not already cached + generated ones).
    pub kv_blocks: u64,
    /// In-flight requests.
    pub active: u32,
    /// In-flight requests past their first token.
    pub decoding: u32,
}

impl Load {
    /// This load with `other` added (ghost load on top of booked load).
    pub fn plus(&self, other: &Load) -> Load {
        Load {
            prefill_tokens: self.prefill_tokens + other.prefill_tokens,
            prefill_work: self.prefill_work + other.prefill_work,
            kv_blocks: self.kv_blocks + other.kv_blocks,
            active: self.active + other.active,
            decoding: self.decoding + other.decoding,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Prefill,
    Decode,
}

#[derive(Debug, Clone)]
pub struct Reservation {
    pub worker: WorkerId,
    pub prefill_tokens: u64,
    /// `prefill_tokens` in token-equivalents of prefill work (at least `prefill_tokens`).
    pub prefill_work: u64,
    pub prompt_blocks: u64,
    pub generated: u64,
    pub block_size: u64,
    pub phase: Phase,
    pub expires_at: Nanos,
}

impl Reservation {
    fn kv_blocks(&self) -> u64 {
        self.prompt_blocks + self.generated / self.block_size.max(1)
    }
}

#[derive(Debug, Default)]
pub struct Ledger {
    live: HashMap<Key, Reservation>,
    loads: HashMap<WorkerId, Load>,
    /// (deadline, key) in booking order; entries refreshed later are re-queued and stale ones skipped.
    deadlines: VecDeque<(Nanos, Key)>,
    tombstones: HashMap<Key, Nanos>,
    tomb_queue: VecDeque<(Nanos, Key)>,
    /// Per worker, when its current prefill (the head of its queue) started, as far as the
    /// ledger can tell: when its queue last became non-empty or a prefill last left it.
    anchors: HashMap<WorkerId, Nanos>,
    pub expired: u64,
}

impl Ledger {
    pub fn load(&self, w: WorkerId) -> Load {
        self.loads.get(&w).copied().unwrap_or_default()
    }

    pub fn get(&self, key: &Key) -> Option<&Reservation> {
        self.live.get(key)
    }

    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    pub fn is_tombstoned(&self, key: &Key) -> bool {
        self.tombstones.contains_key(key)
    }

    /// When worker `w`'s current prefill started (see the field), if it has one.
    pub fn prefill_started(&self, w: WorkerId) -> Option<Nanos> {
        self.anchors.get(&w).copied()
    }

    /// Adds (`sign` 1) or removes (-1) `r`'s share of its worker's load. With `now`, a prefill
    /// queue that starts or a prefill that leaves it (the next one starts) moves the anchor.
    fn add(&mut self, r: &Reservation, sign: i64, now: Option<Nanos>) {
        let l = self.loads.entry(r.worker).or_default();
        if let (Some(now), Phase::Prefill) = (now, r.phase) {
            if sign < 0 || l.prefill_work == 0 {
                self.anchors.insert(r.worker, now);
            }
        }
        let kv = r.kv_blocks();
        let (pre, work) = if r.phase == Phase::Prefill {
            (r.prefill_tokens, r.prefill_work)
        } else {
            (0, 0)
        };
        if sign > 0 {
            l.prefill_tokens += pre;
            l.prefill_work += work;
            l.kv_blocks += kv;
            l.active += 1;
            l.decoding += u32::from(r.phase == Phase::Decode);
        } else {
            l.prefill_tokens -= pre;
            l.prefill_work -= work;
            l.kv_blocks -= kv;
            l.active -= 1;
            l.decoding -= u32::from(r.phase == Phase::Decode);
        }
    }

    /// Books a reservation. False (and nothing booked) if the key is live or tombstoned.
    pub fn book(&mut self, key: Key, r: Reservation, now: Nanos) -> bool {
        if self.live.contains_key(&key) || self.tombstones.contains_key(&key) {
            return false;
        }
        self.add(&r, 1, Some(now));
        self.deadlines.push_back((r.expires_at, key));
        self.live.insert(key, r);
        true
    }

    /// Changes a live reservation through `f`, keeping the loads in step; refreshes its deadline.
    pub fn update(
        &mut self,
        key: &Key,
        ttl: Nanos,
        now: Nanos,
        f: impl FnOnce(&mut Reservation),
    ) -> bool {
        let Some(mut r) = self.live.remove(key) else {
            return false;
        };
        let was = r.phase;
        self.add(&r, -1, None);
        f(&mut r);
        r.expires_at = now.saturating_add(ttl);
        self.add(&r, 1, None);
        if was == Phase::Prefill && r.phase != Phase::Prefill {
            // Its prefill is done: the next one in the queue starts.
            self.anchors.insert(r.worker, now);
        }
        self.deadlines.push_back((r.expires_at, *key));
        self.live.insert(*key, r);
        true
    }

    /// Removes a reservation and tombstones its key until `tomb_until`. Idempotent.
    pub fn finish(&mut self, key: &Key, tomb_until: Nanos, now: Nanos) -> Option<Reservation> {
        if !self.tombstones.contains_key(key) {
            self.tombstones.insert(*key, tomb_until);
            self.tomb_queue.push_back((tomb_until, *key));
        }
        let r = self.live.remove(key)?;
        self.add(&r, -1, Some(now));
        Some(r)
    }

    /// Expires reservations past their deadline and forgets old tombstones; returns the expired.
    pub fn expire(&mut self, now: Nanos, tomb_until: Nanos) -> Vec<(Key, Reservation)> {
        let mut out = Vec::new();
        while let Some(&(t, key)) = self.deadlines.front() {
            if t > now {
                break;
            }
            self.deadlines.pop_front();
            if self.live.get(&key).is_some_and(|r| r.expires_at <= now) {
                if let Some(r) = self.finish(&key, tomb_until, now) {
                    self.expired += 1;
                    out.push((key, r));
                }
            }
        }
        while let Some(&(t, key)) = self.tomb_queue.front() {
            if t > now {
                break;
            }
            self.tomb_queue.pop_front();
            if self.tombstones.get(&key).is_some_and(|&u| u <= now) {
                self.tombstones.remove(&key);
            }
        }
        // Deadlines of refreshed reservations pile up in the queue; compact now and then.
        if self.deadlines.len() > 64 && self.deadlines.len() > 4 * self.live.len() {
            let live = &self.live;
            self.deadlines
                .retain(|(t, k)| live.get(k).is_some_and(|r| r.expires_at == *t));
        }
        out
    }

    /// Forgets every reservation on a worker (worker removed). Returns how many.
    pub fn drop_worker(&mut self, w: WorkerId, tomb_until: Nanos, now: Nanos) -> usize {
        let keys: Vec<Key> = self
            .live
            .iter()
            .filter(|(_, r)| r.worker == w)
            .map(|(k, _)| *k)
            .collect();
        for k in &keys {
            self.finish(k, tomb_until, now);
        }
        self.loads.remove(&w);
        self.anchors.remove(&w);
        keys.len()
    }

    /// Sum of all loads (for invariant checks).
    pub fn total(&self) -> Load {
        let mut t = Load::default();
        for l in self.loads.values() {
            t.prefill_tokens += l.prefill_tokens;
            t.prefill_work += l.prefill_work;
            t.kv_blocks += l.kv_blocks;
            t.active += l.active;
            t.decoding += l.decoding;
        }
        t
    }

    /// Recomputes every load from the live reservations and compares (tests; O(n)).
    pub fn check(&self) -> Result<(), String> {
        let mut fresh = Ledger::default();
        for r in self.live.values() {
            fresh.add(r, 1, None);
        }
        for (w, l) in &self.loads {
            if fresh.load(*w) != *l {
                return Err(format!(
                    "worker {w}: load {l:?} but reservations add up to {:?}",
                    fresh.load(*w)
                ));
            }
        }
        for w in fresh.loads.keys() {
            if !self.loads.contains_key(w) {
                return Err(format!("worker {w}: reservations but no load"));
            }
        }
        Ok(())
    }
}
