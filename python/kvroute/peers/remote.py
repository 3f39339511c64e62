"""Applying peers' batches to this router's scheduler (the receiving half of fan-out).

Everything goes through the core's remote API (``Scheduler.apply_remote_reserve``,
``..._prefill_done``, ``..._progress``, ``..._finished``), which is idempotent, keys reservations
by ``(origin, id)``, ignores this router's own id and tombstones finished keys, so a late or
repeated message can never resurrect a finished request. On top of that, per origin router:

* batches whose ``seq`` is not above the last one seen are dropped (repeats, replays);
* a snapshot lists every reservation the origin still holds: the ones this router holds for it
  and the snapshot does not list are finished (their ``FINISHED`` was lost), the ones it lacks are
  booked (their ``RESERVE`` was lost). That is how a peer that was unreachable converges again;
* an origin silent for ``timeout_s`` (snapshots double as heartbeats) is presumed dead: every
  reservation it had is finished here.

Engines are named on the wire by backend name and rank and mapped to this router's worker ids
(peers must give their backends the same names); records for engines unknown here are skipped.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvroute.peers import wire

if TYPE_CHECKING:
    from kvroute.fleet import Fleet

log = logging.getLogger("kvroute.peers")

RESULTS = ("applied", "own", "duplicate", "malformed", "auth_failed", "stale")


@dataclass(slots=True)
class Origin:
    """What this router knows of one peer router (by its router id)."""

    name: str
    last_seq: int
    last_seen: float
    live: set[int] = field(default_factory=set)
    """Reservation ids of this origin booked here (and not seen finished)."""
    batches: int = 0


class RemoteLedger:
    """Applies decoded batches; keeps per-origin state. Used from the event loop only."""

    def __init__(
        self, fleet: Fleet, *, timeout_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.fleet = fleet
        self.sched = fleet.scheduler
        self.router_id = fleet.scheduler.router_id
        self.block_size = fleet.scheduler.block_size
        self.timeout_s = timeout_s
        self.clock = clock
        self.origins: dict[int, Origin] = {}
        self.results: dict[str, int] = dict.fromkeys(RESULTS, 0)
        self.unknown_engines = 0
        self.timeouts = 0
        self.latencies: deque[float] = deque(maxlen=1024)
        """Seconds from a peer's send (its wall clock) to arrival here, last 1,024 update batches."""

    def count(self, result: str) -> None:
        self.results[result] += 1

    def _worker(self, backend: str, rank: int) -> int | None:
        b = self.fleet.backends.get(backend)
        if b is None or rank >= len(b.engines):
            self.unknown_engines += 1
            return None
        return b.engines[rank].worker

    def apply(self, batch: wire.Batch) -> str:
        """Applies one batch; returns the result it is counted under."""
        if batch.origin == self.router_id:
            self.count("own")
            return "own"
        now = self.clock()
        o = self.origins.get(batch.origin)
        if o is None:
            o = self.origins[batch.origin] = Origin(batch.name, batch.seq - 1, now)
            log.info("peer %s (router %x) joined", batch.name, batch.origin)
        if batch.seq <= o.last_seq:
            self.count("duplicate")
            return "duplicate"
        o.last_seq = batch.seq
        o.last_seen = now
        if batch.kind != wire.SNAPSHOT:
            self.latencies.append(max(0.0, time.time() - batch.sent_at))
        o.name = batch.name
        o.batches += 1
        if batch.kind == wire.SNAPSHOT:
            self._snapshot(batch.origin, o, batch.records)
        else:
            for r in batch.records:
                self._update(batch.origin, o, r)
        self.count("applied")
        return "applied"

    def _update(self, origin: int, o: Origin, r: wire.Record) -> None:
        s = self.sched
        if isinstance(r, wire.Reserve):
            worker = self._worker(r.backend, r.rank)
            if worker is None:
                return
            blocks = -(-r.prompt_tokens // self.block_size)
            if s.apply_remote_reserve(origin, r.id, worker, r.prefill_tokens, blocks, r.hashes or None):
                o.live.add(r.id)
        elif isinstance(r, wire.PrefillDone):
            s.apply_remote_prefill_done(origin, r.id)
        elif isinstance(r, wire.Progress):
            s.apply_remote_progress(origin, r.id, r.generated)
        elif isinstance(r, wire.Finished):
            s.apply_remote_finished(origin, r.id)
            o.live.discard(r.id)

    def _snapshot(self, origin: int, o: Origin, records: list[wire.Record]) -> None:
        s = self.sched
        listed: set[int] = set()
        for r in records:
            assert isinstance(r, wire.Held)
            listed.add(r.id)
            if r.id not in o.live:
                worker = self._worker(r.backend, r.rank)
                blocks = -(-r.prompt_tokens // self.block_size)
                if worker is None or not s.apply_remote_reserve(
                    origin, r.id, worker, r.prefill_tokens, blocks
                ):
                    continue  # unknown engine, or finished here already (tombstoned)
                o.live.add(r.id)
            if r.decoding:
                # Also refreshes the reservation's deadline, so long requests never expire here.
                s.apply_remote_progress(origin, r.id, r.generated)
        for gone in o.live - listed:
            s.apply_remote_finished(origin, gone)
        o.live &= listed

    def expire(self) -> list[str]:
        """Drops origins silent for ``timeout_s`` (and all their reservations); returns their names."""
        now = self.clock()
        dead = [k for k, o in self.origins.items() if now - o.last_seen > self.timeout_s]
        names = []
        for k in dead:
            o = self.origins.pop(k)
            for id in o.live:
                self.sched.apply_remote_finished(k, id)
            self.timeouts += 1
            names.append(o.name)
            log.warning(
                "peer %s (router %x) silent for %.1f s: its %d reservation(s) dropped",
                o.name,
                k,
                now - o.last_seen,
                len(o.live),
            )
        return names

    def latency_quantiles(self) -> dict[str, float]:
        """p50/p90/p99 of the recent fan-out latencies (peers' wall clocks: exact on one host,
        NTP-accurate across hosts); empty before the first update batch."""
        xs = sorted(self.latencies)
        if not xs:
            return {}
        return {q: xs[min(len(xs) - 1, int(float(q) * len(xs)))] for q in ("0.5", "0.9", "0.99")}

    def live_by_origin(self) -> dict[str, int]:
        return {f"{o.name}/{k:x}": len(o.live) for k, o in self.origins.items()}
