//! Tests of `kvroute_core::hashing`: vLLM's own test vectors (`docs/vllm.md` section 2), every
//! `BlockStored` event of the vLLM 0.33.0 golden stream recomputed from its tokens, and the
//! properties the router relies on in kvroute's own xxh3 chain.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use kvroute_core::hashing::{
    block_hashes, block_hashes_into, chain_hash, event_hash, extend_chain, root_hash, Digest,
    ExtraKey, VllmHashAlgo, VllmHasher, DEFAULT_BLOCK_SIZE,
};
use rmpv::Value;

fn seq(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

/// Deterministic pseudo-random token ids (a 32-bit LCG: no RNG dependency, stable forever).
fn pseudo_tokens(n: usize, seed: u32) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            x >> 8
        })
        .collect()
}

fn hx(d: &Digest) -> String {
    hex::encode(d)
}

fn lora_key(name: &str, path: &str) -> ExtraKey {
    ExtraKey::Lora {
        name: name.into(),
        path: path.into(),
    }
}

// ------------------------------------------------------------------------------------------------
// vLLM test vectors (docs/vllm.md section 2: vLLM 0.33.0's own functions, PYTHONHASHSEED unset)
// ------------------------------------------------------------------------------------------------

#[test]
fn algo_names_parse_like_vllm_flags() {
    assert_eq!(VllmHashAlgo::parse("sha256"), Some(VllmHashAlgo::Sha256));
    assert_eq!(
        VllmHashAlgo::parse("sha256_cbor"),
        Some(VllmHashAlgo::Sha256Cbor)
    );
    for other in ["xxhash", "xxhash_cbor", "SHA256", "sha256-cbor", ""] {
        assert_eq!(VllmHashAlgo::parse(other), None, "{other:?}");
    }
}

