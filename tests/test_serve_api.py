"""`kvroute serve` end to end over loopback: the real `openai` client against a router in front of
simulated vLLM engines; the body reaches the backend unchanged; monitoring and admin routes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from tests.serve_support import RouterThread, router_config, wait_until

pytestmark = pytest.mark.timeout(120)

MODEL = "kvroute-sim"


@pytest.fixture(scope="module")
def router() -> Iterator[RouterThread]:
    with RouterThread(router_config(sim=3)) as r:
        wait_until(lambda: all(b["engines"][0]["events"]["connected"] for b in r.status()["backends"]))
        yield r


@pytest.fixture
def client(router: RouterThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_models_and_health(router: RouterThread, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(router.url + "/health", timeout=10)
    assert r.status_code == 200
    assert r.json()["healthy_backends"] == 3


def test_chat_non_streaming(router: RouterThread, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
    )
    assert r.choices[0].message.content
    assert r.usage is not None
    assert r.usage.completion_tokens == 8
    router.wait_idle()


def test_chat_streaming_with_usage(router: RouterThread, client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to five."}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    text = ""
    usage = None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text
    assert usage is not None
    assert usage.completion_tokens == 12
    router.wait_idle()


def test_completions_streaming_and_not(router: RouterThread, client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert r.choices[0].text
    pieces = [
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=5, stream=True)
    ]
    assert "".join(pieces)
    router.wait_idle()


def test_async_client_concurrent_streams(router: RouterThread) -> None:
    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0) as c:

            async def one(i: int) -> str:
                s = await c.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"question {i}"}],
                    max_tokens=6,
                    stream=True,
                )
                return "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])

            return await asyncio.gather(*(one(i) for i in range(12)))

    texts = asyncio.run(asyncio.wait_for(main(), 60))
    assert all(texts)
    router.wait_idle()


def test_response_headers_name_the_backend_and_echo_the_request_id(router: RouterThread) -> None:
    r = httpx.post(
        router.base_url + "/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"x-request-id": "req-123"},
        timeout=30,
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "req-123"
    assert r.headers["x-kvroute-backend"] in {"sim-0", "sim-1", "sim-2"}
    assert r.json()["id"].endswith("req-123")  # the sim names its response after the request id


def test_body_reaches_the_backend_unchanged() -> None:
    with RouterThread(router_config()) as r:  # no backends until the admin API adds one
        fake = r.add_fake()
        added = r.admin("POST", "/admin/backends", json={"url": fake.url, "name": "fake", "events": "none"})
        assert added.status_code == 201, added.text
        raw = b'{"model":"kvroute-sim",  "messages":[{"role":"user","content":"x \\u00e9"}],'
        raw += b'"top_k":7,"x_extra":[1,2]}'
        resp = httpx.post(
            r.base_url + "/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvroute-backend"] == "fake"
        headers, body = fake.received[-1]
        assert body == raw
        assert headers["x-request-id"] == resp.headers["x-request-id"]
        assert "x-data-parallel-rank" not in headers


def test_data_parallel_ranks_are_pinned_by_header() -> None:
    with RouterThread(router_config()) as r:
        fake = r.add_fake()
        added = r.admin("POST", "/admin/backends", json={"spec": f"{fake.url};dp=2;events=none"})
        assert added.status_code == 201, added.text
        assert [e["rank"] for e in added.json()["engines"]] == [0, 1]
        for i in range(12):
            body = {"model": "kvroute-sim", "messages": [{"role": "user", "content": f"q{i}"}]}
            assert httpx.post(r.base_url + "/chat/completions", json=body).status_code == 200
        assert {h["x-data-parallel-rank"] for h, _ in fake.received} == {"0", "1"}
        r.wait_idle()


def test_lora_requests_are_hashed_with_the_adapter_name() -> None:
    with RouterThread(router_config(model="base")) as r:
        fake = r.add_fake(model="base", loras=("my-adapter",))
        r.admin(
            "POST", "/admin/backends", json={"url": fake.url, "name": "fake", "events": "none"}
        ).raise_for_status()
        wait_until(lambda: r.status()["backends"][0]["loras"] == ["my-adapter"])
        messages = [{"role": "user", "content": "adapter prompt " * 40}]
        resp = httpx.post(
            r.base_url + "/chat/completions", json={"model": "my-adapter", "messages": messages}
        )
        assert resp.status_code == 200, resp.text
        tokens = r.prompt_tokens(messages)
        index = r.router.state.fleet.index
        # The routed prefix is speculated under the adapter's hash chain, not the base model's.
        assert r.call(lambda: index.match_tokens(tokens, lora="my-adapter"))
        assert not r.call(lambda: index.match_tokens(tokens))
        other = httpx.post(
            r.base_url + "/chat/completions", json={"model": "other-adapter", "messages": messages}
        )
        assert other.status_code == 404


def test_metrics_and_status(router: RouterThread, client: openai.OpenAI) -> None:
    for _ in range(3):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "metrics " * 40}], max_tokens=2
        )
    text = httpx.get(router.url + "/metrics", timeout=10).text
    for name in (
        'kvroute_requests_total{backend="sim-',
        'kvroute_routing_overhead_seconds_bucket{le="0.001",stage="tokenize"}',
        'kvroute_routing_overhead_seconds_count{stage="decide"}',
        'kvroute_routing_overhead_seconds_count{stage="total"}',
        "kvroute_actual_cached_tokens_total",
        "kvroute_predicted_cached_tokens_total",
        'kvroute_backend_active_requests{backend="sim-0",rank="0"}',
        "kvroute_backend_index_entries",
        "kvroute_backend_kv_event_lag_seconds",
        "kvroute_kv_event_gaps_total",
        "kvroute_kv_event_replays_total",
        "kvroute_kv_event_resyncs_total",
        "kvroute_scheduler_expired_total",
        "kvroute_index_entries",
    ):
        assert name in text, name
    s = router.status()
    assert s["tokenizer"]["backend"] == "fastokens"
    assert s["scheduler"]["counters"]["decisions"] >= 3
    assert s["recent_decisions"][0]["backend"].startswith("sim-")
    assert {b["name"] for b in s["backends"]} == {"sim-0", "sim-1", "sim-2"}
    assert sum(b["cache_share"] for b in s["backends"]) == pytest.approx(1.0, abs=0.01)
    page = httpx.get(router.url + "/", timeout=10)
    assert page.headers["content-type"].startswith("text/html")
    assert "kvroute" in page.text
    assert 'fetch("status")' in page.text


def test_admin_routes(router: RouterThread) -> None:
    assert httpx.get(router.url + "/admin/backends").status_code == 401
    assert router.admin("GET", "/admin/backends").json()["backends"][0]["name"] == "sim-0"
    assert router.admin("POST", "/admin/backends", json={"url": "ftp://x"}).status_code == 400
    assert (
        router.admin("POST", "/admin/backends", json={"url": router.sim_urls[0], "name": "dup"}).status_code
        == 409
    )
    assert router.admin("DELETE", "/admin/backends/nope").status_code == 404
    r = router.admin("POST", "/admin/backends", content=b"{")
    assert r.status_code == 400
    assert json.loads(r.content)["error"]["type"] == "BadRequestError"
