//! The prefix index: which worker holds which prefix, in which tier.
//!
//! Blocks are keyed by kvroute's own *content* hash ([`crate::hashing`]): the chained xxh3 of the
//! block's tokens, rooted in the LoRA name and cache salt. Events are indexed by hashing the
//! `token_ids` they carry, so no engine seed or hash algorithm has to agree with the router; the
//! engine's own u64 hashes are only kept to resolve `BlockRemoved` events and hash-only CPU
//! placeholder events back to blocks.
//!
//! Memory is bounded by construction: with a budget of `max_entries` resident (block, worker)
//! entries, the least recently matched leaves are evicted first.
mod tree;

use smallvec::SmallVec;

use crate::events::{
    decode_batch, BlockRemoved, BlockStored, EventBatch, KvEvent, Medium, SpecKind,
};
use crate::hashing::{chain_hash, root_hash};
use crate::{Error, Nanos, Result, WorkerId};
use tree::{NodeId, Op, Tree, ROOT};

/// Workers one index can track at once (slots are u16).
pub const MAX_WORKERS: usize = u16::MAX as usize;
/// Expired speculative entries are swept out at most this often (nanoseconds).
pub const SWEEP_INTERVAL: Nanos = 1_000_000_000;

#[derive(Debug, Clone)]
pub struct IndexConfig {
    /// Budget of resident (block, worker) entries, speculative ones included; 0 = unbounded.
    pub max_entries: u64,
    /// When over budget, evict down to this fraction of it (hysteresis, so eviction is amortised).
    pub evict_to: f64,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            max_entries: 0,
            evict_to: 0.9,
        }
    }
}

/// One worker's cached prefix of a request, in blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerMatch {
    pub worker: WorkerId,
    /// Leading blocks in GPU memory (or speculatively routed there and not yet expired).
    pub gpu: u32,
    /// Further blocks, right after the GPU prefix, available from the CPU offload tier.
    pub cpu: u32,
}

/// One worker's resident blocks by tier. A block can be in both tiers; speculative counts blocks
/// routed there and not (yet) confirmed on GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierEntries {
    pub gpu: u64,
    pub cpu: u64,
    pub speculative: u64,
}

/// Event-ingestion and maintenance counters (monotonic).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexCounters {
    pub payloads: u64,
    pub malformed_payloads: u64,
    pub events: u64,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub cleared: u64,
    pub unknown_events: u64,
    /// Blocks of events for KV groups that are not full attention (hybrid models).
    pub skipped_group_blocks: u64,
    /// Blocks in a medium other than GPU or CPU.
    pub skipped_medium_blocks: u64,
    /// Stored blocks whose parent hash is unknown (events were missed): not indexed.
    pub orphan_blocks: u64,
    /// Removals of hashes this worker does not hold in that tier: ignored.
    pub unknown_removals: u64,
    /// Hash-only (placeholder) blocks whose engine hash is not known: not indexed.
    pub unplaced_blocks: u64,
    pub evicted_entries: u64,
    pub speculative_blocks: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct IndexStats {
    pub workers: usize,
    pub nodes: usize,
    pub blocks: usize,
    /// Resident (block, worker) entries, any tier.
    pub entries: u64,
    /// Heap bytes held by the index (measured from its containers' capacities).
    pub memory_bytes: usize,
    pub counters: IndexCounters,
}

pub struct PrefixIndex {
    cfg: IndexConfig,
    tree: Tree,
    slot_of: hashbrown::HashMap<WorkerId, u16>,
    worker_of: Vec<Option<WorkerId>>,
    free_slots: Vec<u16>,
    /// Per slot, the KV-cache groups known to be full attention (bit g = group g; group 0 by default).
    full_groups: Vec<u64>,
    /// Speculative entries recorded since the last sweep (0 = nothing to sweep).
    spec_dirty: u64,
    /// When expired speculative entries are next swept out.
    next_sweep: Nanos,
    counters: IndexCounters,
    scratch: Vec<u64>,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new(IndexConfig::default())
    }
}

