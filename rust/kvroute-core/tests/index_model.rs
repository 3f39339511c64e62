//! Differential test: the radix-tree index against a tiny reference model (per-worker multisets
//! of content hashes), on random streams of stores, removals, clears, worker removals,
//! speculative entries and matches.
use std::collections::HashMap;

use kvroute_core::events::{BlockRemoved, BlockStored, EventBatch, KvEvent, Medium};
use kvroute_core::hashing::block_hashes;
use kvroute_core::index::{IndexConfig, PrefixIndex, WorkerMatch};
use proptest::prelude::*;

const BS: usize = 4;
const BLOCKS: usize = 8;
const WORKERS: u64 = 3;

/// A universe of sequences sharing prefixes: sequence k copies the first `share[k]` blocks of
/// sequence k-1 and continues with fresh tokens.
fn universe(shares: &[usize]) -> Vec<Vec<u32>> {
    let mut seqs: Vec<Vec<u32>> = Vec::new();
    let mut fresh = 1000u32;
    for (k, &share) in shares.iter().enumerate() {
        let mut t: Vec<u32> = if k == 0 {
            Vec::new()
        } else {
            seqs[k - 1][..share * BS].to_vec()
        };
        while t.len() < BLOCKS * BS {
            t.push(fresh);
            fresh += 1;
        }
        seqs.push(t);
    }
    seqs
}

fn engine_of(content: u64) -> u64 {
    content.rotate_left(17) ^ 0x5555_aaaa_1234_8765
}

