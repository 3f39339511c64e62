"""The engine side's bounded store of handed-off prompts: key -> token ids, single use.

Entries arrive from the router over ZMQ, usually a little before the HTTP request that names their
key. The store is bounded three ways: a time to live (an entry nobody took by then is stale: its
request went elsewhere, failed, or is gone), an entry count and a byte budget. When an entry would
break a cap it is refused, not made room for: what is stored is what some request is about to
take, and a refused entry only costs its request a fallback to ordinary tokenization.

A request whose key has not arrived yet waits for it a short while (:meth:`TokenStore.take`);
tokens that arrive after their request stopped waiting are dropped at once and counted as late.
Everything runs on one event loop; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

ABANDONED_KEYS = 4096
"""Keys of requests that stopped waiting, remembered to recognise their tokens as late."""


@dataclass(slots=True)
class StoreStats:
    """Counters of one store (monotonic; read by ``GET /kvroute/handoff`` and metrics)."""

    received: int = 0
    """Payloads stored or handed to a waiting request."""
    used: int = 0
    """Requests served from a handed-off prompt."""
    missing: int = 0
    """Requests whose key had not arrived when their wait ended."""
    late: int = 0
    """Payloads that arrived after their request stopped waiting (dropped)."""
    stale: int = 0
    """Entries dropped unused at their time to live (a request that found one counts here too)."""
    rejected_full: int = 0
    """Payloads refused because the store was at its entry or byte cap."""
    malformed: int = 0
    """Payloads or requests whose token count or byte length did not fit (fallback)."""
    not_applicable: int = 0
    """Requests with a key whose body could not take token ids (fallback: the body is untouched)."""
    duplicates: int = 0
    """Payloads for a key already stored (the first one is kept)."""

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class _Entry:
    payload: bytes
    deadline: float


@dataclass(slots=True)
class TokenStore:
    """Bounded, single-use key -> payload store with waiters. ``clock`` is monotonic seconds."""

    ttl_s: float = 10.0
    max_entries: int = 4096
    max_bytes: int = 256 * 1024 * 1024
    clock: Callable[[], float] = time.monotonic
    stats: StoreStats = field(default_factory=StoreStats)
    _entries: OrderedDict[bytes, _Entry] = field(default_factory=OrderedDict)
    _bytes: int = 0
    _waiters: dict[bytes, asyncio.Future[bytes]] = field(default_factory=dict)
    _abandoned: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def put(self, key: bytes, payload: bytes) -> str:
        """Stores one payload; returns what happened (``stored``, ``delivered`` to a waiting
        request, ``late``, ``duplicate`` or ``full``)."""
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            self.stats.received += 1
            waiter.set_result(payload)
            return "delivered"
        if key in self._abandoned:
            del self._abandoned[key]
            self.stats.late += 1
            return "late"
        if key in self._entries:
            self.stats.duplicates += 1
            return "duplicate"
        self.expire()
        if len(self._entries) >= self.max_entries or self._bytes + len(payload) > self.max_bytes:
            self.stats.rejected_full += 1
            return "full"
        self._entries[key] = _Entry(payload, self.clock() + self.ttl_s)
        self._bytes += len(payload)
        self.stats.received += 1
        return "stored"

    def expire(self) -> int:
        """Drops entries past their time to live (all share one TTL: the oldest go first)."""
        now = self.clock()
        n = 0
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.deadline > now:
                break
            del self._entries[key]
            self._bytes -= len(entry.payload)
            n += 1
        self.stats.stale += n
        return n

    def pop(self, key: bytes) -> bytes | None:
        """The payload of ``key`` if it is here and fresh (single use: it is removed)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._bytes -= len(entry.payload)
        if entry.deadline <= self.clock():
            self.stats.stale += 1
            return None
        return entry.payload

    async def take(self, key: bytes, wait_s: float) -> bytes | None:
        """The payload of ``key``, waiting up to ``wait_s`` for it to arrive; None if it does not
        (the request then falls back to tokenizing)."""
        if key in self._entries:
            return self.pop(key)
        if wait_s <= 0 or key in self._waiters:
            self.stats.missing += 1
            return None
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiters[key] = fut
        try:
            async with asyncio.timeout(wait_s):
                return await fut
        except TimeoutError:
            self.stats.missing += 1
            self._abandon(key)
            return None
        finally:
            if self._waiters.get(key) is fut:
                del self._waiters[key]

    def _abandon(self, key: bytes) -> None:
        self._abandoned[key] = None
        while len(self._abandoned) > ABANDONED_KEYS:
            self._abandoned.popitem(last=False)
