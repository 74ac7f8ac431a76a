"""GPU telemetry samples of one run as per-GPU series on the Gantt's time axis (no Qt)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from engine.topology import TelemetrySample

SERIES = ("util_pct", "pcie_tx_gbs", "pcie_rx_gbs", "mem_used", "sm_clock_mhz", "power_w", "temp_c")


@dataclass
class TelemetryStore:
    origin_ns: int = 0
    available: bool = False
    reason: str = "telemetry starts with a run"
    _rows: dict[int, list[TelemetrySample]] = field(default_factory=dict)

    def reset(self, origin_ns: int, available: bool, reason: str) -> None:
        self.origin_ns, self.available, self.reason = origin_ns, available, reason
        self._rows = {}

    def add(self, samples: Iterable[TelemetrySample]) -> int:
        n = 0
        for s in samples:
            self._rows.setdefault(s.gpu, []).append(s)
            n += 1
        return n

    @property
    def gpus(self) -> list[int]:
        return sorted(self._rows)

    def __len__(self) -> int:
        return sum(len(r) for r in self._rows.values())

    def series(self, gpu: int, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(seconds since the run started, values) of one quantity; missing readings are NaN."""
        if name not in SERIES:
            raise ValueError(f"unknown telemetry series {name!r}: allowed {', '.join(SERIES)}")
        rows = self._rows.get(gpu, [])
        t = np.fromiter(((s.t_ns - self.origin_ns) / 1e9 for s in rows), dtype=np.float64, count=len(rows))
        v = np.fromiter((np.nan if getattr(s, name) is None else float(getattr(s, name)) for s in rows),
                        dtype=np.float64, count=len(rows))
        return t, v