#[test]
fn vllm_none_hash_vectors() {
    let sha = hx(&VllmHasher::new(VllmHashAlgo::Sha256, None).none_hash());
    assert!(
        sha.starts_with("066b1e89") && sha.ends_with("d71198"),
        "{sha}"
    );
    assert_eq!(
        sha,
        "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
    );

    let cbor = hx(&VllmHasher::new(VllmHashAlgo::Sha256Cbor, None).none_hash());
    assert!(
        cbor.starts_with("9bd96a48") && cbor.ends_with("81eef0"),
        "{cbor}"
    );
    assert_eq!(
        cbor,
        "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    );
}

#[test]
fn vllm_none_hash_uses_pythonhashseed_when_set() {
    // hashlib.sha256(pickle.dumps("0", 5)) and of cbor2.dumps("0", canonical=True).
    let sha = VllmHasher::new(VllmHashAlgo::Sha256, Some("0"));
    assert_eq!(
        hx(&sha.none_hash()),
        "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c"
    );
    let cbor = VllmHasher::new(VllmHashAlgo::Sha256Cbor, Some("0"));
    assert_eq!(
        hx(&cbor.none_hash()),
        "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    );
}

#[test]
fn vllm_block_vectors_sha256() {
    let h = VllmHasher::new(VllmHashAlgo::Sha256, None);
    let blocks = h.block_hashes(&seq(0..32), 16, None, None);
    assert_eq!(blocks.len(), 2);
    let (b0, b1) = (hx(&blocks[0]), hx(&blocks[1]));
    assert!(b0.starts_with("fe8fa5dd") && b0.ends_with("434798"), "{b0}");
    assert!(b1.starts_with("8be7aaa3") && b1.ends_with("cc4629"), "{b1}");
    assert_eq!(event_hash(&blocks[0]), 3_262_291_359_910_021_016);
    assert_eq!(event_hash(&blocks[1]), 7_142_137_847_444_424_233);
    // The same through hash_block, chaining by hand.
    assert_eq!(h.hash_block(&h.none_hash(), &seq(0..16), &[]), blocks[0]);
    assert_eq!(h.hash_block(&blocks[0], &seq(16..32), &[]), blocks[1]);
}

#[test]
fn vllm_block_vectors_sha256_cbor() {
    let h = VllmHasher::new(VllmHashAlgo::Sha256Cbor, None);
    let blocks = h.block_hashes(&seq(0..32), 16, None, None);
    assert_eq!(blocks.len(), 2);
    let (b0, b1) = (hx(&blocks[0]), hx(&blocks[1]));
    assert!(b0.starts_with("dc918a88") && b0.ends_with("ac0749"), "{b0}");
    assert!(b1.starts_with("c300ec27") && b1.ends_with("84ef0c"), "{b1}");
    assert_eq!(event_hash(&blocks[0]), 2_233_398_808_101_521_225);
    assert_eq!(event_hash(&blocks[1]), 17_911_472_383_915_781_900);
    assert_eq!(h.hash_block(&h.none_hash(), &seq(0..16), &[]), blocks[0]);
    assert_eq!(h.hash_block(&blocks[0], &seq(16..32), &[]), blocks[1]);
}

#[test]
fn vllm_extra_keys_vectors() {
    let extra = [
        lora_key("my-lora", "/p"),
        ExtraKey::CacheSalt("salt123".into()),
    ];
    for (algo, expected) in [
        (VllmHashAlgo::Sha256Cbor, 7_291_110_907_016_716_650),
        (VllmHashAlgo::Sha256, 7_207_999_314_840_895_509),
    ] {
        let h = VllmHasher::new(algo, None);
        let block0 = h.hash_block(&h.none_hash(), &seq(0..16), &extra);
        assert_eq!(event_hash(&block0), expected, "{algo:?}");
        // block_hashes builds the same extra keys for block 0.
        let chain = h.block_hashes(&seq(0..16), 16, Some(("my-lora", "/p")), Some("salt123"));
        assert_eq!(chain, vec![block0], "{algo:?}");
    }
}

#[test]
fn vllm_multimodal_keys_share_the_mm_tag() {
    // H((NONE_HASH, tuple(range(16)), (("mm", "img-0", 0), ("mm", "img-1", 8)))), computed with
    // CPython; in the pickle the second "mm" tag is a memo reference to the first.
    let extra = [
        ExtraKey::Mm {
            id: "img-0".into(),
            offset: 0,
        },
        ExtraKey::Mm {
            id: "img-1".into(),
            offset: 8,
        },
    ];
    for (algo, expected) in [
        (
            VllmHashAlgo::Sha256,
            "88faad9fc1e5020f79047cb2f0900e26dba0a49bd733b6d4d0128efb588c3c48",
        ),
        (
            VllmHashAlgo::Sha256Cbor,
            "dcccdc5ad600a6c7f1cac55ba000722aadde933f4c660f5fc0c54068a7afdbde",
        ),
    ] {
        let h = VllmHasher::new(algo, None);
        assert_eq!(
            hx(&h.hash_block(&h.none_hash(), &seq(0..16), &extra)),
            expected,
            "{algo:?}"
        );
    }
}

#[test]
fn vllm_lora_on_every_block_salt_on_block_zero_only() {
    // Tokens near u32::MAX exercise pickle's LONG1 ints. Expected digests from CPython:
    // b0 = H((NONE_HASH, tuple(range(2**32 - 16, 2**32)), (LORA, ("cache_salt", "a"))))
    // b1 = H((b0, tuple(range(16)), (LORA,)))
    // with LORA = ("lora", "sql-lora", "/adapters/sql-lora").
    let mut tokens = seq(u32::MAX - 15..u32::MAX);
    tokens.push(u32::MAX);
    tokens.extend(0..16);
    let lora = Some(("sql-lora", "/adapters/sql-lora"));
    for (algo, e0, e1) in [
        (
            VllmHashAlgo::Sha256,
            "a4e0b269bd49c0f1582505d6d259c37382b210acd94b41c82059b9421f5d8b3b",
            "d5b6454e08d84525ea29facb0488e4e060a28638ff4cb7cf4a9403e3fe373a47",
        ),
        (
            VllmHashAlgo::Sha256Cbor,
            "66a31c36578ade722a10d17cd98ed830aaa8b579f8c50648d2376d024e74d4ce",
            "226d3de5a581f272d5f36477ebaf366d1d7122df84d4b2b8eec798bc0ee9a178",
        ),
    ] {
        let h = VllmHasher::new(algo, None);
        let chain = h.block_hashes(&tokens, 16, lora, Some("a"));
        assert_eq!(
            chain.iter().map(hx).collect::<Vec<_>>(),
            [e0, e1],
            "{algo:?}"
        );
    }
}

#[test]
fn vllm_empty_salt_adds_nothing_and_partial_block_is_ignored() {
    let h = VllmHasher::new(VllmHashAlgo::Sha256, None);
    let tokens = seq(0..40);
    let plain = h.block_hashes(&tokens, 16, None, None);
    assert_eq!(plain.len(), 2);
    assert_eq!(h.block_hashes(&tokens, 16, None, Some("")), plain);
    assert_ne!(h.block_hashes(&tokens, 16, None, Some("s"))[0], plain[0]);
}

#[test]
fn event_hash_is_low_64_bits_big_endian() {
    let mut d: Digest = [0xee; 32];
    d[24..].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(event_hash(&d), 0x0102_0304_0506_0708);
}

// ------------------------------------------------------------------------------------------------
// The golden stream of vLLM 0.33.0 (shared/golden/README.md)
// ------------------------------------------------------------------------------------------------

fn golden_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/golden/vllm-0.33.0-seed1.jsonl")
}

fn golden_lines() -> Vec<serde_json::Value> {
    let path = golden_path();
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "golden KV-event stream not found at {} ({e}); it lives in the shared folder next \
             to the repository (shared/golden/), see shared/golden/README.md",
            path.display()
        )
    });
    text.lines()
        .map(|l| serde_json::from_str(l).expect("golden line is JSON"))
        .collect()
}

