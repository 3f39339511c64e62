//! The benchmark side of the simulator: generated workloads and arrival processes through the
//! replay, several routers with and without peer fan-out, and the offline hit-ratio bounds.
use std::sync::Arc;

use kvroute_core::scheduler::PolicyKind;
use kvroute_core::sim::cluster::{Cluster, ClusterConfig};
use kvroute_core::sim::replay::engine_config;
use kvroute_core::sim::trace::TokenSynth;
use kvroute_core::sim::{
    hit_bounds, replay_workload, Arrival, NewRequest, ReplayConfig, ReplayReport, Workload,
};

fn run(w: &Workload, cfg: &ReplayConfig) -> ReplayReport {
    replay_workload(w, cfg, &mut |_, _| true).expect("a valid replay")
}

fn cfg(policy: &str) -> ReplayConfig {
    ReplayConfig {
        policy: policy.into(),
        replicas: 4,
        ..Default::default()
    }
}

#[test]
fn a_generated_workload_replays_at_the_requested_rate() {
    let w = Workload::generate("shared-prefix", 400, 3).unwrap();
    let r = run(
        &w,
        &ReplayConfig {
            rate: Some(40.0),
            ..cfg("kvroute")
        },
    );
    assert_eq!(r.num_requests, 400);
    assert_eq!(r.workload, "shared-prefix");
    assert!((r.offered_rps - 40.0).abs() < 1e-6, "{}", r.offered_rps);
    assert!(
        (r.speedup - 2.0).abs() < 0.5,
        "natural rate 20/s: {}",
        r.speedup
    );
    assert!(r.p50_e2e_ms <= r.p90_e2e_ms && r.p90_e2e_ms <= r.p99_e2e_ms);
    assert_eq!(r.prefill_tokens_per_replica.len(), 4);
    // Shared system prompts: most prompt tokens are hits for a cache-aware router.
    assert!(r.gpu_hit_ratio > 0.6, "{}", r.gpu_hit_ratio);
    let rr = run(
        &w,
        &ReplayConfig {
            rate: Some(40.0),
            ..cfg("round_robin")
        },
    );
    assert!(r.gpu_hit_ratio >= rr.gpu_hit_ratio);
    assert!(r.mean_ttft_ms < rr.mean_ttft_ms, "{r:?}\n{rr:?}");

    // Arrival processes replace the workload's own times; a burst puts everything at 0.
    let poisson = run(
        &w,
        &ReplayConfig {
            arrival: Arrival::Poisson { rate: 10.0 },
            ..cfg("round_robin")
        },
    );
    assert!((poisson.offered_rps / 10.0 - 1.0).abs() < 0.15);
    let burst = run(
        &w,
        &ReplayConfig {
            arrival: Arrival::Burst,
            ..cfg("round_robin")
        },
    );
    assert!(burst.offered_rps.is_infinite());
    assert!(burst.duration_s < poisson.duration_s);
    // Stopping through the progress callback is an error, not a partial report.
    let mut calls = 0;
    let stopped = replay_workload(&w, &cfg("round_robin"), &mut |_, _| {
        calls += 1;
        false
    });
    assert!(stopped.is_err());
    assert_eq!(calls, 1, "400 requests: the first call is at the end");
}

/// Four routers over the same engines: with fan-out every router's ledger sees every
/// reservation and drains to zero; without it each sees a quarter of the load and they herd.
#[test]
fn routers_share_reservations_through_fan_out() {
    // Long documents: a router that sees a quarter of the load keeps sending questions to the
    // replica holding their document.
    let w = Workload::generate("doc-qa", 1500, 5).unwrap();
    let base = ReplayConfig {
        rate: Some(7.4),
        arrival: Arrival::Poisson { rate: 10.0 },
        ..cfg("kvroute")
    };
    let one = run(&w, &base);
    let fan = run(
        &w,
        &ReplayConfig {
            routers: 4,
            fanout_delay_s: Some(0.001),
            ..base.clone()
        },
    );
    let alone = run(
        &w,
        &ReplayConfig {
            routers: 4,
            ..base.clone()
        },
    );
    assert_eq!(
        (one.peer_messages, alone.peer_messages, fan.peer_messages),
        (0, 0, 3 * 1500),
        "reserve, prefill done and finished for each request"
    );
    assert!(
        fan.mean_ttft_ms < 1.15 * one.mean_ttft_ms,
        "fan-out keeps one router's quality: {} vs {}",
        fan.mean_ttft_ms,
        one.mean_ttft_ms
    );
    assert!(
        alone.mean_ttft_ms > 1.2 * fan.mean_ttft_ms,
        "without fan-out routers herd: {} vs {}",
        alone.mean_ttft_ms,
        fan.mean_ttft_ms
    );
}

