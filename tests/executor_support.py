"""Helpers for tests of stage processes: hooks that pickle (they travel into the processes)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Sleep:
    """after_layer hook: deterministic stage work that a stage process can run (picklable)."""

    seconds: float

    def __call__(self, stage: int, layer: int, chunk: int) -> None:
        time.sleep(self.seconds)


def process_gone(pid: int) -> bool:
    """True once a pid no longer names a process (reaped; not even a zombie)."""
    return not Path(f"/proc/{pid}").exists()
