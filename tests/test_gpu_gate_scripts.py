"""The GPU gate in bash (device machine, Linux) and in PowerShell (a Windows workstation) run the
same steps: the same test files, the same default bench command, the same app check."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SH = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
PS = (ROOT / "benchmarks" / "gpu_check.ps1").read_text()


def test_both_gates_run_the_same_tests_and_checks():
    for needle in ("tests/test_cuda.py", "test_*_cuda.py", "test_executor_cuda.py", "tests/test_executor_cuda.py",
                   "benchmarks/app_run_check.py",
                   "synthetic:qwen3-30b-a3b:n_layers=16", "8192,32768", "794", "GPU CHECK PASSED", "GPU CHECK FAILED"):
        assert needle in SH and needle in PS, needle
    sh_steps = re.findall(r'step "([^"$]+)', SH)
    ps_steps = re.findall(r'Step "([^"$]+)', PS)
    assert sh_steps == ps_steps == ["CUDA tests", "default strata-bench run on ", "process executor on CUDA", "app run path on "]


def test_the_powershell_gate_needs_no_bash_and_no_ampersand_chains():
    assert "&&" not in PS  # Windows PowerShell 5.1 has no &&
    assert "device_env.sh" not in PS and "bash" not in PS.split("#>")[1]


def _gate(tmp_path: Path, units: str, deadline: int = 60) -> str:
    """benchmarks/gate_units.sh as gpu_check.sh uses it, over a tree of its own in tmp_path."""
    script = (f'. "{ROOT / "benchmarks" / "gate_units.sh"}"\nGATE_PATHS=(tree)\n'
              f'gate_start "{tmp_path / "state"}" {deadline}\necho "tree $GATE_TREE"\n{units}\n'
              'echo "resumed=$GATE_RESUMED cut=${#GATE_CUT[@]}"\n')
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GATE_MIN_LEFT": "0"})
    return done.stdout


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_a_gate_cut_by_its_deadline_resumes_on_the_same_tree_and_restarts_on_a_changed_one(tmp_path):
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "code.py").write_text("x = 1\n")
    units = ('unit first true; echo "rc=$?"; unit second false; echo "rc=$?"; '
             'unit third sleep 30; echo "rc=$?"; unit fourth true; echo "rc=$?"')
    out = _gate(tmp_path, units, deadline=2)
    assert "= first: passed" in out and "= second: FAILED (exit 1)" in out
    assert "= third: cut by the deadline" in out and "= fourth: not run (the deadline)" in out
    assert out.count("rc=0") == 1 and "rc=1" in out and out.count("rc=2") == 2 and "resumed=0 cut=2" in out
    again = _gate(tmp_path, "unit first true; unit second false; unit fourth true")
    assert "= first: passed in an earlier call" in again and "not run again" in again
    assert "= second: FAILED" in again  # a failure is never remembered: it runs again
    assert "= fourth: passed in" in again and "resumed=1 cut=0" in again
    assert again.splitlines()[0] == out.splitlines()[0]  # the same tree id
    (tmp_path / "tree" / "code.py").write_text("x = 2\n")
    changed = _gate(tmp_path, "unit first true")
    assert changed.splitlines()[0] != out.splitlines()[0]
    assert "= first: passed in" in changed and "earlier call" not in changed and "resumed=0" in changed
