"""Binding contract of `Scheduler`, `Decision` and the vLLM hashing helper."""

from __future__ import annotations

import contextlib
import threading
from array import array

import numpy as np
import pytest

import kvroute

NOW = 10**12


def make(policy: str = "kvroute", workers: int = 3, **kw: object) -> kvroute.Scheduler:
    s = kvroute.Scheduler(kvroute.PrefixIndex(), policy, **kw)  # type: ignore[arg-type]
    for w in range(workers):
        s.upsert_worker(w, capacity_blocks=10_000)
    return s


def prompt(seed: int, n: int = 320) -> np.ndarray:
    return np.arange(seed * 100_000, seed * 100_000 + n, dtype=np.uint32)


def test_decision_fields_and_lifecycle_return_ledger_to_zero() -> None:
    s = make()
    d = s.select_and_reserve(prompt(1), expected_output_tokens=64, now_ns=NOW)
    assert isinstance(d, kvroute.Decision)
    assert d.worker in (0, 1, 2)
    assert d.candidates == 3
    assert (d.gpu_blocks, d.cpu_blocks, d.prefill_tokens, d.uncached_tokens) == (0, 0, 320, 320)
    assert d.est_ttft_s > 0
    assert d.est_ttft_s == d.score
    assert "Decision(worker=" in repr(d)
    load = s.loads()[d.worker]
    assert load == {"prefill_tokens": 320, "kv_blocks": 20, "active": 1, "decoding": 0}
    assert s.prefill_done(d.reservation, now_ns=NOW)
    assert s.decode_progress(d.reservation, 48, now_ns=NOW)
    assert s.loads()[d.worker] == {"prefill_tokens": 0, "kv_blocks": 23, "active": 1, "decoding": 1}
    assert s.release(d.reservation, now_ns=NOW)
    assert not s.release(d.reservation, now_ns=NOW), "release is idempotent"
    assert all(
        v == {"prefill_tokens": 0, "kv_blocks": 0, "active": 0, "decoding": 0} for v in s.loads().values()
    )
    assert s.reservations() == 0
    s.check_invariants()
    assert s.counters()["decisions"] == 1
    assert s.counters()["released"] == 1


def test_second_turn_follows_the_first_and_every_input_kind_agrees() -> None:
    s = make(speculative_ttl_s=30.0)
    first = s.select_and_reserve(prompt(2, 640), now_ns=NOW)
    s.release(first.reservation, now_ns=NOW)
    turn2 = np.concatenate([prompt(2, 640), prompt(9, 64)])
    for i, tokens in enumerate((turn2, array("I", turn2.tobytes()), turn2.tobytes(), turn2.tolist())):
        d = s.select_and_reserve(tokens, now_ns=NOW + 1)
        assert d.worker == first.worker
        # The first turn's 40 blocks, then all 44 once turn 2 itself was routed there.
        assert d.gpu_blocks == (40 if i == 0 else 44)
        s.release(d.reservation, now_ns=NOW + 1)
    h = kvroute.block_hashes(turn2)
    d = s.select_and_reserve_hashes(h, len(turn2), now_ns=NOW + 2)
    assert d.worker == first.worker
    assert d.prefill_tokens == 0  # every block was speculated there by now


def test_errors_map_to_the_exception_hierarchy() -> None:
    with pytest.raises(kvroute.UnknownPolicyError) as e:
        make("nope")
    assert isinstance(e.value, ValueError)
    with pytest.raises(kvroute.InvalidArgumentError):
        kvroute.Scheduler(kvroute.PrefixIndex(), params={"no_such_knob": 1.0})
    with pytest.raises(kvroute.InvalidArgumentError):
        kvroute.Scheduler(kvroute.PrefixIndex(), params={"step_s": -1.0})
    s = make("round_robin", max_inflight_per_worker=1)
    with pytest.raises(kvroute.NoEligibleWorkerError):
        s.select_and_reserve(prompt(1), exclude=[0, 1, 2], now_ns=NOW)
    for _ in range(3):
        s.select_and_reserve(prompt(1), now_ns=NOW)
    with pytest.raises(kvroute.SaturatedError):
        s.select_and_reserve(prompt(1), now_ns=NOW)
    with pytest.raises(kvroute.UnknownWorkerError):
        s.remove_worker(42)
    with pytest.raises(kvroute.InvalidArgumentError):
        s.select_and_reserve(np.zeros(4, dtype=np.int64), now_ns=NOW)
    assert s.counters()["saturated"] == 1
    assert s.counters()["no_eligible"] == 1


def test_params_health_metrics_and_worker_removal() -> None:
    s = make(params={"step_s": 0.01, "max_batched_tokens": 4096})
    p = s.params()
    assert p["step_s"] == 0.01
    assert p["max_batched_tokens"] == 4096
    assert set(p) == set(kvroute.POLICY_PARAMS)
    s.set_healthy(0, False)
    s.set_metrics(1, running=3, waiting=2, kv_usage=0.5)
    s.set_metrics(1)
    assert s.workers()[0] == (0, 10_000, 0, False)
    for _ in range(10):
        assert s.select_and_reserve(prompt(3), now_ns=NOW).worker != 0
    assert s.remove_worker(1, now_ns=NOW) + s.remove_worker(2, now_ns=NOW) == 10
    assert s.reservations() == 0


