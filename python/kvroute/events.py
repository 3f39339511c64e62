"""KV-event subscription: one asyncio ZMQ ``SUB`` socket per engine (backend and DP rank).

Each engine publishes ``[topic, seq (8 bytes, big-endian), payload]`` batches; the payload goes to
:meth:`PrefixIndex.apply` as raw bytes (decoded in Rust). The subscriber keeps the index exact
across what can go wrong on the wire (``../shared/docs/vllm.md`` section 1):

* **Gap** (``seq`` jumps ahead: batches lost at the high-water mark): ask the engine's replay
  socket (``DEALER`` -> ``ROUTER``) for the missing batches and apply them in order. If the replay
  cannot fill the gap (no replay socket, timeout, or the first replayed seq is later than the one
  asked for because the engine's buffer no longer holds it), the engine's entries are cleared
  (``clear_worker``): a *resync*, after which the index fills again from live events.
* **Restart** (``seq`` goes backwards) and **new connection** (the socket monitor reports a
  connect: the first one, or a reconnect after the engine went away): the engine's cache may be
  new, so its entries are cleared and everything the replay buffer holds is applied from seq 0.
* **Recovery**: a backend that comes back after being unhealthy is resynced the same way (it
  may have restarted without its socket noticing).
* **Reconnect**: libzmq reconnects with exponential backoff (``RECONNECT_IVL`` up to
  ``RECONNECT_IVL_MAX``); a failing socket is recreated, with backoff too.

Batches a replay already applied are skipped when they arrive live (same seq, same bytes). The
engine's DP rank is implied by the socket (vLLM shifts the port by the rank), not read from the
payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvroute._native import InvalidEventError, PrefixIndex

log = logging.getLogger("kvroute.events")

END_SEQ = b"\xff" * 8
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 5000
POLL_MS = 100


@dataclass(slots=True)
class EventStats:
    """Counters of one engine's event stream (read by metrics and the status page)."""

    batches: int = 0
    malformed: int = 0
    duplicates: int = 0
    gaps: int = 0
    missed_batches: int = 0
    replays: int = 0
    replay_failures: int = 0
    replayed_batches: int = 0
    resyncs: int = 0
    restarts: int = 0
    connects: int = 0
    disconnects: int = 0
    connected: bool = False
    last_seq: int | None = None
    lag_s: float = 0.0
    """Wall-clock time between the engine stamping the last batch and its arrival here."""


def batch_timestamp(payload: bytes) -> float | None:
    """The ``ts`` of a msgpack batch ``[ts, events, dp_rank]`` without decoding the rest."""
    if len(payload) >= 10 and payload[0] == 0x93 and payload[1] == 0xCB:
        ts: float = struct.unpack_from(">d", payload, 2)[0]
        return ts
    return None


ReplayFn = Callable[[int], Awaitable[list[tuple[int, bytes]] | None]]


class SeqTracker:
    """Sequence logic of one engine's stream, separate from the sockets so it can be tested alone.

    ``replay(start)`` returns the buffered ``(seq, payload)`` batches from ``start`` on, or None
    when it cannot (no socket, timeout, bad reply).
    """

    def __init__(self, index: PrefixIndex, worker: int, replay: ReplayFn, stats: EventStats) -> None:
        self.index = index
        self.worker = worker
        self.replay = replay
        self.stats = stats
        self.last: int | None = None
        """Last applied seq; None = nothing trusted (fresh connection): resync on the next batch."""
        self._clean = False
        """The engine's entries were just cleared and nothing was applied since."""
        self._replayed: dict[int, int] = {}
        """seq -> hash(payload) of batches a replay applied that have not yet been seen live: a
        live batch equal to one of them is a duplicate, a different one means a restart."""

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            self.index.apply(self.worker, payload)
        except InvalidEventError as e:
            self.stats.malformed += 1
            log.warning("engine %d: malformed KV-event batch %d: %s", self.worker, seq, e)
        self.last = seq
        self.stats.last_seq = seq
        self._clean = False

    async def resync(self, reason: str, upto: int | None = None) -> None:
        """Clears the engine's entries and applies what the replay buffer holds from seq 0
        (``upto``: stop before this seq, which the caller holds)."""
        self.stats.resyncs += 1
        dropped = self.index.clear_worker(self.worker)
        log.info("engine %d: index resync (%s), %d entries dropped", self.worker, reason, dropped)
        self.last = None
        self._replayed.clear()
        self._clean = True
        batches = await self._replay(0)
        for seq, payload in batches or ():
            if upto is not None and seq >= upto:
                break
            self._apply(seq, payload)
            if upto is None:
                self._replayed[seq] = hash(payload)

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        self.stats.replays += 1
        batches = await self.replay(start)
        if batches is None:
            self.stats.replay_failures += 1
        else:
            self.stats.replayed_batches += len(batches)
        return batches

    async def on_batch(self, seq: int, payload: bytes) -> None:
        """One live batch."""
        self.stats.batches += 1
        ts = batch_timestamp(payload)
        if ts is not None:
            self.stats.lag_s = max(0.0, time.time() - ts)
        last = self.last
        if last is None:
            # Nothing trusted yet. After a resync that found the buffer empty, a stream starting
            # at 0 needs nothing more; otherwise fetch what came before this batch.
            if not (seq == 0 and self._clean):
                await self.resync("new stream", upto=seq)
            self._apply(seq, payload)
            return
        if seq == last + 1:
            self._replayed.clear()
            self._apply(seq, payload)
            return
        if seq <= last:
            if self._replayed.get(seq) == hash(payload):
                self.stats.duplicates += 1
                return
            self.stats.restarts += 1
            await self.resync(f"sequence restarted at {seq} after {last}", upto=seq)
            self._apply(seq, payload)
            return
        await self._fill_gap(last + 1, seq)
        self._apply(seq, payload)

    async def _fill_gap(self, start: int, seq: int) -> None:
        self.stats.gaps += 1
        self.stats.missed_batches += seq - start
        log.info("engine %d: KV-event gap, batches %d..%d missing", self.worker, start, seq - 1)
        batches = await self._replay(start)
        wanted = [(s, p) for s, p in batches or () if start <= s < seq]
        if batches is None or not wanted or wanted[0][0] != start or len(wanted) != seq - start:
            # The buffer no longer holds the gap (or there is no replay): what the engine did in
            # it is unknown, so its entries cannot be trusted.
            self.stats.resyncs += 1
            dropped = self.index.clear_worker(self.worker)
            log.info("engine %d: gap not replayable, index cleared (%d entries)", self.worker, dropped)
            # What was replayed is still true of the current cache; apply it.
            for s, p in wanted:
                self._apply(s, p)
            return
        for s, p in wanted:
            self._apply(s, p)

    async def on_connect(self) -> None:
        """The socket (re)connected: the engine's cache may be new."""
        self.stats.connects += 1
        self.stats.connected = True
        await self.resync("connected")

    def on_disconnect(self) -> None:
        self.stats.disconnects += 1
        self.stats.connected = False


