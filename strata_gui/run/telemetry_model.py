"""GPU telemetry samples of one run as per-GPU series on the Gantt's time axis (no Qt).

Samples arrive in batches every ~50 ms during a run.  Each GPU keeps one growable float64
array per series, appended in place (capacity doubles), so a redraw takes views of what is
there instead of rebuilding arrays from every sample so far (which was quadratic in a run).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from engine.topology import TelemetrySample

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
