//! Scheduler tests that need its private state: atomicity (with a deliberately racy variant
//! that the same check catches), ledger invariants, remote convergence, policy behaviour.
use std::sync::{Arc, Barrier};
use std::thread;

use parking_lot::Mutex;
use proptest::prelude::*;

use super::*;

const NOW: Nanos = 1_000 * SECOND;

fn sched(policy: PolicyKind, workers: u64, f: impl FnOnce(&mut SchedulerConfig)) -> Scheduler {
    let mut cfg = SchedulerConfig {
        policy,
        ..Default::default()
    };
    f(&mut cfg);
    let s = Scheduler::new(cfg, Arc::new(Mutex::new(PrefixIndex::default()))).unwrap();
    for id in 0..workers {
        s.upsert_worker(WorkerInfo {
            id,
            capacity_blocks: 10_000,
            cpu_capacity_blocks: 0,
            healthy: true,
            metrics: None,
        })
        .unwrap();
    }
    s
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| seed.wrapping_mul(7919).wrapping_add(i))
        .collect()
}

/// The racy variant: choose under one lock, book under another, with the gap a split
/// select/reserve across an `await` would have.
fn select_then_reserve_racy(s: &Scheduler, now: Nanos) -> Result<u64> {
    let limit = s.cfg.max_inflight_per_worker;
    let pick = {
        let st = s.state.lock();
        st.workers
            .iter()
            .map(|w| (st.ledger.load(w.id).active, w.id))
            .filter(|(a, _)| *a < limit)
            .min()
    };
    let (_, worker) = pick.ok_or(Error::Saturated)?;
    thread::sleep(std::time::Duration::from_micros(200));
    let mut st = s.state.lock();
    let id = st.next_id;
    st.next_id += 1;
    let r = Reservation {
        worker,
        prefill_tokens: 16,
        prefill_work: 16,
        prompt_blocks: 1,
        generated: 0,
        block_size: 16,
        phase: Phase::Prefill,
        expires_at: now + SECOND,
    };
    st.ledger.book((0, id), r, now);
    Ok(id)
}

/// Many threads race to reserve; returns the worst per-worker in-flight count seen at the end.
fn hammer(s: &Arc<Scheduler>, racy: bool) -> (u32, usize) {
    let threads = 8;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let s = Arc::clone(s);
            let b = Arc::clone(&barrier);
            thread::spawn(move || {
                b.wait();
                let mut ok = 0usize;
                for i in 0..40u32 {
                    let r = if racy {
                        select_then_reserve_racy(&s, NOW)
                    } else {
                        s.select_and_reserve_tokens(
                            &tokens(t as u32 * 1000 + i, 64),
                            None,
                            None,
                            16,
                            &[],
                            NOW,
                        )
                        .map(|d| d.reservation)
                    };
                    match r {
                        Ok(_) => ok += 1,
                        Err(Error::Saturated) => {}
                        Err(e) => panic!("unexpected {e}"),
                    }
                }
                ok
            })
        })
        .collect();
    let booked: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    let worst = s.loads().iter().map(|(_, l)| l.active).max().unwrap();
    (worst, booked)
}

#[test]
fn select_and_reserve_is_atomic() {
    let s = Arc::new(sched(PolicyKind::LeastLoaded, 4, |c| {
        c.max_inflight_per_worker = 5
    }));
    let (worst, booked) = hammer(&s, false);
    assert!(
        worst <= 5,
        "over-booked: a worker has {worst} in flight, limit 5"
    );
    assert_eq!(booked, 20, "every slot is taken exactly once, none lost");
    assert_eq!(s.reservations(), booked);
    s.check_invariants().unwrap();
}

#[test]
fn racy_variant_is_caught() {
    // The same check on a select/reserve split across two lock holds must fail.
    let s = Arc::new(sched(PolicyKind::LeastLoaded, 4, |c| {
        c.max_inflight_per_worker = 5
    }));
    let (worst, _) = hammer(&s, true);
    assert!(
        worst > 5,
        "the racy variant should over-book (worst {worst})"
    );
}

