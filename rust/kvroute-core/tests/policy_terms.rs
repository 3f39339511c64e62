//! The terms of kvroute's score, one at a time: attention in the prefill work, the queued work
//! the ledger books, the pollution charge and its heat discount. (The hedge against concurrent
//! peer routers needs the scheduler's state: its tests are in `scheduler/tests.rs`.)
use kvroute_core::scheduler::policy::{choose, ttft_terms, work_tokens, PolicyState, Rng};
use kvroute_core::scheduler::{Candidate, Load, PolicyKind, PolicyParams, RequestInfo};

fn params() -> PolicyParams {
    PolicyParams {
        prefill_s_per_token: 1e-5,
        attn_s_per_token_pair: 1e-9,
        step_s: 0.0,
        decode_s_per_seq: 0.0,
        pollution_factor: 0.0,
        ..Default::default()
    }
}

fn request(prompt: u32, heat: f64) -> RequestInfo {
    RequestInfo {
        prompt_tokens: prompt,
        expected_output_tokens: 0,
        blocks: prompt / 16,
        block_size: 16,
        prefix_heat: heat,
    }
}

fn cand(worker: u64, cached_blocks: u32, queued_work: u64) -> Candidate {
    Candidate {
        worker,
        gpu_blocks: cached_blocks,
        load: Load {
            prefill_tokens: queued_work / 2,
            prefill_work: queued_work,
            ..Default::default()
        },
        ..Default::default()
    }
}

#[test]
fn attention_makes_long_prompts_and_long_hits_worth_more() {
    let p = params();
    // 1,000 new tokens after none: 1,000 + 500,500 pairs * 1e-9 / 1e-5 = 1,050 token-equivalents.
    assert_eq!(work_tokens(&p, 1000, 0), 1050);
    // After 10,000 cached ones they also attend to those: + 10,000,000 pairs -> +1,000.
    assert_eq!(work_tokens(&p, 1000, 10_000), 2050);
    let plain = PolicyParams {
        attn_s_per_token_pair: 0.0,
        ..p.clone()
    };
    assert_eq!(work_tokens(&plain, 1000, 10_000), 1000);
    // A 32K-token prompt: the worker holding 30K of it saves more than 30K tokens of work.
    let req = request(32_768, 0.0);
    let hit = ttft_terms(&p, &req, &cand(0, 30_720 / 16, 0));
    let miss = ttft_terms(&p, &req, &cand(1, 0, 0));
    assert_eq!((hit.uncached_tokens, miss.uncached_tokens), (2048, 32_768));
    let saved = miss.work_tokens - hit.work_tokens;
    assert!(saved > 2 * 30_720, "{saved}");
    // The queue is the booked work, not the raw tokens.
    let queued = ttft_terms(&p, &req, &cand(0, 30_720 / 16, 100_000));
    assert!((queued.est_ttft_s - hit.est_ttft_s - 1.0).abs() < 1e-9);
    assert_eq!(queued.queued_prefill_tokens, 50_000);
}

#[test]
fn pollution_is_charged_on_computed_tokens_and_fades_with_heat() {
    let p = PolicyParams {
        pollution_factor: 8.0,
        attn_s_per_token_pair: 0.0,
        ..params()
    };
    let cold = ttft_terms(&p, &request(1600, 0.0), &cand(0, 0, 0));
    // 1,600 tokens of prefill, then 8 x 1,600 tokens charged for the cache they take.
    assert!((cold.est_ttft_s - 9.0 * 0.016).abs() < 1e-12);
    assert_eq!(cold.score, cold.est_ttft_s);
    let hot = ttft_terms(&p, &request(1600, 3.0), &cand(0, 0, 0));
    assert!((hot.est_ttft_s - (0.016 + 8.0 * 0.016 * (-3.0f64).exp())).abs() < 1e-12);
    // A worker holding the prefix is charged only for what it computes.
    let held = ttft_terms(&p, &request(1600, 0.0), &cand(0, 90, 0));
    assert!((held.est_ttft_s - 9.0 * 160.0 * 1e-5).abs() < 1e-12);
}

