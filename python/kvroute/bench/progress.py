"""A one-line progress bar on a terminal (no dependency); silent when the stream is not a TTY."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``update(done, total)`` redraws ``label [#####.....] 45% 540/1200 3.2s`` in place."""

    def __init__(self, label: str = "", *, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.label = label
        self.started = time.monotonic()
        self._last = 0.0
        self._drawn = False

    def set_label(self, label: str) -> None:
        self.label = label

    def update(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        line = f"\r{self.label} [{bar:<30}] {frac:4.0%} {done}/{total} {now - self.started:.1f}s"
        self.stream.write(line + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
