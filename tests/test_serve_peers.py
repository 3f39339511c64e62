"""Peer fan-out end to end: several routers on real ZMQ sockets and HTTP over 127.0.0.1.

Every router binds its fan-out socket on a free loopback port; the peers file lists all of them
(each router included, so every router also receives its own broadcast). The backend is one
scriptable fake engine shared by all routers under the same name, so that a request's phases
(waiting for its first token, streaming, finished) last as long as the test needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from kvroute.peers import wire
from serve_support import FakeBackend, RouterThread, router_config, wait_until

SECRET = "a-shared-secret-of-32-characters"
Loads = tuple[int, int, int, int, int]


class FakeThread:
    """A :class:`FakeBackend` on its own loop, so any router can be stopped independently."""

    def __init__(self, **behaviour: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.fake = FakeBackend(**behaviour)

    def __enter__(self) -> FakeBackend:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.fake.start(), self.loop).result(10)
        return self.fake

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.fake.aclose(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Mesh:
    """``n`` routers in front of one fake engine, peers listed in a file."""

    def __init__(self, tmp_path: Path, fake: FakeBackend, n: int, **changes: Any) -> None:
        self.peers_file = tmp_path / "peers.txt"
        self.peers_file.write_text("# filled in once the routers have bound their ports\n")
        self.fake = fake
        self.changes = {
            "backends": (f"{fake.url};events=none;name=fake",),
            "model": "kvroute-sim",
            "peers_file": str(self.peers_file),
            "peer_bind": "tcp://127.0.0.1:*",
            "peer_snapshot_interval_s": 0.2,
            "peer_timeout_s": 10.0,
            **changes,
        }
        self.routers: list[RouterThread | None] = []
        for _ in range(n):
            self.start()
        self.write_peers()

    def start(self, **changes: Any) -> RouterThread:
        r = RouterThread(router_config(**{**self.changes, **changes})).__enter__()
        self.routers.append(r)
        return r

    def endpoint(self, r: RouterThread) -> str:
        peers = r.router.state.fleet.peers
        assert peers is not None
        assert peers.endpoint is not None
        return peers.endpoint

    def write_peers(self) -> None:
        live = [r for r in self.routers if r is not None]
        endpoints = [self.endpoint(r) for r in live]
        self.peers_file.write_text("\n".join(endpoints) + "\n")
        for r in live:
            wait_until(lambda r=r: len(links(r)) == len(endpoints), 10, lambda r=r: str(links(r)))

    def stop(self, i: int) -> None:
        r = self.routers[i]
        assert r is not None
        self.routers[i] = None
        r.__exit__(None, None, None)

    def close(self) -> None:
        for i, r in enumerate(self.routers):
            if r is not None:
                self.stop(i)


@pytest.fixture
def fake() -> Iterator[FakeBackend]:
    with FakeThread(chunks=40, chunk_delay_s=0.03) as f:
        yield f


def links(r: RouterThread) -> dict[str, Any]:
    peers = r.router.state.fleet.peers
    assert peers is not None
    return r.call(lambda: {e: (link.up, link.sent, link.dropped) for e, link in peers.links.links.items()})


def view(r: RouterThread) -> Loads:
    """(reservations, and the fake engine's prefill tokens, KV blocks, active, decoding)."""
    fleet = r.router.state.fleet

    def read() -> Loads:
        worker = fleet.backends["fake"].engines[0].worker
        load = fleet.scheduler.loads().get(worker)
        assert load is not None
        return (
            fleet.scheduler.reservations(),
            load["prefill_tokens"],
            load["kv_blocks"],
            load["active"],
            load["decoding"],
        )

    return r.call(read)


def peer_stat(r: RouterThread, key: str) -> Any:
    peers = r.router.state.fleet.peers
    assert peers is not None
    return r.call(lambda: peers.snapshot()[key])


def converged(routers: list[RouterThread], want: Any) -> bool:
    views = [view(r) for r in routers]
    return len(set(views)) == 1 and want(views[0])


MESSAGES = [{"role": "user", "content": "Explain the KV cache of a transformer. " * 20}]


def stream_in_background(r: RouterThread, out: list[Any]) -> threading.Thread:
    def run() -> None:
        body = {"model": "kvroute-sim", "messages": MESSAGES, "max_tokens": 40, "stream": True}
        try:
            with httpx.stream("POST", r.base_url + "/chat/completions", json=body, timeout=20) as s:
                out.append((s.status_code, b"".join(s.iter_bytes())))
        except httpx.HTTPError as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_three_routers_converge_through_a_lifecycle(tmp_path: Path, fake: FakeBackend) -> None:
    fake.delay_s = 3.0  # the request waits this long for its first token
    fake.chunk_delay_s = 0.1  # then streams for 4 s
    mesh = Mesh(tmp_path, fake, 3, peer_secret=SECRET)
    try:
        routers = [r for r in mesh.routers if r is not None]
        r0, r1, _ = routers
        out: list[Any] = []
        t = stream_in_background(r0, out)
        # Booked at r0, seen by every peer: the same prefill tokens, blocks and request.
        wait_until(lambda: converged(routers, lambda v: v[3] == 1 and v[4] == 0 and v[1] > 0), 5)
        tokens = r0.prompt_tokens(MESSAGES)
        for r in routers:  # peers speculate the routed prefix on the same engine
            assert r.cached_blocks("fake", tokens) == len(tokens) // 4 // 16
        origins = peer_stat(r1, "origins")
        r0_id = peer_stat(r0, "router_id")
        assert origins[r0_id]["live"] == 1
        # First token: every ledger moves it from prefill to decode; its KV footprint grows.
        wait_until(lambda: converged(routers, lambda v: v[4] == 1 and v[1] == 0), 5)
        blocks = view(r0)[2]
        wait_until(lambda: converged(routers, lambda v: v[2] > blocks), 5)
        t.join(20)
        assert out[0][0] == 200
        wait_until(lambda: converged(routers, lambda v: v == (0, 0, 0, 0, 0)), 5)
        for r in routers:  # each router got its own batches back and ignored them
            received = peer_stat(r, "received")
            assert received["own"] > 0
            assert received["applied"] > 0
            assert received["auth_failed"] == 0
    finally:
        mesh.close()


def test_late_broadcast_does_not_resurrect_a_finished_request(tmp_path: Path, fake: FakeBackend) -> None:
    mesh = Mesh(tmp_path, fake, 2, peer_secret=SECRET)
    try:
        r0, r1 = (r for r in mesh.routers if r is not None)
        resp = httpx.post(r0.base_url + "/chat/completions", json={"messages": MESSAGES}, timeout=10)
        assert resp.status_code == 200
        wait_until(lambda: converged([r0, r1], lambda v: v == (0, 0, 0, 0, 0)), 5)
        origin = r0.router.state.fleet.scheduler.router_id
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(mesh.endpoint(r1))
        try:
            late = [wire.reserve(1, "fake", 0, 500, 600, 16, b""), wire.prefill_done(1)]
            frame = wire.batch(wire.UPDATES, origin, 2**40, time.time(), "r0", late)
            push.send_multipart([frame, wire.sign(SECRET.encode(), frame)])
            push.send_multipart([frame, b"\0" * 32])  # forged
            wait_until(lambda: peer_stat(r1, "received")["auth_failed"] == 1, 5)
            assert view(r1) == (0, 0, 0, 0, 0)
            counters = r1.call(r1.router.state.fleet.scheduler.counters)
            assert counters["remote_ignored"] >= 2  # the reserve (tombstoned) and its prefill
        finally:
            push.close(0)
            ctx.term()
    finally:
        mesh.close()


def metric_lines(r: RouterThread, name: str) -> list[str]:
    text = httpx.get(r.url + "/metrics", timeout=10).text
    return [line for line in text.splitlines() if line.startswith(name)]


class RouterProcess:
    """``kvroute serve`` in a child process (so that it can be killed with SIGKILL)."""

    def __init__(self, mesh: Mesh, peer_bind: str) -> None:
        c = mesh.changes
        cmd = [
            sys.executable, "-m", "kvroute.cli", "serve", "--port", "0", "--log-level", "error",
            "--backends", c["backends"][0], "--model", "kvroute-sim",
            "--peers-file", c["peers_file"], "--peer-bind", peer_bind,
            "--peer-snapshot-interval-s", str(c["peer_snapshot_interval_s"]),
            "--peer-timeout-s", str(c["peer_timeout_s"]), "--health-interval-s", "0.2",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "kvroute serve: OpenAI API at URL/v1"
        assert "OpenAI API at" in line, line
        self.base_url = line.rsplit(" ", 1)[1].strip()
        self.status_url = self.base_url.removesuffix("/v1") + "/status"
        self.endpoint = peer_bind

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_killing_a_peer_does_not_disturb_the_others(
    tmp_path: Path, fake: FakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvroute.peers")
    mesh = Mesh(tmp_path, fake, 2, peer_timeout_s=2.0)  # short, to see a dead peer dropped
    gone = f"tcp://127.0.0.1:{free_port()}"
    victims: list[RouterProcess] = []
    try:
        r0, r1 = (r for r in mesh.routers if r is not None)
        victims.append(RouterProcess(mesh, gone))
        mesh.peers_file.write_text(f"{mesh.endpoint(r0)}\n{mesh.endpoint(r1)}\n{gone}\n")
        wait_until(lambda: len(links(r0)) == len(links(r1)) == 3, 10)
        fake.delay_s = 30.0  # its request stays in flight until it is killed

        def request_via_victim() -> None:
            body = {"model": "kvroute-sim", "messages": MESSAGES, "stream": True}
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(victims[0].base_url + "/chat/completions", json=body, timeout=30)

        threading.Thread(target=request_via_victim, daemon=True).start()
        wait_until(lambda: converged([r0, r1], lambda v: v[3] == 1), 10)
        fake.delay_s = 0.0
        victim_id = httpx.get(victims[0].status_url, timeout=10).json()["peers"]["router_id"]
        victims[0].kill()  # no goodbye: its FINISHED never comes
        for i in range(8):
            r = (r0, r1)[i % 2]
            resp = httpx.post(r.base_url + "/chat/completions", json={"messages": MESSAGES}, timeout=10)
            assert resp.status_code == 200
        wait_until(lambda: links(r0)[gone][2] > 0, 5, lambda: str(links(r0)))
        assert links(r0)[gone][0] is False
        assert f'kvroute_peer_up{{peer="{gone}"}} 0.0' in metric_lines(r0, "kvroute_peer_up")
        assert metric_lines(r0, f'kvroute_peer_dropped_batches_total{{peer="{gone}"}}')
        # The peers' update batches reached r0 over loopback: their fan-out latency is measured.
        p50 = metric_lines(r0, 'kvroute_peer_batch_latency_seconds{quantile="0.5"}')
        assert p50
        assert 0.0 <= float(p50[0].split()[-1]) < 1.0
        concurrency = metric_lines(r0, "kvroute_scheduler_peer_concurrency")
        assert concurrency
        assert float(concurrency[0].split()[-1]) >= 0.0
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(gone in w and "unreachable" in w for w in warnings), warnings
        # The dead router's reservation is dropped once it has been silent for peer_timeout_s.
        wait_until(lambda: converged([r0, r1], lambda v: v == (0, 0, 0, 0, 0)), 10)
        for r in (r0, r1):
            assert peer_stat(r, "timeouts") >= 1  # more if the loaded machine stalled a live one
            assert victim_id not in peer_stat(r, "origins")
        assert any("silent" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        # A router that comes back on the same endpoint converges again: it learns what is in
        # flight from the next snapshot, and its peers' links to it recover.
        fake.delay_s = 60.0  # in flight until the test ends (the mesh's shutdown cancels it)
        out: list[Any] = []
        stream_in_background(r0, out)
        wait_until(lambda: converged([r0, r1], lambda v: v[3] == 1), 5)
        victims.append(RouterProcess(mesh, gone))
        status_url = victims[1].status_url
        assert httpx.get(status_url, timeout=10).json()["peers"]["endpoint"] == gone
        wait_until(lambda: links(r0)[gone][0] is True, 15)
        wait_until(lambda: httpx.get(status_url, timeout=10).json()["backends"][0]["active"] == 1, 15)
    finally:
        for v in victims:
            v.kill()
        mesh.close()


def test_curve_peers_converge_and_strangers_are_refused(tmp_path: Path, fake: FakeBackend) -> None:
    (p0, s0), (p1, s1) = zmq.curve_keypair(), zmq.curve_keypair()
    fake.delay_s = 3.0
    mesh = Mesh(tmp_path, fake, 0)
    try:
        r0 = mesh.start(peer_curve_secret_key=s0.decode())
        e0 = mesh.endpoint(r0)
        r1 = mesh.start(
            peer_curve_secret_key=s1.decode(),
            peers_file=None,
            peers=(f"{e0};key={p0.decode()}",),
        )
        e1 = mesh.endpoint(r1)
        # r0 learns of r1 (and its key) through a file it re-reads.
        mesh.peers_file.write_text(f"{e1};key={p1.decode()}\n")
        wait_until(lambda: len(links(r0)) == 1, 5)
        # r0 refused r1's handshake until it listed r1's key; r1 replaces that stuck socket.
        wait_until(lambda: links(r1)[e0][0] is True, 10, lambda: str(links(r1)))
        out: list[Any] = []
        t = stream_in_background(r1, out)
        wait_until(lambda: converged([r0, r1], lambda v: v[3] == 1), 5)
        t.join(20)
        wait_until(lambda: converged([r0, r1], lambda v: v == (0, 0, 0, 0, 0)), 5)
        # A client with a key r0 does not list gets no batch through.
        stranger_pub, stranger_sec = zmq.curve_keypair()
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.IMMEDIATE, 1)
        push.curve_secretkey, push.curve_publickey, push.curve_serverkey = stranger_sec, stranger_pub, p0
        push.connect(e0)
        frame = wire.batch(wire.UPDATES, 12345, 1, time.time(), "stranger", [wire.finished(1)])
        time.sleep(0.3)  # the handshake is refused: the connection never completes
        with pytest.raises(zmq.Again):
            push.send_multipart([frame], flags=zmq.NOBLOCK)
        time.sleep(0.3)
        assert f"{12345:x}" not in peer_stat(r0, "origins")
        push.close(0)
        ctx.term()
    finally:
        mesh.close()
