"""Faults end to end: the router keeps serving, streams end cleanly, the index is repaired, and
the scheduler's ledger always returns to zero."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from tests.serve_support import RouterThread, router_config, wait_until

pytestmark = pytest.mark.timeout(120)

MODEL = "kvroute-sim"


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def ok(r: RouterThread, body: dict[str, Any]) -> httpx.Response:
    resp = httpx.post(r.base_url + "/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp


def engine(r: RouterThread, name: str) -> dict[str, Any]:
    for b in r.status()["backends"]:
        if b["name"] == name:
            e: dict[str, Any] = b["engines"][0]
            return e
    raise KeyError(name)


def healthy(r: RouterThread) -> dict[str, bool]:
    return {b["name"]: b["healthy"] for b in r.status()["backends"]}


def metric(r: RouterThread, prefix: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(r.url + "/metrics").text.splitlines()
        if line.startswith(prefix)
    )


def test_backend_killed_mid_stream() -> None:
    with RouterThread(router_config(sim=2, sim_time_scale=1.0)) as r:
        body = chat("tell me a long story", max_tokens=1000, stream=True)
        with httpx.stream("POST", r.base_url + "/chat/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            victim = resp.headers["x-kvroute-backend"]
            lines = resp.iter_lines()
            data: list[str] = []
            for line in lines:
                if line.startswith("data: "):
                    data.append(line)
                if len(data) == 3:
                    break
            r.fault(int(victim[-1]), "crash", 1.5)  # down, restarted 1.5 s later
            data += [line for line in lines if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        error = json.loads(data[-2][len("data: ") :])["error"]
        assert error["code"] == 502
        assert "mid-stream" in error["message"]
        r.wait_idle()
        # The router keeps serving on the other engine while the victim is down...
        wait_until(lambda: not healthy(r)[victim])
        for i in range(4):
            assert ok(r, chat(f"meanwhile {i}", max_tokens=3)).headers["x-kvroute-backend"] != victim
        # ...and routes to it again once it is back, its index resynced.
        resyncs = engine(r, victim)["events"]["resyncs"]
        wait_until(lambda: healthy(r)[victim], 10)
        wait_until(lambda: engine(r, victim)["events"]["resyncs"] > resyncs)
        assert metric(r, "kvroute_stream_errors_total") == 1
        r.wait_idle()


def test_backend_restart_resyncs_its_index() -> None:
    with RouterThread(router_config(sim=1)) as r:
        history = [{"role": "system", "content": "restart test " + "lorem ipsum " * 300}]
        tokens = r.prompt_tokens(history)
        ok(r, {"model": MODEL, "messages": history, "max_tokens": 2})
        wait_until(lambda: r.cached_blocks("sim-0", tokens) >= len(tokens) // 64)
        r.fault(0, "restart")  # empty cache, event sequence back to 0, no event about it
        # The next batch the engine publishes starts a new sequence: the index drops the old entries.
        resp = ok(
            r, {"model": MODEL, "messages": [*history, {"role": "user", "content": "again"}], "max_tokens": 2}
        )
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the engine forgot
        wait_until(lambda: engine(r, "sim-0")["events"]["resyncs"] >= 2)
        assert r.status()["backends"][0]["engines"][0]["events"]["last_seq"] < 5
        wait_until(lambda: r.cached_blocks("sim-0", tokens) >= len(tokens) // 64)  # re-learned
        r.wait_idle()


def test_dropped_event_batches_are_replayed() -> None:
    with RouterThread(router_config(sim=1, speculative_ttl_s=0.0)) as r:
        ok(r, chat("warm up " * 40, max_tokens=2))
        wait_until(lambda: engine(r, "sim-0")["events"]["batches"] > 0)
        r.fault(0, "drop", 1.0)  # batches are numbered and buffered but not sent
        prompts = [[{"role": "user", "content": f"dropped {i} " + "words " * 100}] for i in range(3)]
        for p in prompts:
            ok(r, {"model": MODEL, "messages": p, "max_tokens": 2})
        assert all(r.cached_blocks("sim-0", r.prompt_tokens(p)) == 0 for p in prompts)
        r.fault(0, "drop", 0.0)
        ok(r, chat("after the drop " * 40, max_tokens=2))  # its batch reveals the gap
        wait_until(lambda: engine(r, "sim-0")["events"]["gaps"] == 1)
        for p in prompts:
            tokens = r.prompt_tokens(p)
            wait_until(lambda t=tokens: r.cached_blocks("sim-0", t) >= len(t) // 64)
        ev = engine(r, "sim-0")["events"]
        assert ev["replays"] >= 2
        assert ev["resyncs"] == 1  # only the one at connect: the gap was filled, not resynced
        assert metric(r, "kvroute_kv_event_missed_batches_total") >= 3
        r.wait_idle()


def test_backend_503_is_retried_elsewhere_then_recovers() -> None:
    config = router_config(sim=2, policy="round_robin", health_interval_s=30.0, metrics_interval_s=0.0)
    with RouterThread(config) as r:
        r.fault(0, "unavailable", 2.0)
        for i in range(6):
            assert ok(r, chat(f"q{i}", max_tokens=2)).headers["x-kvroute-backend"] == "sim-1"
        assert metric(r, 'kvroute_upstream_retries_total{backend="sim-0",reason="http_503"}') >= 3
        r.wait_idle()


def test_unhealthy_backend_is_skipped_and_comes_back() -> None:
    with RouterThread(router_config(sim=2)) as r:
        r.fault(0, "unavailable", 1.0)
        wait_until(lambda: not healthy(r)["sim-0"])
        assert all(
            ok(r, chat(f"x{i}", max_tokens=2)).headers["x-kvroute-backend"] == "sim-1" for i in range(4)
        )
        wait_until(lambda: healthy(r)["sim-0"], 10)
        r.wait_idle()


def test_client_disconnect_mid_stream_releases_and_aborts_upstream() -> None:
    with RouterThread(router_config(sim=1, sim_time_scale=1.0)) as r:
        body = chat("a very long answer please", max_tokens=2000, stream=True)
        with httpx.stream("POST", r.base_url + "/chat/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert r.ledger() == (1, 1)
        # The client hung up: the reservation is released and the engine stops the request.
        r.wait_idle()
        wait_until(lambda: engine(r, "sim-0")["engine_metrics"]["running"] == 0)
        assert metric(r, "kvroute_client_disconnects_total") == 1
        assert ok(r, chat("still serving", max_tokens=2))


def test_connection_refused_is_retried_and_marks_the_backend_down() -> None:
    with RouterThread(router_config(sim=1, policy="round_robin", health_interval_s=30.0)) as r:
        fake = r.add_fake()
        assert (
            r.admin(
                "POST", "/admin/backends", json={"url": fake.url, "name": "dead", "events": "none"}
            ).status_code
            == 201
        )
        wait_until(lambda: r.status()["backends"][1]["models"] == [MODEL])  # polled once, healthy
        r.run(fake.aclose())  # its port now refuses connections; the next health poll is 30 s away
        for i in range(4):
            assert ok(r, chat(f"c{i}", max_tokens=2)).headers["x-kvroute-backend"] == "sim-0"
        assert not healthy(r)["dead"]
        assert metric(r, 'kvroute_upstream_retries_total{backend="dead",reason="connect"}') == 1
        assert r.admin("DELETE", "/admin/backends/dead").status_code == 200
        r.wait_idle()


def test_no_first_byte_in_time_is_retried_and_all_failing_is_an_error() -> None:
    with RouterThread(router_config(first_byte_timeout_s=0.5, policy="round_robin", max_retries=1)) as r:
        slow = r.add_fake(delay_s=3.0)
        fast = r.add_fake()
        for name, fake in (("slow", slow), ("fast", fast)):
            r.admin(
                "POST", "/admin/backends", json={"url": fake.url, "name": name, "events": "none"}
            ).raise_for_status()
        for i in range(4):
            resp = ok(r, chat(f"t{i}", stream=True))
            assert resp.headers["x-kvroute-backend"] == "fast"
            assert resp.text.endswith("data: [DONE]\n\n")
        assert metric(r, 'kvroute_upstream_retries_total{backend="slow",reason="timeout"}') >= 1
        fast.status = 500
        resp = httpx.post(r.base_url + "/chat/completions", json=chat("doomed", stream=True), timeout=30)
        assert resp.status_code in (500, 504)
        assert "all backends failed" in resp.json()["error"]["message"]
        r.wait_idle()


def test_openai_client_sees_a_clean_error_when_the_stream_breaks() -> None:
    with RouterThread(router_config()) as r:
        fake = r.add_fake(chunks=10, die_after=3)
        r.admin("POST", "/admin/backends", json={"url": fake.url, "events": "none"}).raise_for_status()

        async def main() -> tuple[str, str]:
            async with openai.AsyncOpenAI(base_url=r.base_url, api_key="x", max_retries=0) as c:
                text = ""
                stream = await c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True
                )
                try:
                    async for chunk in stream:
                        text += chunk.choices[0].delta.content or ""
                except openai.APIError as e:
                    return text, e.message
                return text, ""

        text, error = asyncio.run(asyncio.wait_for(main(), 30))
        assert text == "t0 t1 t2 "
        assert "mid-stream" in error
        r.wait_idle()
