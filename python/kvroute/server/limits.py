"""Admission: at most ``max_concurrency`` requests proxied at once and ``max_queue`` waiting.

A request over both limits, or one that waited ``queue_timeout_s`` for a slot, is answered 429
with ``Retry-After``. ``max_concurrency=0`` admits everything.
"""

from __future__ import annotations

import asyncio


class Busy(Exception):
    """No slot and no room in the queue (or the wait timed out)."""


class Limiter:
    def __init__(self, max_concurrency: int, max_queue: int, queue_timeout_s: float) -> None:
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        self.waiting = 0
        self._sem = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
        self.rejected = 0

    async def acquire(self) -> None:
        if self._sem is not None:
            if self._sem.locked():
                if self.waiting >= self.max_queue:
                    self.rejected += 1
                    raise Busy
                self.waiting += 1
                try:
                    async with asyncio.timeout(self.queue_timeout_s):
                        await self._sem.acquire()
                except TimeoutError:
                    self.rejected += 1
                    raise Busy from None
                finally:
                    self.waiting -= 1
            else:
                await self._sem.acquire()
        self.active += 1

    def release(self) -> None:
        self.active -= 1
        if self._sem is not None:
            self._sem.release()
