"""A sim replica's KV events on the wire: decoded by kvroute's own index, replayed, gapped, reset."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import httpx
import pytest
import zmq

import kvroute
from sim_support import ClusterThread, sim_config

MODEL = "sim-model"
_unique = itertools.count(60000)
BLOCK = 16
TIMEOUT_MS = 5000


@pytest.fixture(scope="module")
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(linger=0)


def complete(url: str, prompt: list[int], max_tokens: int = 2) -> dict[str, object]:
    r = httpx.post(
        f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}, timeout=30
    )
    r.raise_for_status()
    body: dict[str, object] = r.json()
    return body


def fresh_prompt() -> list[int]:
    """A prompt with one full block nobody has cached: admitting it publishes a BlockStored."""
    return [next(_unique)] * (BLOCK + 1)


def subscribe(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, url: str) -> zmq.Socket[bytes]:
    """A SUB socket known to be receiving: requests are sent until a batch arrives."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    for _ in range(100):
        complete(url, fresh_prompt(), 1)
        if sub.poll(50):
            drain(sub)
            return sub
    raise AssertionError("no KV-event batch arrived")


def drain(sub: zmq.Socket[bytes], wait_ms: int = 200) -> list[list[bytes]]:
    out = []
    while sub.poll(wait_ms):
        out.append(sub.recv_multipart())
    return out