#[test]
fn ledger_returns_to_zero_after_release_and_expiry() {
    let s = sched(PolicyKind::Kvroute, 3, |c| c.reservation_ttl = 10 * SECOND);
    let mut ids = Vec::new();
    for i in 0..30 {
        let d = s
            .select_and_reserve_tokens(&tokens(i, 300), None, None, 50, &[], NOW)
            .unwrap();
        ids.push(d.reservation);
    }
    for (k, id) in ids.iter().enumerate() {
        match k % 3 {
            0 => {
                assert!(s.prefill_done(*id, NOW + 1));
                assert!(s.decode_progress(*id, 40, NOW + 2));
                assert!(s.release(*id, NOW + 3));
                assert!(!s.release(*id, NOW + 4), "release is idempotent");
            }
            1 => assert!(s.release(*id, NOW + 3)),
            _ => {} // never reported: must expire
        }
        s.check_invariants().unwrap();
    }
    assert_eq!(s.expire(NOW + 5 * SECOND), 0, "not yet due");
    assert_eq!(s.expire(NOW + 11 * SECOND), 10);
    assert_eq!(s.reservations(), 0);
    for (_, l) in s.loads() {
        assert_eq!(l, Load::default());
    }
    assert_eq!(s.counters().expired, 10);
}

#[test]
fn lifecycle_moves_load_from_prefill_to_decode() {
    let s = sched(PolicyKind::Kvroute, 1, |_| {});
    let d = s
        .select_and_reserve_tokens(&tokens(1, 320), None, None, 100, &[], NOW)
        .unwrap();
    assert_eq!(d.prefill_tokens, 320);
    let l = s.load(0);
    assert_eq!(
        (l.prefill_tokens, l.kv_blocks, l.active, l.decoding),
        (320, 20, 1, 0)
    );
    s.prefill_done(d.reservation, NOW);
    s.decode_progress(d.reservation, 33, NOW);
    let l = s.load(0);
    assert_eq!(
        (l.prefill_tokens, l.kv_blocks, l.active, l.decoding),
        (0, 22, 1, 1)
    );
}

fn remote(origin: u64, id: u64, worker: u64) -> RemoteUpdate {
    RemoteUpdate::Reserve(RemoteReservation {
        origin,
        id,
        worker,
        prefill_tokens: 100,
        prefill_work: 0,
        prompt_blocks: 7,
        hashes: vec![],
    })
}

#[test]
fn remote_updates_converge_in_any_order_and_tombstones_hold() {
    let msgs = vec![
        remote(7, 1, 0),
        RemoteUpdate::PrefillDone { origin: 7, id: 1 },
        remote(7, 2, 1),
        RemoteUpdate::Progress {
            origin: 7,
            id: 2,
            generated: 64,
        },
        remote(8, 1, 2),
        RemoteUpdate::Finished { origin: 7, id: 1 },
    ];
    let a = sched(PolicyKind::Kvroute, 3, |c| c.router_id = 1);
    for m in &msgs {
        a.apply_remote(m, NOW).unwrap();
    }
    // Duplicated, and the finish of (7,1) delivered before its reservation.
    let b = sched(PolicyKind::Kvroute, 3, |c| c.router_id = 2);
    let order = [5, 0, 0, 2, 4, 3, 1, 2, 4];
    for &i in &order {
        b.apply_remote(&msgs[i], NOW).unwrap();
    }
    b.apply_remote(&msgs[3], NOW).unwrap();
    assert_eq!(a.loads(), b.loads());
    assert!(
        a.reservation(7, 1).is_none() && b.reservation(7, 1).is_none(),
        "late reserve resurrected a finished one"
    );
    assert_eq!(a.reservations(), 2);
    // A router ignores its own broadcasts.
    let own = sched(PolicyKind::Kvroute, 3, |c| c.router_id = 7);
    assert!(!own.apply_remote(&msgs[0], NOW).unwrap());
    assert_eq!(own.reservations(), 0);
}

