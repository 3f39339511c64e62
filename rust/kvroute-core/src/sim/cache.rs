//! The GPU block pool, with vLLM v1's prefix-cache semantics (`vllm/v1/core/block_pool.py`).
//!
//! * Block 0 is vLLM's null block and is never handed out: `num_gpu_blocks - 1` are usable.
//! * A full block becomes *cached* when it is scheduled ([`BlockPool::cache_blocks`]): its hash
//!   enters a hash -> blocks map that allows several blocks per hash (a re-sent block-aligned
//!   prompt recomputes its last block, because a hit is capped at `num_tokens - 1`), and one
//!   `BlockStored` announces the run of newly cached blocks with the previous block as parent.
//! * Blocks are reference counted. A block whose count drops to 0 joins the tail of the free
//!   queue and *stays cached*; a request frees its blocks tail first, so its tail is evicted
//!   before its head. A cache hit on a free block takes it out of the queue.
//! * Allocation pops the head of the free queue (least recently freed). If that block is cached,
//!   its hash is evicted: with a CPU tier the block is offloaded there first (CPU events), then a
//!   `BlockRemoved` with that one hash is emitted, even if another copy of the hash remains.
//!
//! All events of one engine step are collected in order and taken by the engine at the end of the
//! step ([`BlockPool::take_events`]).
use hashbrown::hash_map::Entry;
use hashbrown::HashMap;

use super::cpu::CpuTier;
pub use super::idhash::IdHashBuilder;
use crate::events::{BlockRemoved, BlockStored, KvEvent, Medium, SpecKind};

/// A block's index in the pool.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Block {
    hash: u64,
    cached: bool,
    ref_cnt: u32,
    /// Free-queue links (valid while `ref_cnt == 0`).
    prev: u32,
    next: u32,
    /// Next block cached under the same hash (duplicates form a chain from the map's entry).
    next_dup: u32,
}

/// What [`BlockPool::cache_blocks`] needs to know about a request to announce its blocks.
#[derive(Debug, Clone, Copy)]
pub struct SeqView<'a> {
    /// All tokens (prompt and output so far).
    pub tokens: &'a [u32],
    /// Engine hashes of the full blocks of `tokens`.
    pub hashes: &'a [u64],
    pub lora_name: Option<&'a str>,
    pub lora_id: Option<i64>,
    pub salt: Option<&'a str>,
}

#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<Block>,
    /// Free queue: `head` is evicted first.
    head: u32,
    tail: u32,
    num_free: usize,
    /// Hash -> first block of its duplicate chain. One small entry per distinct hash keeps the
    /// map compact: eviction's lookup is the pool's main cache miss.
    cached: HashMap<u64, BlockId, IdHashBuilder>,
    cpu: CpuTier,
    events: Vec<KvEvent>,
    emit: bool,
}

impl BlockPool {
    /// A pool of `num_gpu_blocks` blocks (at least 2: the null block and one usable) and a CPU
    /// tier of `num_cpu_blocks` (0 = none). `emit` turns event collection on.
    pub fn new(
        block_size: usize,
        num_gpu_blocks: usize,
        num_cpu_blocks: usize,
        emit: bool,
    ) -> Self {
        assert!(block_size > 0 && num_gpu_blocks >= 2 && num_gpu_blocks < NIL as usize);
        let mut pool = BlockPool {
            block_size,
            blocks: Vec::new(),
            head: NIL,
            tail: NIL,
            num_free: 0,
            cached: HashMap::with_hasher(IdHashBuilder),
            cpu: CpuTier::new(num_cpu_blocks),
            events: Vec::new(),
            emit,
        };
        pool.init(num_gpu_blocks);
        pool
    }

    fn init(&mut self, n: usize) {
        let blank = Block {
            hash: 0,
            cached: false,
            ref_cnt: 0,
            prev: NIL,
            next: NIL,
            next_dup: NIL,
        };
        self.blocks.clear();
        self.blocks.resize(n, blank);
        self.head = NIL;
        self.tail = NIL;
        self.num_free = 0;
        self.cached.clear();
        // Block 0 is the null block: never free, never allocated.
        self.blocks[0].ref_cnt = 1;
        for b in 1..n as u32 {
            self.push_free(b);
        }
    }