fn map_get<'v>(map: &'v Value, key: &str) -> Option<&'v Value> {
    map.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("u64"))
        .collect()
}

#[test]
fn golden_header_none_hash() {
    let lines = golden_lines();
    let header = &lines[0];
    assert_eq!(header["kind"], "header");
    assert_eq!(header["algo"], "sha256");
    assert_eq!(header["none_hash_seed"], "vllm-none-hash");
    assert!(header["pythonhashseed"].is_null());
    let algo = VllmHashAlgo::parse(header["algo"].as_str().unwrap()).unwrap();
    let h = VllmHasher::new(algo, None);
    assert_eq!(
        hx(&h.none_hash()),
        header["none_hash_hex"].as_str().unwrap()
    );
}

/// Every `BlockStored` event's `block_hashes`, recomputed from its `token_ids` with
/// `VllmHasher(Sha256, None)`: the parent digest comes from earlier events (all workers share the
/// seed), the LoRA path from the header (events carry only the name), and the salt from block 0's
/// untagged `extra_keys` when the event starts a chain.
#[test]
fn golden_every_block_stored_hash_recomputed() {
    let lines = golden_lines();
    let header = &lines[0];
    let lora_paths: HashMap<String, String> = header["lora_adapters"]
        .as_object()
        .expect("lora_adapters")
        .iter()
        .map(|(name, a)| (name.clone(), a["lora_path"].as_str().unwrap().to_owned()))
        .collect();
    let hasher = VllmHasher::new(VllmHashAlgo::Sha256, None);
    let mut digests: HashMap<u64, Digest> = HashMap::new();
    let (mut events, mut blocks, mut salted, mut with_lora, mut with_parent) = (0, 0, 0, 0, 0);

    for rec in lines.iter().filter(|r| r["kind"] == "events") {
        let payload = hex::decode(rec["payload_hex"].as_str().unwrap()).unwrap();
        let batch = rmpv::decode::read_value(&mut &payload[..]).expect("msgpack batch");
        let batch = batch.as_array().expect("[ts, events, dp]");
        for event in batch[1].as_array().expect("events") {
            if map_get(event, "type").and_then(Value::as_str) != Some("BlockStored") {
                continue;
            }
            let ctx = format!("worker {} seq {}", rec["worker"], rec["seq"]);
            let expected = u64s(map_get(event, "block_hashes").unwrap());
            let tokens: Vec<u32> = u64s(map_get(event, "token_ids").unwrap())
                .into_iter()
                .map(|t| u32::try_from(t).unwrap())
                .collect();
            let block_size = map_get(event, "block_size").unwrap().as_u64().unwrap() as usize;
            assert_eq!(tokens.len(), expected.len() * block_size, "{ctx}");
            let lora = map_get(event, "lora_name")
                .and_then(Value::as_str)
                .map(|name| {
                    let path = lora_paths
                        .get(name)
                        .unwrap_or_else(|| panic!("{ctx}: adapter {name}"));
                    (name, path.as_str())
                });
            let parent = map_get(event, "parent_block_hash").and_then(Value::as_u64);

            // Block 0's untagged extra keys are [lora name?, salt?] when the chain starts here.
            let mut salt = None;
            if parent.is_none() {
                let keys = map_get(event, "extra_keys")
                    .and_then(Value::as_array)
                    .and_then(|per_block| per_block.first())
                    .and_then(Value::as_array);
                let mut rest: Vec<&str> = keys
                    .into_iter()
                    .flatten()
                    .map(|k| k.as_str().expect("string extra key"))
                    .collect();
                if let Some((name, _)) = lora {
                    assert_eq!(
                        rest.first(),
                        Some(&name),
                        "{ctx}: extra keys start with the LoRA"
                    );
                    rest.remove(0);
                }
                assert!(rest.len() <= 1, "{ctx}: unexpected extra keys {rest:?}");
                salt = rest.first().copied();
            }

            let parent_digest = match parent {
                None => hasher.none_hash(),
                Some(p) => *digests
                    .get(&p)
                    .unwrap_or_else(|| panic!("{ctx}: parent {p} never stored before")),
            };
            let lora_extra: Vec<ExtraKey> = lora.map(|(n, p)| lora_key(n, p)).into_iter().collect();
            let mut chain = Vec::with_capacity(expected.len());
            let mut prev = parent_digest;
            for (i, block) in tokens.chunks_exact(block_size).enumerate() {
                let mut extra = lora_extra.clone();
                if i == 0 {
                    if let Some(s) = salt {
                        extra.push(ExtraKey::CacheSalt(s.to_owned()));
                    }
                }
                prev = hasher.hash_block(&prev, block, &extra);
                chain.push(prev);
            }
            if parent.is_none() {
                // A chain root: the convenience API must agree with the block-by-block one.
                assert_eq!(
                    hasher.block_hashes(&tokens, block_size, lora, salt),
                    chain,
                    "{ctx}"
                );
            }
            let got: Vec<u64> = chain.iter().map(event_hash).collect();
            assert_eq!(got, expected, "{ctx}: block hashes differ");
            for (h, d) in expected.iter().zip(&chain) {
                digests.insert(*h, *d);
            }

            events += 1;
            blocks += expected.len();
            salted += usize::from(salt.is_some());
            with_lora += usize::from(lora.is_some());
            with_parent += usize::from(parent.is_some());
        }
    }
    eprintln!(
        "golden: {events} BlockStored events, {blocks} blocks \
         ({salted} salted, {with_lora} with LoRA, {with_parent} with a parent)"
    );
    // The stream has all kinds of events; if any kind were never seen, the decoding is broken.
    assert!(events > 100 && salted > 0 && with_lora > 0 && with_parent > 0);
}

