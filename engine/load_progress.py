"""Progress of a model load on a text stream (the CLI's stderr): one rewritten line with an ETA
on a terminal (a line every 10 s into a log), then the time and rate.

`LoadProgress` is the `progress(what, fraction)` callback a `Session` takes; `finish()` writes
how long the load took and how fast it read the file (GB/s of file bytes).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TextIO

log = logging.getLogger(__name__)


@dataclass
class LoadProgress:
    stream: TextIO
    file_bytes: int  # 0 when there is no file (synthetic weights)
    label: str = "model"
    verb: str = "loading"  # "writing" for make-model
    interval_s: float | None = None  # None: 0.2 s on a terminal (one line, rewritten), 10 s into a log
    _t0: float = field(default=0.0, init=False)
    _last: float = -1.0
    _tty: bool = field(default=False, init=False)
    _open_line: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self._t0 = time.perf_counter()
        isatty = getattr(self.stream, "isatty", None)
        self._tty = bool(isatty and isatty())
        if self.interval_s is None:
            self.interval_s = 0.2 if self._tty else 10.0
        self._last = self._t0  # a log gets its first line after interval_s: short loads print one line

    def __call__(self, what: str, frac: float) -> None:
        now = time.perf_counter()
        if now - self._last < self.interval_s or frac >= 1.0:
            return
        self._last = now
        spent = now - self._t0
        eta = f", about {spent / frac - spent:.0f} s left" if 0.02 < frac < 1.0 else ""
        text = f"{self.verb} {self.label}: {what} {100 * frac:.0f}% ({spent:.1f} s{eta})"
        if self._tty:
            self.stream.write("\r" + text[:120].ljust(120))
            self._open_line = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def clear(self) -> float:
        """Clear the rewritten line (a terminal's); returns the seconds since the start."""
        if self._open_line:
            self.stream.write("\r" + " " * 120 + "\r")
            self._open_line = False
        return time.perf_counter() - self._t0

    def finish(self) -> float:
        """Write the total; returns the seconds the load took."""
        took = self.clear()
        rate = f": {self.file_bytes / took / 1e9:.2f} GB/s of file" if self.file_bytes and took > 0 else ""
        self.stream.write(f"loaded {self.label} ({self.file_bytes / 2**30:.2f} GiB) in {took:.2f} s{rate}\n")
        self.stream.flush()
        return took