#[derive(Debug, Clone)]
enum Op {
    Store {
        w: u64,
        seq: usize,
        a: usize,
        b: usize,
        cpu: bool,
    },
    Placeholder {
        w: u64,
        seq: usize,
        blk: usize,
    },
    Remove {
        w: u64,
        seq: usize,
        blk: usize,
        cpu: bool,
    },
    Clear {
        w: u64,
    },
    RemoveWorker {
        w: u64,
    },
    Speculate {
        w: u64,
        seq: usize,
        n: usize,
        ttl: u64,
    },
    Advance {
        dt: u64,
    },
    Match {
        seq: usize,
        n: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let w = 0..WORKERS;
    let seq = 0..6usize;
    prop_oneof![
        6 => (w.clone(), seq.clone(), 0..BLOCKS, 1..=BLOCKS, any::<bool>())
            .prop_map(|(w, seq, a, b, cpu)| Op::Store { w, seq, a: a.min(b - 1), b, cpu }),
        1 => (w.clone(), seq.clone(), 0..BLOCKS).prop_map(|(w, seq, blk)| Op::Placeholder { w, seq, blk }),
        4 => (w.clone(), seq.clone(), 0..BLOCKS, any::<bool>()).prop_map(|(w, seq, blk, cpu)| Op::Remove { w, seq, blk, cpu }),
        1 => w.clone().prop_map(|w| Op::Clear { w }),
        1 => w.clone().prop_map(|w| Op::RemoveWorker { w }),
        2 => (w, seq.clone(), 1..=BLOCKS, 1..20u64).prop_map(|(w, seq, n, ttl)| Op::Speculate { w, seq, n, ttl }),
        1 => (1..10u64).prop_map(|dt| Op::Advance { dt }),
        4 => (seq, 1..=BLOCKS).prop_map(|(seq, n)| Op::Match { seq, n }),
    ]
}

#[derive(Default, Clone, Copy, Debug)]
struct Cell {
    gpu: u32,
    cpu: u32,
    spec_until: u64,
}

#[derive(Default)]
struct Model {
    held: HashMap<(u64, u64), Cell>,
}

impl Model {
    fn cell(&mut self, w: u64, h: u64) -> &mut Cell {
        self.held.entry((w, h)).or_default()
    }
    fn holds(&self, w: u64, h: u64) -> bool {
        self.held
            .get(&(w, h))
            .is_some_and(|c| c.gpu > 0 || c.cpu > 0)
    }
    fn matches(&self, hashes: &[u64], now: u64) -> Vec<WorkerMatch> {
        let mut out = Vec::new();
        for w in 0..WORKERS {
            let (mut gpu, mut total, mut on_gpu) = (0u32, 0u32, true);
            for h in hashes {
                let c = self.held.get(&(w, *h)).copied().unwrap_or_default();
                let g = c.gpu > 0 || c.spec_until > now;
                if !(g || c.cpu > 0) {
                    break;
                }
                if on_gpu && g {
                    gpu += 1;
                } else {
                    on_gpu = false;
                }
                total += 1;
            }
            if total > 0 {
                out.push(WorkerMatch {
                    worker: w,
                    gpu,
                    cpu: total - gpu,
                });
            }
        }
        out
    }
}

fn batch(ev: KvEvent) -> EventBatch {
    EventBatch {
        ts: 0.0,
        events: vec![ev],
        dp_rank: Some(0),
    }
}

fn stored(hashes: &[u64], tokens: &[u32], parent: Option<u64>, medium: Medium) -> KvEvent {
    KvEvent::Stored(BlockStored {
        block_hashes: hashes.iter().map(|&h| engine_of(h)).collect(),
        parent: parent.map(engine_of),
        token_ids: tokens.to_vec(),
        block_size: if tokens.is_empty() { 0 } else { BS as u32 },
        lora_name: None,
        lora_id: None,
        medium,
        cache_salt: None,
        extra: None,
        group_idx: 0,
        spec_kind: None,
    })
}

fn run(shares: Vec<usize>, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let seqs = universe(&shares);
    let hashes: Vec<Vec<u64>> = seqs
        .iter()
        .map(|t| block_hashes(t, BS, None, None))
        .collect();
    let mut idx = PrefixIndex::new(IndexConfig::default());
    let mut model = Model::default();
    let mut now = 100u64;
    for op in ops {
        match op {
            Op::Store { w, seq, a, b, cpu } => {
                let hs = &hashes[seq];
                // Like an engine, a worker only stores a block whose parent it holds.
                if a > 0 && !model.holds(w, hs[a - 1]) {
                    continue;
                }
                let medium = if cpu { Medium::Cpu } else { Medium::Gpu };
                let parent = if a > 0 { Some(hs[a - 1]) } else { None };
                let ev = stored(&hs[a..b], &seqs[seq][a * BS..b * BS], parent, medium);
                idx.apply_batch(w, &batch(ev), now).unwrap();
                for &h in &hs[a..b] {
                    let c = model.cell(w, h);
                    if cpu {
                        c.cpu += 1;
                    } else {
                        c.gpu += 1;
                        c.spec_until = 0;
                    }
                }
            }
            Op::Placeholder { w, seq, blk } => {
                let h = hashes[seq][blk];
                // Offload tiers announce blocks the worker computed: place only those.
                if model.held.get(&(w, h)).is_none_or(|c| c.gpu == 0) {
                    continue;
                }
                idx.apply_batch(w, &batch(stored(&[h], &[], None, Medium::Cpu)), now)
                    .unwrap();
                model.cell(w, h).cpu += 1;
            }
            Op::Remove { w, seq, blk, cpu } => {
                let h = hashes[seq][blk];
                let medium = if cpu { Medium::Cpu } else { Medium::Gpu };
                let ev = KvEvent::Removed(BlockRemoved {
                    block_hashes: vec![engine_of(h)],
                    medium,
                    group_idx: 0,
                });
                idx.apply_batch(w, &batch(ev), now).unwrap();
                let c = model.cell(w, h);
                if cpu {
                    c.cpu = c.cpu.saturating_sub(1);
                } else {
                    c.gpu = c.gpu.saturating_sub(1);
                }
            }
            Op::Clear { w } => {
                idx.apply_batch(w, &batch(KvEvent::AllCleared), now)
                    .unwrap();
                model.held.retain(|(ww, _), _| *ww != w);
            }
            Op::RemoveWorker { w } => {
                idx.remove_worker(w);
                model.held.retain(|(ww, _), _| *ww != w);
            }
            Op::Speculate { w, seq, n, ttl } => {
                idx.speculate(w, &hashes[seq][..n], now + ttl, now).unwrap();
                for &h in &hashes[seq][..n] {
                    let c = model.cell(w, h);
                    if c.gpu == 0 {
                        c.spec_until = c.spec_until.max(now + ttl);
                    }
                }
            }
            Op::Advance { dt } => {
                now += dt;
                idx.expire(now);
            }
            Op::Match { seq, n } => {
                let mut got = idx.find_matches(&hashes[seq][..n], now);
                got.sort_by_key(|m| m.worker);
                let want = model.matches(&hashes[seq][..n], now);
                prop_assert_eq!(got, want);
            }
        }
        idx.check_invariants().map_err(TestCaseError::fail)?;
    }
    // Every entry accounted for: what the model holds is what the index counts.
    for w in 0..WORKERS {
        let want = model
            .held
            .iter()
            .filter(|((ww, _), c)| *ww == w && (c.gpu > 0 || c.cpu > 0 || c.spec_until > now))
            .count();
        let got = idx.worker_entries(w);
        // Expired speculative entries may linger until their record is collected.
        prop_assert!(
            got >= want as u64,
            "worker {w}: index has {got} entries, model {want}"
        );
    }
    idx.expire(u64::MAX - 1);
    for w in 0..WORKERS {
        let want = model
            .held
            .iter()
            .filter(|((ww, _), c)| *ww == w && (c.gpu > 0 || c.cpu > 0))
            .count();
        prop_assert_eq!(idx.worker_entries(w), want as u64, "worker {}", w);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    #[test]
    fn index_agrees_with_reference_model(
        shares in prop::collection::vec(0..BLOCKS, 6),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        run(shares, ops)?;
    }
}
