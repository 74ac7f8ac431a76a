"""The GPU gate in bash (device machine, Linux) and in PowerShell (a Windows workstation) run the
same steps: the same test files, the same default bench command, the same app check."""
from __future__ import annotations

import re
from pathlib import Path

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
