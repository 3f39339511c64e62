//! Offline bounds on the prefix-cache token hit ratio a router can reach on a workload.
//!
//! Every bound replays the workload's prompts in arrival order as the engines would see them:
//! the prompt is cut into the engine's KV blocks, hashed as a chain, and a hit is the leading run
//! of blocks already cached, capped as vLLM caps it (at most `num_tokens - 1` tokens, whole
//! blocks). The ratio is hit tokens over prompt tokens, as [`super::ReplayReport::gpu_hit_ratio`].
//!
//! * `infinite`: one shared cache that never evicts. No router on any cache size does better.
//! * `pooled_lru`: one LRU cache the size of the whole fleet (replicas x usable GPU blocks), with
//!   vLLM's order (a prompt's tail blocks are evicted before its head). This is a perfectly
//!   cache-aware router on caches of the given size: every cached prefix is found and no block is
//!   held twice, with no load constraint. It is the reference kvroute's target is set against.
//! * `belady`: the optimal replacement (evict the block used farthest in the future, or do not
//!   cache the new one) on the same pooled capacity, counting every cached block of a prompt, not
//!   only its leading run: a strict upper bound for caches of that total size in arrival order.
use std::collections::BinaryHeap;

use hashbrown::HashMap;

use super::trace::TokenSynth;
use super::workload::Workload;
use crate::hashing::block_hashes;

/// Token hit ratios of the three bounds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct HitBounds {
    pub infinite: f64,
    pub pooled_lru: f64,
    pub belady: f64,
}

impl HitBounds {
    pub fn items(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("infinite", self.infinite),
            ("pooled_lru", self.pooled_lru),
            ("belady", self.belady),
        ]
    }
}

/// Computes the bounds for `workload` on engines with `block_size`-token blocks and, together,
/// `capacity_blocks` usable GPU blocks; prompts are synthesised as the replay does (`seed`).
pub fn hit_bounds(
    workload: &Workload,
    block_size: usize,
    capacity_blocks: usize,
    seed: u64,
    vocab_size: u32,
) -> HitBounds {
    let synth = TokenSynth::with_block_tokens(seed, vocab_size, workload.block_tokens);
    let bs = block_size.max(1);
    // Per request: its block hashes and how many of them may count as hits.
    let mut accesses: Vec<u64> = Vec::new();
    let mut spans: Vec<(usize, usize, usize)> = Vec::with_capacity(workload.records.len());
    let mut prompt = Vec::new();
    let mut total_tokens = 0u64;
    for rec in &workload.records {
        prompt.clear();
        synth.prompt(rec, &mut prompt);
        total_tokens += prompt.len() as u64;
        let start = accesses.len();
        accesses.extend(block_hashes(&prompt, bs, None, None));
        let countable = (prompt.len().saturating_sub(1)) / bs;
        spans.push((start, accesses.len(), countable));
    }
    let ratio = |blocks: u64| {
        if total_tokens == 0 {
            0.0
        } else {
            (blocks * bs as u64) as f64 / total_tokens as f64
        }
    };
    HitBounds {
        infinite: ratio(infinite(&accesses, &spans)),
        pooled_lru: ratio(pooled_lru(&accesses, &spans, capacity_blocks)),
        belady: ratio(belady(&accesses, &spans, capacity_blocks)),
    }
}

fn infinite(accesses: &[u64], spans: &[(usize, usize, usize)]) -> u64 {
    let mut seen = hashbrown::HashSet::with_capacity(accesses.len() / 2);
    let mut hits = 0u64;
    for &(a, b, countable) in spans {
        let run = accesses[a..b]
            .iter()
            .take_while(|h| seen.contains(*h))
            .count();
        hits += run.min(countable) as u64;
        seen.extend(accesses[a..b].iter().copied());
    }
    hits
}

const NIL: u32 = u32::MAX;

/// An LRU set of block hashes: a doubly linked list over a slab, indexed by a hash map.
struct Lru {
    map: HashMap<u64, u32>,
    keys: Vec<u64>,
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Least recently used end.
    head: u32,
    tail: u32,
    capacity: usize,
}

impl Lru {
    fn new(capacity: usize) -> Self {
        Lru {
            map: HashMap::new(),
            keys: Vec::new(),
            prev: Vec::new(),
            next: Vec::new(),
            head: NIL,
            tail: NIL,
            capacity,
        }
    }

