//! The simulated engine: chunked prefill, stored-at-schedule events, decode-filled blocks,
//! preemption, deterministic tokens, aborts and restarts, against hand-computed expectations.
use kvroute_core::events::{decode_batch, encode_batch, Encoding, KvEvent, Medium};
use kvroute_core::sim::{Engine, EngineConfig, FinishReason, HashAlgo, LatencyModel, NewRequest};

fn config(block_size: usize, gpu_blocks: usize, budget: usize) -> EngineConfig {
    let mut c = EngineConfig::from_preset("llama3-8b-h100").unwrap();
    c.block_size = block_size;
    c.num_gpu_blocks = gpu_blocks;
    c.max_num_batched_tokens = budget;
    c.max_num_seqs = 16;
    c.hash_algo = HashAlgo::Xxh3;
    c.latency = LatencyModel::linear(0.001, 0.0001);
    c
}

/// (kind, hashes, parent?, token count) of an event.
type EventSummary = (char, usize, bool, usize);
/// (request id, token, first?, finish) of an output.
type OutputSummary = (String, Option<u32>, bool, Option<FinishReason>);

/// One step's events and outputs, summarised.
fn events(e: &mut Engine, now: f64) -> (Vec<EventSummary>, Vec<OutputSummary>) {
    let r = e.step(now);
    let ev = r.events.map_or_else(Vec::new, |b| {
        b.events
            .iter()
            .map(|ev| match ev {
                KvEvent::Stored(s) => (
                    'S',
                    s.block_hashes.len(),
                    s.parent.is_some(),
                    s.token_ids.len(),
                ),
                KvEvent::Removed(r) => ('R', r.block_hashes.len(), false, 0),
                other => panic!("{other:?}"),
            })
            .collect()
    });
    let outs = r
        .outputs
        .iter()
        .map(|o| (o.id.to_string(), o.token, o.first, o.finish))
        .collect();
    (ev, outs)
}

#[test]
fn chunked_prefill_stores_blocks_per_chunk_and_samples_after_the_last() {
    let mut e = Engine::new(config(4, 64, 8)).unwrap();
    e.add_request(NewRequest::new("a", (0..20).collect(), 3))
        .unwrap();
    // 20 prompt tokens, 8 per step: 8 (2 blocks, root), 8 (2 blocks, parent), 4 (1 block) + token.
    let (ev, out) = events(&mut e, 0.0);
    assert_eq!(ev, vec![('S', 2, false, 8)]);
    assert!(out.is_empty());
    let (ev, out) = events(&mut e, 1.0);
    assert_eq!(ev, vec![('S', 2, true, 8)]);
    assert!(out.is_empty());
    let (ev, out) = events(&mut e, 2.0);
    assert_eq!(ev, vec![('S', 1, true, 4)]);
    assert_eq!(out.len(), 1);
    assert!(out[0].2 && out[0].3.is_none(), "first token, not finished");
    let (_, out) = events(&mut e, 3.0);
    assert!(!out[0].2 && out[0].3.is_none());
    let (_, out) = events(&mut e, 4.0);
    assert_eq!(out[0].3, Some(FinishReason::Length));
    assert!(!e.has_work());
    assert_eq!(e.metrics().generation_tokens, 3);
    assert_eq!(e.metrics().prefix_cache_queries, 20);
}

#[test]
fn decode_fills_blocks_but_the_final_token_block_is_never_cached() {
    // 6 prompt tokens, block size 4: block 0 is stored at admission. Output t0, t1 fill block 1
    // (tokens 4..8); it is stored in the step that computes t1 (the third step).
    let mut e = Engine::new(config(4, 64, 64)).unwrap();
    e.add_request(NewRequest::new("a", (0..6).collect(), 4))
        .unwrap();
    let (ev, _) = events(&mut e, 0.0);
    assert_eq!(ev, vec![('S', 1, false, 4)]);
    let (ev, _) = events(&mut e, 1.0); // computes t0
    assert!(ev.is_empty());
    let (ev, _) = events(&mut e, 2.0); // computes t1: block 1 is full
    assert_eq!(ev, vec![('S', 1, true, 4)]);
    let (ev, out) = events(&mut e, 3.0);
    assert!(ev.is_empty());
    assert_eq!(out[0].3, Some(FinishReason::Length));

    // With max_tokens = 2 the block is completed by the last sampled token: never stored.
    let mut e = Engine::new(config(4, 64, 64)).unwrap();
    e.add_request(NewRequest::new("b", (0..6).collect(), 2))
        .unwrap();
    let mut stored = 0;
    while e.has_work() {
        let r = e.step(0.0);
        for ev in r.events.map(|b| b.events).unwrap_or_default() {
            if let KvEvent::Stored(s) = ev {
                stored += s.block_hashes.len();
            }
        }
    }
    assert_eq!(stored, 1);
    assert_eq!(e.pool().cached_hashes(), 1);
}

