//! The simulator's block pool against hand-computed expectations: hits, LRU eviction order
//! (tail first), duplicate hashes, the CPU tier, and the events each operation publishes.
use kvroute_core::events::{KvEvent, Medium};
use kvroute_core::sim::cache::{BlockPool, SeqView};

const BS: usize = 4;

/// A request's view with `n` tokens and the given block hashes.
struct Seq {
    tokens: Vec<u32>,
    hashes: Vec<u64>,
}

impl Seq {
    fn new(first_token: u32, hashes: &[u64]) -> Self {
        Seq {
            tokens: (first_token..first_token + (hashes.len() * BS) as u32).collect(),
            hashes: hashes.to_vec(),
        }
    }
    fn view(&self) -> SeqView<'_> {
        SeqView {
            tokens: &self.tokens,
            hashes: &self.hashes,
            lora_name: None,
            lora_id: None,
            salt: None,
        }
    }
}

/// Runs a request through the pool: allocate with `hits`, cache everything, return its blocks.
fn run(pool: &mut BlockPool, seq: &Seq, hits: &[u32]) -> Vec<u32> {
    let mut blocks = Vec::new();
    let n = seq.tokens.len();
    assert!(pool.allocate(&mut blocks, hits, n));
    let mut cached = hits.len();
    pool.cache_blocks(&seq.view(), &blocks, &mut cached, n);
    blocks
}

fn summary(ev: &[KvEvent]) -> Vec<(char, Medium, Vec<u64>, Option<u64>)> {
    ev.iter()
        .map(|e| match e {
            KvEvent::Stored(s) => ('S', s.medium, s.block_hashes.clone(), s.parent),
            KvEvent::Removed(r) => ('R', r.medium, r.block_hashes.clone(), None),
            other => panic!("unexpected {other:?}"),
        })
        .collect()
}

#[test]
fn freed_blocks_stay_cached_and_the_tail_is_evicted_first() {
    // 9 blocks: block 0 is the null block, 1..=8 are usable.
    let mut pool = BlockPool::new(BS, 9, 0, true);
    assert_eq!(pool.usable_blocks(), 8);
    assert_eq!(pool.free_order(), (1..=8).collect::<Vec<_>>());

    let a = Seq::new(0, &[100, 101, 102]);
    let blocks = run(&mut pool, &a, &[]);
    assert_eq!(blocks, vec![1, 2, 3]);
    assert_eq!(
        summary(&pool.take_events()),
        vec![('S', Medium::Gpu, vec![100, 101, 102], None)]
    );
    assert!((pool.usage() - 3.0 / 8.0).abs() < 1e-12);

    pool.free(&blocks);
    // Never-used blocks first, then A's blocks tail first.
    assert_eq!(pool.free_order(), vec![4, 5, 6, 7, 8, 3, 2, 1]);
    assert!(pool.take_events().is_empty(), "freeing publishes nothing");
    assert_eq!(pool.usage(), 0.0);
    let mut hits = Vec::new();
    pool.find_cached(&[100, 101, 102, 999], &mut hits);
    assert_eq!(hits, vec![1, 2, 3]);

    // B takes the five never-used blocks (nothing evicted), then one more: A's tail (block 3).
    let mut b_blocks = Vec::new();
    assert!(pool.allocate(&mut b_blocks, &[], 5 * BS));
    assert!(pool.take_events().is_empty());
    assert!(pool.allocate(&mut b_blocks, &[], 6 * BS));
    assert_eq!(b_blocks, vec![4, 5, 6, 7, 8, 3]);
    assert_eq!(
        summary(&pool.take_events()),
        vec![('R', Medium::Gpu, vec![102], None)]
    );
    hits.clear();
    pool.find_cached(&[100, 101, 102], &mut hits);
    assert_eq!(hits, vec![1, 2]);

    // Two blocks left (A's head, still cached); asking for three more fails and changes nothing.
    assert!(!pool.allocate(&mut b_blocks, &[], 9 * BS));
    assert_eq!(b_blocks.len(), 6);
    assert_eq!(pool.num_free(), 2);
}

#[test]
fn a_hit_takes_free_blocks_out_of_the_queue_and_counts_against_allocation() {
    let mut pool = BlockPool::new(BS, 5, 0, true); // 4 usable
    let a = Seq::new(0, &[1, 2, 3]);
    let blocks = run(&mut pool, &a, &[]);
    pool.free(&blocks);
    pool.take_events();
    // Hitting A's 3 free blocks and wanting 2 more needs 5 free blocks: only 4 exist.
    let mut blocks = Vec::new();
    assert!(!pool.allocate(&mut blocks, &[1, 2, 3], 5 * BS));
    assert!(pool.allocate(&mut blocks, &[1, 2, 3], 4 * BS));
    assert_eq!(blocks, vec![1, 2, 3, 4]);
    assert_eq!(pool.num_free(), 0);
    assert_eq!(pool.ref_cnt(1), 1);
}