impl PrefixIndex {
    pub fn new(cfg: IndexConfig) -> Self {
        PrefixIndex {
            cfg,
            tree: Tree::new(),
            slot_of: Default::default(),
            worker_of: Vec::new(),
            free_slots: Vec::new(),
            full_groups: Vec::new(),
            spec_dirty: 0,
            next_sweep: 0,
            counters: IndexCounters::default(),
            scratch: Vec::new(),
        }
    }

    pub fn config(&self) -> &IndexConfig {
        &self.cfg
    }

    /// Registers a worker (idempotent).
    pub fn add_worker(&mut self, worker: WorkerId) -> Result<()> {
        self.slot(worker).map(|_| ())
    }

    fn slot(&mut self, worker: WorkerId) -> Result<u16> {
        if let Some(&s) = self.slot_of.get(&worker) {
            return Ok(s);
        }
        let s = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                if self.worker_of.len() >= MAX_WORKERS {
                    return Err(Error::TooManyWorkers(MAX_WORKERS));
                }
                self.worker_of.push(None);
                self.full_groups.push(0);
                self.tree.slot_entries.push(0);
                (self.worker_of.len() - 1) as u16
            }
        };
        self.worker_of[s as usize] = Some(worker);
        self.full_groups[s as usize] = 1;
        self.slot_of.insert(worker, s);
        Ok(s)
    }

    /// Unregisters a worker and purges all its residency at once. Returns the entries purged.
    pub fn remove_worker(&mut self, worker: WorkerId) -> u64 {
        let Some(s) = self.slot_of.remove(&worker) else {
            return 0;
        };
        let purged = self.tree.purge_slot(s);
        self.worker_of[s as usize] = None;
        self.free_slots.push(s);
        purged
    }

    /// Drops everything a worker holds but keeps it registered (engine restart, cache reset).
    pub fn clear_worker(&mut self, worker: WorkerId) -> u64 {
        match self.slot_of.get(&worker) {
            Some(&s) => self.tree.purge_slot(s),
            None => 0,
        }
    }

    pub fn workers(&self) -> Vec<WorkerId> {
        self.worker_of.iter().flatten().copied().collect()
    }

    pub fn has_worker(&self, worker: WorkerId) -> bool {
        self.slot_of.contains_key(&worker)
    }

    /// Resident blocks of one worker (any tier, speculative included).
    pub fn worker_entries(&self, worker: WorkerId) -> u64 {
        self.slot_of
            .get(&worker)
            .map_or(0, |&s| self.tree.slot_entries[s as usize])
    }

    /// Decodes one raw ZMQ payload (msgpack `[ts, events, dp_rank]`) and applies it for `worker`
    /// (registered on first use). A malformed payload is counted, changes nothing and errors.
    pub fn apply_payload(&mut self, worker: WorkerId, payload: &[u8], now: Nanos) -> Result<()> {
        self.counters.payloads += 1;
        match decode_batch(payload) {
            Ok(batch) => self.apply_batch(worker, &batch, now),
            Err(e) => {
                self.counters.malformed_payloads += 1;
                Err(Error::Event(e))
            }
        }
    }

    /// Applies an already decoded batch for `worker` (registered on first use).
    pub fn apply_batch(&mut self, worker: WorkerId, batch: &EventBatch, now: Nanos) -> Result<()> {
        let slot = self.slot(worker)?;
        for ev in &batch.events {
            self.apply_event(slot, ev, now);
        }
        self.enforce_budget();
        Ok(())
    }

    fn apply_event(&mut self, slot: u16, ev: &KvEvent, now: Nanos) {
        self.counters.events += 1;
        match ev {
            KvEvent::Stored(s) => self.apply_stored(slot, s, now),
            KvEvent::Removed(r) => self.apply_removed(slot, r, now),
            KvEvent::AllCleared => {
                self.counters.cleared += 1;
                self.tree.purge_slot(slot);
            }
            KvEvent::Unknown(_) => self.counters.unknown_events += 1,
        }
    }

    /// Whether events of `group` count for routing, learning from `kv_cache_spec_kind` when told.
    fn full_group(&mut self, slot: u16, group: u32, kind: Option<SpecKind>) -> bool {
        let bits = &mut self.full_groups[slot as usize];
        let bit = if group < 64 { 1u64 << group } else { 0 };
        match kind {
            Some(SpecKind::FullAttention) => {
                *bits |= bit;
                true
            }
            Some(SpecKind::Other) => {
                *bits &= !bit;
                false
            }
            None => *bits & bit != 0,
        }
    }

    fn apply_stored(&mut self, slot: u16, s: &BlockStored, now: Nanos) {
        let n = s.block_hashes.len() as u64;
        if !self.full_group(slot, s.group_idx, s.spec_kind) {
            self.counters.skipped_group_blocks += n;
            return;
        }
        let cpu = match s.medium {
            Medium::Gpu => false,
            Medium::Cpu => true,
            Medium::Other => {
                self.counters.skipped_medium_blocks += n;
                return;
            }
        };
        let op = Op::Store { cpu };
        if s.token_ids.is_empty() || s.block_size == 0 {
            // Hash-only placeholder (default for CPU offload events): place by engine hash.
            for &e in &s.block_hashes {
                match self.tree.engine.get(&e).copied() {
                    Some(b) => {
                        let (node, off) = self.tree.after_block(b);
                        self.touch_one(slot, node, off - 1, op, true, now);
                        self.counters.stored_blocks += 1;
                    }
                    None => self.counters.unplaced_blocks += 1,
                }
            }
            return;
        }
        let (start, mut h) = match s.parent {
            None => (
                (ROOT, 0),
                root_hash(s.lora_name.as_deref(), s.cache_salt.as_deref()),
            ),
            Some(p) => match self.tree.engine.get(&p).copied() {
                Some(b) => {
                    let (node, off) = self.tree.after_block(b);
                    ((node, off), self.tree.nodes[node as usize].hashes[off - 1])
                }
                None => {
                    self.counters.orphan_blocks += n;
                    return;
                }
            },
        };
        let bs = s.block_size as usize;
        let mut hashes = std::mem::take(&mut self.scratch);
        hashes.clear();
        for (i, chunk) in s.token_ids.chunks_exact(bs).enumerate() {
            let extra = s.extra.as_ref().map_or(0, |x| x[i]);
            h = chain_hash(h, chunk, extra);
            hashes.push(h);
        }
        self.tree
            .insert_chain(slot, start, &hashes, Some(&s.block_hashes), op, now);
        self.counters.stored_blocks += n;
        self.scratch = hashes;
    }

    fn apply_removed(&mut self, slot: u16, r: &BlockRemoved, now: Nanos) {
        let n = r.block_hashes.len() as u64;
        if !self.full_group(slot, r.group_idx, None) {
            self.counters.skipped_group_blocks += n;
            return;
        }
        let cpu = match r.medium {
            Medium::Gpu => false,
            Medium::Cpu => true,
            Medium::Other => {
                self.counters.skipped_medium_blocks += n;
                return;
            }
        };
        for &e in &r.block_hashes {
            let Some(b) = self.tree.engine.get(&e).copied() else {
                self.counters.unknown_removals += 1;
                continue;
            };
            let (node, off) = self.tree.after_block(b);
            let held = self.tree.nodes[node as usize]
                .res_of(slot)
                .is_some_and(|x| if cpu { x.cpu > 0 } else { x.gpu > 0 });
            if held {
                self.touch_one(slot, node, off - 1, Op::Store { cpu }, false, now);
                self.counters.removed_blocks += 1;
            } else {
                self.counters.unknown_removals += 1;
            }
        }
    }

    /// Adds or removes `op` for `slot` on the single block at (`node`, `off`).
    fn touch_one(&mut self, slot: u16, node: NodeId, off: usize, op: Op, add: bool, now: Nanos) {
        if !add && self.is_sole_last_copy(slot, node, off, op) {
            self.tree.pop_last(node);
            return;
        }
        let seg = self.tree.isolate(node, off, off + 1);
        self.tree.update_res(seg, slot, op, add, now);
        if self.tree.nodes[seg as usize].res.is_empty()
            && self.tree.nodes[seg as usize].children.len() == 0
        {
            self.tree.prune(seg);
        } else {
            let first = self.tree.nodes[seg as usize].parent;
            self.tree.merge_around(seg);
            if first != ROOT && self.tree.nodes[first as usize].live {
                self.tree.merge_around(first);
            }
        }
    }

    /// Whether removing `op`'s copy of the block at (`node`, `off`) empties the tail of a leaf
    /// that only `slot` holds: then the block can simply be dropped, with no split.
    fn is_sole_last_copy(&self, slot: u16, node: NodeId, off: usize, op: Op) -> bool {
        let n = &self.tree.nodes[node as usize];
        if off + 1 != n.len() || n.children.len() != 0 || n.res.len() != 1 || n.res[0].slot != slot
        {
            return false;
        }
        let r = n.res[0];
        match op {
            Op::Store { cpu: false } => r.gpu == 1 && r.cpu == 0 && r.spec_until == 0,
            Op::Store { cpu: true } => r.cpu == 1 && r.gpu == 0 && r.spec_until == 0,
            Op::Speculate { .. } => false,
        }
    }

    /// Per worker, the longest cached prefix of `hashes` (content hashes from
    /// [`crate::hashing::block_hashes`]), split by tier. Workers with no cached block are omitted.
    pub fn find_matches(&mut self, hashes: &[u64], now: Nanos) -> Vec<WorkerMatch> {
        let mut out = Vec::new();
        self.find_matches_into(hashes, now, &mut out);
        out
    }

    /// As [`Self::find_matches`], into a caller-owned vector (cleared first).
    pub fn find_matches_into(&mut self, hashes: &[u64], now: Nanos, out: &mut Vec<WorkerMatch>) {
        struct Acc {
            slot: u16,
            gpu: u32,
            total: u32,
            on_gpu: bool,
            alive: bool,
        }
        out.clear();
        self.tree.clock += 1;
        let tick = self.tree.clock;
        let mut acc: SmallVec<[Acc; 16]> = SmallVec::new();
        let mut node = ROOT;
        let mut i = 0;
        let mut first = true;
        while i < hashes.len() {
            let Some(child) = self.tree.nodes[node as usize].children.get(hashes[i]) else {
                break;
            };
            let cn = &mut self.tree.nodes[child as usize];
            cn.last_used = tick;
            let m = cn
                .hashes
                .iter()
                .zip(&hashes[i..])
                .take_while(|(a, b)| a == b)
                .count();
            if first {
                first = false;
                acc.extend(cn.res.iter().map(|r| Acc {
                    slot: r.slot,
                    gpu: 0,
                    total: 0,
                    on_gpu: true,
                    alive: true,
                }));
            }
            let mut any = false;
            // Both `acc` and `res` are sorted by slot: one merge pass.
            let res = &cn.res;
            let mut j = 0;
            for a in acc.iter_mut().filter(|a| a.alive) {
                while j < res.len() && res[j].slot < a.slot {
                    j += 1;
                }
                let r = res.get(j).filter(|r| r.slot == a.slot);
                let (gpu, avail) = match r {
                    Some(r) => {
                        let g = r.gpu > 0 || r.spec_until > now;
                        (g, g || r.cpu > 0)
                    }
                    None => (false, false),
                };
                if !avail {
                    a.alive = false;
                    continue;
                }
                any = true;
                if a.on_gpu && gpu {
                    a.gpu += m as u32;
                } else {
                    a.on_gpu = false;
                }
                a.total += m as u32;
            }
            if !any {
                break;
            }
            i += m;
            if m < cn.hashes.len() {
                break;
            }
            node = child;
        }
        for a in acc {
            if a.total > 0 {
                if let Some(w) = self.worker_of[a.slot as usize] {
                    out.push(WorkerMatch {
                        worker: w,
                        gpu: a.gpu,
                        cpu: a.total - a.gpu,
                    });
                }
            }
        }
    }

    /// Records that the router just sent a request with these blocks to `worker`: until `until`
    /// (or until the engine's own events arrive) the worker counts as holding them on GPU.
    pub fn speculate(
        &mut self,
        worker: WorkerId,
        hashes: &[u64],
        until: Nanos,
        now: Nanos,
    ) -> Result<()> {
        if hashes.is_empty() || until <= now {
            return Ok(());
        }
        let slot = self.slot(worker)?;
        self.expire(now);
        self.tree.clock += 1;
        self.tree
            .insert_chain(slot, (ROOT, 0), hashes, None, Op::Speculate { until }, now);
        self.counters.speculative_blocks += hashes.len() as u64;
        self.spec_dirty += hashes.len() as u64;
        self.enforce_budget();
        Ok(())
    }

    /// Frees speculative entries whose deadline has passed. Matching already ignores them, so
    /// this is only about memory: it sweeps the tree at most once per `SWEEP_INTERVAL` (the tree
    /// has few nodes: runs are long), which keeps per-request bookkeeping off the hot path.
    pub fn expire(&mut self, now: Nanos) {
        if self.spec_dirty == 0 || now < self.next_sweep {
            return;
        }
        self.next_sweep = now.saturating_add(SWEEP_INTERVAL);
        let mut live = 0u64;
        let mut changed = Vec::new();
        for (id, n) in self.tree.nodes.iter().enumerate().skip(1) {
            if !n.live {
                continue;
            }
            for r in &n.res {
                if r.spec_until > now {
                    live += n.len() as u64;
                } else if r.spec_until != 0 {
                    changed.push((id as NodeId, r.slot));
                }
            }
        }
        self.spec_dirty = live;
        for (id, slot) in changed {
            if !self.tree.nodes[id as usize].live {
                continue;
            }
            self.tree
                .update_res(id, slot, Op::Speculate { until: 0 }, false, now);
            let n = &self.tree.nodes[id as usize];
            if n.res.is_empty() && n.children.len() == 0 {
                self.tree.prune(id);
            } else {
                self.tree.merge_around(id);
            }
        }
    }

    fn enforce_budget(&mut self) {
        let max = self.cfg.max_entries;
        if max == 0 || self.tree.entries <= max {
            return;
        }
        let target = (max as f64 * self.cfg.evict_to.clamp(0.0, 1.0)) as u64;
        while self.tree.entries > target {
            let mut leaves: Vec<(u64, NodeId)> = self
                .tree
                .nodes
                .iter()
                .enumerate()
                .skip(1)
                .filter(|(_, n)| n.live && n.children.len() == 0)
                .map(|(i, n)| (n.last_used, i as NodeId))
                .collect();
            if leaves.is_empty() {
                break;
            }
            leaves.sort_unstable();
            for (_, id) in leaves {
                if self.tree.entries <= target {
                    break;
                }
                let n = &self.tree.nodes[id as usize];
                let before = self.tree.entries;
                let parent = n.parent;
                self.tree.delete_leaf(id);
                self.counters.evicted_entries += before - self.tree.entries;
                if parent != ROOT && self.tree.nodes[parent as usize].res.is_empty() {
                    self.tree.prune(parent);
                }
            }
        }
    }

    /// Every registered worker's resident blocks by tier (one pass over the tree's runs).
    pub fn tier_entries(&self, now: Nanos) -> Vec<(WorkerId, TierEntries)> {
        let mut per = vec![TierEntries::default(); self.worker_of.len()];
        for n in self.tree.nodes.iter().skip(1).filter(|n| n.live) {
            let len = n.len() as u64;
            for r in &n.res {
                let t = &mut per[r.slot as usize];
                t.gpu += if r.gpu > 0 { len } else { 0 };
                t.cpu += if r.cpu > 0 { len } else { 0 };
                t.speculative += if r.gpu == 0 && r.spec_until > now {
                    len
                } else {
                    0
                };
            }
        }
        self.worker_of
            .iter()
            .zip(per)
            .filter_map(|(w, t)| w.map(|w| (w, t)))
            .collect()
    }

    pub fn counters(&self) -> &IndexCounters {
        &self.counters
    }

    pub fn entries(&self) -> u64 {
        self.tree.entries
    }

    pub fn stats(&self) -> IndexStats {
        IndexStats {
            workers: self.slot_of.len(),
            nodes: self.tree.node_count(),
            blocks: self.tree.block_count(),
            entries: self.tree.entries,
            memory_bytes: self.tree.heap_bytes() + self.scratch.capacity() * 8,
            counters: self.counters.clone(),
        }
    }

    /// Verifies the tree's structural invariants (tests and debugging; O(size)).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.tree.check_invariants()
    }
}
