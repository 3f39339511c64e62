"""Fault injection: what can go wrong with a replica, and when.

Kinds (``value`` in parentheses):

* ``drop`` (fraction 0..1): that fraction of KV-event batches is not sent. Their sequence numbers
  are still consumed, so subscribers see gaps, and they stay in the replay buffer, as a batch lost
  at a slow subscriber's high-water mark does on vLLM. ``drop`` with 0 ends it.
* ``restart``: the engine restarts: requests in flight end, caches are empty, the event sequence
  restarts at 0 and the replay buffer is cleared (vLLM sends no ``AllBlocksCleared`` then either).
* ``crash`` (seconds until an automatic restart; 0 or none = stay down): streams in flight are cut
  (the connection closes without the final chunk), other requests in flight fail with 500, and the
  replica answers 503 until a ``restart``.
* ``stall`` (seconds): the engine takes no step for that long; requests queue up, health stays 200.
* ``unavailable`` (seconds): every inference request and ``/health`` answer 503 for that long.
* ``clear``: ends drop, stall and unavailability (a crash needs ``restart``).

On the command line a fault is ``KIND[=VALUE][@AT_SECONDS][/REPLICA]``, e.g. ``drop=0.2``,
``restart@30``, ``crash=5@20/1`` (replica 1 crashes 20 s after start and restarts 5 s later),
``stall=3@10``. Without ``/REPLICA`` it applies to every replica. At run time each replica takes
``POST /admin/fault`` with ``{"kind": ..., "value": ...}``.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

KINDS = ("drop", "restart", "crash", "stall", "unavailable", "clear")
_NEEDS_VALUE = frozenset({"drop", "stall", "unavailable"})
_SPEC = re.compile(r"^(?P<kind>[a-z]+)(?:=(?P<value>[^@/]+))?(?:@(?P<at>[^/]+))?(?:/(?P<replica>\d+))?$")


class FaultError(ValueError):
    """A fault description is malformed."""


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """One fault: its kind, value, when (seconds after start) and where (None = every replica)."""

    kind: str
    value: float | None = None
    at_s: float = 0.0
    replica: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise FaultError(f"unknown fault kind {self.kind!r} (one of {', '.join(KINDS)})")
        if self.kind in _NEEDS_VALUE and self.value is None:
            raise FaultError(f"fault {self.kind!r} needs a value ({self.kind}=...)")
        v = self.value
        if v is not None and (not math.isfinite(v) or v < 0):
            raise FaultError(f"fault {self.kind!r}: value must be a finite number >= 0, got {v}")
        if self.kind == "drop" and v is not None and v > 1:
            raise FaultError(f"fault 'drop': fraction must be in 0..1, got {v}")
        if not math.isfinite(self.at_s) or self.at_s < 0:
            raise FaultError(f"fault {self.kind!r}: start time must be >= 0, got {self.at_s}")

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """Parses ``KIND[=VALUE][@AT_SECONDS][/REPLICA]``."""
        m = _SPEC.match(text.strip())
        if m is None:
            raise FaultError(f"bad fault {text!r}: expected KIND[=VALUE][@AT_SECONDS][/REPLICA]")
        try:
            value = float(m["value"]) if m["value"] is not None else None
            at_s = float(m["at"]) if m["at"] is not None else 0.0
        except ValueError:
            raise FaultError(f"bad fault {text!r}: VALUE and AT_SECONDS must be numbers") from None
        replica = int(m["replica"]) if m["replica"] is not None else None
        return cls(m["kind"], value, at_s, replica)

    def __str__(self) -> str:
        s = self.kind
        if self.value is not None:
            s += f"={self.value:g}"
        if self.at_s:
            s += f"@{self.at_s:g}"
        if self.replica is not None:
            s += f"/{self.replica}"
        return s


class FaultState:
    """The faults in force on one replica. Times are ``loop.time()`` seconds."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self.drop_fraction = 0.0
        self.unavailable_until = 0.0
        self.stalled_until = 0.0
        self.crashed = False
        self.dropped_batches = 0

    def should_drop(self) -> bool:
        """Decides (deterministically from the seed) whether the next event batch is dropped."""
        if self.drop_fraction <= 0.0:
            return False
        drop = self.drop_fraction >= 1.0 or self._rng.random() < self.drop_fraction
        self.dropped_batches += drop
        return drop

    def unavailable(self, now: float) -> bool:
        return self.crashed or now < self.unavailable_until

    def stalled(self, now: float) -> bool:
        return now < self.stalled_until

    def clear(self) -> None:
        self.drop_fraction = 0.0
        self.unavailable_until = 0.0
        self.stalled_until = 0.0

    def snapshot(self, now: float) -> dict[str, object]:
        return {
            "drop_fraction": self.drop_fraction,
            "dropped_batches": self.dropped_batches,
            "crashed": self.crashed,
            "unavailable_s": max(0.0, self.unavailable_until - now),
            "stalled_s": max(0.0, self.stalled_until - now),
        }
