"""Drives one replica's engine model on real time and fans its outputs out to requests.

One asyncio task per replica calls ``SimEngine.step(now)`` whenever the engine has work. A step's
results become visible when the step would have finished on the modelled hardware: the loop
sleeps ``duration_s / time_scale``, then publishes the step's KV-event batch and hands each
request its new tokens through an :class:`asyncio.Queue`. Step k+1 starts at step k's deadline,
not when Python got round to it, so serving overhead does not stretch modelled time; a loop more
than :data:`MAX_CATCH_UP_S` behind stops catching up, and the lag shows in the
``kvroute_sim:late_step_seconds_total`` metric. Every engine call is synchronous and short, so the
engine is only ever touched from the event loop: no locks.

Faults act here: a stall pauses stepping, a crash or restart ends every request in flight (their
queues get :data:`CRASHED`) and a restart resets the engine and the event sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from kvroute._native import SimEngine, StepResult
from kvroute.sim.events import EventPublisher
from kvroute.sim.faults import FaultState
from kvroute.sim.metrics import ReplicaStats

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Output:
    """One step's news for one request."""

    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    prompt_tokens: int


MAX_CATCH_UP_S = 0.05
"""How far behind its modelled schedule the step loop may run back-to-back steps to catch up."""


class Crashed:
    """The engine went away under the request (injected crash or restart)."""


CRASHED: Final = Crashed()


class RequestHandle:
    """A request in the engine: read :attr:`queue` until an output has ``finished``."""

    __slots__ = ("arrival", "done", "first_token_at", "queue", "request_id")

    def __init__(self, request_id: str, arrival: float) -> None:
        self.request_id = request_id
        self.arrival = arrival
        self.first_token_at: float | None = None
        self.done = False
        self.queue: asyncio.Queue[Output | Crashed] = asyncio.Queue()


class EngineLoop:
    """The step loop of one replica. Create, then :meth:`start` inside the running loop."""

    def __init__(
        self,
        engine: SimEngine,
        *,
        publisher: EventPublisher | None,
        faults: FaultState,
        stats: ReplicaStats,
        time_scale: float = 1.0,
        legacy_events: bool = False,
    ) -> None:
        self.engine = engine
        self.publisher = publisher
        self.faults = faults
        self.stats = stats
        self.time_scale = time_scale
        self.legacy_events = legacy_events
        self._requests: dict[str, RequestHandle] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._epoch = 0
        self._task: asyncio.Task[None] | None = None

    # -- requests -------------------------------------------------------------------------------

    def submit(
        self,
        prompt_tokens: Sequence[int],
        max_tokens: int,
        *,
        tag: str = "req",
        lora: str | None = None,
        salt: str | None = None,
        ignore_eos: bool = False,
        eos_token_id: int | None = None,
    ) -> RequestHandle:
        """Adds a request to the engine. The id is made unique here, so clients may reuse theirs."""
        request_id = f"{tag}-{next(self._ids)}"
        self.engine.add_request(
            request_id,
            prompt_tokens,
            max_tokens,
            lora=lora,
            salt=salt,
            ignore_eos=ignore_eos,
            eos_token_id=eos_token_id,
        )
        handle = RequestHandle(request_id, time.monotonic())
        self._requests[request_id] = handle
        self._wake.set()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Stops a request the client gave up on (idempotent)."""
        if handle.done:
            return
        handle.done = True
        if self._requests.pop(handle.request_id, None) is not None:
            self.engine.abort(handle.request_id)
            self.stats.finished["abort"] += 1

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    # -- faults ---------------------------------------------------------------------------------

    def crash(self) -> None:
        """The engine dies: requests in flight are cut; nothing runs until :meth:`restart`."""
        self.faults.crashed = True
        self._cut_all()
        self.engine.reset()

    def restart(self) -> None:
        """A fresh engine: empty caches, event seq from 0, an empty replay buffer."""
        self._cut_all()
        self.engine.reset()
        if self.publisher is not None:
            self.publisher.reset()
        self.faults.crashed = False
        self.stats.restarts += 1
        self._wake.set()

    def stall(self, seconds: float) -> None:
        self.faults.stalled_until = asyncio.get_running_loop().time() + seconds
        self._wake.set()

    def poke(self) -> None:
        """Re-evaluate faults now (after one was cleared)."""
        self._wake.set()

    def _cut_all(self) -> None:
        self._epoch += 1  # a step in progress is discarded
        for handle in self._requests.values():
            handle.done = True
            handle.queue.put_nowait(CRASHED)
            self.stats.crashed_requests += 1
        self._requests.clear()

    # -- the loop -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvroute-sim-engine")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _wait(self, timeout: float | None) -> None:
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            now = loop.time()
            if self.faults.crashed:
                await self._wait(None)
                continue
            if self.faults.stalled(now):
                await self._wait(self.faults.stalled_until - now)
                continue
            if not self.engine.has_work():
                await self._wait(None)
                deadline = loop.time()
                continue
            epoch = self._epoch
            result = self.engine.step(time.time())
            modelled = result.duration_s / self.time_scale
            deadline = max(deadline, now - MAX_CATCH_UP_S) + modelled
            # sleep(0) still yields, so HTTP handlers run between back-to-back short steps.
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            # Lateness stays near zero while this process keeps up with the modelled step times.
            self.stats.steps += 1
            self.stats.modelled_step_s += modelled
            self.stats.late_step_s += max(0.0, loop.time() - deadline)
            if epoch != self._epoch:
                continue  # crashed or restarted while this step "ran"
            await self._publish(result)
            self._deliver(result)

    async def _publish(self, result: StepResult) -> None:
        payload = result.events_legacy if self.legacy_events else result.events
        if payload is None or self.publisher is None:
            return
        try:
            await self.publisher.publish(payload, drop=self.faults.should_drop())
        except Exception:
            log.exception("publishing a KV-event batch failed")

    def _deliver(self, result: StepResult) -> None:
        now = time.monotonic()
        for request_id, new_ids, finished, reason, cached, prompt_tokens in result.outputs:
            handle = self._requests.get(request_id)
            if handle is None:
                continue  # aborted meanwhile
            if new_ids and handle.first_token_at is None:
                handle.first_token_at = now
                self.stats.ttft.observe(now - handle.arrival)
                self.stats.prompt_tokens += prompt_tokens
            self.stats.generation_tokens += len(new_ids)
            if finished:
                handle.done = True
                del self._requests[request_id]
                self.stats.finished[reason or "stop"] += 1
            handle.queue.put_nowait(Output(list(new_ids), finished, reason, cached, prompt_tokens))