#[test]
fn kvroute_prefers_the_cached_worker_then_spreads_under_load() {
    let s = sched(PolicyKind::Kvroute, 4, |c| c.speculative_ttl = 0);
    let system: Vec<u32> = tokens(42, 4096);
    let hashes = block_hashes(&system, 16, None, None);
    s.index
        .lock()
        .speculate(2, &hashes, NOW + 1000 * SECOND, NOW)
        .unwrap();
    let mut per = [0u32; 4];
    let first = s
        .select_and_reserve_tokens(
            &[system.clone(), tokens(1, 64)].concat(),
            None,
            None,
            10,
            &[],
            NOW,
        )
        .unwrap();
    assert_eq!(first.worker, 2, "idle fleet: go where the prefix is cached");
    assert_eq!(first.gpu_blocks, 256);
    per[2] += 1;
    // A burst sharing the prefix: the cached worker's queue grows until others win.
    for i in 0..200 {
        let t = [system.clone(), tokens(100 + i, 64)].concat();
        let d = s
            .select_and_reserve_tokens(&t, None, None, 10, &[], NOW)
            .unwrap();
        per[d.worker as usize] += 1;
    }
    assert!(
        per[2] > per.iter().sum::<u32>() / 4,
        "the cached worker takes more than its share: {per:?}"
    );
    assert!(
        per.iter().all(|&n| n > 0),
        "a hot system prompt must not pile onto one worker: {per:?}"
    );
}

#[test]
fn exclusion_health_and_saturation() {
    let s = sched(PolicyKind::RoundRobin, 3, |c| c.max_inflight_per_worker = 1);
    s.set_healthy(1, false).unwrap();
    let d = s
        .select_and_reserve_tokens(&tokens(1, 32), None, None, 1, &[0], NOW)
        .unwrap();
    assert_eq!(d.worker, 2);
    let e = s
        .select_and_reserve_tokens(&tokens(1, 32), None, None, 1, &[0], NOW)
        .unwrap_err();
    assert_eq!(e, Error::Saturated);
    let e = s
        .select_and_reserve_tokens(&tokens(1, 32), None, None, 1, &[0, 2], NOW)
        .unwrap_err();
    assert_eq!(e, Error::NoEligibleWorker);
    assert_eq!(s.remove_worker(2, NOW).unwrap(), 1);
    assert_eq!(s.reservations(), 0);
    assert!(matches!(
        s.remove_worker(2, NOW),
        Err(Error::UnknownWorker(2))
    ));
}

#[test]
fn every_policy_routes_and_books() {
    for kind in PolicyKind::ALL {
        let s = sched(kind, 3, |_| {});
        for i in 0..20 {
            let d = s
                .select_and_reserve_tokens(&tokens(i % 4, 200), None, None, 10, &[], NOW)
                .unwrap();
            assert!(d.worker < 3);
            if i % 2 == 0 {
                s.release(d.reservation, NOW);
            }
        }
        assert_eq!(s.reservations(), 10, "{}", kind.name());
        s.check_invariants().unwrap();
        assert_eq!(PolicyKind::parse(kind.name()).unwrap(), kind);
    }
    assert!(matches!(
        PolicyKind::parse("nope"),
        Err(Error::UnknownPolicy(_))
    ));
}