    /// Empties every tier and drops pending events (an engine restart).
    pub fn reset(&mut self) {
        let n = self.blocks.len();
        self.init(n);
        self.cpu.clear();
        self.events.clear();
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks that requests can use (`num_gpu_blocks - 1`).
    pub fn usable_blocks(&self) -> usize {
        self.blocks.len() - 1
    }

    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// vLLM's `kv_cache_usage`: `1 - free / usable` (cached free blocks count as free).
    pub fn usage(&self) -> f64 {
        1.0 - self.num_free as f64 / self.usable_blocks() as f64
    }

    pub fn cpu(&self) -> &CpuTier {
        &self.cpu
    }

    fn push_free(&mut self, b: BlockId) {
        self.blocks[b as usize].prev = self.tail;
        self.blocks[b as usize].next = NIL;
        match self.tail {
            NIL => self.head = b,
            t => self.blocks[t as usize].next = b,
        }
        self.tail = b;
        self.num_free += 1;
    }

    fn unlink_free(&mut self, b: BlockId) {
        let Block { prev, next, .. } = self.blocks[b as usize];
        match prev {
            NIL => self.head = next,
            p => self.blocks[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.blocks[n as usize].prev = prev,
        }
        self.num_free -= 1;
    }

    /// The longest prefix of `hashes` cached on the GPU: appends one block per hash to `out`
    /// (the first copy, as vLLM's `get_cached_block` does). Reads only: no LRU change.
    pub fn find_cached(&self, hashes: &[u64], out: &mut Vec<BlockId>) {
        for h in hashes {
            match self.cached.get(h) {
                Some(&b) => out.push(b),
                None => break,
            }
        }
    }

    /// How many leading `hashes` the CPU tier holds.
    pub fn cpu_prefix(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|&&h| self.cpu.contains(h)).count()
    }

    /// Marks loaded blocks most recently used in the CPU tier.
    pub fn touch_cpu(&mut self, hashes: &[u64]) {
        for &h in hashes {
            self.cpu.touch(h);
        }
    }

    /// vLLM's `allocate_slots`: appends the cache hits `hits` (first allocation only) and then new
    /// blocks to `blocks` until they hold `num_tokens` tokens. Fails, changing nothing, when the
    /// free queue cannot supply the new blocks plus the hits it currently holds.
    pub fn allocate(
        &mut self,
        blocks: &mut Vec<BlockId>,
        hits: &[BlockId],
        num_tokens: usize,
    ) -> bool {
        let want = num_tokens.div_ceil(self.block_size);
        let new = want.saturating_sub(blocks.len() + hits.len());
        let hits_free = hits
            .iter()
            .filter(|&&b| self.blocks[b as usize].ref_cnt == 0)
            .count();
        if new + hits_free > self.num_free {
            return false;
        }
        for &b in hits {
            if self.blocks[b as usize].ref_cnt == 0 {
                self.unlink_free(b);
            }
            self.blocks[b as usize].ref_cnt += 1;
        }
        blocks.extend_from_slice(hits);
        blocks.reserve(new);
        for _ in 0..new {
            let b = self.head;
            self.unlink_free(b);
            self.evict(b);
            self.blocks[b as usize].ref_cnt = 1;
            blocks.push(b);
        }
        true
    }

    /// Drops block `b`'s hash, if it has one: offload to the CPU tier, then `BlockRemoved`.
    fn evict(&mut self, b: BlockId) {
        let blk = &mut self.blocks[b as usize];
        if !blk.cached {
            return;
        }
        blk.cached = false;
        let (hash, next) = (blk.hash, blk.next_dup);
        if let Entry::Occupied(mut head) = self.cached.entry(hash) {
            if *head.get() == b {
                if next == NIL {
                    head.remove();
                } else {
                    *head.get_mut() = next;
                }
            } else {
                // A duplicate further down the chain: unlink it.
                let mut p = *head.get();
                while self.blocks[p as usize].next_dup != b {
                    p = self.blocks[p as usize].next_dup;
                }
                self.blocks[p as usize].next_dup = next;
            }
        }
        let events = self.emit.then_some(&mut self.events);
        self.cpu.store(hash, events);
        if self.emit {
            self.events.push(KvEvent::Removed(BlockRemoved {
                block_hashes: vec![hash],
                medium: Medium::Gpu,
                group_idx: 0,
            }));
        }
    }

    /// vLLM's `cache_blocks`: caches the full blocks among the first `num_tokens` tokens of `seq`
    /// past the `*num_cached` already cached, announcing them in one `BlockStored`.
    pub fn cache_blocks(
        &mut self,
        seq: &SeqView<'_>,
        blocks: &[BlockId],
        num_cached: &mut usize,
        num_tokens: usize,
    ) {
        let bs = self.block_size;
        let full = num_tokens / bs;
        let start = *num_cached;
        if full <= start {
            return;
        }
        for (i, &b) in blocks.iter().enumerate().take(full).skip(start) {
            let hash = seq.hashes[i];
            let blk = &mut self.blocks[b as usize];
            debug_assert!(!blk.cached, "block {b} is already cached");
            blk.hash = hash;
            blk.cached = true;
            blk.next_dup = NIL;
            match self.cached.entry(hash) {
                // A duplicate joins the end of the chain: lookups keep answering with the oldest
                // copy, as vLLM's insertion-ordered dict of blocks per hash does.
                Entry::Occupied(head) => {
                    let mut last = *head.get();
                    while self.blocks[last as usize].next_dup != NIL {
                        last = self.blocks[last as usize].next_dup;
                    }
                    self.blocks[last as usize].next_dup = b;
                }
                Entry::Vacant(v) => {
                    v.insert(b);
                }
            }
        }
        *num_cached = full;
        if !self.emit {
            return;
        }
        self.events.push(KvEvent::Stored(BlockStored {
            block_hashes: seq.hashes[start..full].to_vec(),
            parent: start.checked_sub(1).map(|p| seq.hashes[p]),
            token_ids: seq.tokens[start * bs..full * bs].to_vec(),
            block_size: bs as u32,
            lora_id: seq.lora_id,
            lora_name: seq.lora_name.map(str::to_owned),
            medium: Medium::Gpu,
            cache_salt: if start == 0 {
                seq.salt.map(str::to_owned)
            } else {
                None
            },
            extra: None,
            group_idx: 0,
            spec_kind: Some(SpecKind::FullAttention),
        }));
    }

    /// Releases a request's blocks, tail first: each reaches the free queue (still cached) when
    /// its last reference goes.
    pub fn free(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            let blk = &mut self.blocks[b as usize];
            debug_assert!(blk.ref_cnt > 0, "double free of block {b}");
            blk.ref_cnt -= 1;
            if blk.ref_cnt == 0 {
                self.push_free(b);
            }
        }
    }

