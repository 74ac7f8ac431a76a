"""Byte counts as people read them: each in the unit that keeps its digits meaningful."""
from __future__ import annotations

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def _digits(value: float) -> str:
    """Three significant digits or so: one decimal below 100, none from there."""
    return f"{value:.1f}" if round(value, 1) < 100 else f"{value:.0f}"


def size_text(nbytes: int | float) -> str:
    """'1.23 GiB', '12.3 MiB', '512 KiB', '0 B': the unit is chosen on the rounded figure, so a
    size never reads '1000 MiB' or '1023.9 MiB' (it is then '0.98 GiB' or '1.00 GiB')."""
    if nbytes <= 0:
        return "0 B"
    if round(nbytes / MiB) >= 1000:
        return f"{nbytes / GiB:.2f} GiB"
    if round(nbytes / KiB) >= 1000:
        return f"{_digits(nbytes / MiB)} MiB"
    return f"{_digits(max(nbytes / KiB, 0.1))} KiB"
