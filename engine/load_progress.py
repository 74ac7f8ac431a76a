"""Progress of a model load on a text stream (the CLI's stderr): throttled lines, then the rate.

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
    interval_s: float = 0.5
    _t0: float = field(default_factory=time.perf_counter)
    _last: float = -1.0
    _what: str = ""

    def __call__(self, what: str, frac: float) -> None:
        now = time.perf_counter()
        if what != self._what or now - self._last >= self.interval_s or frac >= 1.0:
            self._what, self._last = what, now
            self.stream.write(f"loading {self.label}: {what} {100 * frac:.0f}% ({now - self._t0:.1f} s)\n")
            self.stream.flush()

    def finish(self) -> float:
        """Write the total; returns the seconds the load took."""
        took = time.perf_counter() - self._t0
        rate = f": {self.file_bytes / took / 1e9:.2f} GB/s of file" if self.file_bytes and took > 0 else ""
        self.stream.write(f"loaded {self.label} ({self.file_bytes / 2**30:.2f} GiB) in {took:.2f} s{rate}\n")
        self.stream.flush()
        return took