    /// Events collected since the last call, in order. The next step's buffer starts with the
    /// same capacity, so steady state does not regrow it event by event.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        let cap = self.events.len();
        std::mem::replace(&mut self.events, Vec::with_capacity(cap))
    }

    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    // ---- inspection (tests, metrics)

    /// GPU blocks currently holding `hash` (duplicates included).
    pub fn copies(&self, hash: u64) -> usize {
        let mut n = 0;
        let mut b = self.cached.get(&hash).copied().unwrap_or(NIL);
        while b != NIL {
            n += 1;
            b = self.blocks[b as usize].next_dup;
        }
        n
    }

    /// Distinct hashes cached on the GPU.
    pub fn cached_hashes(&self) -> usize {
        self.cached.len()
    }

    /// The hash block `b` is cached under, if any.
    pub fn block_hash(&self, b: BlockId) -> Option<u64> {
        let blk = &self.blocks[b as usize];
        blk.cached.then_some(blk.hash)
    }

    pub fn ref_cnt(&self, b: BlockId) -> u32 {
        self.blocks[b as usize].ref_cnt
    }

    /// The free queue, next to be evicted first.
    pub fn free_order(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut b = self.head;
        while b != NIL {
            out.push(b);
            b = self.blocks[b as usize].next;
        }
        out
    }
}
