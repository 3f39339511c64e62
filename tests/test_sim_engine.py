"""SimEngine / StepResult / replay_mooncake binding contract: determinism, wire format, errors."""

from __future__ import annotations

import array
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvroute import (
    SIM_HASH_ALGOS,
    SIM_PRESETS,
    InvalidArgumentError,
    PrefixIndex,
    SimEngine,
    StepResult,
    UnknownPolicyError,
    replay_mooncake,
)

TRACE = Path(__file__).parents[1] / ".." / "shared" / "traces" / "conversation_trace.jsonl"


def drain(engine: SimEngine, t0: float = 0.0) -> list[StepResult]:
    """Steps until the engine is idle, advancing time by each step's duration."""
    steps, now = [], t0
    while engine.has_work():
        r = engine.step(now)
        steps.append(r)
        now += r.duration_s
        assert len(steps) < 10_000
    return steps


def small_engine(**kw: Any) -> SimEngine:
    return SimEngine(block_size=16, num_gpu_blocks=64, max_num_batched_tokens=64, **kw)


def test_presets_and_defaults() -> None:
    assert SIM_PRESETS[0] == "llama3-8b-h100"
    assert {"llama3-70b-h100x8", "dynamo-mocker"} <= set(SIM_PRESETS)
    assert SIM_HASH_ALGOS == ["sha256", "sha256_cbor", "xxh3"]
    cfg = SimEngine().config()
    assert cfg["preset"] == "llama3-8b-h100"
    assert (cfg["block_size"], cfg["hash_algo"], cfg["num_cpu_blocks"]) == (16, "sha256", 0)
    assert cfg["max_num_seqs"] == 256
    assert cfg["max_num_batched_tokens"] == 8192
    assert isinstance(cfg["latency"], dict)
    assert cfg["latency"]["prefill_s_per_token"] > 0
    dyn = SimEngine(preset="dynamo-mocker", num_gpu_blocks=100, lora_paths={"a": "/p/a"}).config()
    assert (dyn["block_size"], dyn["num_gpu_blocks"], dyn["lora_paths"]) == (64, 100, {"a": "/p/a"})
    m = SimEngine().metrics()
    for key in (
        "running",
        "waiting",
        "kv_cache_usage",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "preemptions",
        "num_gpu_blocks",
        "num_cpu_blocks",
        "block_size",
        "steps",
    ):
        assert isinstance(m[key], float), key


def test_a_request_runs_to_completion_with_its_outputs() -> None:
    e = small_engine()
    e.add_request("r1", array.array("I", range(40)), 3)
    steps = drain(e)
    outs = [o for s in steps for o in s.outputs]
    assert [o[0] for o in outs] == ["r1"] * 3
    assert all(len(o[1]) == 1 for o in outs)
    assert [o[2] for o in outs] == [False, False, True]
    assert outs[-1][3] == "length"
    assert {(o[4], o[5]) for o in outs} == {(0, 40)}
    assert all(s.duration_s > 0 for s in steps)
    m = e.metrics()
    assert (m["prefix_cache_queries"], m["running"], m["waiting"]) == (40.0, 0.0, 0.0)