class EventSubscriber:
    """Subscribes to one engine's KV events until :meth:`stop` (or the task is cancelled)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        index: PrefixIndex,
        worker: int,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        topic: str = "",
        replay_timeout_s: float = 2.0,
        stats: EventStats | None = None,
    ) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s
        self.stats = stats or EventStats()
        self.tracker = SeqTracker(index, worker, self.replay, self.stats)
        self._task: asyncio.Task[None] | None = None
        self._resync_requested = False

    def request_resync(self) -> None:
        """Clears the engine's entries and replays its buffer (soon, in the subscriber's task):
        called when a backend comes back after being unhealthy, as it may have restarted."""
        self._resync_requested = True

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self.run(), name=f"kvroute-events-{self.tracker.worker}"
        )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def run(self) -> None:
        backoff = 0.1
        while True:
            try:
                await self._subscribe()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("engine %d: KV-event subscriber failed; reconnecting", self.tracker.worker)
                self.tracker.on_disconnect()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RECONNECT_IVL_MAX_MS / 1000)

    async def _subscribe(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        mon = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            sub.connect(self.endpoint)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(mon, zmq.POLLIN)
            while True:
                if self._resync_requested:
                    self._resync_requested = False
                    await self.tracker.resync("requested")
                ready = dict(await poller.poll(POLL_MS))
                if mon in ready:
                    event = parse_monitor_message(await mon.recv_multipart())["event"]
                    if event == zmq.EVENT_CONNECTED:
                        await self.tracker.on_connect()
                    elif event == zmq.EVENT_DISCONNECTED:
                        self.tracker.on_disconnect()
                if sub in ready:
                    # Drain what is queued, without waiting, before polling again.
                    for _ in range(256):
                        try:
                            frames = await sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        await self._on_frames(frames)
        finally:
            sub.disable_monitor()
            mon.close(linger=0)
            sub.close(linger=0)

    async def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.malformed += 1
            return
        await self.tracker.on_batch(int.from_bytes(frames[1], "big"), frames[2])

    async def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Asks the replay socket for every buffered batch with seq >= ``start``."""
        if self.replay_endpoint is None:
            return None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[tuple[int, bytes]] = []
            async with asyncio.timeout(self.replay_timeout_s):
                while True:
                    frames = await sock.recv_multipart()
                    if frames and frames[0] == b"":
                        frames = frames[1:]
                    # [topic, seq, payload] (vLLM >= mid-2026) or [seq, payload] (older).
                    if len(frames) == 3:
                        seq_b, payload = frames[1], frames[2]
                    elif len(frames) == 2:
                        seq_b, payload = frames
                    else:
                        log.warning("engine %d: malformed replay reply", self.tracker.worker)
                        return None
                    if payload == b"" or seq_b == END_SEQ:
                        return out
                    if len(seq_b) != 8:
                        return None
                    out.append((int.from_bytes(seq_b, "big"), payload))
        except TimeoutError:
            log.warning("engine %d: replay from %d timed out", self.tracker.worker, start)
            return None
        finally:
            sock.close(linger=0)