    fn unlink(&mut self, i: u32) {
        let (p, n) = (self.prev[i as usize], self.next[i as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
    }

    fn push_back(&mut self, i: u32) {
        self.prev[i as usize] = self.tail;
        self.next[i as usize] = NIL;
        if self.tail == NIL {
            self.head = i;
        } else {
            self.next[self.tail as usize] = i;
        }
        self.tail = i;
    }

    /// Makes `key` the most recently used, inserting it (and evicting the least recently used
    /// when full).
    fn touch(&mut self, key: u64) {
        if let Some(&i) = self.map.get(&key) {
            self.unlink(i);
            self.push_back(i);
            return;
        }
        if self.capacity == 0 {
            return;
        }
        let i = if self.map.len() >= self.capacity {
            let victim = self.head;
            self.unlink(victim);
            self.map.remove(&self.keys[victim as usize]);
            self.keys[victim as usize] = key;
            victim
        } else {
            self.keys.push(key);
            self.prev.push(NIL);
            self.next.push(NIL);
            (self.keys.len() - 1) as u32
        };
        self.map.insert(key, i);
        self.push_back(i);
    }
}

fn pooled_lru(accesses: &[u64], spans: &[(usize, usize, usize)], capacity: usize) -> u64 {
    let mut lru = Lru::new(capacity);
    let mut hits = 0u64;
    for &(a, b, countable) in spans {
        let blocks = &accesses[a..b];
        let run = blocks
            .iter()
            .take_while(|h| lru.map.contains_key(*h))
            .count();
        hits += run.min(countable) as u64;
        // Tail first, so the head of the prompt is the most recently used (vLLM frees a
        // request's blocks tail first and evicts from the front of its free queue).
        for &h in blocks.iter().rev() {
            lru.touch(h);
        }
    }
    hits
}

fn belady(accesses: &[u64], spans: &[(usize, usize, usize)], capacity: usize) -> u64 {
    // Next use of each access (usize::MAX: never again).
    let mut next_use = vec![usize::MAX; accesses.len()];
    let mut last: HashMap<u64, usize> = HashMap::with_capacity(accesses.len() / 2);
    for (i, &h) in accesses.iter().enumerate().rev() {
        if let Some(j) = last.insert(h, i) {
            next_use[i] = j;
        }
    }
    drop(last);
    // Cached block -> its next use; a max-heap of (next use, block) with stale entries skipped.
    let mut cached: HashMap<u64, usize> = HashMap::with_capacity(capacity.min(accesses.len()));
    let mut heap: BinaryHeap<(usize, u64)> = BinaryHeap::new();
    let mut hits = 0u64;
    for &(a, b, countable) in spans {
        for (k, i) in (a..b).enumerate() {
            let h = accesses[i];
            let nu = next_use[i];
            if let Some(v) = cached.get_mut(&h) {
                hits += u64::from(k < countable);
                *v = nu;
                heap.push((nu, h));
                continue;
            }
            if capacity == 0 || nu == usize::MAX {
                continue;
            }
            if cached.len() >= capacity {
                // The farthest next use among cached blocks (skipping stale heap entries).
                let far = loop {
                    let (u, x) = heap.pop().expect("a full cache has heap entries");
                    if cached.get(&x) == Some(&u) {
                        break (u, x);
                    }
                };
                if far.0 <= nu {
                    heap.push(far);
                    continue;
                }
                cached.remove(&far.1);
            }
            cached.insert(h, nu);
            heap.push((nu, h));
        }
        // Keep the heap from growing without bound on long runs.
        if heap.len() > 4 * cached.len() + 1024 {
            heap = cached.iter().map(|(&h, &u)| (u, h)).collect();
        }
    }
    hits
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::trace::TraceRecord;

    fn workload(prompts: &[&[u64]]) -> Workload {
        Workload {
            name: "t".into(),
            block_tokens: 16,
            records: prompts
                .iter()
                .map(|ids| TraceRecord {
                    timestamp_ms: 0.0,
                    input_length: ids.len() * 16,
                    output_length: 1,
                    hash_ids: ids.to_vec(),
                })
                .collect(),
        }
    }

    #[test]
    fn bounds_on_a_hand_checked_sequence() {
        // Four blocks of 16 tokens per prompt; the hit is capped at 3 blocks (num_tokens - 1).
        let w = workload(&[&[1, 2, 3, 4], &[1, 2, 3, 4], &[5, 6, 7, 8], &[1, 2, 9, 9]]);
        let total = 4.0 * 64.0;
        let b = hit_bounds(&w, 16, 1000, 0, 1000);
        // Infinite: 3 blocks on the 2nd prompt, 2 on the 4th.
        assert_eq!(b.infinite, 5.0 * 16.0 / total);
        assert_eq!(b.pooled_lru, b.infinite);
        assert_eq!(b.belady, b.infinite);
        // Four blocks of room: the third prompt evicts the first, LRU keeps nothing useful.
        let b = hit_bounds(&w, 16, 4, 0, 1000);
        assert_eq!(b.pooled_lru, 3.0 * 16.0 / total);
        // Belady does not cache the third prompt's blocks (never used again) and keeps 1, 2.
        assert_eq!(b.belady, 5.0 * 16.0 / total);
        assert!(b.belady >= b.pooled_lru && b.infinite >= b.belady);
        let none = hit_bounds(&w, 16, 0, 0, 1000);
        assert_eq!((none.pooled_lru, none.belady), (0.0, 0.0));
    }

    #[test]
    fn lru_evicts_the_tail_of_a_prompt_first() {
        // Room for 5 blocks: after [1,2,3,4] then [5], the LRU victim is block 4, not block 1.
        let w = workload(&[&[1, 2, 3, 4], &[5], &[6], &[1, 2, 3, 7]]);
        let b = hit_bounds(&w, 16, 5, 0, 1000);
        // [6] evicts 4 (tail first): [1,2,3] still hit 3 blocks.
        assert_eq!(b.pooled_lru, 3.0 / 10.0);
    }
}
