"""Progress of a multi-run job on a text stream (the CLI's stderr): which run of how many, the
arm and the test, time spent and an estimate of the time left.

On a terminal one line is rewritten, and a ticker refreshes the elapsed time every second while
a long run goes on; into a pipe or a file nothing is written unless asked (`--progress`: then a
line per run), and `--quiet` silences it everywhere.  The estimate is the mean time of the runs
so far (warm-ups count: they cost about what a measured run does) times the runs left.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TextIO

WIDTH = 120


def duration(seconds: float) -> str:
    """41 s, 3 min 05 s, 1 h 02 min."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


@dataclass
class RunProgress:
    stream: TextIO | None  # None: silent
    measured: int  # measured runs in the job
    warmups: int = 0  # unmeasured runs in the job
    tty: bool = False  # rewrite one line (else a line per run)
    tick_s: float = 1.0  # the ticker's refresh on a terminal
    clock: object = time.perf_counter  # a test passes its own
    _t0: float = field(default=0.0, init=False)
    _started: int = field(default=0, init=False)  # runs started (warm-ups too)
    _measured_started: int = field(default=0, init=False)
    _text: str = field(default="", init=False)
    _end: float | None = field(default=None, init=False)  # the estimated end of the job (clock time)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _ticker: threading.Thread | None = field(default=None, init=False)

    @classmethod
    def for_stream(cls, stream: TextIO, *, quiet: bool, force: bool, measured: int, warmups: int = 0) -> RunProgress:
        """Shown on a terminal (or with force), not with quiet, and only for a job of more than one run."""
        isatty = getattr(stream, "isatty", None)
        tty = bool(isatty and isatty())
        shown = not quiet and (tty or force) and measured + warmups > 1
        return cls(stream if shown else None, measured, warmups, tty=tty)

    def __post_init__(self) -> None:
        self._t0 = self.clock()

    @property
    def total(self) -> int:
        return self.measured + self.warmups

    def start(self, arm: str, prompt_tokens: int, *, repeat: int | None = None, warmup: int | None = None) -> None:
        """A run begins: `repeat` (0-based) for a measured one, `warmup` for an unmeasured one."""
        if self.stream is None:
            return
        now = self.clock()
        spent = now - self._t0
        done = self._started
        self._started += 1
        if warmup is not None:
            what = f"warm-up {warmup + 1}"
        else:
            self._measured_started += 1
            what = f"run {self._measured_started}/{self.measured}" + (f" (repeat {repeat + 1})" if repeat else "")
        self._end = now + spent / done * (self.total - done) if done else None
        head = f"[{done + 1}/{self.total}] {what} · arm {arm} · pp{prompt_tokens}"
        with self._lock:
            self._text = head
            self._write(self._line(now))
        if self.tty and self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="strata-run-progress", daemon=True)
            self._ticker.start()

    def _line(self, now: float) -> str:
        eta = f", about {duration(max(0.0, self._end - now))} left" if self._end is not None else ""
        return f"{self._text} · {duration(now - self._t0)} elapsed{eta}"

    def _tick(self) -> None:
        while not self._stop.wait(self.tick_s):
            with self._lock:
                if self._text and self.stream is not None:
                    self._write(self._line(self.clock()), refresh=True)

    def _write(self, text: str, refresh: bool = False) -> None:
        assert self.stream is not None
        if self.tty:
            self.stream.write("\r" + text[:WIDTH].ljust(WIDTH))
        elif not refresh:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Stop the ticker and clear the line (a terminal's)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self.stream is not None and self.tty and self._started:
            with self._lock:
                self.stream.write("\r" + " " * WIDTH + "\r")
                self.stream.flush()
