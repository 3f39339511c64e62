"""Router side of the token handoff: send the prompt's token ids to the chosen engine.

The router tokenizes every request to route it. When the engine runs kvroute's middleware
(:mod:`kvroute.vllm`), the router sends it those ids so that it need not template and tokenize the
prompt again: after selection, ``[key, ids as little-endian u32]`` goes to the engine's token
channel over a ZMQ ``PUSH`` socket, and the request carries ``X-Kvroute-Token-Key: key`` and
``X-Kvroute-Token-Count: n``. The send never waits: the socket only queues on a live connection
(``IMMEDIATE``) and at most ``handoff_hwm`` messages; when it would block, or the engine has no
channel, the request goes without a key and the engine tokenizes as usual.

Channels are discovered per backend with ``GET /kvroute/handoff`` (polled by the health monitor
once the backend answers, and again whenever it comes back after being unhealthy: a restarted
engine may have bound a new port). A wildcard host in the announced endpoint (``0.0.0.0``,
``*``) is replaced by the backend's own host.

The handoff is only correct if the router's tokenizer and chat template are the engine's: with
``token_handoff = auto`` (the default) it is used when the router was given ``--tokenizer`` or runs
its own ``--sim`` engines (which share its tokenizer); ``on`` forces it, ``off`` disables it.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import zmq

from kvroute.config import RouterConfig
from kvroute.vllm.middleware import COUNT_HEADER, KEY_HEADER

if TYPE_CHECKING:
    from kvroute.fleet import Backend

log = logging.getLogger("kvroute.handoff")

KEY = KEY_HEADER.decode()
COUNT = COUNT_HEADER.decode()
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]", "")
RESULTS = ("sent", "would_block", "no_channel", "skipped")


def handoff_active(c: RouterConfig) -> bool:
    """Whether this router hands tokens off at all (see the module docstring)."""
    if c.token_handoff == "auto":
        return bool(c.sim) or c.tokenizer is not None
    return c.token_handoff == "on"


def resolve_endpoint(endpoint: str, backend_url: str) -> str:
    """``endpoint`` with a wildcard host replaced by the host of ``backend_url``."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, sep, port = endpoint[6:].rpartition(":")
    if not sep or host not in _WILDCARDS:
        return endpoint
    backend_host = urlsplit(backend_url).hostname or "127.0.0.1"
    if ":" in backend_host:
        backend_host = f"[{backend_host}]"
    return f"tcp://{backend_host}:{port}"


@dataclass(slots=True)
class Channel:
    endpoint: str
    socket: zmq.Socket[bytes]


class TokenHandoff:
    """The PUSH sockets to every backend's token channel. Used from the event loop only."""

    def __init__(self, config: RouterConfig) -> None:
        self.active = handoff_active(config)
        self.hwm = config.handoff_hwm
        self.min_tokens = config.handoff_min_tokens
        self._ctx = zmq.Context()
        self._channels: dict[str, Channel] = {}
        self.counts: dict[tuple[str, str], int] = {}
        """(backend, result) -> requests, result one of :data:`RESULTS`."""

    def endpoint(self, backend: str) -> str | None:
        ch = self._channels.get(backend)
        return ch.endpoint if ch is not None else None

    def set_channel(self, backend: Backend, endpoint: str | None) -> None:
        """Points ``backend``'s channel at ``endpoint`` (None: the backend has none)."""
        old = self._channels.get(backend.name)
        if endpoint is not None:
            endpoint = resolve_endpoint(endpoint, backend.url)
        if old is not None and old.endpoint == endpoint:
            return
        self.drop_channel(backend.name)
        if endpoint is None:
            return
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a live connection: never for a dead engine
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            log.warning("backend %s: bad token-handoff endpoint %s: %s", backend.name, endpoint, e)
            return
        self._channels[backend.name] = Channel(endpoint, sock)
        log.info("backend %s: token handoff to %s", backend.name, endpoint)

    def drop_channel(self, name: str) -> None:
        ch = self._channels.pop(name, None)
        if ch is not None:
            ch.socket.close(linger=0)

    def offer(self, backend: str, tokens: bytes, eligible: bool, headers: dict[str, str]) -> str:
        """Sends ``tokens`` to ``backend``'s channel and names the key in ``headers``; returns the
        result (one of :data:`RESULTS`). Never blocks."""
        if not eligible or len(tokens) < 4 * max(self.min_tokens, 1):
            result = "skipped"
        else:
            ch = self._channels.get(backend)
            if ch is None:
                result = "no_channel"
            else:
                key = secrets.token_hex(16)
                try:
                    ch.socket.send_multipart(
                        (key.encode(), tokens), flags=zmq.NOBLOCK, copy=len(tokens) < 65536
                    )
                except zmq.Again:
                    result = "would_block"
                else:
                    headers[KEY] = key
                    headers[COUNT] = str(len(tokens) // 4)
                    result = "sent"
        k = (backend, result)
        self.counts[k] = self.counts.get(k, 0) + 1
        return result

    def close(self) -> None:
        for name in list(self._channels):
            self.drop_channel(name)
        self._ctx.term()
