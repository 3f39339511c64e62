"""Router pieces without sockets: vLLM metrics parsing, admission limits, request schema."""

from __future__ import annotations

import asyncio

import pytest
from tests.router_support import async_test

from kvroute.health import parse_vllm_metrics
from kvroute.server.limits import Busy, Limiter

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 1.5
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="2048",num_cpu_blocks="None"} 1.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0
"""


def test_parse_vllm_metrics_per_engine() -> None:
    m = parse_vllm_metrics(VLLM_METRICS)
    assert (m[0].running, m[0].waiting, m[0].kv_usage) == (3, 7, 0.42)
    assert (m[0].num_gpu_blocks, m[0].num_cpu_blocks) == (2048, None)
    assert (m[1].running, m[1].waiting, m[1].kv_usage) == (1, 0, 1.0)  # clamped


def test_parse_vllm_metrics_without_engine_label() -> None:
    m = parse_vllm_metrics('vllm:num_requests_running{model_name="m"} 2\ngarbage line\n')
    assert list(m) == [0]
    assert m[0].running == 2


@async_test()
async def test_limiter_queues_then_rejects() -> None:
    lim = Limiter(max_concurrency=1, max_queue=1, queue_timeout_s=5)
    await lim.acquire()
    waiter = asyncio.create_task(lim.acquire())
    await asyncio.sleep(0.01)
    assert (lim.active, lim.waiting) == (1, 1)
    with pytest.raises(Busy):
        await lim.acquire()  # queue full
    lim.release()
    await waiter
    assert (lim.active, lim.waiting, lim.rejected) == (1, 0, 1)
    lim.release()
    assert lim.active == 0


@async_test()
async def test_limiter_queue_timeout_and_unlimited() -> None:
    lim = Limiter(max_concurrency=1, max_queue=5, queue_timeout_s=0.05)
    await lim.acquire()
    with pytest.raises(Busy):
        await lim.acquire()
    assert (lim.active, lim.waiting) == (1, 0)
    free = Limiter(0, 0, 1)
    for _ in range(100):
        await free.acquire()
    assert free.active == 100


def test_json_logs_carry_the_decision(capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import logging

    from kvroute import logs

    logs.configure("debug", "json")
    try:
        logging.getLogger("kvroute.proxy").debug(
            "route %s", "r1", extra={"decision": {"backend": "b", "score": 0.5}}
        )
        line = capsys.readouterr().err.strip().splitlines()[-1]
        record = json.loads(line)
        assert (record["level"], record["logger"], record["message"]) == (
            "debug",
            "kvroute.proxy",
            "route r1",
        )
        assert record["decision"] == {"backend": "b", "score": 0.5}
    finally:
        logging.getLogger("kvroute").handlers.clear()
        logging.getLogger("kvroute").propagate = True
        logging.getLogger("kvroute").setLevel(logging.NOTSET)