// ------------------------------------------------------------------------------------------------
// kvroute's own chain
// ------------------------------------------------------------------------------------------------

#[test]
fn chain_is_prefix_consistent() {
    let tokens = pseudo_tokens(160, 1);
    let base = block_hashes(&tokens, 16, None, None);
    assert_eq!(base.len(), 10);
    for k in [0, 15, 16, 37, 159] {
        let mut changed = tokens.clone();
        changed[k] ^= 1;
        let other = block_hashes(&changed, 16, None, None);
        let hit = k / 16;
        assert_eq!(
            other[..hit],
            base[..hit],
            "blocks before the change are unchanged (k={k})"
        );
        for b in hit..base.len() {
            assert_ne!(other[b], base[b], "block {b} must change (k={k})");
        }
    }
}

#[test]
fn chain_hash_builds_block_hashes() {
    let tokens = pseudo_tokens(48, 2);
    let hashes = block_hashes(&tokens, 16, Some("l"), Some("s"));
    let mut parent = root_hash(Some("l"), Some("s"));
    for (block, h) in tokens.chunks(16).zip(&hashes) {
        parent = chain_hash(parent, block, 0);
        assert_eq!(parent, *h);
    }
    assert_ne!(
        chain_hash(parent, &tokens[..16], 42),
        chain_hash(parent, &tokens[..16], 0)
    );
}

#[test]
fn extend_chain_continues_block_hashes() {
    let tokens = pseudo_tokens(200, 3);
    let full = block_hashes(&tokens, 16, Some("lora-a"), Some("tenant"));
    let mut out = block_hashes(&tokens[..80], 16, Some("lora-a"), Some("tenant"));
    extend_chain(*out.last().unwrap(), &tokens[80..], 16, &mut out);
    assert_eq!(out, full);
    // From the root, extend_chain is block_hashes.
    let mut from_root = Vec::new();
    extend_chain(
        root_hash(Some("lora-a"), Some("tenant")),
        &tokens,
        16,
        &mut from_root,
    );
    assert_eq!(from_root, full);
}