#[test]
fn a_resent_prompt_hits_all_but_its_last_block_and_caches_it_again() {
    let mut e = Engine::new(config(4, 64, 64)).unwrap();
    let prompt: Vec<u32> = (0..12).collect();
    e.add_request(NewRequest::new("a", prompt.clone(), 1))
        .unwrap();
    let r = e.step(0.0);
    assert_eq!(r.outputs[0].num_cached_tokens, 0);
    e.add_request(NewRequest::new("b", prompt, 1)).unwrap();
    let r = e.step(1.0);
    // Hit capped at num_tokens - 1 = 11, block aligned: 8 tokens; block 2 is recomputed.
    assert_eq!(r.outputs[0].num_cached_tokens, 8);
    let b = r.events.unwrap();
    assert!(
        matches!(&b.events[..], [KvEvent::Stored(s)] if s.block_hashes.len() == 1 && s.parent.is_some())
    );
    let KvEvent::Stored(s) = &b.events[0] else {
        unreachable!()
    };
    assert_eq!(e.pool().copies(s.block_hashes[0]), 2);
    let m = e.metrics();
    assert_eq!((m.prefix_cache_queries, m.prefix_cache_hits), (24, 8));
}

#[test]
fn preemption_recomputes_and_generates_the_same_tokens() {
    // 4 usable blocks of 4 tokens; two requests that each grow to 3 blocks cannot both run.
    let tokens_alone = |id: &str, prompt: Vec<u32>| {
        let mut e = Engine::new(config(4, 64, 64)).unwrap();
        e.add_request(NewRequest::new(id, prompt, 8)).unwrap();
        let mut t = Vec::new();
        while e.has_work() {
            t.extend(e.step(0.0).outputs.iter().filter_map(|o| o.token));
        }
        t
    };
    let mut e = Engine::new(config(4, 5, 64)).unwrap();
    e.add_request(NewRequest::new("a", vec![1, 2, 3, 4], 8))
        .unwrap();
    e.add_request(NewRequest::new("b", vec![5, 6, 7, 8], 8))
        .unwrap();
    let (mut ta, mut tb, mut removed) = (Vec::new(), Vec::new(), 0);
    let mut steps = 0;
    while e.has_work() {
        let r = e.step(steps as f64);
        steps += 1;
        assert!(steps < 100, "no progress");
        for o in &r.outputs {
            let t = if &*o.id == "a" { &mut ta } else { &mut tb };
            t.extend(o.token);
        }
        for ev in r.events.map(|b| b.events).unwrap_or_default() {
            removed += usize::from(matches!(ev, KvEvent::Removed(_)));
        }
    }
    let m = e.metrics();
    assert!(m.preemptions >= 1, "{m:?}");
    assert!(removed >= 1);
    assert_eq!(ta, tokens_alone("a", vec![1, 2, 3, 4]));
    assert_eq!(tb, tokens_alone("b", vec![5, 6, 7, 8]));
    assert_eq!((ta.len(), tb.len()), (8, 8));
    // Queries count first admissions only.
    assert_eq!(m.prefix_cache_queries, 8);
}

#[test]
fn the_last_running_request_is_preempted_and_requeued_first() {
    let mut e = Engine::new(config(4, 5, 64)).unwrap();
    e.add_request(NewRequest::new("a", vec![1, 2, 3, 4], 8))
        .unwrap();
    e.add_request(NewRequest::new("b", vec![5, 6, 7, 8], 8))
        .unwrap();
    e.add_request(NewRequest::new("c", vec![9], 1)).unwrap();
    // Step 1 admits a, b (1 block each) and c (1 block), c finishes at once.
    let r = e.step(0.0);
    assert_eq!(r.outputs.len(), 3);
    // a and b each need a second block now (2 free), then a third: b (last) is preempted.
    let mut preempted_at = None;
    for i in 1..20 {
        e.step(f64::from(i));
        let m = e.metrics();
        if m.preemptions > 0 {
            preempted_at = Some(i);
            assert_eq!((m.running, m.waiting), (1, 1));
            break;
        }
    }
    assert!(preempted_at.is_some());
}

