"""Progress of a model load on a text stream (the CLI's stderr): one rewritten line with an ETA
on a terminal (a line every 10 s into a log), then the time and rate.

`LoadProgress` is the `progress(what, fraction)` callback a `Session` takes; `finish()` writes
how long the load took and how fast it read the file (GB/s of file bytes).  With `heartbeat_s`
(the CLI's, on a terminal) a thread rewrites the line that often between callbacks, so a long
step (an output head dequantised on a CPU) shows its seconds going by instead of a frozen line;
`clear()`/`finish()` stop it.
"""
from __future__ import annotations

import logging
import threading
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
    heartbeat_s: float | None = None  # a terminal's line rewritten this often between callbacks
    _what: str = field(default="", init=False)
    _frac: float = field(default=0.0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _beat: threading.Thread | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._t0 = time.perf_counter()
        isatty = getattr(self.stream, "isatty", None)
        self._tty = bool(isatty and isatty())
        if self.interval_s is None:
            self.interval_s = 0.2 if self._tty else 10.0
        self._last = self._t0  # a log gets its first line after interval_s: short loads print one line

    def __call__(self, what: str, frac: float) -> None:
        now = time.perf_counter()
        self._what, self._frac = what, frac
        if self.heartbeat_s and self._tty and self._beat is None and frac < 1.0:
            self._beat = threading.Thread(target=self._heartbeat, name="strata-load-progress", daemon=True)
            self._beat.start()
        if now - self._last < self.interval_s or frac >= 1.0:
            return
        self._last = now
        self._show(now)

    def _show(self, now: float) -> None:
        spent = now - self._t0
        frac = self._frac
        eta = f", about {spent / frac - spent:.0f} s left" if 0.02 < frac < 1.0 else ""
        text = f"{self.verb} {self.label}: {self._what} {100 * frac:.0f}% ({spent:.1f} s{eta})"
        with self._lock:
            if self._stop.is_set():
                return
            if self._tty:
                self.stream.write("\r" + text[:120].ljust(120))
                self._open_line = True
            else:
                self.stream.write(text + "\n")
            self.stream.flush()

    def _heartbeat(self) -> None:
        assert self.heartbeat_s is not None
        while not self._stop.wait(self.heartbeat_s):
            self._show(time.perf_counter())

    def clear(self) -> float:
        """Clear the rewritten line (a terminal's); returns the seconds since the start."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
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
