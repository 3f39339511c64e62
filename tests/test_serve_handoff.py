"""The token handoff end to end: router -> ZMQ -> kvroute.vllm middleware in ``kvroute sim``.

The simulator serves every request through the same middleware real vLLM loads, and counts the
prompts it had to template or tokenize (``kvroute_sim:tokenized_requests_total``) and the chat
requests served from ``kv_transfer_params.prompt_token_ids``. Each failure case must fall back
to ordinary tokenization with the request succeeding. Real sockets and HTTP on 127.0.0.1 only.
"""

from __future__ import annotations

import time
from array import array
from typing import Any

import httpx
import pytest
import zmq

from serve_support import RouterThread, router_config, wait_until
from sim_support import ClusterThread, metric, sim_config

MODEL = "sim-model"


def chat(text: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 3}


def handoff_stat(url: str, name: str) -> float:
    return metric(url, f"kvroute_sim:handoff_{name}_total")


def tokenized(url: str) -> float:
    return metric(url, "kvroute_sim:tokenized_requests_total")


def router_counts(r: RouterThread) -> dict[str, int]:
    counts = r.call(lambda: dict(r.router.state.fleet.handoff.counts))
    out: dict[str, int] = {}
    for (_, result), n in counts.items():
        out[result] = out.get(result, 0) + n
    return out


def wait_channels(r: RouterThread) -> None:
    wait_until(lambda: all(b["token_handoff"] for b in r.status()["backends"]), 10, r.status)


def test_tokens_arrive_and_are_used() -> None:
    with RouterThread(router_config(sim=2, model=MODEL)) as r:
        wait_channels(r)
        for i in range(3):
            body = chat(f"question number {i}: what is a KV cache?")
            resp = httpx.post(r.base_url + "/chat/completions", json=body, timeout=10)
            assert resp.status_code == 200
            assert resp.json()["usage"]["prompt_tokens"] > 5
            body = {"model": MODEL, "prompt": f"Once upon a time {i}", "max_tokens": 3, "stream": True}
            with httpx.stream("POST", r.base_url + "/completions", json=body, timeout=10) as s:
                assert s.status_code == 200
                assert b"[DONE]" in b"".join(s.iter_bytes())
        urls = r.sim_urls
        assert sum(tokenized(u) for u in urls) == 0  # the engines never tokenized
        assert sum(metric(u, "kvroute_sim:reused_prompt_token_ids_requests_total") for u in urls) == 3
        assert sum(handoff_stat(u, "used") for u in urls) == 6
        assert router_counts(r) == {"sent": 6}
        text = httpx.get(r.url + "/metrics", timeout=10).text
        assert 'kvroute_token_handoff_total{backend="sim-0",result="sent"}' in text


def test_ineligible_prompts_are_not_handed_off() -> None:
    with RouterThread(router_config(sim=1, model=MODEL)) as r:
        wait_channels(r)
        ids = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 2}
        assert httpx.post(r.base_url + "/completions", json=ids, timeout=10).status_code == 200
        given = chat("hi") | {"kv_transfer_params": {"prompt_token_ids": [5, 6, 7]}}
        assert httpx.post(r.base_url + "/chat/completions", json=given, timeout=10).status_code == 200
        assert router_counts(r) == {"skipped": 2}
        assert handoff_stat(r.sim_urls[0], "used") == 0


def test_receiver_down_falls_back() -> None:
    with RouterThread(router_config(sim=1, model=MODEL)) as r:
        wait_channels(r)
        url = r.sim_urls[0]
        replica = r.router.sim.replicas[0]  # type: ignore[union-attr]
        assert replica.handoff is not None
        r.run(replica.handoff.aclose())
        for i in range(20):
            resp = httpx.post(r.base_url + "/chat/completions", json=chat(f"still there {i}?"), timeout=10)
            assert resp.status_code == 200
            if router_counts(r).get("would_block"):
                break
            time.sleep(0.05)
        # Once the connection is seen gone nothing is queued for the dead channel; before that,
        # a key may still have been sent, which the engine (channel closed) ignored.
        assert router_counts(r).get("would_block", 0) >= 1
        assert tokenized(url) == i + 1
        assert handoff_stat(url, "used") == 0


@pytest.fixture
def cluster() -> Any:
    config = sim_config(replicas=1, handoff_wait_s=0.05, handoff_ttl_s=30.0)
    with ClusterThread(config) as c:
        yield c


class Engine:
    """Direct access to one sim replica's handoff channel (a PUSH socket) and HTTP API."""

    def __init__(self, url: str) -> None:
        self.url = url
        info = httpx.get(url + "/kvroute/handoff", timeout=10).json()
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(info["endpoint"])

    def close(self) -> None:
        self.push.close(0)
        self.ctx.term()

    def send(self, key: str, payload: bytes) -> None:
        self.push.send_multipart([key.encode(), payload])

    def stored(self) -> int:
        stored: int = httpx.get(self.url + "/kvroute/handoff", timeout=10).json()["stored"]
        return stored

    def post(self, key: str, count: int | None = None, text: str = "hello there") -> httpx.Response:
        headers = {"x-kvroute-token-key": key}
        if count is not None:
            headers["x-kvroute-token-count"] = str(count)
        resp = httpx.post(self.url + "/v1/chat/completions", json=chat(text), headers=headers, timeout=10)
        assert resp.status_code == 200
        return resp