#[test]
fn tokens_depend_on_seed_and_id_only() {
    let run = |seed: u64, id: &str, other: bool| {
        let mut c = config(16, 256, 8192);
        c.seed = seed;
        let mut e = Engine::new(c).unwrap();
        if other {
            e.add_request(NewRequest::new("x", vec![3; 40], 20))
                .unwrap();
        }
        e.add_request(NewRequest::new(id, (0..30).collect(), 10))
            .unwrap();
        let mut t = Vec::new();
        while e.has_work() {
            t.extend(
                e.step(0.0)
                    .outputs
                    .iter()
                    .filter(|o| &*o.id == id)
                    .filter_map(|o| o.token),
            );
        }
        t
    };
    assert_eq!(run(1, "r", false), run(1, "r", true));
    assert_ne!(run(1, "r", false), run(2, "r", false));
    assert_ne!(run(1, "r", false), run(1, "s", false));
    assert!(run(1, "r", false).iter().all(|&t| t < 128_000));
}

#[test]
fn eos_stops_unless_ignored() {
    let mut e = Engine::new(config(16, 256, 8192)).unwrap();
    e.add_request(NewRequest::new("probe", vec![1, 2, 3], 1))
        .unwrap();
    let first = e.step(0.0).outputs[0].token.unwrap();
    // The same id after it finished generates the same first token: make it the EOS.
    let mut r = NewRequest::new("probe", vec![1, 2, 3], 5);
    r.ignore_eos = false;
    r.eos_token_id = Some(first);
    e.add_request(r).unwrap();
    let out = e.step(1.0).outputs;
    assert_eq!(out[0].finish, Some(FinishReason::Stop));
}

#[test]
fn abort_reports_once_and_reset_restarts_everything() {
    let mut e = Engine::new(config(4, 64, 8)).unwrap();
    e.add_request(NewRequest::new("a", (0..20).collect(), 3))
        .unwrap();
    let first = e.step(0.0);
    assert_eq!(first.seq, Some(0));
    assert!(e.abort("a"));
    assert!(!e.abort("a"));
    let r = e.step(1.0);
    assert_eq!(r.outputs.len(), 1);
    assert_eq!(r.outputs[0].finish, Some(FinishReason::Abort));
    assert_eq!(r.duration_s, 0.0);
    assert!(!e.has_work());
    // The aborted request's blocks stay cached: a new request hits them.
    e.add_request(NewRequest::new("b", (0..20).collect(), 1))
        .unwrap();
    let r = e.step(2.0);
    assert_eq!(r.seq, Some(1));
    e.reset();
    assert!(!e.has_work());
    assert_eq!(e.pool().cached_hashes(), 0);
    e.add_request(NewRequest::new("b", (0..20).collect(), 1))
        .unwrap();
    let r = e.step(3.0);
    assert_eq!(r.seq, Some(0), "sequence numbers restart");
    assert_eq!(e.metrics().prefix_cache_hits, 0);
}

#[test]
fn bad_requests_are_rejected() {
    let mut e = Engine::new(config(4, 5, 64)).unwrap();
    e.add_request(NewRequest::new("a", vec![1], 1)).unwrap();
    let err = |e: &mut Engine, r| e.add_request(r).unwrap_err().to_string();
    assert!(err(&mut e, NewRequest::new("a", vec![1], 1)).contains("already"));
    assert!(err(&mut e, NewRequest::new("b", vec![], 1)).contains("prompt"));
    assert!(err(&mut e, NewRequest::new("b", vec![1], 0)).contains("max_tokens"));
    assert!(err(&mut e, NewRequest::new("b", vec![200_000], 1)).contains("vocabulary"));
    assert!(err(&mut e, NewRequest::new("b", vec![1; 16], 1)).contains("KV blocks"));
}

#[test]
fn batches_round_trip_through_both_wire_encodings() {
    let mut c = config(4, 6, 64);
    c.num_cpu_blocks = 8;
    c.lora_paths = vec![("ad".into(), "/adapters/ad".into())];
    let mut e = Engine::new(c).unwrap();
    let mut r = NewRequest::new("a", (0..12).collect(), 2);
    r.lora = Some("ad".into());
    r.salt = Some("s".into());
    e.add_request(r).unwrap();
    e.add_request(NewRequest::new("b", (100..116).collect(), 2))
        .unwrap();
    let mut media = Vec::new();
    while e.has_work() {
        let Some(batch) = e.step(0.5).events else {
            continue;
        };
        for enc in [Encoding::Map, Encoding::Array] {
            let back = decode_batch(&encode_batch(&batch, enc)).unwrap();
            assert_eq!(back, batch);
        }
        for ev in &batch.events {
            if let KvEvent::Stored(s) = ev {
                media.push(s.medium);
                if s.medium == Medium::Gpu && s.lora_name.is_some() {
                    assert_eq!(s.lora_id, Some(1));
                }
            }
        }
    }
    assert!(
        media.contains(&Medium::Cpu),
        "the small pool offloads to the CPU tier"
    );
}
