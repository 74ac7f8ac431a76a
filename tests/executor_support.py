"""Helpers for tests of stage processes: hooks that pickle (they travel into the processes), and
stages started apart (`strata-bench stage --rendezvous`, as on another workstation)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stage_command(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "engine.bench", "stage", "--rendezvous", f"127.0.0.1:{port}", *extra]


def env(**more: str) -> dict[str, str]:
    e = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update(more)
    return e


def reap(procs: list[subprocess.Popen]) -> None:
    """Kill what is still running of stages started apart, and check none is left (not even a zombie)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    assert all(process_gone(p.pid) for p in procs)


@dataclass(frozen=True)
class Sleep:
    """after_layer hook: deterministic stage work that a stage process can run (picklable)."""

    seconds: float

    def __call__(self, stage: int, layer: int, chunk: int) -> None:
        time.sleep(self.seconds)


def process_gone(pid: int) -> bool:
    """True once a pid no longer names a process (reaped; not even a zombie)."""
    return not Path(f"/proc/{pid}").exists()