def ids(n: int) -> bytes:
    return array("I", range(100, 100 + n)).tobytes()


def test_direct_handoff_used(cluster: ClusterThread) -> None:
    e = Engine(cluster.urls[0])
    try:
        e.send("k", ids(12))
        wait_until(lambda: e.stored() == 1, 5)
        resp = e.post("k", 12)
        assert resp.headers["x-kvroute-handoff"] == "used"
        assert resp.json()["usage"]["prompt_tokens"] == 12
        assert tokenized(e.url) == 0
    finally:
        e.close()


def test_late_tokens_fall_back(cluster: ClusterThread) -> None:
    e = Engine(cluster.urls[0])
    try:
        resp = e.post("late-key", 12)  # waits 50 ms for tokens that have not been sent
        assert resp.headers["x-kvroute-handoff"] == "missing"
        e.send("late-key", ids(12))
        wait_until(lambda: handoff_stat(e.url, "late") == 1, 5)
        assert e.stored() == 0  # late tokens are dropped, not kept until their TTL
        assert tokenized(e.url) == 1
    finally:
        e.close()


@pytest.mark.parametrize(("payload", "count"), [(ids(11), 12), (ids(12)[:-1], None), (b"", 0)])
def test_wrong_length_payloads_fall_back(cluster: ClusterThread, payload: bytes, count: int | None) -> None:
    e = Engine(cluster.urls[0])
    try:
        e.send("bad", payload)
        wait_until(lambda: e.stored() == 1, 5)
        resp = e.post("bad", count)
        assert resp.headers["x-kvroute-handoff"] == "malformed"
        assert handoff_stat(e.url, "malformed") == 1
        assert tokenized(e.url) == 1
    finally:
        e.close()


def test_stale_keys_fall_back() -> None:
    with ClusterThread(sim_config(replicas=1, handoff_ttl_s=0.3)) as cluster:
        stale_key(cluster)


def stale_key(cluster: ClusterThread) -> None:
    e = Engine(cluster.urls[0])
    try:
        e.send("old", ids(12))
        wait_until(lambda: e.stored() == 1, 5)
        time.sleep(0.4)  # past the 0.3 s TTL
        resp = e.post("old", 12)
        assert resp.headers["x-kvroute-handoff"] == "missing"
        assert handoff_stat(e.url, "stale") == 1
        assert tokenized(e.url) == 1
    finally:
        e.close()


def test_store_full_falls_back_through_the_router() -> None:
    """The engine's store holds 2 entries; two orphans fill it, so the router's tokens are refused
    and its request is tokenized by the engine -- and still succeeds."""
    config = sim_config(replicas=1, handoff_wait_s=0.05, handoff_ttl_s=60, handoff_max_entries=2)
    with ClusterThread(config) as cluster:
        store_full_through_router(cluster)


def store_full_through_router(cluster: ClusterThread) -> None:
    e = Engine(cluster.urls[0])
    url = cluster.urls[0]
    events, replay = cluster.cluster.event_endpoints[0], cluster.cluster.replay_endpoints[0]
    backend = f"{url};events={events};replay={replay};name=e0"
    try:
        e.send("orphan-1", ids(4))
        e.send("orphan-2", ids(4))
        wait_until(lambda: e.stored() == 2, 5)
        config = router_config(backends=(backend,), token_handoff="on", model=MODEL)
        with RouterThread(config) as r:
            wait_channels(r)
            resp = httpx.post(r.base_url + "/chat/completions", json=chat("is there room?"), timeout=10)
            assert resp.status_code == 200
            assert router_counts(r) == {"sent": 1}
        assert handoff_stat(url, "rejected_full") == 1
        assert handoff_stat(url, "missing") == 1
        assert tokenized(url) == 1
    finally:
        e.close()


def test_sim_without_handoff_has_no_channel() -> None:
    with ClusterThread(sim_config(replicas=1, handoff=False)) as c:
        assert httpx.get(c.urls[0] + "/kvroute/handoff", timeout=10).status_code == 404
        assert c.cluster.replicas[0].handoff is None


def test_handoff_settings_and_endpoints() -> None:
    from kvroute.config import ConfigError, RouterConfig
    from kvroute.handoff import handoff_active, resolve_endpoint

    base: dict[str, Any] = {"admin_key": "k"}
    assert handoff_active(RouterConfig(**base, sim=1))
    assert not handoff_active(RouterConfig(**base))  # the default tokenizer may not be the engines'
    assert not handoff_active(RouterConfig(**base, sim=1, token_handoff="off"))
    assert handoff_active(RouterConfig(**base, token_handoff="on"))
    with pytest.raises(ConfigError, match="token_handoff"):
        RouterConfig(**base, token_handoff="maybe")
    assert resolve_endpoint("tcp://0.0.0.0:5700", "http://10.1.2.3:8000") == "tcp://10.1.2.3:5700"
    assert resolve_endpoint("tcp://*:5700", "http://[fd00::1]:8000") == "tcp://[fd00::1]:5700"
    assert resolve_endpoint("tcp://engine-7:5700", "http://10.1.2.3:8000") == "tcp://engine-7:5700"
