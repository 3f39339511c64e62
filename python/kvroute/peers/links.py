"""Sending batches to peers: one ZMQ ``PUSH`` socket per peer, never blocking.

Each socket connects to its peer's ``PULL`` endpoint with ``IMMEDIATE`` (messages queue only on a
live connection) and a send high-water mark of ``hwm`` batches. A send that would block -- peer
unreachable, or too slow to keep up -- drops the batch (counted, and a warning when the peer goes
from reachable to not); the peer's queue never grows past ``hwm``, and libzmq discards it when the
connection drops. The next snapshot brings a peer that comes back up to date. A socket that has
not delivered for :data:`RECREATE_AFTER_S` is replaced by a fresh one: libzmq stops retrying a
connection whose handshake the peer refused (a CURVE key it did not list yet), and a fresh socket
also sheds whatever backlog a slow peer left.

With CURVE keys each socket authenticates the peer's server key and presents this router's key.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

from kvroute.config import PeerSpec

log = logging.getLogger("kvroute.peers")

RECREATE_AFTER_S = 2.0


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """This router's CURVE key pair (Z85 bytes)."""

    secret: bytes
    public: bytes

    @classmethod
    def from_secret(cls, secret: str) -> CurveKeys:
        return cls(secret.encode(), zmq.curve_public(secret.encode()))


@dataclass(slots=True)
class Link:
    """One peer and the socket to it."""

    spec: PeerSpec
    socket: zmq.Socket[bytes]
    sent: int = 0
    dropped: int = 0
    up: bool = True
    """Whether the last send went out (a peer starts presumed up, so its first failure warns)."""
    changed_at: float = 0.0
    recreated_at: float = 0.0
    recreated: int = 0


class Links:
    """The sockets to every peer. Used from the event loop only."""

    def __init__(self, *, hwm: int, curve: CurveKeys | None) -> None:
        self.hwm = hwm
        self.curve = curve
        self._ctx = zmq.Context()
        self.links: dict[str, Link] = {}
        self.recovered = False
        """A peer became reachable again since this was last cleared (send a snapshot now)."""

    def set_peers(self, specs: tuple[PeerSpec, ...]) -> None:
        """Connects to new peers and disconnects from the ones no longer listed."""
        wanted = {s.endpoint: s for s in specs}
        for endpoint in [e for e, link in self.links.items() if wanted.get(e) != link.spec]:
            self.links.pop(endpoint).socket.close(linger=0)
            log.info("peer %s removed", endpoint)
        for endpoint, spec in wanted.items():
            if endpoint not in self.links:
                self.links[endpoint] = Link(spec, self._connect(spec), changed_at=time.monotonic())
                log.info("peer %s added", endpoint)

    def _connect(self, spec: PeerSpec) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if self.curve is not None:
            assert spec.key is not None  # the config requires a key per peer with CURVE on
            sock.curve_secretkey = self.curve.secret
            sock.curve_publickey = self.curve.public
            sock.curve_serverkey = spec.key.encode()
        sock.connect(spec.endpoint)
        return sock

    def refresh(self, now: float | None = None) -> None:
        """Replaces the sockets of peers that have been down for :data:`RECREATE_AFTER_S`."""
        now = time.monotonic() if now is None else now
        for link in self.links.values():
            if not link.up and now - max(link.changed_at, link.recreated_at) > RECREATE_AFTER_S:
                link.socket.close(linger=0)
                link.socket = self._connect(link.spec)
                link.recreated_at = now
                link.recreated += 1

    def send(self, frames: list[bytes]) -> None:
        """Sends one batch to every peer that can take it now."""
        for link in self.links.values():
            try:
                link.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                link.dropped += 1
                if link.up:
                    link.up = False
                    link.changed_at = time.monotonic()
                    log.warning(
                        "peer %s unreachable or too slow: dropping its batches until it keeps up",
                        link.spec.endpoint,
                    )
                continue
            link.sent += 1
            if not link.up:
                link.up = True
                self.recovered = True
                log.info(
                    "peer %s reachable again after %.1f s (%d batches dropped so far)",
                    link.spec.endpoint,
                    time.monotonic() - link.changed_at,
                    link.dropped,
                )
                link.changed_at = time.monotonic()

    def close(self) -> None:
        for link in self.links.values():
            link.socket.close(linger=0)
        self.links.clear()
        self._ctx.term()
