"""Skip markers for tests that need a POSIX facility Windows lacks (the Windows CI runs the rest)."""
from __future__ import annotations

import importlib.util
import signal
import sys
from pathlib import Path

import pytest

WINDOWS = sys.platform == "win32"

# SIGKILL / SIGSTOP / SIGCONT: Windows has TerminateProcess (Popen.kill) and no way to stop a process
posix_signals = pytest.mark.skipif(not (hasattr(signal, "SIGKILL") and hasattr(signal, "SIGSTOP")),
                                   reason="POSIX signals (SIGKILL/SIGSTOP); Windows has none")
# /proc: Linux only (process state, RSS)
needs_proc = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
# the `resource` module (peak RSS of a child): POSIX only
needs_resource = pytest.mark.skipif(importlib.util.find_spec("resource") is None, reason="the resource module (POSIX)")
# a path that cannot be written on Linux (/proc refuses new files); on Windows /proc/x is C:\proc\x
not_on_windows = pytest.mark.skipif(WINDOWS, reason="the path is unwritable on Linux only")
