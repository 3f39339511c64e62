"""The engine side's token channel: a ZMQ ``PULL`` socket feeding a :class:`TokenStore`.

The router connects a ``PUSH`` socket and sends ``[key, token ids as little-endian u32]`` per
request. Settings come from :class:`HandoffSettings` (``KVROUTE_HANDOFF_*`` variables when vLLM
loads the middleware; explicit values in ``kvroute sim``). ``zmq`` is imported when the receiver
starts, not when this module is imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from kvroute.vllm.store import TokenStore

if TYPE_CHECKING:
    import zmq.asyncio

log = logging.getLogger("kvroute.vllm")

PROTOCOL = "kvroute-token-handoff/1"
ENV_PREFIX = "KVROUTE_HANDOFF_"
MAX_KEY_BYTES = 128


@dataclass(frozen=True, slots=True)
class HandoffSettings:
    """The engine side's settings. From the environment: ``KVROUTE_HANDOFF=0`` turns the
    middleware into a pass-through; ``KVROUTE_HANDOFF_<FIELD>`` sets a field."""

    enabled: bool = True
    bind: str = "tcp://*:*"
    """Where the PULL socket binds (``*`` as port: a free one; the router learns it by GET)."""
    advertise: str | None = None
    """The endpoint announced to routers (default: the bound one; routers replace a wildcard
    host with the engine's HTTP host)."""
    ttl_s: float = 10.0
    max_entries: int = 4096
    max_bytes: int = 256 * 1024 * 1024
    wait_s: float = 0.05
    """How long a request whose tokens have not arrived waits for them before tokenizing."""
    max_body_bytes: int = 64 * 1024 * 1024
    """Larger request bodies are passed through untouched (not buffered)."""
    rcvhwm: int = 1000

    def __post_init__(self) -> None:
        if not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"{ENV_PREFIX}BIND: expected tcp://HOST:PORT, got {self.bind!r}")
        for name in ("ttl_s", "wait_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{ENV_PREFIX}{name.upper()}: must be >= 0, got {v}")
        for name in ("max_entries", "max_bytes", "max_body_bytes", "rcvhwm"):
            if getattr(self, name) < 1:
                raise ValueError(f"{ENV_PREFIX}{name.upper()}: must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HandoffSettings:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        raw = env.get("KVROUTE_HANDOFF")
        if raw is not None:
            values["enabled"] = raw.strip().lower() not in ("0", "false", "no", "off")
        for f in fields(cls):
            if f.name == "enabled":
                continue
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            kind = str(f.type)
            try:
                if kind.startswith("int"):
                    values[f.name] = int(raw)
                elif kind.startswith("float"):
                    values[f.name] = float(raw)
                else:
                    values[f.name] = raw or None if f.name == "advertise" else raw
            except ValueError:
                raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r} is not a valid {kind}") from None
        return cls(**values)


class TokenReceiver:
    """A PULL socket and its store. :meth:`start` binds (idempotent); create and use it on one
    event loop."""

    def __init__(self, settings: HandoffSettings, *, zmq_ctx: zmq.asyncio.Context | None = None) -> None:
        self.settings = settings
        s = settings
        self.store = TokenStore(ttl_s=s.ttl_s, max_entries=s.max_entries, max_bytes=s.max_bytes)
        self.endpoint: str | None = None
        """The bound endpoint (None until started, or if binding failed)."""
        self.error: str | None = None
        self.malformed_frames = 0
        self._ctx = zmq_ctx
        self._own_ctx = False
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._started = False

    @property
    def advertised(self) -> str | None:
        return self.settings.advertise or self.endpoint

    async def start(self) -> None:
        """Binds the socket and starts receiving. A bind failure is logged and leaves the
        receiver off (every request then goes to vLLM untouched)."""
        if self._started:
            return
        self._started = True
        import zmq
        import zmq.asyncio

        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
            self._own_ctx = True
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.settings.rcvhwm)
        # No prompt is larger than the request bodies accepted: a sender of such frames is cut off.
        sock.setsockopt(zmq.MAXMSGSIZE, self.settings.max_body_bytes)
        try:
            sock.bind(self.settings.bind)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            self.error = f"cannot bind {self.settings.bind}: {e}"
            log.warning("kvroute token handoff off: %s", self.error)
            return
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvroute-token-handoff")
        log.info("kvroute token handoff: receiving on %s", self.endpoint)

    async def _run(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2 or not 0 < len(frames[0]) <= MAX_KEY_BYTES:
                self.malformed_frames += 1
                continue
            self.store.put(frames[0], frames[1])

    async def aclose(self) -> None:
        """Stops receiving; requests still naming a key fall back to tokenizing."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self.endpoint = None
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def info(self) -> dict[str, Any]:
        """What ``GET /kvroute/handoff`` answers."""
        s = self.settings
        return {
            "protocol": PROTOCOL,
            "endpoint": self.advertised,
            "running": self._sock is not None,
            "error": self.error,
            "limits": {
                "ttl_s": s.ttl_s,
                "max_entries": s.max_entries,
                "max_bytes": s.max_bytes,
                "wait_s": s.wait_s,
            },
            "stored": len(self.store),
            "stored_bytes": self.store.size_bytes,
            "stats": {**self.store.stats.as_dict(), "malformed_frames": self.malformed_frames},
        }