#[test]
fn round_robin_cycles_and_sglang_sticks_to_its_tree() {
    let s = sched(PolicyKind::RoundRobin, 3, |_| {});
    let w: Vec<u64> = (0..6)
        .map(|i| {
            s.select_and_reserve_tokens(&tokens(i, 32), None, None, 1, &[], NOW)
                .unwrap()
                .worker
        })
        .collect();
    assert_eq!(w, vec![0, 1, 2, 0, 1, 2]);
    let s = sched(PolicyKind::SglangCacheAware, 3, |_| {});
    let first = s
        .select_and_reserve_tokens(&tokens(9, 320), None, None, 1, &[], NOW)
        .unwrap()
        .worker;
    for _ in 0..5 {
        let d = s
            .select_and_reserve_tokens(&tokens(9, 320), None, None, 1, &[], NOW)
            .unwrap();
        assert_eq!(
            d.worker, first,
            "a repeated prompt follows the approximate tree"
        );
        s.release(d.reservation, NOW);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
    /// Random lifecycles, local and remote: the ledger always equals the sum of its
    /// reservations and returns to zero once everything has ended.
    #[test]
    fn ledger_invariants_hold(ops in prop::collection::vec((0u8..6, 0u64..12, 0u64..3), 1..80)) {
        let s = sched(PolicyKind::Kvroute, 3, |c| { c.router_id = 1; c.reservation_ttl = 50 * SECOND });
        let mut now = NOW;
        let mut local = Vec::new();
        for (op, k, w) in ops {
            now += SECOND;
            match op {
                0 => local.push(s.select_and_reserve_tokens(&tokens(k as u32, 100), None, None, 20, &[], now).unwrap().reservation),
                1 => { if let Some(id) = local.get(k as usize) { s.prefill_done(*id, now); } }
                2 => { if let Some(id) = local.get(k as usize) { s.release(*id, now); } }
                3 => { s.apply_remote(&remote(9, k, w), now).unwrap(); }
                4 => { s.apply_remote(&RemoteUpdate::Finished { origin: 9, id: k }, now).unwrap(); }
                _ => { s.apply_remote(&RemoteUpdate::Progress { origin: 9, id: k, generated: 17 * w }, now).unwrap(); }
            }
            prop_assert!(s.check_invariants().is_ok());
        }
        for id in local { s.release(id, now); }
        for k in 0..12 { s.apply_remote(&RemoteUpdate::Finished { origin: 9, id: k }, now).unwrap(); }
        prop_assert_eq!(s.reservations(), 0);
        for (_, l) in s.loads() { prop_assert_eq!(l, Load::default()); }
    }
}

/// Four routers with fan-out; bursts in which every router routes `per_router` cold requests
/// at the same instant, before any peer message can arrive. Returns, for the last burst, the
/// workers chosen in each round (router order), and the routers' concurrency estimates.
fn bursts(hedge: f64, bursts: u64, per_router: usize) -> (Vec<Vec<WorkerId>>, Vec<f64>) {
    bursts_on(8, hedge, bursts, per_router)
}

fn bursts_on(
    workers: u64,
    hedge: f64,
    bursts: u64,
    per_router: usize,
) -> (Vec<Vec<WorkerId>>, Vec<f64>) {
    let routers: Vec<Scheduler> = (0..4)
        .map(|r| {
            sched(PolicyKind::Kvroute, workers, |c| {
                c.router_id = r;
                c.params.peer_hedge = hedge;
            })
        })
        .collect();
    let mut last = Vec::new();
    let mut seed = 0u32;
    for b in 0..bursts {
        let t = NOW + b * 3 * SECOND;
        let mut rounds = vec![Vec::new(); per_router];
        let mut msgs = Vec::new();
        for (j, round) in rounds.iter_mut().enumerate() {
            for (r, s) in routers.iter().enumerate() {
                seed += 1;
                let toks = tokens(seed, 4096 + 512 * ((r + j) % 3));
                let d = s
                    .select_and_reserve_tokens(&toks, None, None, 64, &[], t)
                    .unwrap();
                round.push(d.worker);
                msgs.push((
                    r,
                    d.reservation,
                    RemoteUpdate::Reserve(RemoteReservation {
                        origin: r as u64,
                        id: d.reservation,
                        worker: d.worker,
                        prefill_tokens: u64::from(d.prefill_tokens),
                        prefill_work: d.breakdown.work_tokens,
                        prompt_blocks: toks.len().div_ceil(16) as u64,
                        hashes: vec![],
                    }),
                ));
            }
        }
        // The fan-out arrives 1 ms later; every request finishes within the next second.
        for (from, _, m) in &msgs {
            for (r, s) in routers.iter().enumerate() {
                if r != *from {
                    s.apply_remote(m, t + SECOND / 1000).unwrap();
                }
            }
        }
        for (from, id, _) in &msgs {
            routers[*from].release(*id, t + SECOND);
            let fin = RemoteUpdate::Finished {
                origin: *from as u64,
                id: *id,
            };
            for s in &routers {
                s.apply_remote(&fin, t + SECOND).unwrap();
            }
        }
        last = rounds;
    }
    for s in &routers {
        assert_eq!(s.reservations(), 0, "ghosts never leak into the ledger");
        s.check_invariants().unwrap();
    }
    let est = routers
        .iter()
        .map(|s| s.state.lock().hedge.concurrency())
        .collect();
    (last, est)
}

fn distinct(rounds: &[Vec<WorkerId>]) -> usize {
    let mut all: Vec<WorkerId> = rounds.iter().flatten().copied().collect();
    all.sort_unstable();
    all.dedup();
    all.len()
}

#[test]
fn routers_deciding_at_once_tile_the_fleet_instead_of_herding() {
    // (Decisions taken without waiting for their turn: the plan and its ghosts alone.)
    // Without the hedge the four routers, seeing the same idle fleet, all take the same worker
    // in each round.
    let (herd, _) = bursts(0.0, 12, 2);
    assert!(
        herd.iter().all(|r| r.iter().all(|w| *w == r[0])),
        "{herd:?}"
    );
    // With it, once concurrency has been observed, eight concurrent requests take eight workers.
    let (tiled, est) = bursts(1.0, 12, 2);
    assert_eq!(distinct(&tiled), 8, "{tiled:?}");
    assert!(est.iter().all(|c| (5.0..=7.0).contains(c)), "{est:?}");
}

#[test]
fn without_concurrency_the_hedge_changes_nothing() {
    // One request per burst at one router only (peers heard from, never concurrent): every
    // decision is the plain argmin, as with the hedge off.
    let run = |hedge: f64| {
        let routers: Vec<Scheduler> = (0..2)
            .map(|r| {
                sched(PolicyKind::Kvroute, 4, |c| {
                    c.router_id = r;
                    c.params.peer_hedge = hedge;
                })
            })
            .collect();
        let mut picks = Vec::new();
        for b in 0..20u64 {
            let t = NOW + b * SECOND;
            let (s, peer) = (&routers[(b % 2) as usize], &routers[1 - (b % 2) as usize]);
            let d = s
                .select_and_reserve_tokens(&tokens(b as u32, 2048), None, None, 16, &[], t)
                .unwrap();
            picks.push(d.worker);
            assert_eq!(s.pace(t + 1), 0, "steady traffic never waits");
            // Delivered 100 ms later: well outside the window; finished much later.
            peer.apply_remote(&remote(b % 2, d.reservation, d.worker), t + SECOND / 10)
                .unwrap();
        }
        let hedged = routers
            .iter()
            .map(|s| s.state.lock().hedge.hedged)
            .sum::<u64>();
        (picks, hedged)
    };
    let (off, _) = run(0.0);
    let (on, hedged) = run(1.0);
    assert_eq!(on, off);
    assert_eq!(hedged, 0);
}

#[test]
fn a_burst_is_paced_one_decision_per_window_and_steady_traffic_never_waits() {
    let ms = SECOND / 1000;
    // Bursts at four routers teach router 0 that its peers decide concurrently.
    let routers: Vec<Scheduler> = (0..4)
        .map(|r| sched(PolicyKind::Kvroute, 8, |c| c.router_id = r))
        .collect();
    let s = &routers[0];
    assert_eq!(s.pace(NOW), 0, "no peers yet");
    for b in 0..12u64 {
        let t = NOW + b * 3 * SECOND;
        let mut msgs = Vec::new();
        for (r, x) in routers.iter().enumerate() {
            let d = x
                .select_and_reserve_tokens(
                    &tokens(b as u32 * 4 + r as u32, 2048),
                    None,
                    None,
                    8,
                    &[],
                    t,
                )
                .unwrap();
            msgs.push(remote(r as u64, d.reservation, d.worker));
        }
        for (r, x) in routers.iter().enumerate() {
            for (from, m) in msgs.iter().enumerate() {
                if from != r {
                    x.apply_remote(m, t + ms).unwrap();
                }
            }
        }
    }
    assert!(s.peer_concurrency() > 2.0, "{}", s.peer_concurrency());
    // A burst of six requests at one instant: one decision per 5 ms window, none waiting more
    // than 20 ms; past that the request is decided at once.
    let t = NOW + 40 * SECOND;
    let waits: Vec<Nanos> = (0..6).map(|_| s.pace(t) / ms).collect();
    assert_eq!(waits, [0, 5, 10, 15, 20, 0]);
    assert_eq!(s.counters().paced, 4);
    // Routers take turns: the burst's first decision at the router of rank k of 4 waits k/4 of
    // a window, after the fan-out of the earlier ranks' decisions.
    let us = SECOND / 1_000_000;
    let first: Vec<Nanos> = routers.iter().map(|x| x.pace(t) / us).collect();
    assert_eq!(first[1..], [1250, 2500, 3750]);
    // With pacing off (`peer_pace_max_s` 0) nothing waits.
    let off = sched(PolicyKind::Kvroute, 8, |c| {
        c.router_id = 9;
        c.params.peer_pace_max_s = 0.0;
    });
    off.apply_remote(&remote(1, 1, 0), NOW).unwrap();
    assert_eq!(off.pace(NOW), 0);
}

#[test]
fn a_long_burst_of_equal_requests_is_tiled_evenly() {
    for hedge in [0.0, 1.0] {
        let (rounds, _) = bursts_on(4, hedge, 6, 16);
        let mut count = [0; 4];
        for w in rounds.iter().flatten() {
            count[*w as usize] += 1;
        }
        assert_eq!(count, [16; 4], "hedge {hedge}");
    }
}

#[test]
fn the_ledger_knows_when_each_workers_current_prefill_started() {
    let mut l = Ledger::default();
    let r = |worker| Reservation {
        worker,
        prefill_tokens: 100,
        prefill_work: 100,
        prompt_blocks: 7,
        generated: 0,
        block_size: 16,
        phase: Phase::Prefill,
        expires_at: NOW + 100 * SECOND,
    };
    assert_eq!(l.prefill_started(0), None);
    assert!(l.book((1, 1), r(0), NOW));
    assert!(l.book((1, 2), r(0), NOW + 5));
    assert_eq!(
        l.prefill_started(0),
        Some(NOW),
        "a second request queues behind the first"
    );
    // A refresh of a queued request starts nothing; its first token starts the next prefill.
    assert!(l.update(&(1, 2), SECOND, NOW + 7, |_| {}));
    assert_eq!(l.prefill_started(0), Some(NOW));
    assert!(l.update(&(1, 1), SECOND, NOW + 9, |x| x.phase = Phase::Decode));
    assert_eq!(l.prefill_started(0), Some(NOW + 9));
    l.finish(&(1, 2), NOW + SECOND, NOW + 11);
    assert_eq!(l.prefill_started(0), Some(NOW + 11));
    // Finishing a decoding request does not touch it; dropping the worker forgets it.
    l.finish(&(1, 1), NOW + SECOND, NOW + 20);
    assert_eq!(l.prefill_started(0), Some(NOW + 11));
    l.drop_worker(0, NOW + SECOND, NOW + 30);
    assert_eq!(l.prefill_started(0), None);
    l.check().unwrap();
}
