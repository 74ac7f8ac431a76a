"""Repeated measurements of one figure: median and spread (no Qt).

A run from the Run tab can be repeated; a sweep point has repeats; the history holds earlier
runs with the same settings.  `Spread` is what the summary and Compare say about such a set:
its median, its range, and its sample standard deviation ("± sd", as strata-bench and the
Sweep tab say it; `rel`, half the range over the median, is Compare's noise band, not shown as
"±").  One value has no known spread (`known` is False): the app then says so instead of
showing a single sample as if it were a result.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Spread:
        return cls(tuple(float(v) for v in values if v is not None))

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def known(self) -> bool:
        """At least two values: a spread was measured."""
        return self.n >= 2

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    @property
    def lo(self) -> float | None:
        return min(self.values) if self.values else None

    @property
    def hi(self) -> float | None:
        return max(self.values) if self.values else None

    @property
    def sd(self) -> float | None:
        """The sample standard deviation (n - 1), as strata-bench's ± sd; None without two values."""
        return statistics.stdev(self.values) if self.known else None

    @property
    def rel(self) -> float | None:
        """Half the range over the median (0.05 = ±5%); None without two values or a median of 0."""
        med = self.median
        if not self.known or not med:
            return None
        return (self.hi - self.lo) / 2 / abs(med)


def format_spread(s: Spread, fmt: str = "{:,.0f}", unit: str = "") -> str:
    """'12,345 tok/s (median of 3; 12,001–12,600, ± sd 300)', or the one value when there is one."""
    if not s.values:
        return "—"
    u = f" {unit}" if unit else ""
    if not s.known:
        return f"{fmt.format(s.median)}{u}"
    return (f"{fmt.format(s.median)}{u} (median of {s.n}; {fmt.format(s.lo)}–{fmt.format(s.hi)}, "
            f"± sd {fmt.format(s.sd)})")
