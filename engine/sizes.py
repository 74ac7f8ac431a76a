"""Byte counts as people read them: each in the unit that keeps its digits meaningful."""
from __future__ import annotations

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def size_text(nbytes: int | float) -> str:
    """'1.23 GiB', '12.3 MiB', '512 KiB', '0 B': a unit from 1000 of the one below it (so no
    '1023.9 MiB'), three significant digits or so."""
    if nbytes >= 1000 * MiB:
        return f"{nbytes / GiB:.2f} GiB"
    if nbytes >= 1000 * KiB:
        return f"{nbytes / MiB:.1f} MiB" if nbytes < 100 * MiB else f"{nbytes / MiB:.0f} MiB"
    if nbytes > 0:
        return f"{max(nbytes / KiB, 0.1):.1f} KiB" if nbytes < 100 * KiB else f"{nbytes / KiB:.0f} KiB"
    return "0 B"
