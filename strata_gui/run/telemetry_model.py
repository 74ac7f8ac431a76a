"""GPU telemetry samples of one run as per-GPU series on the Gantt's time axis (no Qt).

Samples arrive in batches every ~50 ms during a run.  Each GPU keeps one growable float64
array per series, appended in place (capacity doubles), so a redraw takes views of what is
there instead of rebuilding arrays from every sample so far (which was quadratic in a run).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from engine.hw.topology import GpuProcess, TelemetrySample, TelemetrySampler, Topology, gpu_processes

log = logging.getLogger(__name__)

SERIES = ("util_pct", "pcie_tx_gbs", "pcie_rx_gbs", "mem_used", "sm_clock_mhz", "power_w", "temp_c")
_START = 256


@dataclass
class _GpuColumns:
    """Time (ns) and every series of one GPU in growable columns; missing readings are NaN."""

    n: int = 0
    t_ns: np.ndarray = field(default_factory=lambda: np.empty(_START, dtype=np.int64))
    values: np.ndarray = field(default_factory=lambda: np.empty((len(SERIES), _START), dtype=np.float64))

    def append(self, rows: list[TelemetrySample]) -> None:
        need = self.n + len(rows)
        if need > self.t_ns.size:
            cap = max(need, 2 * self.t_ns.size)
            t, v = np.empty(cap, dtype=np.int64), np.empty((len(SERIES), cap), dtype=np.float64)
            t[: self.n], v[:, : self.n] = self.t_ns[: self.n], self.values[:, : self.n]
            self.t_ns, self.values = t, v
        sl = slice(self.n, need)
        self.t_ns[sl] = [s.t_ns for s in rows]
        for i, name in enumerate(SERIES):
            self.values[i, sl] = [np.nan if (x := getattr(s, name)) is None else float(x) for s in rows]
        self.n = need


@dataclass
class TelemetryStore:
    origin_ns: int = 0
    available: bool = False
    reason: str = "telemetry starts with a run"
    _gpus: dict[int, _GpuColumns] = field(default_factory=dict)

    def reset(self, origin_ns: int, available: bool, reason: str) -> None:
        self.origin_ns, self.available, self.reason = origin_ns, available, reason
        self._gpus = {}

    def add(self, samples: Iterable[TelemetrySample]) -> int:
        by_gpu: dict[int, list[TelemetrySample]] = {}
        for s in samples:
            by_gpu.setdefault(s.gpu, []).append(s)
        for gpu, rows in by_gpu.items():
            self._gpus.setdefault(gpu, _GpuColumns()).append(rows)
        return sum(len(r) for r in by_gpu.values())

    @property
    def gpus(self) -> list[int]:
        return sorted(self._gpus)

    def __len__(self) -> int:
        return sum(c.n for c in self._gpus.values())

    def series(self, gpu: int, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(seconds since the run started, values) of one quantity; missing readings are NaN."""
        if name not in SERIES:
            raise ValueError(f"unknown telemetry series {name!r}: allowed {', '.join(SERIES)}")
        cols = self._gpus.get(gpu)
        if cols is None:
            return np.zeros(0), np.zeros(0)
        t = (cols.t_ns[: cols.n] - self.origin_ns) / 1e9
        return t, cols.values[SERIES.index(name), : cols.n].copy()


class TelemetryMonitor:
    """The GPU panel between runs (nvitop's view of our devices): a sampler on every GPU the
    machine has, polled by the window's timer, and the processes holding GPU memory.  No Qt; the
    sampler's thread does the NVML reads."""

    def __init__(self, topo: Topology | None, interval_s: float = 0.5, processes_every: int = 4) -> None:
        self.topology = topo
        self.interval_s = interval_s
        self.processes_every = processes_every
        self.sampler: TelemetrySampler | None = None
        self.origin_ns = 0
        self._since: int | None = None
        self._polls = 0
        self.reason = ""

    def start(self) -> bool:
        """Start sampling (True), or False and `reason` says why there is nothing to watch."""
        self.stop()
        if self.topology is None or not self.topology.devices:
            why = self.topology.reason if self.topology is not None else "GPU discovery has not run"
            self.reason = f"no GPU to monitor ({why})" if why else "no GPU to monitor"
            return False
        sampler = TelemetrySampler(self.topology, interval_s=self.interval_s)
        if not sampler.available:
            self.reason = sampler.reason
            return False
        self.origin_ns = time.perf_counter_ns()
        self._since, self._polls, self.reason = None, 0, sampler.reason
        sampler.start()
        self.sampler = sampler
        return True

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
        self.sampler = None

    @property
    def running(self) -> bool:
        return self.sampler is not None

    def poll(self) -> tuple[list[TelemetrySample], list[GpuProcess] | None]:
        """The samples since the last poll, and (every `processes_every` polls) the GPU processes."""
        if self.sampler is None:
            return [], None
        samples = self.sampler.samples(since_ns=self._since)
        if samples:
            self._since = samples[-1].t_ns
        procs = None
        if self._polls % self.processes_every == 0 and self.topology is not None:
            procs, why = gpu_processes(self.topology)
            if why:
                log.info("GPU processes: %s", why)
        self._polls += 1
        return samples, procs


def processes_text(procs: list[GpuProcess]) -> str:
    """nvitop's process lines for our GPUs: 'cuda:0 · python (pid 4242) 5.20 GiB', largest first."""
    if not procs:
        return "no process holds memory on these GPUs"
    rows = sorted(procs, key=lambda p: (p.gpu, -(p.used_bytes or 0)))
    return "\n".join(f"cuda:{p.gpu} · {p.name or '?'} (pid {p.pid}) "
                     + (f"{p.used_bytes / 2**30:.2f} GiB" if p.used_bytes is not None else "memory not reported")
                     for p in rows)
