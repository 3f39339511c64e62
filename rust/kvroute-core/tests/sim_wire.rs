//! End-to-end wire fidelity: the engine's KV-event batches, encoded as vLLM sends them, decoded
//! and applied to a `PrefixIndex`, must make the index see exactly the engine's own cache:
//! for random prompts (shared prefixes, LoRA, salts, evictions, preemptions, a CPU tier) the
//! index's match on worker 0 equals the engine's cached prefix, per tier.
use kvroute_core::events::{encode_batch, Encoding, KvEvent, Medium};
use kvroute_core::hashing::{block_hashes, event_hash, VllmHashAlgo, VllmHasher};
use kvroute_core::index::PrefixIndex;
use kvroute_core::sim::blockhash::EngineHasher;
use kvroute_core::sim::request::splitmix64;
use kvroute_core::sim::{Engine, EngineConfig, HashAlgo, LatencyModel, NewRequest};

const BS: usize = 4;
const LORA: (&str, &str) = ("ad", "/adapters/ad");

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = splitmix64(self.0);
        self.0 % n
    }
}

fn engine(algo: HashAlgo, cpu_blocks: usize, seed: u64) -> Engine {
    let mut c = EngineConfig::from_preset("llama3-8b-h100").unwrap();
    c.block_size = BS;
    c.num_gpu_blocks = 24;
    c.num_cpu_blocks = cpu_blocks;
    c.max_num_batched_tokens = 16;
    c.max_num_seqs = 4;
    c.hash_algo = algo;
    c.hash_seed = Some("42".into());
    c.seed = seed;
    c.lora_paths = vec![(LORA.0.into(), LORA.1.into())];
    c.latency = LatencyModel::linear(0.001, 1e-4);
    Engine::new(c).unwrap()
}

/// The engine's own view of `tokens`: leading blocks on the GPU, then leading blocks available
/// on the GPU or the CPU (the index's notion of a match across tiers).
fn engine_match(e: &Engine, tokens: &[u32], lora: bool, salt: Option<&str>) -> (u32, u32) {
    let h = EngineHasher::new(e.config().hash_algo, e.config().hash_seed.as_deref());
    let mut chain = h.start(lora.then_some(LORA), salt);
    let mut buf = Vec::new();
    let hashes: Vec<u64> = tokens
        .chunks_exact(BS)
        .map(|b| h.next(&mut chain, b, &mut buf))
        .collect();
    let pool = e.pool();
    let gpu = hashes.iter().take_while(|&&x| pool.copies(x) > 0).count();
    let any = hashes
        .iter()
        .take_while(|&&x| pool.copies(x) > 0 || pool.cpu().contains(x))
        .count();
    (gpu as u32, (any - gpu) as u32)
}

fn index_match(
    idx: &mut PrefixIndex,
    tokens: &[u32],
    lora: bool,
    salt: Option<&str>,
) -> (u32, u32) {
    let hashes = block_hashes(tokens, BS, lora.then_some(LORA.0), salt);
    idx.find_matches(&hashes, 0)
        .iter()
        .find(|m| m.worker == 0)
        .map_or((0, 0), |m| (m.gpu, m.cpu))
}

fn check(algo: HashAlgo, cpu_blocks: usize, seed: u64) -> (usize, usize) {
    let mut rng = Rng(seed);
    let mut e = engine(algo, cpu_blocks, seed);
    let mut idx = PrefixIndex::default();
    let prefixes: Vec<Vec<u32>> = (0..3)
        .map(|p| (0..(4 + 5 * p)).map(|i| (100 * p + i) as u32).collect())
        .collect();
    let mut probes: Vec<(Vec<u32>, bool, Option<&str>)> = Vec::new();
    let (mut compared, mut nonzero, mut removed, mut offloaded) = (0, 0, 0, 0);
    for step in 0..400u32 {
        if step < 300 && rng.below(2) == 0 {
            let mut prompt = prefixes[rng.below(3) as usize].clone();
            let suffix = 1 + rng.below(14);
            prompt.extend((0..suffix).map(|_| 1000 + rng.below(50) as u32));
            let lora = rng.below(4) == 0;
            let salt = [None, None, None, Some("s1")][rng.below(4) as usize];
            let mut r = NewRequest::new(
                &format!("r{step}"),
                prompt.clone(),
                1 + rng.below(24) as u32,
            );
            r.lora = lora.then(|| LORA.0.into());
            r.salt = salt.map(Into::into);
            e.add_request(r).unwrap();
            probes.push((prompt, lora, salt));
        }
        let out = e.step(f64::from(step));
        if let Some(batch) = &out.events {
            for ev in &batch.events {
                match ev {
                    KvEvent::Removed(r) if r.medium == Medium::Gpu => removed += 1,
                    KvEvent::Stored(s) if s.medium == Medium::Cpu => offloaded += 1,
                    _ => {}
                }
            }
            let enc = if step % 2 == 0 {
                Encoding::Map
            } else {
                Encoding::Array
            };
            idx.apply_payload(0, &encode_batch(batch, enc), 0).unwrap();
        }
        idx.check_invariants().unwrap();
        let c = idx.counters();
        assert_eq!((c.orphan_blocks, c.unplaced_blocks), (0, 0), "{c:?}");
        for (tokens, lora, salt) in probes.iter().rev().take(12) {
            let want = engine_match(&e, tokens, *lora, *salt);
            let got = index_match(&mut idx, tokens, *lora, *salt);
            assert_eq!(
                got, want,
                "{algo:?} step {step} probe {tokens:?} lora {lora} salt {salt:?}"
            );
            compared += 1;
            nonzero += usize::from(want.0 + want.1 > 0);
        }
    }
    // The run must exercise evictions, preemptions and (with a CPU tier) offloads and loads.
    let m = e.metrics();
    assert!(
        removed > 20 && m.preemptions > 0,
        "removed {removed}, {m:?}"
    );
    if cpu_blocks > 0 {
        assert!(
            offloaded > 10 && m.external_prefix_cache_hits > 0,
            "{offloaded} {m:?}"
        );
    }
    (compared, nonzero)
}