#[test]
fn a_resent_block_aligned_prompt_caches_its_last_block_twice() {
    let mut pool = BlockPool::new(BS, 9, 0, true);
    let a = Seq::new(0, &[100, 101, 102]);
    let first = run(&mut pool, &a, &[]);
    pool.free(&first);
    pool.take_events();
    // The engine caps the hit at num_tokens - 1 = 11 tokens: 2 blocks. The last block is
    // recomputed into a new block and cached again under the same hash.
    let mut hits = Vec::new();
    pool.find_cached(&a.hashes[..(a.tokens.len() - 1) / BS], &mut hits);
    assert_eq!(hits, vec![1, 2]);
    let second = run(&mut pool, &a, &hits);
    assert_eq!(second, vec![1, 2, 4]);
    assert_eq!(
        summary(&pool.take_events()),
        vec![('S', Medium::Gpu, vec![102], Some(101))]
    );
    assert_eq!(pool.copies(102), 2);
    assert_eq!(pool.block_hash(3), Some(102));
    assert_eq!(pool.block_hash(4), Some(102));
    // Lookups answer with the oldest copy (vLLM's insertion-ordered dict per hash).
    hits.clear();
    pool.find_cached(&a.hashes, &mut hits);
    assert_eq!(hits, vec![1, 2, 3]);

    // Evicting one copy publishes its removal; the other copy still answers lookups.
    pool.free(&second);
    let mut other = Vec::new();
    // Free queue now: 5, 6, 7, 8, 3 (first A's tail), 4, 2, 1.
    assert!(pool.allocate(&mut other, &[], 5 * BS));
    assert_eq!(other, vec![5, 6, 7, 8, 3]);
    assert_eq!(
        summary(&pool.take_events()),
        vec![('R', Medium::Gpu, vec![102], None)]
    );
    assert_eq!(pool.copies(102), 1);
    hits.clear();
    pool.find_cached(&a.hashes, &mut hits);
    assert_eq!(hits, vec![1, 2, 4]);
}

#[test]
fn evicted_blocks_go_to_the_cpu_tier_and_cpu_evictions_are_published() {
    // 3 usable GPU blocks, 2 CPU blocks.
    let mut pool = BlockPool::new(BS, 4, 2, true);
    let a = Seq::new(0, &[10, 11, 12]);
    let blocks = run(&mut pool, &a, &[]);
    pool.free(&blocks); // free queue: 3, 2, 1
    pool.take_events();

    let b = Seq::new(1000, &[20, 21]);
    let b_blocks = run(&mut pool, &b, &[]);
    assert_eq!(b_blocks, vec![3, 2]);
    // Each GPU eviction: CPU placeholder stored first (so a router can still place it), then
    // the GPU removal; then B's own blocks are stored.
    assert_eq!(
        summary(&pool.take_events()),
        vec![
            ('S', Medium::Cpu, vec![12], None),
            ('R', Medium::Gpu, vec![12], None),
            ('S', Medium::Cpu, vec![11], None),
            ('R', Medium::Gpu, vec![11], None),
            ('S', Medium::Gpu, vec![20, 21], None),
        ]
    );
    let mut hits = Vec::new();
    pool.find_cached(&a.hashes, &mut hits);
    assert_eq!(hits, vec![1]);
    assert_eq!(pool.cpu_prefix(&a.hashes[1..]), 2);
    assert_eq!(pool.cpu().lru_order(), vec![12, 11]);

    // Loading touches: 12 becomes most recent, so the next CPU eviction drops 11.
    pool.touch_cpu(&[12]);
    let mut c_blocks = Vec::new();
    pool.free(&b_blocks); // B's tail (block 2, hash 21) joins the queue before its head
    pool.take_events();
    assert_eq!(pool.free_order(), vec![1, 2, 3]);
    assert!(pool.allocate(&mut c_blocks, &[], 2 * BS)); // evicts block 1 (10), then 2 (21)
    let ev = summary(&pool.take_events());
    assert_eq!(
        ev,
        vec![
            ('R', Medium::Cpu, vec![11], None),
            ('S', Medium::Cpu, vec![10], None),
            ('R', Medium::Gpu, vec![10], None),
            ('R', Medium::Cpu, vec![12], None),
            ('S', Medium::Cpu, vec![21], None),
            ('R', Medium::Gpu, vec![21], None),
        ]
    );
    // Placeholders carry no tokens and block size 0, like vLLM's OffloadingConnector.
    pool.reset();
    assert_eq!(pool.num_free(), 3);
    assert!(pool.cpu().is_empty());
    assert_eq!(pool.cached_hashes(), 0);
}

#[test]
fn cpu_placeholders_are_hash_only() {
    let mut pool = BlockPool::new(BS, 2, 4, true); // one usable GPU block
    let a = Seq::new(0, &[7]);
    let blocks = run(&mut pool, &a, &[]);
    pool.free(&blocks);
    pool.take_events();
    let b = Seq::new(50, &[8]);
    run(&mut pool, &b, &[]);
    let ev = pool.take_events();
    let KvEvent::Stored(s) = &ev[0] else {
        panic!("{ev:?}")
    };
    assert_eq!(s.medium, Medium::Cpu);
    assert!(s.token_ids.is_empty() && s.block_size == 0 && s.parent.is_none());
}