#[test]
fn pollution_counts_only_the_tokens_that_evict_and_compute_counts_them_all() {
    let p = PolicyParams {
        pollution_factor: 8.0,
        attn_s_per_token_pair: 0.0,
        ..params()
    };
    let req = request(1600, 0.0); // 100 blocks to compute
    let with = |resident: u64| Candidate {
        capacity_blocks: 1000,
        resident_blocks: resident,
        ..cand(0, 0, 0)
    };
    let charge = |c: &Candidate, p: &PolicyParams| ttft_terms(p, &req, c).est_ttft_s - 0.016;
    // Room for all 100 blocks: nothing evicted, nothing charged.
    assert!(charge(&with(900), &p).abs() < 1e-12);
    // 40 of them push cached blocks out: 8 x 640 tokens.
    assert!((charge(&with(940), &p) - 8.0 * 640.0 * 1e-5).abs() < 1e-12);
    // A full cache: all 1,600; an unknown capacity is charged as full.
    assert!((charge(&with(1000), &p) - 8.0 * 0.016).abs() < 1e-12);
    assert!((charge(&cand(0, 0, 0), &p) - 8.0 * 0.016).abs() < 1e-12);
    // The compute charge applies with room or without.
    let compute = PolicyParams {
        pollution_factor: 0.0,
        compute_factor: 2.0,
        ..p.clone()
    };
    assert!((charge(&with(0), &compute) - 2.0 * 0.016).abs() < 1e-12);
}

#[test]
fn a_private_history_stays_where_a_hot_prompt_spreads() {
    let p = PolicyParams {
        pollution_factor: 8.0,
        ..params()
    };
    // Worker 0 holds 4,000 of 4,096 tokens but has 10,000 tokens of work queued; worker 1 is idle.
    let cands = [cand(0, 250, 10_000), cand(1, 0, 0)];
    let mut st = PolicyState {
        rr: 0,
        rng: Rng::new(0),
    };
    let private = choose(
        PolicyKind::Kvroute,
        &p,
        &request(4096, 0.0),
        &cands,
        &mut st,
    );
    let hot = choose(
        PolicyKind::Kvroute,
        &p,
        &request(4096, 20.0),
        &cands,
        &mut st,
    );
    assert_eq!((private.0, hot.0), (0, 1));
}

#[test]
fn prefill_drain_credits_the_time_the_current_prefill_has_run() {
    let p = PolicyParams {
        attn_s_per_token_pair: 0.0,
        prefill_drain: 0.5,
        ..params()
    };
    let req = request(1600, 0.0);
    // 100,000 tokens of work queued: 1 s at 1e-5 s/token, plus this request's 0.016 s.
    let fresh = ttft_terms(&p, &req, &cand(0, 0, 100_000));
    assert!((fresh.est_ttft_s - 1.016).abs() < 1e-9);
    // 0.8 s after its current prefill started, half of that time is credited: 40,000 tokens.
    let ran = Candidate {
        prefill_elapsed_s: 0.8,
        ..cand(0, 0, 100_000)
    };
    let t = ttft_terms(&p, &req, &ran);
    assert!((t.est_ttft_s - 0.616).abs() < 1e-9, "{}", t.est_ttft_s);
    assert_eq!(t.queued_prefill_tokens, 30_000);
    // Never below empty; and off by default.
    let long = Candidate {
        prefill_elapsed_s: 100.0,
        ..cand(0, 0, 100_000)
    };
    assert!((ttft_terms(&p, &req, &long).est_ttft_s - 0.016).abs() < 1e-9);
    let off = PolicyParams {
        prefill_drain: 0.0,
        ..p.clone()
    };
    assert!((ttft_terms(&off, &req, &ran).est_ttft_s - 1.016).abs() < 1e-9);
}
