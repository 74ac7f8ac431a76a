"""Live GPU telemetry between runs (what nvitop shows for our devices): one `TelemetrySampler`
over the discovered GPUs, read by the panel's timer into a rolling window, with the processes
that hold memory on each GPU.  No Qt: the panel draws what `poll` returns."""
from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass, field

from engine.topology import GpuProcess, TelemetrySample, TelemetrySampler, Topology

log = logging.getLogger(__name__)

WINDOW_S = 120.0  # seconds of history the live plots keep
INTERVAL_S = 0.5  # one reading per GPU this often (a run's own sampler reads faster)


@dataclass
class LiveView:
    """What the live panel shows: the window's samples (oldest first), the processes, and the
    clock reading the window ends at."""

    samples: list[TelemetrySample]
    processes: list[GpuProcess]
    now_ns: int
    own_pid: int = field(default_factory=os.getpid)


class GpuMonitor:
    """Starts and stops the between-runs sampler; `poll()` gives the rolling window."""

    def __init__(self, window_s: float = WINDOW_S, interval_s: float = INTERVAL_S) -> None:
        self.window_s, self.interval_s = window_s, interval_s
        self._sampler: TelemetrySampler | None = None
        self._window: collections.deque[TelemetrySample] = collections.deque()
        self._since: int | None = None
        self.reason = "no GPU discovered yet"

    @property
    def running(self) -> bool:
        return self._sampler is not None and self._sampler.running

    def start(self, topo: Topology) -> bool:
        """Sample the topology's GPUs; False (with `reason`) when there is nothing to sample."""
        self.stop()
        try:
            sampler = TelemetrySampler(topo, interval_s=self.interval_s, capacity=int(self.window_s / self.interval_s) + 8)
        except Exception as exc:  # the monitor is a view: it must never stop the app
            self.reason = f"the GPU monitor could not start: {exc}"
            log.warning("%s", self.reason)
            return False
        if not sampler.available:
            self.reason = f"GPU monitor {sampler.reason}"
            return False
        sampler.start()
        self._sampler, self.reason = sampler, sampler.reason
        return sampler.running

    def stop(self) -> None:
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.stop()

    def poll(self, now_ns: int | None = None) -> LiveView:
        """The samples of the last `window_s` seconds and the latest process list."""
        now_ns = time.perf_counter_ns() if now_ns is None else now_ns
        sampler = self._sampler
        if sampler is not None:
            new = sampler.samples(since_ns=self._since)
            if new:
                self._since = new[-1].t_ns
                self._window.extend(new)
        cut = now_ns - int(self.window_s * 1e9)
        while self._window and self._window[0].t_ns < cut:
            self._window.popleft()
        procs = sampler.processes() if sampler is not None else []
        return LiveView(list(self._window), procs, now_ns)