def test_remote_reservations_are_idempotent_and_tombstoned() -> None:
    s = make(router_id=1)
    h = kvroute.block_hashes(prompt(4))
    assert s.apply_remote_reserve(2, 7, 0, 320, 20, h, now_ns=NOW)
    assert not s.apply_remote_reserve(2, 7, 0, 320, 20, h, now_ns=NOW), "duplicate"
    assert not s.apply_remote_reserve(1, 9, 0, 1, 1, now_ns=NOW), "own broadcast"
    assert s.apply_remote_prefill_done(2, 7, now_ns=NOW)
    assert s.apply_remote_progress(2, 7, 32, now_ns=NOW)
    assert s.apply_remote_finished(2, 7, now_ns=NOW)
    assert not s.apply_remote_reserve(2, 7, 0, 320, 20, h, now_ns=NOW), "tombstoned"
    assert s.reservations() == 0
    assert s.counters()["remote_applied"] == 4


def test_expiry_of_unreported_reservations() -> None:
    s = make(reservation_ttl_s=1.0)
    for i in range(5):
        s.select_and_reserve(prompt(i), now_ns=NOW)
    assert s.expire(now_ns=NOW + 500_000_000) == 0
    assert s.expire(now_ns=NOW + 1_000_000_001) == 5
    assert s.reservations() == 0


def test_concurrent_python_threads_never_overbook() -> None:
    s = make("least_loaded", workers=4, max_inflight_per_worker=5)
    ok: list[int] = []

    def run(t: int) -> None:
        for i in range(30):
            with contextlib.suppress(kvroute.SaturatedError):
                ok.append(s.select_and_reserve(prompt(t * 100 + i, 64), now_ns=NOW).reservation)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ok) == 20 == len(set(ok))
    assert max(v["active"] for v in s.loads().values()) == 5
    s.check_invariants()


def test_vllm_block_hashes_match_the_published_vectors() -> None:
    toks = list(range(32))
    assert kvroute.vllm_block_hashes(toks, 16, "sha256_cbor") == [2233398808101521225, 17911472383915781900]
    assert kvroute.vllm_block_hashes(toks, 16, "sha256") == [3262291359910021016, 7142137847444424233]
    lora = ("my-lora", "/p")
    assert kvroute.vllm_block_hashes(toks[:16], 16, "sha256_cbor", lora=lora, salt="salt123") == [
        7291110907016716650
    ]
    assert kvroute.vllm_block_hashes(toks[:16], 16, "sha256", lora=lora, salt="salt123") == [
        7207999314840895509
    ]
    with pytest.raises(kvroute.InvalidArgumentError):
        kvroute.vllm_block_hashes(toks, 16, "md5")


def test_bursts_at_peer_routers_make_the_router_take_turns() -> None:
    """Peer reservations arriving right after each of this router's decisions teach it that the
    routers decide concurrently; a burst's later requests then wait for the next window, and the
    wait shows in the counters and the concurrency gauge. Steady traffic never waits."""
    ms = 1_000_000
    s = make(router_id=1, workers=4)
    assert s.pace(now_ns=NOW) == 0.0, "no peers: never waits"
    for b in range(12):
        t = NOW + b * 3_000 * ms
        d = s.select_and_reserve(prompt(b), now_ns=t)
        for peer in (2, 3):
            assert s.apply_remote_reserve(peer, b, b % 4, 320, 20, now_ns=t + ms)
        s.release(d.reservation, now_ns=t + 500 * ms)
        for peer in (2, 3):
            s.apply_remote_finished(peer, b, now_ns=t + 500 * ms)
    assert s.peer_concurrency() > 1.0
    t = NOW + 40_000 * ms
    # Rank 0 of three routers (ids 1, 2, 3): its first decision goes at once, then one per 5 ms.
    assert [round(s.pace(now_ns=t) * 1e3, 3) for _ in range(3)] == [0.0, 5.0, 10.0]
    c = s.counters()
    # The warm-up's decisions, taken without a turn once concurrency was known, were hedged.
    assert c["paced"] == 2
    assert c["hedged"] > 0
    assert s.reservations() == 0

    quiet = make(router_id=1, workers=4)
    for b in range(12):
        t = NOW + b * 3_000 * ms
        quiet.select_and_reserve(prompt(b), now_ns=t)
        # Peer decisions 1 s apart from this router's: never concurrent.
        quiet.apply_remote_reserve(2, b, 0, 320, 20, now_ns=t + 1_000 * ms)
    assert quiet.peer_concurrency() < 0.1
    assert quiet.pace(now_ns=NOW + 40_000 * ms) == 0.0