def test_same_seed_same_tokens_and_bytes() -> None:
    def run(seed: int) -> list[tuple[Any, ...]]:
        e = small_engine(seed=seed)
        e.add_request("a", list(range(50)), 8)
        e.add_request("b", list(range(30)), 5)
        return [(s.duration_s, s.events, s.outputs) for s in drain(e)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_events_decode_with_msgpack_in_both_encodings() -> None:
    e = small_engine()
    e.add_request("r", list(range(40)), 2, lora="ad", salt="tenant")
    r = e.step(12.5)
    assert r.seq == 0
    assert r.events is not None
    assert r.events_legacy is not None
    ts, events, dp = msgpack.unpackb(r.events)
    assert (ts, dp) == (12.5, 0)
    (ev,) = events
    assert ev["type"] == "BlockStored"
    assert ev["medium"] == "GPU"
    assert len(ev["block_hashes"]) == 2
    assert ev["parent_block_hash"] is None
    assert ev["token_ids"] == list(range(32))
    assert ev["block_size"] == 16
    assert ev["lora_name"] == "ad"
    assert ev["lora_id"] == 1
    assert ev["extra_keys"] == [["ad", "tenant"], ["ad"]]
    assert ev["kv_cache_spec_kind"] == "full_attention"
    ts, legacy, dp = msgpack.unpackb(r.events_legacy)
    assert legacy[0][0] == "BlockStored"
    assert legacy[0][1] == ev["block_hashes"]
    # The next step decodes one token: no block fills, so there is no batch and no sequence number.
    r2 = e.step(13.0)
    assert r2.events is None
    assert r2.seq is None


def test_sha256_hashes_are_vllms_test_vectors() -> None:
    # shared/docs/vllm.md section 2: tokens 0..15 then 16..31, PYTHONHASHSEED unset.
    e = SimEngine()
    e.add_request("v", list(range(33)), 1)
    _, events, _ = msgpack.unpackb(e.step(0.0).events)
    assert events[0]["block_hashes"] == [3262291359910021016, 7142137847444424233]
    cbor = SimEngine(hash_algo="sha256_cbor")
    cbor.add_request("v", list(range(33)), 1)
    _, events, _ = msgpack.unpackb(cbor.step(0.0).events)
    assert events[0]["block_hashes"] == [2233398808101521225, 17911472383915781900]


def test_events_fed_to_the_index_reproduce_the_engine_cache() -> None:
    e = small_engine()
    idx = PrefixIndex(block_size=16)
    prompt = list(range(100, 164))
    e.add_request("a", prompt, 4)
    for s in drain(e):
        if s.events is not None:
            idx.apply(0, s.events)
    assert idx.match_tokens(prompt) == {0: (4, 0)}
    assert idx.match_tokens(prompt, salt="other") == {}


def test_resent_prompt_reports_cached_tokens() -> None:
    e = small_engine()
    prompt = list(range(64))
    e.add_request("a", prompt, 1)
    drain(e)
    e.add_request("b", prompt, 1)
    (out,) = e.step(1.0).outputs
    assert out[4] == 48  # capped at num_tokens - 1, block aligned
    assert e.metrics()["prefix_cache_hits"] == 48.0


def test_abort_and_reset() -> None:
    e = small_engine()
    e.add_request("a", list(range(200)), 10)
    assert e.step(0.0).seq == 0
    assert e.abort("a")
    assert not e.abort("a")
    r = e.step(1.0)
    assert r.outputs == [("a", [], True, "abort", 0, 200)]
    assert not e.has_work()
    e.add_request("b", list(range(500, 520)), 1)
    assert e.step(2.0).seq == 1
    e.reset()
    e.add_request("b", list(range(500, 520)), 1)
    assert e.step(3.0).seq == 0
    assert e.metrics()["steps"] == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"preset": "gpt-17"},
        {"block_size": 0},
        {"block_size": -16},
        {"num_gpu_blocks": 1},
        {"num_cpu_blocks": -1},
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": -1},
        {"hash_algo": "md5"},
        {"vocab_size": 0},
        {"seed": -1},
    ],
)
def test_bad_config_raises_invalid_argument(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        SimEngine(**kwargs)


def test_bad_requests_raise_invalid_argument() -> None:
    e = small_engine()
    e.add_request("a", [1, 2, 3], 1)
    with pytest.raises(InvalidArgumentError, match="already"):
        e.add_request("a", [1], 1)
    for prompt, max_tokens in [([], 1), ([1], 0), ([1], -2), ([128_000], 1), ([1] * 5000, 1)]:
        with pytest.raises(InvalidArgumentError):
            e.add_request("x", prompt, max_tokens)
    with pytest.raises(InvalidArgumentError):
        e.add_request("x", [1], 1, eos_token_id=-1)
    with pytest.raises(TypeError):
        e.add_request("x", "not tokens", 1)  # type: ignore[arg-type]


def test_step_result_is_frozen() -> None:
    r = small_engine().step(0.0)
    assert r.outputs == []
    assert r.duration_s == 0.0
    assert r.events is None
    with pytest.raises(AttributeError):
        r.duration_s = 1.0  # type: ignore[misc]


@pytest.mark.skipif(not TRACE.is_file(), reason="shared/traces not present")
def test_replay_mooncake_small_prefix_is_deterministic() -> None:
    kw: dict[str, Any] = {"limit": 60, "preset": "dynamo-mocker", "replicas": 4}
    a = replay_mooncake(str(TRACE), **kw)
    b = replay_mooncake(str(TRACE), **kw)
    assert a["num_requests"] == 60
    assert a["requests_per_replica"] == [15, 15, 15, 15]
    assert isinstance(a["num_requests"], int)
    assert isinstance(a["mean_ttft_ms"], float)
    a.pop("wall_time_s")
    b.pop("wall_time_s")
    assert a == b
    assert 0 < float(a["p50_ttft_ms"]) <= float(a["p99_ttft_ms"])  # type: ignore[arg-type]
    with pytest.raises(UnknownPolicyError):
        replay_mooncake(str(TRACE), policy="nope", limit=5)
    with pytest.raises(InvalidArgumentError):
        replay_mooncake(str(TRACE), replicas=-1, limit=5)
    with pytest.raises(InvalidArgumentError):
        replay_mooncake("/nonexistent/trace.jsonl")