#[test]
fn the_index_sees_exactly_the_engines_gpu_cache() {
    for (i, algo) in HashAlgo::ALL.into_iter().enumerate() {
        let (compared, nonzero) = check(algo, 0, 7 + i as u64);
        assert!(
            nonzero * 4 > compared,
            "too few hits exercised: {nonzero}/{compared}"
        );
    }
}

#[test]
fn the_index_sees_exactly_the_engines_gpu_and_cpu_cache() {
    for seed in [1, 2] {
        check(HashAlgo::Sha256, 12, seed);
        check(HashAlgo::Xxh3, 40, seed);
    }
}

#[test]
fn sha256_engine_hashes_are_vllms() {
    let mut e = engine(HashAlgo::Sha256, 0, 0);
    let prompt: Vec<u32> = (0..13).collect();
    let mut r = NewRequest::new("a", prompt.clone(), 1);
    r.lora = Some(LORA.0.into());
    r.salt = Some("tenant".into());
    e.add_request(r).unwrap();
    let batch = e.step(0.0).events.unwrap();
    let KvEvent::Stored(s) = &batch.events[0] else {
        panic!("{batch:?}")
    };
    let want: Vec<u64> = VllmHasher::new(VllmHashAlgo::Sha256, Some("42"))
        .block_hashes(&prompt, BS, Some(LORA), Some("tenant"))
        .iter()
        .map(event_hash)
        .collect();
    assert_eq!(s.block_hashes, want);
    assert_eq!(s.lora_name.as_deref(), Some(LORA.0));
    assert_eq!(s.cache_salt.as_deref(), Some("tenant"));
}

/// vLLM 0.33.0's own golden stream (`shared/golden/`): every full block of every admitted prompt,
/// hashed by the simulator's engine hasher, is a hash vLLM published for that worker.
#[test]
fn engine_hashes_match_the_vllm_golden_stream() {
    use std::collections::HashSet;
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/golden/vllm-0.33.0-seed1.jsonl");
    let text = std::fs::read_to_string(&path).expect("golden stream ships in shared/golden");
    let records: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let header = &records[0];
    assert_eq!(header["algo"], "sha256");
    let bs = header["block_size"].as_u64().unwrap() as usize;
    let mut stored: HashSet<(u64, u64)> = HashSet::new();
    for r in &records[1..] {
        if r["kind"] == "events" {
            let payload = hex::decode(r["payload_hex"].as_str().unwrap()).unwrap();
            let batch = kvroute_core::events::decode_batch(&payload).unwrap();
            for ev in batch.events {
                if let KvEvent::Stored(s) = ev {
                    let w = r["worker"].as_u64().unwrap();
                    stored.extend(s.block_hashes.iter().map(|&h| (w, h)));
                }
            }
        }
    }
    let hasher = EngineHasher::new(HashAlgo::Sha256, None);
    let mut buf = Vec::new();
    let (mut checked, mut with_lora, mut with_salt) = (0, 0, 0);
    for r in records
        .iter()
        .filter(|r| r["kind"] == "probe" && r["source"] == "admission")
    {
        let tokens: Vec<u32> = r["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let lora = r["lora"]
            .as_str()
            .map(|n| (n, header["lora_adapters"][n]["lora_path"].as_str().unwrap()));
        let salt = r["salt"].as_str();
        let w = r["target_worker"].as_u64().unwrap();
        let mut chain = hasher.start(lora, salt);
        for block in tokens.chunks_exact(bs) {
            let h = hasher.next(&mut chain, block, &mut buf);
            assert!(
                stored.contains(&(w, h)),
                "probe {} block hash {h} never published",
                r["probe_id"]
            );
            checked += 1;
        }
        with_lora += usize::from(lora.is_some());
        with_salt += usize::from(salt.is_some());
    }
    assert!(
        checked > 500 && with_lora > 5 && with_salt > 5,
        "{checked} {with_lora} {with_salt}"
    );
}