#[test]
fn every_ledger_drains_and_applies_its_peers_messages() {
    let engine = engine_config(&ReplayConfig {
        preset: "dynamo-mocker".into(),
        ..Default::default()
    })
    .unwrap();
    let mut c = Cluster::new(&ClusterConfig {
        replicas: 3,
        engine: engine.clone(),
        policy: PolicyKind::Kvroute,
        event_delay_s: 0.005,
        feed_index: true,
        metrics_interval_s: 0.1,
        seed: 0,
        routers: 3,
        fanout_delay_s: Some(0.002),
        params: vec![("pollution_factor".into(), 1.0)],
    })
    .unwrap();
    let w = Workload::generate("doc-qa", 60, 1).unwrap();
    let synth = TokenSynth::with_block_tokens(0, engine.vocab_size, w.block_tokens);
    for (i, rec) in w.records.iter().enumerate() {
        let now = i as f64 * 0.05;
        c.run_until(now, &mut |_, _, _| {});
        let mut prompt = Vec::new();
        synth.prompt(rec, &mut prompt);
        let req = NewRequest {
            id: Arc::from(i.to_string()),
            tag: i as u64,
            ..NewRequest::new("x", prompt, rec.output_length.min(20) as u32)
        };
        c.submit(now, req, 20).unwrap();
    }
    c.run_until(f64::INFINITY, &mut |_, _, _| {});
    let mut decisions = 0;
    for s in c.schedulers() {
        assert_eq!(s.reservations(), 0);
        assert!(s
            .loads()
            .iter()
            .all(|(_, l)| l.active == 0 && l.kv_blocks == 0));
        s.check_invariants().unwrap();
        let k = s.counters();
        assert_eq!(k.decisions, 20);
        assert_eq!((k.remote_applied, k.remote_ignored), (3 * 40, 0));
        decisions += k.decisions;
    }
    assert_eq!(decisions, 60);
    assert_eq!(c.peer_messages, 3 * 60);
    // A knob that does not exist is refused when the routers are built.
    let bad = Cluster::new(&ClusterConfig {
        replicas: 1,
        engine,
        policy: PolicyKind::Kvroute,
        event_delay_s: 0.0,
        feed_index: true,
        metrics_interval_s: 0.1,
        seed: 0,
        routers: 1,
        fanout_delay_s: None,
        params: vec![("nope".into(), 1.0)],
    });
    assert!(bad.is_err());
}

#[test]
fn a_cache_aware_router_approaches_the_pooled_bound_on_documents() {
    let w = Workload::generate("doc-qa", 600, 2).unwrap();
    let c = ReplayConfig {
        rate: Some(4.0),
        ..cfg("kvroute")
    };
    let e = engine_config(&c).unwrap();
    let b = hit_bounds(
        &w,
        e.block_size,
        4 * (e.num_gpu_blocks - 1),
        0,
        e.vocab_size,
    );
    assert!(b.pooled_lru <= b.belady && b.belady <= b.infinite);
    let r = run(&w, &c);
    assert!(
        r.gpu_hit_ratio > 0.85 * b.pooled_lru,
        "{} vs {b:?}",
        r.gpu_hit_ratio
    );
    assert!(r.gpu_hit_ratio <= b.infinite + 1e-9);
}

/// Requests in bursts (eight at the same millisecond, as in the Mooncake trace's ticks): the
/// four routers would decide each burst before any fan-out can arrive. Hedging (turns of a few
/// milliseconds, and a shared plan with ghosts past them) keeps one router's quality; without
/// it they herd even with fan-out. (Measured: one router 125 ms mean TTFT, four hedged 114,
/// four unhedged 172.)
#[test]
fn routers_deciding_a_burst_together_keep_one_routers_quality_only_when_hedging() {
    let mut w = Workload::generate("multi-turn", 1200, 4).unwrap();
    for (i, r) in w.records.iter_mut().enumerate() {
        r.timestamp_ms = (i / 8) as f64 * 1000.0;
    }
    let base = ReplayConfig {
        rate: Some(60.0),
        ..cfg("kvroute")
    };
    let four = |hedge: f64| ReplayConfig {
        routers: 4,
        fanout_delay_s: Some(0.001),
        params: vec![("peer_hedge".into(), hedge)],
        ..base.clone()
    };
    let one = run(&w, &base);
    let hedged = run(&w, &four(1.0));
    let herd = run(&w, &four(0.0));
    assert!(
        hedged.mean_ttft_ms < 1.1 * one.mean_ttft_ms,
        "hedged: {} vs one router {}",
        hedged.mean_ttft_ms,
        one.mean_ttft_ms
    );
    assert!(
        herd.mean_ttft_ms > 1.2 * hedged.mean_ttft_ms,
        "unhedged routers herd: {} vs {}",
        herd.mean_ttft_ms,
        hedged.mean_ttft_ms
    );
    assert!(hedged.gpu_hit_ratio > 0.95 * one.gpu_hit_ratio);
}

/// A burst larger than the turns can absorb (64 requests at one instant, 16 per router, on one
/// new prefix; the turns take 5 of each router's 16): the rest are decided at once against the
/// shared plan, and the fleet is split as evenly as by one router.
#[test]
fn a_burst_beyond_the_turns_is_split_as_by_one_router() {
    use kvroute_core::sim::trace::TraceRecord;
    let mut records = Vec::new();
    let mut id = 0u64;
    for b in 0..5u64 {
        let prefix: Vec<u64> = (0..8).map(|i| 1_000_000 + b * 100 + i).collect();
        for _ in 0..64 {
            id += 1;
            let mut hash_ids = prefix.clone();
            hash_ids.push(id);
            records.push(TraceRecord {
                timestamp_ms: b as f64 * 20_000.0,
                input_length: 9 * 512,
                output_length: 32,
                hash_ids,
            });
        }
    }
    let w = Workload {
        name: "burst".into(),
        block_tokens: 512,
        records,
    };
    let one = run(&w, &cfg("kvroute"));
    let four = run(
        &w,
        &ReplayConfig {
            routers: 4,
            fanout_delay_s: Some(0.001),
            ..cfg("kvroute")
        },
    );
    assert_eq!(one.requests_per_replica, [80, 80, 80, 80]);
    assert_eq!(four.requests_per_replica, one.requests_per_replica);
    assert!(
        four.p99_ttft_ms < 1.05 * one.p99_ttft_ms,
        "{} vs {}",
        four.p99_ttft_ms,
        one.p99_ttft_ms
    );
}
