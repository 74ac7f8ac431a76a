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
    return [sys.executable, "-m", "engine.cli.bench", "stage", "--rendezvous", f"127.0.0.1:{port}", *extra]


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
    """True once a pid no longer names a process (reaped; not even a zombie).  Linux reads
    /proc; Windows asks for the process's exit code (a handle to an ended process says it has
    one; no handle: no such process); other systems ask with signal 0."""
    if sys.platform == "win32":
        import ctypes

        kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
        handle = kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
        if not handle:
            return True
        try:
            code = ctypes.c_ulong()
            return bool(kernel32.GetExitCodeProcess(handle, ctypes.byref(code))) and code.value != 259  # STILL_ACTIVE
        finally:
            kernel32.CloseHandle(handle)
    if Path("/proc/self").exists():
        return not Path(f"/proc/{pid}").exists()
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