def replay(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        frames_list = []
        while True:
            assert dealer.poll(TIMEOUT_MS), "replay timed out"
            frames = dealer.recv_multipart()
            frames_list.append(frames)
            if frames[-1] == b"":
                return frames_list
    finally:
        dealer.close(linger=0)


def seqs(frames: list[list[bytes]]) -> list[int]:
    return [int.from_bytes(f[1], "big") for f in frames]


@pytest.fixture(scope="module")
def sim() -> Iterator[ClusterThread]:
    with ClusterThread(sim_config(replicas=2, topic="kv", buffer_steps=50)) as c:
        yield c


@pytest.mark.parametrize("legacy", [False, True])
def test_events_decode_into_the_prefix_index(ctx: zmq.Context[zmq.Socket[bytes]], legacy: bool) -> None:
    with ClusterThread(sim_config(replicas=2, legacy_events=legacy)) as c:
        subs = [subscribe(ctx, c.cluster.event_endpoints[i] or "", c.urls[i]) for i in range(2)]
        prompt = list(range(2000, 2000 + 5 * BLOCK + 3))  # 5 full blocks and a partial one
        complete(c.urls[1], prompt)
        index = kvroute.PrefixIndex(block_size=BLOCK)
        for worker, sub in enumerate(subs):
            for topic, seq, payload in drain(sub):
                assert topic == b""
                assert len(seq) == 8
                index.apply(worker, payload)
            sub.close(linger=0)
        assert index.stats()["malformed_payloads"] == 0
        # Replica 1 holds the prompt's full blocks; replica 0 never saw it.
        assert index.match_tokens(prompt) == {1: (5, 0)}


def test_replay_returns_buffer_then_end_marker(
    ctx: zmq.Context[zmq.Socket[bytes]], sim: ClusterThread
) -> None:
    url, endpoint = sim.urls[0], sim.cluster.replay_endpoints[0] or ""
    for i in range(3):
        complete(url, list(range(100 * i, 100 * i + 40)))
    replies = replay(ctx, endpoint, 0)
    assert replies[-1] == [b"", b"", b"\xff" * 8, b""]
    body = replies[:-1]
    assert body
    assert all(len(f) == 4 and f[0] == b"" and f[1] == b"kv" for f in body)
    got = [int.from_bytes(f[2], "big") for f in body]
    assert got == list(range(got[0], got[0] + len(got)))
    index = kvroute.PrefixIndex(block_size=BLOCK)
    for f in body:
        index.apply(0, f[3])
    # More batches than the buffer holds: a start at 0 silently begins later.
    while sim.call(lambda: sim.cluster.replicas[0].publisher.next_seq) <= 60:  # type: ignore[union-attr]
        complete(url, fresh_prompt(), 1)
    late = replay(ctx, endpoint, 0)
    first = int.from_bytes(late[0][2], "big")
    assert first > 0
    assert len(late) - 1 == 50


def test_dropped_batches_leave_seq_gaps(ctx: zmq.Context[zmq.Socket[bytes]], sim: ClusterThread) -> None:
    url = sim.urls[1]
    sub = subscribe(ctx, sim.cluster.event_endpoints[1] or "", url)
    try:
        sim.fault(1, "drop", 1.0)
        complete(url, list(range(300, 340)))
        assert drain(sub) == []
        state = sim.fault(1, "drop", 0.0)
        assert int(str(state["dropped_batches"])) >= 1
        complete(url, list(range(400, 440)))
        got = seqs(drain(sub))
        next_seq = int(str(state["next_seq"]))
        assert got
        assert got[0] == next_seq  # the dropped ones are missing before it
        # They are still in the replay buffer.
        missing = replay(ctx, sim.cluster.replay_endpoints[1] or "", next_seq - 1)
        assert int.from_bytes(missing[0][2], "big") == next_seq - 1
    finally:
        sub.close(linger=0)


def test_restart_resets_seq_and_cache(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with ClusterThread(sim_config()) as c:
        url = c.urls[0]
        prompt = list(range(600, 600 + 4 * BLOCK))
        sub = subscribe(ctx, c.cluster.event_endpoints[0] or "", url)
        try:
            complete(url, prompt)
            again = complete(url, prompt)
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # type: ignore[index]
            drain(sub)
            state = c.fault(0, "restart")
            assert state["next_seq"] == 0
            assert replay(ctx, c.cluster.replay_endpoints[0] or "", 0) == [[b"", b"", b"\xff" * 8, b""]]
            fresh = complete(url, prompt)
            assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # type: ignore[index]
            frames = drain(sub)
            assert int.from_bytes(frames[0][1], "big") == 0
        finally:
            sub.close(linger=0)


def read_until_cut(c: ClusterThread, resp: httpx.Response, crash_after: int) -> int:
    """Reads SSE events, crashing the replica after ``crash_after`` of them; returns how many came."""
    received = 0
    for line in resp.iter_lines():
        assert line != "data: [DONE]", "the stream ended normally"
        if line.startswith("data: "):
            received += 1
            if received == crash_after:
                c.fault(0, "crash")
    return received


def test_crash_cuts_streams_then_503_until_restart() -> None:
    with ClusterThread(sim_config(time_scale=1.0)) as c:
        url = c.urls[0]
        body = {"model": MODEL, "prompt": "go on forever", "max_tokens": 2000, "stream": True}
        with httpx.Client(timeout=30) as h, h.stream("POST", f"{url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                read_until_cut(c, resp, crash_after=3)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == 503
        c.fault(0, "restart")
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        assert complete(url, [1, 2, 3], 1)["choices"]


def test_unavailable_and_stall(sim: ClusterThread) -> None:
    url = sim.urls[0]
    sim.fault(0, "unavailable", 0.5)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 503
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
    time.sleep(0.6)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    sim.fault(0, "stall", 0.7)
    t0 = time.monotonic()
    complete(url, [9, 9, 9], 1)
    assert time.monotonic() - t0 >= 0.6
    # A crash with a value restarts by itself after that many seconds.
    sim.fault(0, "crash", 0.3)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 503
    time.sleep(0.5)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    bad = httpx.post(f"{url}/admin/fault", json={"kind": "explode"}, timeout=10)
    assert bad.status_code == 400


def test_client_disconnect_aborts_the_request(sim: ClusterThread) -> None:
    url = sim.urls[0]
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 3000, "stream": True}
    with httpx.Client(timeout=30) as h, h.stream("POST", f"{url}/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break
    for _ in range(100):
        if sim.call(lambda: sim.cluster.replicas[0].loop.in_flight) == 0:
            break
        time.sleep(0.05)
    assert sim.call(lambda: sim.cluster.replicas[0].loop.in_flight) == 0
    assert sim.call(lambda: sim.cluster.replicas[0].engine.metrics()["running"]) == 0
