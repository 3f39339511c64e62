//! Replays the KV-event streams that vLLM 0.33.0's own prefix-cache code produced
//! (`shared/golden/`) through the index: at every probe, each worker's cached prefix must be
//! exactly what vLLM reported.
use std::path::PathBuf;

use kvroute_core::events::decode_batch;
use kvroute_core::hashing::block_hashes;
use kvroute_core::index::PrefixIndex;
use serde_json::Value;

fn golden() -> Vec<Value> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/golden/vllm-0.33.0-seed1.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "golden stream {} not readable ({e}); it ships in shared/golden",
            path.display()
        )
    });
    text.lines()
        .map(|l| serde_json::from_str(l).expect("golden line is JSON"))
        .collect()
}

#[test]
fn golden_stream_reproduces_every_probe() {
    let records = golden();
    let header = &records[0];
    let bs = header["block_size"].as_u64().unwrap() as usize;
    let workers = header["workers"].as_u64().unwrap();
    let mut idx = PrefixIndex::default();
    let (mut probes, mut nonzero, mut events, mut finals) = (0, 0, 0, 0);
    for r in &records[1..] {
        match r["kind"].as_str().unwrap() {
            "events" => {
                let payload = hex::decode(r["payload_hex"].as_str().unwrap()).unwrap();
                idx.apply_payload(r["worker"].as_u64().unwrap(), &payload, 0)
                    .unwrap();
                idx.check_invariants().unwrap();
                events += 1;
            }
            "probe" => {
                let tokens: Vec<u32> = r["tokens"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32)
                    .collect();
                let hashes = block_hashes(&tokens, bs, r["lora"].as_str(), r["salt"].as_str());
                let got = idx.find_matches(&hashes, 0);
                for w in 0..workers {
                    let want = r["cached_blocks"][w.to_string()].as_u64().unwrap() as u32;
                    let m = got.iter().find(|m| m.worker == w);
                    let gpu = m.map_or(0, |m| m.gpu);
                    assert_eq!(
                        gpu, want,
                        "probe {} worker {w}: cached prefix",
                        r["probe_id"]
                    );
                    assert_eq!(
                        m.map_or(0, |m| m.cpu),
                        0,
                        "the golden stream has no CPU tier"
                    );
                    nonzero += usize::from(want > 0);
                }
                probes += 1;
            }
            "final" => {
                // Distinct hashes each worker still caches at the end of the stream.
                let w = r["worker"].as_u64().unwrap();
                assert_eq!(
                    idx.worker_entries(w),
                    r["num_cached_hashes"].as_u64().unwrap(),
                    "worker {w} at the end"
                );
                finals += 1;
            }
            "summary" => {}
            other => panic!("unknown record kind {other}"),
        }
    }
    let c = idx.counters();
    assert_eq!(c.malformed_payloads, 0);
    assert_eq!(c.orphan_blocks, 0, "every stored parent is known");
    assert_eq!(
        c.unknown_removals, 0,
        "every removal resolves to a held block"
    );
    assert_eq!(finals, workers);
    assert!(
        probes > 200 && nonzero > 100 && events > 300,
        "{probes} probes, {nonzero} hits, {events} batches"
    );
}

/// Truncated and bit-flipped copies of real payloads, applied to a populated index: each one
/// that is rejected must leave the index exactly as it was.
#[test]
fn rejected_payloads_change_nothing() {
    let records = golden();
    let mut idx = PrefixIndex::default();
    let mut payloads = Vec::new();
    let mut probes = Vec::new();
    for r in &records[1..] {
        match r["kind"].as_str().unwrap() {
            "events" => {
                let p = hex::decode(r["payload_hex"].as_str().unwrap()).unwrap();
                idx.apply_payload(r["worker"].as_u64().unwrap(), &p, 0)
                    .unwrap();
                payloads.push(p);
            }
            "probe" => {
                let tokens: Vec<u32> = r["tokens"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32)
                    .collect();
                probes.push(block_hashes(
                    &tokens,
                    16,
                    r["lora"].as_str(),
                    r["salt"].as_str(),
                ));
            }
            _ => {}
        }
    }
    let snapshot = |idx: &mut PrefixIndex| {
        let s = idx.stats();
        let m: Vec<_> = probes.iter().map(|h| idx.find_matches(h, 0)).collect();
        (s.entries, s.blocks, s.nodes, m)
    };
    let before = snapshot(&mut idx);
    let mut rejected = 0;
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for p in payloads.iter().filter(|p| p.len() > 40).take(120) {
        for k in 0..8 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let mut bad = p.clone();
            if k % 2 == 0 {
                bad.truncate((state as usize) % p.len());
            } else {
                let i = (state as usize) % p.len();
                bad[i] = 0xc1; // the one byte msgpack never uses
            }
            if decode_batch(&bad).is_ok() {
                continue; // the byte landed inside a float or a string: still well-formed
            }
            assert!(idx.apply_payload(1, &bad, 0).is_err());
            rejected += 1;
        }
    }
    assert!(rejected >= 700, "{rejected} rejected");
    assert_eq!(idx.counters().malformed_payloads, rejected);
    assert_eq!(
        snapshot(&mut idx),
        before,
        "a rejected payload changed the index"
    );
    idx.check_invariants().unwrap();
}
