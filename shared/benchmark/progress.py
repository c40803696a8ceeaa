"""A one-line progress bar on stderr: done/total, failures, in flight, elapsed.

On a terminal it redraws in place (carriage return) at most every 0.1 s; into a file or a pipe
it writes a plain line every 10 s instead, so logs do not fill with redraws.
"""

import sys
import time
from typing import TextIO

WIDTH = 30


class Progress:
    def __init__(
        self,
        total: int | None,
        duration_s: float | None = None,
        stream: TextIO | None = None,
        label: str = "",
    ):
        self.total = total
        self.duration_s = duration_s
        self.stream = stream or sys.stderr
        self.label = f"{label} " if label else ""
        self.live = self.stream.isatty()
        self.interval = 0.1 if self.live else 10.0
        self.started = time.monotonic()
        self.done = self.failed = self.in_flight = 0
        self._drawn = 0.0

    def started_one(self) -> None:
        self.in_flight += 1
        self._maybe_draw()

    def finished_one(self, ok: bool) -> None:
        self.in_flight -= 1
        self.done += 1
        self.failed += not ok
        self._maybe_draw()

    def close(self) -> None:
        self._draw()
        if self.live:
            self.stream.write("\n")
        self.stream.flush()

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        fraction = self._fraction(elapsed)
        filled = int(WIDTH * fraction)
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        clock = f"{elapsed:.1f}/{self.duration_s:.0f} s" if self.duration_s else f"{elapsed:.1f} s"
        return (
            f"{self.label}[{'#' * filled}{'.' * (WIDTH - filled)}] {count} done, "
            f"{self.failed} failed, {self.in_flight} in flight, {clock}"
        )

    def _fraction(self, elapsed: float) -> float:
        if self.total:
            return min(1.0, self.done / self.total)
        if self.duration_s:
            return min(1.0, elapsed / self.duration_s)
        return 0.0

    def _maybe_draw(self) -> None:
        if time.monotonic() - self._drawn >= self.interval:
            self._draw()

    def _draw(self) -> None:
        self._drawn = time.monotonic()
        self.stream.write(f"\r{self.line()}\033[K" if self.live else f"{self.line()}\n")
        self.stream.flush()