#[test]
fn lora_and_salt_change_every_hash() {
    let tokens = pseudo_tokens(128, 4);
    let variants = [
        block_hashes(&tokens, 16, None, None),
        block_hashes(&tokens, 16, Some("a"), None),
        block_hashes(&tokens, 16, Some("b"), None),
        block_hashes(&tokens, 16, None, Some("a")),
        block_hashes(&tokens, 16, Some("a"), Some("a")),
        block_hashes(&tokens, 16, Some(""), None),
        block_hashes(&tokens, 16, None, Some("")),
    ];
    for (i, a) in variants.iter().enumerate() {
        for b in &variants[i + 1..] {
            assert!(
                a.iter().zip(b).all(|(x, y)| x != y),
                "every block must differ"
            );
        }
    }
    assert_ne!(root_hash(None, None), root_hash(Some(""), None));
    assert_ne!(root_hash(Some("ab"), None), root_hash(Some("a"), Some("b")));
}

#[test]
fn partial_last_block_is_ignored() {
    let tokens = pseudo_tokens(40, 5);
    let hashes = block_hashes(&tokens, 16, None, None);
    assert_eq!(hashes, block_hashes(&tokens[..32], 16, None, None));
    assert!(block_hashes(&tokens[..15], 16, None, None).is_empty());
    assert!(block_hashes(&[], DEFAULT_BLOCK_SIZE, None, None).is_empty());
}

#[test]
fn block_sizes_1_and_64_work() {
    let tokens = pseudo_tokens(200, 6);
    let ones = block_hashes(&tokens, 1, None, None);
    assert_eq!(ones.len(), 200);
    let mut parent = root_hash(None, None);
    for (t, h) in tokens.iter().zip(&ones) {
        parent = chain_hash(parent, std::slice::from_ref(t), 0);
        assert_eq!(parent, *h);
    }
    let sixty_four = block_hashes(&tokens, 64, None, None);
    assert_eq!(sixty_four.len(), 3);
    assert_eq!(
        sixty_four[0],
        chain_hash(root_hash(None, None), &tokens[..64], 0)
    );
    // Blocks larger than the stack buffer stream through it.
    let big = block_hashes(&tokens, 100, None, None);
    assert_eq!(
        big,
        vec![
            chain_hash(root_hash(None, None), &tokens[..100], 0),
            chain_hash(big[0], &tokens[100..200], 0)
        ]
    );
    let mut unique = ones.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), ones.len());
}

#[test]
fn block_hashes_into_clears_and_reuses() {
    let tokens = pseudo_tokens(64, 7);
    let mut out = vec![1, 2, 3];
    block_hashes_into(&tokens, 16, None, Some("x"), &mut out);
    assert_eq!(out, block_hashes(&tokens, 16, None, Some("x")));
    block_hashes_into(&tokens[..16], 16, None, Some("x"), &mut out);
    assert_eq!(out.len(), 1);
}

#[test]
#[should_panic(expected = "block_size")]
fn block_size_zero_panics() {
    let _ = block_hashes(&[1, 2, 3], 0, None, None);
}

/// Rough speed check (run in release):
/// `cargo test -p kvroute-core --release --test hashing -- --ignored --nocapture hashing_speed`.
#[test]
#[ignore = "timing, run in release with --nocapture"]
fn hashing_speed() {
    /// Best of 20 rounds: the minimum is the least disturbed by other work on the machine.
    fn time_per_call(iters: u32, mut f: impl FnMut()) -> f64 {
        (0..20)
            .map(|_| {
                let start = Instant::now();
                for _ in 0..iters {
                    f();
                }
                start.elapsed().as_secs_f64() / f64::from(iters)
            })
            .fold(f64::INFINITY, f64::min)
    }
    let tokens = pseudo_tokens(8192, 8);
    let mut out = Vec::with_capacity(512);
    let xxh = time_per_call(2_000, || {
        block_hashes_into(
            std::hint::black_box(&tokens),
            16,
            Some("lora"),
            None,
            &mut out,
        );
        std::hint::black_box(&out);
    });
    let vllm = VllmHasher::new(VllmHashAlgo::Sha256, None);
    let sha = time_per_call(10, || {
        std::hint::black_box(vllm.block_hashes(std::hint::black_box(&tokens), 16, None, None));
    });
    let vllm_cbor = VllmHasher::new(VllmHashAlgo::Sha256Cbor, None);
    let cbor = time_per_call(10, || {
        std::hint::black_box(vllm_cbor.block_hashes(std::hint::black_box(&tokens), 16, None, None));
    });
    eprintln!(
        "8192 tokens, 512 blocks of 16: kvroute xxh3 {:.2} us ({:.1} ns/block, {:.1} GB/s), \
         vLLM sha256 {:.1} us, sha256_cbor {:.1} us",
        xxh * 1e6,
        xxh * 1e9 / 512.0,
        8192.0 * 4.0 / xxh / 1e9,
        sha * 1e6,
        cbor * 1e6
    );
}
