"""A single-line live progress bar on stderr (no dependencies).

Contract: `ProgressBar(label, total, unit)`; `update(done, text)` redraws at most every 0.2 s
(always when `force`); `close()` ends the line. On a terminal the line is redrawn in place; when
stderr is not a terminal (CI logs) a plain line is printed every 10 s instead. `enabled=False`
makes every call a no-op.
"""

from __future__ import annotations

import sys
import time

WIDTH = 24


class ProgressBar:
    def __init__(self, label: str, total: float, unit: str, enabled: bool = True, stream=None):
        self.label, self.total, self.unit = label, total, unit
        self.enabled = enabled
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty()
        self._last_draw = 0.0
        self._period_s = 0.2 if self._tty else 10.0

    def update(self, done: float, text: str = "", force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last_draw < self._period_s):
            return
        self._last_draw = now
        fraction = min(1.0, done / self.total) if self.total > 0 else 1.0
        filled = int(fraction * WIDTH)
        bar = "#" * filled + "." * (WIDTH - filled)
        line = f"{self.label} [{bar}] {fraction:4.0%} {done:.0f}/{self.total:.0f} {self.unit}  {text}"
        if self._tty:
            self._stream.write("\r\x1b[2K" + line)
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def close(self, text: str = "") -> None:
        if not self.enabled:
            return
        self.update(self.total, text, force=True)
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()
