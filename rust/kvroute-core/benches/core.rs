//! Criterion benches for the hot paths of the core, on a prefix-sharing workload shaped like
//! `shared/bench/dynamo_index_bench.py`: W workers, sequences of S blocks that copy a random
//! prefix of an earlier sequence, about one million resident (block, worker) entries.
//!
//! Run: `cargo bench -p kvroute-core --bench core` (pin with `taskset -c 0` for single-core figures).
//! `KVROUTE_BENCH_ENTRIES` shrinks the workload for a quick run.
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute_core::events::{encode_batch, BlockStored, Encoding, EventBatch, KvEvent, Medium};
use kvroute_core::hashing::{block_hashes, chain_hash};
use kvroute_core::index::PrefixIndex;
use kvroute_core::scheduler::{PolicyKind, Scheduler, SchedulerConfig, WorkerInfo};
use parking_lot::Mutex;

const BS: usize = 16;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

pub struct Workload {
    /// (worker, payload) in apply order.
    pub payloads: Vec<(u64, Vec<u8>)>,
    pub blocks: u64,
    /// Token sequences resident on some worker (full hits for their worker).
    pub seqs: Vec<(u64, Vec<u32>)>,
}

/// Engine hashes: a chain distinct from kvroute's content chain, as a real engine's would be.
fn engine_chain(parent: u64, tokens: &[u32]) -> u64 {
    chain_hash(parent ^ 0x7e57_e7e5_7e57_e7e5, tokens, 0)
}

pub fn workload(
    workers: u64,
    seq_blocks: usize,
    entries: u64,
    blocks_per_event: usize,
    seed: u64,
) -> Workload {
    let mut rng = Rng(seed);
    let mut seqs: Vec<(u64, Vec<u32>)> = Vec::new();
    let mut held: Vec<hashbrown::HashSet<u64>> = vec![Default::default(); workers as usize];
    let mut payloads = Vec::new();
    let mut total = 0u64;
    while total < entries {
        let (tokens, worker) = if !seqs.is_empty() && rng.below(10) < 8 {
            let (pw, parent) = &seqs[rng.below(seqs.len())];
            let b = 1 + rng.below(seq_blocks - 1);
            let mut t = parent[..b * BS].to_vec();
            t.extend((0..(seq_blocks - b) * BS).map(|_| rng.next() as u32));
            let w = if rng.below(2) == 0 {
                *pw
            } else {
                rng.below(workers as usize) as u64
            };
            (t, w)
        } else {
            (
                (0..seq_blocks * BS).map(|_| rng.next() as u32).collect(),
                rng.below(workers as usize) as u64,
            )
        };
        let mut eng = Vec::with_capacity(seq_blocks);
        let mut h = 0u64;
        for c in tokens.chunks_exact(BS) {
            h = engine_chain(h, c);
            eng.push(h);
        }
        let res = &mut held[worker as usize];
        let k = eng.iter().take_while(|e| res.contains(*e)).count();
        let mut parent = if k > 0 { Some(eng[k - 1]) } else { None };
        let mut start = k;
        while start < seq_blocks {
            let end = (start + blocks_per_event).min(seq_blocks);
            let ev = KvEvent::Stored(BlockStored {
                block_hashes: eng[start..end].to_vec(),
                parent,
                token_ids: tokens[start * BS..end * BS].to_vec(),
                block_size: BS as u32,
                lora_id: None,
                lora_name: None,
                medium: Medium::Gpu,
                cache_salt: None,
                extra: None,
                group_idx: 0,
                spec_kind: None,
            });
            let batch = EventBatch {
                ts: 0.0,
                events: vec![ev],
                dp_rank: Some(0),
            };
            payloads.push((worker, encode_batch(&batch, Encoding::Map)));
            parent = Some(eng[end - 1]);
            start = end;
        }
        res.extend(eng[k..].iter().copied());
        total += (seq_blocks - k) as u64;
        seqs.push((worker, tokens));
    }
    Workload {
        payloads,
        blocks: total,
        seqs,
    }
}

fn entries() -> u64 {
    std::env::var("KVROUTE_BENCH_ENTRIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000)
}

fn build(w: &Workload) -> PrefixIndex {
    let mut idx = PrefixIndex::default();
    for (worker, p) in &w.payloads {
        idx.apply_payload(*worker, p, 0).unwrap();
    }
    idx
}

fn ingest(c: &mut Criterion) {
    let mut g = c.benchmark_group("ingest");
    g.sample_size(10).measurement_time(Duration::from_secs(20));
    for bpe in [32usize, 512] {
        let w = workload(16, 512, entries(), bpe, 1);
        g.throughput(Throughput::Elements(w.blocks));
        g.bench_function(
            BenchmarkId::new("vllm_payloads_blocks", format!("{bpe}_per_event")),
            |b| b.iter(|| black_box(build(&w))),
        );
    }
    g.finish();
}

fn decision(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    for (workers, tokens) in [(16u64, 8192usize), (16, 32768), (64, 8192)] {
        let seq_blocks = tokens / BS;
        let w = workload(workers, seq_blocks, entries(), 32, 2);
        let idx = Arc::new(Mutex::new(build(&w)));
        let cfg = SchedulerConfig {
            policy: PolicyKind::Kvroute,
            ..Default::default()
        };
        let s = Scheduler::new(cfg, idx.clone()).unwrap();
        for id in 0..workers {
            s.upsert_worker(WorkerInfo {
                id,
                capacity_blocks: 25_000,
                cpu_capacity_blocks: 0,
                healthy: true,
                metrics: None,
            })
            .unwrap();
        }
        let queries: Vec<&Vec<u32>> = w.seqs.iter().rev().take(64).map(|(_, t)| t).collect();
        let mut i = 0usize;
        let name = format!("{workers}w_{tokens}tok");
        g.bench_function(BenchmarkId::new("hash_match_score_reserve", &name), |b| {
            b.iter(|| {
                let q = queries[i % queries.len()];
                i += 1;
                let d = s
                    .select_and_reserve_tokens(q, None, None, 128, &[], 1)
                    .unwrap();
                s.release(d.reservation, 1);
                black_box(d)
            })
        });
        let hashes: Vec<Vec<u64>> = queries
            .iter()
            .map(|q| block_hashes(q, BS, None, None))
            .collect();
        g.bench_function(BenchmarkId::new("match_only", &name), |b| {
            b.iter(|| {
                let h = &hashes[i % hashes.len()];
                i += 1;
                black_box(idx.lock().find_matches(h, 1))
            })
        });
        g.bench_function(BenchmarkId::new("hash_only", &name), |b| {
            b.iter(|| {
                let q = queries[i % queries.len()];
                i += 1;
                black_box(block_hashes(q, BS, None, None))
            })
        });
    }
    g.finish();
}

fn memory(_c: &mut Criterion) {
    // Not a timing: reports the index's own accounting of its heap per resident entry.
    let w = workload(16, 512, entries(), 32, 3);
    let idx = build(&w);
    let s = idx.stats();
    eprintln!(
        "memory: {} entries, {} blocks, {} nodes, {} heap bytes = {:.1} bytes/entry",
        s.entries,
        s.blocks,
        s.nodes,
        s.memory_bytes,
        s.memory_bytes as f64 / s.entries as f64
    );
}

criterion_group!(benches, memory, decision, ingest);
criterion_main!(benches);
