"""Peer fan-out: several ``kvroute serve`` replicas behind one load balancer share their ledgers.

After every select-and-reserve the router queues a ``RESERVE`` record (request id, this router's
id, engine, block hashes, prompt length, expected output, prefill tokens booked), then the
request's lifecycle (``PREFILL``, ``PROGRESS``, ``FINISHED``). Records are packed on the spot and
never awaited: selection never waits on the network. All records queued during one turn of the
event loop leave together as one batch (:mod:`kvroute.peers.wire`) to every peer
(:mod:`kvroute.peers.links`). Every ``snapshot_interval_s`` a snapshot of the reservations this
router holds goes out too: it is the heartbeat, and it repairs whatever a peer missed.

Peers' batches arrive on one ``PULL`` socket, bound only when ``peer_bind`` is set, and are
applied by :class:`~kvroute.peers.remote.RemoteLedger`. Authentication: a shared secret signs every
batch (HMAC-SHA256; unsigned, badly signed or -- with a secret -- too old batches are dropped) and/or
ZMQ CURVE encrypts the connections, the receiving socket accepting only the public keys of the
peers it lists.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from kvroute.config import ConfigError, PeerSpec, RouterConfig, read_peers_file
from kvroute.peers import wire
from kvroute.peers.links import CurveKeys, Links
from kvroute.peers.remote import RemoteLedger

if TYPE_CHECKING:
    from kvroute._native import Decision
    from kvroute.fleet import Fleet

log = logging.getLogger("kvroute.peers")

MAX_OUTBOX = 65536
"""Records queued between two flushes before the oldest are dropped (a flush runs every loop turn,
so this is only reached if the loop stalls)."""


@dataclass(slots=True)
class Held:
    """A reservation of this router, as the next snapshot will list it."""

    backend: str
    rank: int
    prefill_tokens: int
    prompt_tokens: int
    decoding: bool = False
    generated: int = 0


class _AllowedKeys:
    """ZAP credentials provider: the CURVE public keys of the listed peers."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


@dataclass(slots=True)
class FanoutStats:
    outbox_dropped: int = 0
    batches: int = 0
    snapshots: int = 0
    peers_file_errors: int = 0
    received: dict[str, int] = field(default_factory=dict)


