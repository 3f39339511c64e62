//! Virtual-time replay of the Mooncake conversation trace: sane and deterministic results on a
//! prefix of the trace; the full trace and its wall time are an ignored test (run it in release).
use std::path::PathBuf;

use kvroute_core::sim::{replay_mooncake, ReplayConfig, ReplayReport};

fn trace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/traces/conversation_trace.jsonl")
}

fn run(cfg: &ReplayConfig) -> ReplayReport {
    replay_mooncake(&trace(), cfg).expect("the trace ships in shared/traces")
}

fn first_300(policy: &str) -> ReplayConfig {
    ReplayConfig {
        policy: policy.into(),
        preset: "dynamo-mocker".into(),
        limit: Some(300),
        ..Default::default()
    }
}

/// Everything but the wall time.
fn strip(mut r: ReplayReport) -> ReplayReport {
    r.wall_time_s = 0.0;
    r
}

#[test]
fn a_trace_prefix_replays_sanely_and_deterministically() {
    let cfg = first_300("round_robin");
    let a = run(&cfg);
    assert_eq!(a.num_requests, 300);
    assert_eq!(a.requests_per_replica, vec![38, 38, 38, 38, 37, 37, 37, 37]);
    assert!(a.load_imbalance > 1.0 && a.load_imbalance < 1.02);
    // Every request got its first token after arriving, and finished after that.
    assert!(a.mean_ttft_ms > 17.0, "at least one prefill step: {a:?}");
    assert!(a.p50_ttft_ms <= a.p90_ttft_ms && a.p90_ttft_ms <= a.p99_ttft_ms);
    assert!(a.mean_e2e_ms > a.mean_ttft_ms);
    assert!(
        a.gpu_hit_ratio > 0.0 && a.gpu_hit_ratio < 0.5,
        "{}",
        a.gpu_hit_ratio
    );
    assert_eq!(a.cpu_hit_ratio, 0.0);
    assert!(a.output_tokens > 300 && a.prompt_tokens > 300 * 1000);
    assert!(a.kv_event_batches > 300 && a.engine_steps > 1000);
    // The first 300 requests arrive over ~90 s at 3.4 req/s.
    assert!(
        a.duration_s > 60.0 && a.duration_s < 200.0,
        "{}",
        a.duration_s
    );

    assert_eq!(strip(run(&cfg)), strip(a.clone()), "same seed, same report");
    // The seed changes prompt contents and generated tokens, which round robin cannot see; a
    // policy with random choices routes differently.
    let random = |seed| {
        strip(run(&ReplayConfig {
            seed,
            ..first_300("random")
        }))
    };
    assert_eq!(random(1), random(1));
    assert_ne!(random(1), random(2));
    // Twice the arrival rate: the same work in about half the time.
    let fast = run(&ReplayConfig {
        speedup: 2.0,
        ..cfg
    });
    assert!(fast.duration_s < 0.6 * a.duration_s);
}

#[test]
fn a_cache_aware_policy_beats_round_robin_on_hits() {
    let rr = run(&first_300("round_robin"));
    let kv = run(&first_300("kvroute"));
    assert!(
        kv.gpu_hit_ratio > rr.gpu_hit_ratio,
        "{} vs {}",
        kv.gpu_hit_ratio,
        rr.gpu_hit_ratio
    );
    assert_eq!(
        strip(run(&first_300("kvroute"))),
        strip(kv),
        "index-fed policies are deterministic"
    );
}

#[test]
fn a_cpu_tier_serves_hits_when_the_gpu_is_small() {
    let cfg = ReplayConfig {
        // 2,099 usable blocks of 64 tokens hold the longest prompt (126 K tokens), not the load.
        num_gpu_blocks: Some(2100),
        num_cpu_blocks: 8000,
        ..first_300("round_robin")
    };
    let r = run(&cfg);
    assert!(r.cpu_hit_ratio > 0.0, "{r:?}");
    let bad = ReplayConfig {
        preset: "nope".into(),
        ..first_300("round_robin")
    };
    assert!(replay_mooncake(&trace(), &bad).is_err());
    let bad = ReplayConfig {
        policy: "nope".into(),
        ..first_300("round_robin")
    };
    assert!(replay_mooncake(&trace(), &bad).is_err());
}

/// The full conversation trace (12,031 requests) on 8 replicas; prints the report. Run with
/// `cargo test --release -p kvroute-core --test sim_replay -- --ignored --nocapture`.
#[test]
#[ignore = "the full trace; run in release"]
fn full_conversation_trace_wall_time() {
    for (policy, preset) in [
        ("round_robin", "dynamo-mocker"),
        ("kvroute", "dynamo-mocker"),
        ("round_robin", "llama3-8b-h100"),
        ("kvroute", "llama3-8b-h100"),
    ] {
        let r = run(&ReplayConfig {
            policy: policy.into(),
            preset: preset.into(),
            ..Default::default()
        });
        assert_eq!(r.num_requests, 12_031);
        println!(
            "{policy:>12} {preset:>16}: mean TTFT {:.1} ms (p50 {:.1}, p90 {:.1}, p99 {:.1}), \
             e2e {:.1} ms (p99 {:.1}), GPU hit {:.3}, wall {:.2} s",
            r.mean_ttft_ms,
            r.p50_ttft_ms,
            r.p90_ttft_ms,
            r.p99_ttft_ms,
            r.mean_e2e_ms,
            r.p99_e2e_ms,
            r.gpu_hit_ratio,
            r.wall_time_s
        );
    }
}
