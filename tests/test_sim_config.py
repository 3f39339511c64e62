"""Simulator configuration, fault specs, request parsing and metrics rendering (no engine)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvroute.sim.cli import add_parser, config_from_args
from kvroute.sim.config import ConfigError, EngineConfig, SimConfig
from kvroute.sim.faults import FaultError, FaultSpec, FaultState
from kvroute.sim.metrics import ReplicaStats, render
from kvroute.sim.protocol import ApiError, parse_chat, parse_completion
from kvroute.sim.responses import Usage, sse


def sim_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    add_parser(sub)
    return p.parse_args(["sim", *argv])


def test_port_convention() -> None:
    c = SimConfig(replicas=3)
    assert [c.http_port(i) for i in range(3)] == [8000, 8001, 8002]
    assert c.events_endpoint(2) == "tcp://*:5559"
    assert c.replay_endpoint(2) == "tcp://*:5659"
    free = SimConfig(base_port=0, kv_events_port_base=0, replay_port_base=0)
    assert free.http_port(5) == 0
    assert free.events_endpoint(0) == free.replay_endpoint(0) == "tcp://127.0.0.1:*"
    assert SimConfig(kv_events_host="::1").events_endpoint(0) == "tcp://[::1]:5557"
    shared = SimConfig(replicas=2, kv_events_endpoint="tcp://127.0.0.1:6000")
    assert shared.events_endpoint(1) == "tcp://127.0.0.1:6000"
    assert SimConfig(kv_events_endpoint="ipc:///tmp/kv-{replica}").events_endpoint(3) == "ipc:///tmp/kv-3"
    assert SimConfig(kv_events=False).events_endpoint(0) is None
    assert SimConfig(replay_port_base=None).replay_endpoint(0) is None


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"replicas": 0}, "replicas"),
        ({"time_scale": 0.0}, "time_scale"),
        ({"time_scale": float("nan")}, "time_scale"),
        ({"base_port": 65535, "replicas": 2}, "base_port"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"engine": EngineConfig(hash_algo="md5")}, "hash_algo"),
        ({"engine": EngineConfig(block_size=0)}, "block_size"),
        ({"engine": EngineConfig(num_cpu_blocks=-1)}, "num_cpu_blocks"),
        ({"faults": (FaultSpec("restart", replica=3),)}, "no replica 3"),
        ({"model": " "}, "model"),
        ({"engine": EngineConfig(preset="h200-dreams")}, "preset"),
    ],
)
def test_invalid_configs_name_the_setting(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SimConfig(**changes)  # type: ignore[arg-type]


def test_env_then_flags() -> None:
    env = {"KVROUTE_SIM_REPLICAS": "3", "KVROUTE_SIM_NUM_GPU_BLOCKS": "64", "KVROUTE_SIM_LEGACY_EVENTS": "1"}
    c = SimConfig.from_env(env, replicas=2, model="m", hash_seed=None)
    assert (c.replicas, c.engine.num_gpu_blocks, c.legacy_events, c.model) == (2, 64, True, "m")
    with pytest.raises(ConfigError, match="KVROUTE_SIM_REPLICAS"):
        SimConfig.from_env({"KVROUTE_SIM_REPLICAS": "two"})


def test_cli_flags_to_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_SIM_TIME_SCALE", "10")
    args = sim_args(
        "--replicas", "2", "--base-port", "9000", "--model", "m", "--block-size", "32",
        "--hash-algo", "sha256_cbor", "--legacy-events", "--fault", "drop=0.5", "--fault", "crash=2@5/1",
    )  # fmt: skip
    c = config_from_args(args)
    assert (c.replicas, c.base_port, c.model, c.time_scale) == (2, 9000, "m", 10.0)
    assert (c.engine.block_size, c.engine.hash_algo, c.legacy_events) == (32, "sha256_cbor", True)
    assert c.faults == (FaultSpec("drop", 0.5), FaultSpec("crash", 2.0, 5.0, 1))
    assert config_from_args(sim_args()).kv_events is True
    assert config_from_args(sim_args("--no-kv-events")).kv_events is False


def test_fault_specs() -> None:
    assert FaultSpec.parse("stall=3@10/2") == FaultSpec("stall", 3.0, 10.0, 2)
    assert str(FaultSpec.parse("crash=5@20/1")) == "crash=5@20/1"
    for bad in ("explode", "drop", "drop=2", "stall=x", "restart@-1", "drop=0.1@"):
        with pytest.raises(FaultError):
            FaultSpec.parse(bad)


def test_fault_state_drops_deterministically() -> None:
    a, b = FaultState(seed=1), FaultState(seed=1)
    a.drop_fraction = b.drop_fraction = 0.3
    da = [a.should_drop() for _ in range(200)]
    assert da == [b.should_drop() for _ in range(200)]
    assert 30 < sum(da) < 90
    assert a.dropped_batches == sum(da)
    a.crashed = True
    assert a.unavailable(0.0)


def bad(fn: object, body: object, match: str, status: int = 400) -> None:
    with pytest.raises(ApiError, match=match) as info:
        fn(body)  # type: ignore[operator]
    assert info.value.status == status
    err = info.value.body()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status


def test_completion_parsing() -> None:
    r = parse_completion({"prompt": "hi", "model": "m"})
    assert (r.prompts, r.sampling.max_tokens, r.add_special_tokens) == (("hi",), 16, True)
    assert parse_completion({"prompt": [1, 2, 3]}).prompts == ((1, 2, 3),)
    assert parse_completion({"prompt": ["a", [4, 5]]}).prompts == ("a", (4, 5))
    s = parse_completion({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}).sampling
    assert s.stream
    assert s.include_usage
    bad(parse_completion, [], "JSON object")
    bad(parse_completion, {"prompt": 3}, "prompt")
    bad(parse_completion, {"prompt": []}, "prompt")
    bad(parse_completion, {"prompt": ""}, "empty")
    bad(parse_completion, {"prompt": [1, -2]}, "negative")
    bad(parse_completion, {"prompt": [[1, True]]}, "token ids")
    bad(parse_completion, {"prompt": "x", "n": 2}, "n=1")
    bad(parse_completion, {"prompt": "x", "echo": True}, "echo")
    bad(parse_completion, {"prompt": "x", "max_tokens": 0}, "max_tokens")
    bad(parse_completion, {"prompt": "x", "max_tokens": "5"}, "max_tokens")
    bad(parse_completion, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream=True")


def test_chat_parsing_and_reused_prompt_token_ids() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    r = parse_chat({"messages": msgs, "max_completion_tokens": 7})
    assert (r.sampling.max_tokens, r.reused_prompt_token_ids, r.add_special_tokens) == (7, None, False)
    kv = {"kv_transfer_params": {"prompt_token_ids": [0, 5, 6]}}
    assert parse_chat({"messages": msgs, **kv}).reused_prompt_token_ids == (0, 5, 6)
    # vLLM ignores the ids with echo, or with non-text parts.
    assert parse_chat({"messages": msgs, "echo": True, **kv}).reused_prompt_token_ids is None
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]
    assert parse_chat({"messages": image, **kv}).reused_prompt_token_ids is None
    bad(parse_chat, {"messages": msgs, "kv_transfer_params": {"prompt_token_ids": ["a"]}}, "prompt_token_ids")
    bad(parse_chat, {"messages": msgs, "kv_transfer_params": {"prompt_token_ids": []}}, "empty")
    bad(parse_chat, {"messages": []}, "messages")
    bad(parse_chat, {"messages": msgs, "n": 3}, "n=1")
    bad(parse_chat, {"messages": msgs, "tools": [1]}, "tools")


def test_metrics_render_vllm_names() -> None:
    stats = ReplicaStats()
    stats.finished["length"] += 2
    stats.ttft.observe(0.03)
    stats.ttft.observe(3.0)
    engine = {
        "running": 1.0, "waiting": 2.0, "kv_cache_usage": 0.25, "prefix_cache_queries": 64.0,
        "prefix_cache_hits": 32.0, "preemptions": 0.0,
    }  # fmt: skip
    info = {"block_size": 16, "prefix_caching_hash_algo": "sha256", "num_gpu_blocks": 100}
    text = render(model="m", engine=engine, cache_info=info, stats=stats)
    lines = text.splitlines()
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 1.0' in lines
    assert 'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0' in lines
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25' in lines
    assert "# TYPE vllm:prefix_cache_queries counter" in lines
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 32.0' in lines
    assert 'vllm:request_success_total{engine="0",model_name="m",finished_reason="length"} 2.0' in lines
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",model_name="m",le="0.04"} 1.0' in lines
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",model_name="m",le="+Inf"} 2.0' in lines
    assert 'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 2.0' in lines
    assert (
        'vllm:cache_config_info{engine="0",model_name="m",block_size="16",'
        'prefix_caching_hash_algo="sha256",num_gpu_blocks="100"} 1.0'
    ) in lines


def test_sse_and_usage() -> None:
    u = Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=8)
    assert u.body() == {
        "prompt_tokens": 10,
        "total_tokens": 13,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    frame = sse({"a": "é"})
    assert frame.startswith(b"data: ")
    assert frame.endswith(b"\n\n")
    assert json.loads(frame[6:]) == {"a": "é"}