class PeerFanout:
    """Create inside the running loop after the fleet; :meth:`start`, then :meth:`aclose`."""

    def __init__(self, config: RouterConfig, fleet: Fleet, name: str) -> None:
        c = config
        self.config = config
        self.name = name
        self.router_id = fleet.scheduler.router_id
        self.secret = c.peer_secret.encode() if c.peer_secret else None
        self.curve = CurveKeys.from_secret(c.peer_curve_secret_key) if c.peer_curve_secret_key else None
        self.links = Links(hwm=c.peer_hwm, curve=self.curve)
        self.remote = RemoteLedger(fleet, timeout_s=c.peer_timeout_s)
        self.stats = FanoutStats()
        self.held: dict[int, Held] = {}
        self.endpoint: str | None = None
        """Where this router receives (the bound endpoint), None without ``peer_bind``."""
        self._outbox: list[bytes] = []
        self._flush_scheduled = False
        self._seq = 0
        self._actx: zmq.asyncio.Context | None = None
        self._auth: AsyncioAuthenticator | None = None
        self._allowed = _AllowedKeys()
        self._pull: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._file_mtime: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        c = self.config
        self._loop = asyncio.get_running_loop()
        self._set_peers(self._listed_peers())
        if c.peer_bind is not None:
            self._actx = zmq.asyncio.Context()
            sock = self._actx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, c.peer_hwm)
            if self.curve is not None:
                self._auth = AsyncioAuthenticator(self._actx)
                self._auth.start()
                self._auth.configure_curve_callback("*", credentials_provider=self._allowed)
                sock.curve_secretkey = self.curve.secret
                sock.curve_publickey = self.curve.public
                sock.curve_server = True
            try:
                sock.bind(c.peer_bind)
            except zmq.ZMQError as e:
                sock.close(linger=0)
                raise OSError(f"peer_bind {c.peer_bind}: {e}") from None
            self._pull = sock
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._tasks.append(self._loop.create_task(self._receive(), name="kvroute-peers-recv"))
        self._tasks.append(self._loop.create_task(self._tick(), name="kvroute-peers-tick"))
        log.info(
            "peer fan-out: router %s (id %x), receiving on %s, %d peer(s)%s%s",
            self.name,
            self.router_id,
            self.endpoint or "(no bind)",
            len(self.links.links),
            ", CURVE" if self.curve else "",
            ", signed" if self.secret else "",
        )

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        if self._pull is not None:
            self._pull.close(linger=0)
            self._pull = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._actx is not None:
            self._actx.term()
            self._actx = None
        self.links.close()

    def _listed_peers(self) -> tuple[PeerSpec, ...]:
        specs = list(self.config.peer_specs)
        path = self.config.peers_file
        if path is not None:
            try:
                self._file_mtime = os.stat(path).st_mtime
                specs += read_peers_file(path)
            except (OSError, ConfigError) as e:
                self.stats.peers_file_errors += 1
                log.warning("peers_file %s: %s (keeping the current peers)", path, e)
                return tuple(link.spec for link in self.links.links.values())
        return tuple(specs)

    def _set_peers(self, specs: tuple[PeerSpec, ...]) -> None:
        if self.curve is not None:
            specs = tuple(s for s in specs if s.key is not None)
            self._allowed.keys = {s.key.encode() for s in specs if s.key is not None}
        self.links.set_peers(specs)

    # -- sending --------------------------------------------------------------------------------

    def _queue(self, record: bytes) -> None:
        if len(self._outbox) >= MAX_OUTBOX:
            del self._outbox[: MAX_OUTBOX // 2]
            self.stats.outbox_dropped += MAX_OUTBOX // 2
        self._outbox.append(record)
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _frames(self, kind: int, records: list[bytes]) -> list[bytes]:
        self._seq += 1
        frame = wire.batch(kind, self.router_id, self._seq, time.time(), self.name, records)
        return [frame, wire.sign(self.secret, frame)] if self.secret else [frame]

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._outbox:
            return
        records, self._outbox = self._outbox, []
        if self.links.links:
            self.links.send(self._frames(wire.UPDATES, records))
            self.stats.batches += 1
        if self.links.recovered:
            self.send_snapshot()

    def send_snapshot(self) -> None:
        self.links.recovered = False
        records = [
            wire.held(i, h.backend, h.rank, h.prefill_tokens, h.prompt_tokens, h.decoding, h.generated)
            for i, h in self.held.items()
        ]
        if self.links.links:
            self.links.send(self._frames(wire.SNAPSHOT, records))
            self.stats.snapshots += 1

    def reserved(
        self, d: Decision, backend: str, rank: int, prompt_tokens: int, expected_output: int, hashes: bytes
    ) -> None:
        """A reservation was just booked here (after ``select_and_reserve``)."""
        self.held[d.reservation] = Held(backend, rank, d.prefill_tokens, prompt_tokens)
        self._queue(
            wire.reserve(
                d.reservation, backend, rank, d.prefill_tokens, prompt_tokens, expected_output, hashes
            )
        )

    def prefill_done(self, reservation: int) -> None:
        h = self.held.get(reservation)
        if h is None:
            return
        h.decoding = True
        self._queue(wire.prefill_done(reservation))

    def progress(self, reservation: int, generated: int) -> None:
        h = self.held.get(reservation)
        if h is None:
            return
        h.decoding = True
        h.generated = max(h.generated, generated)
        self._queue(wire.progress(reservation, generated))

    def finished(self, reservation: int) -> None:
        if self.held.pop(reservation, None) is not None:
            self._queue(wire.finished(reservation))

    # -- receiving and housekeeping -------------------------------------------------------------

    async def _receive(self) -> None:
        assert self._pull is not None
        while True:
            frames = await self._pull.recv_multipart()
            self.handle(frames)

    def handle(self, frames: list[bytes]) -> str:
        """One received message; returns the result it was counted under."""
        r = self.remote
        if self.secret is not None:
            if len(frames) != 2 or not wire.verify(self.secret, frames[0], frames[1]):
                r.count("auth_failed")
                return "auth_failed"
        elif len(frames) not in (1, 2):
            r.count("malformed")
            return "malformed"
        try:
            batch = wire.decode(frames[0])
        except wire.WireError as e:
            r.count("malformed")
            log.warning("malformed peer batch dropped: %s", e)
            return "malformed"
        if self.secret is not None and abs(time.time() - batch.sent_at) > self.config.peer_max_skew_s:
            r.count("stale")
            return "stale"
        return r.apply(batch)

    async def _tick(self) -> None:
        interval = self.config.peer_snapshot_interval_s
        path = self.config.peers_file
        while True:
            await asyncio.sleep(interval)
            self._flush()  # records queued before the snapshot go out before it
            self.send_snapshot()
            self.remote.expire()
            self.links.refresh()
            if path is not None:
                try:
                    mtime: float | None = os.stat(path).st_mtime
                except OSError:
                    mtime = None
                if mtime != self._file_mtime:
                    self._set_peers(self._listed_peers())

    def snapshot(self) -> dict[str, Any]:
        """The ``peers`` section of ``GET /status``."""
        return {
            "router": self.name,
            "router_id": f"{self.router_id:x}",
            "endpoint": self.endpoint,
            "auth": [a for a, on in (("curve", self.curve), ("secret", self.secret)) if on],
            "held": len(self.held),
            "batches": self.stats.batches,
            "snapshots": self.stats.snapshots,
            "outbox_dropped": self.stats.outbox_dropped,
            "links": [
                {"endpoint": e, "up": link.up, "sent": link.sent, "dropped": link.dropped}
                for e, link in self.links.links.items()
            ],
            "received": dict(self.remote.results),
            "unknown_engines": self.remote.unknown_engines,
            "timeouts": self.remote.timeouts,
            "origins": {
                f"{k:x}": {"name": o.name, "live": len(o.live), "batches": o.batches}
                for k, o in self.remote.origins.items()
            },
        }
