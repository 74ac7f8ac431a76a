"""Run a compile script in a fresh Python where `@triton.jit` compiles: the interpreter that the
CPU suite sets (tests/conftest.py) accepts code that the compiler refuses, so each check of a
module's kernels for sm_90 runs its script without TRITON_INTERPRET, given the repo root."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compiled_lines(script: str, *, drop_env: tuple[str, ...] = ()) -> list[str]:
    """The stdout lines of `script` (sys.argv[1]: the repo root), run without the interpreter and
    the variables in `drop_env`; fails the test with its stderr's tail where it exits non-zero."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", *drop_env)}
    run = subprocess.run([sys.executable, "-c", script, str(ROOT)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()
