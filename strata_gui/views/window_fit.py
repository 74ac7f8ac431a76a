"""Where the main window goes on the screen (no Qt): a remembered size and place, clamped to the
screen's available area, or a default size that fits it.

At 150% scale a 1920x1080 screen is 1280x720 logical pixels (less the task bar): a window forced
to 1600x1000 put the right column and the summary off-screen.  `fit` keeps a remembered window
where it was when it fits, shrinks it (never below the layout's minimum, unless the screen is
smaller still) and moves it back on the screen otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

PREFERRED = (1600, 1000)  # the first start's size, when the screen has room for it
TITLE_BAR = 32  # the window frame's title bar, above the geometry Qt restores (logical px)


@dataclass(frozen=True)
class Rect:
    x: int
    y: int
    w: int
    h: int


def fit(saved: Rect | None, available: Rect, minimum: tuple[int, int] = (0, 0),
        preferred: tuple[int, int] = PREFERRED) -> Rect:
    """The window's geometry (client area) on a screen whose available area is `available`."""
    room_w, room_h = available.w, max(available.h - TITLE_BAR, 1)
    if saved is None or saved.w <= 0 or saved.h <= 0:
        w = min(preferred[0], int(room_w * 0.95))
        h = min(preferred[1], int(room_h * 0.95))
        w, h = max(w, min(minimum[0], room_w)), max(h, min(minimum[1], room_h))
        return Rect(available.x + (room_w - w) // 2, available.y + TITLE_BAR + (room_h - h) // 2, w, h)
    w = min(max(saved.w, min(minimum[0], room_w)), room_w)
    h = min(max(saved.h, min(minimum[1], room_h)), room_h)
    x = min(max(saved.x, available.x), available.x + room_w - w)
    y = min(max(saved.y, available.y + TITLE_BAR), available.y + available.h - h)
    return Rect(x, y, w, h)
