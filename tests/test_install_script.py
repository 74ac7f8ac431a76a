"""scripts/install.py keeps a torch the venv already has (a CUDA build above all) instead of
replacing it with the CPU wheel, checked against a fake "installed torch" on this Linux machine."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("strata_install", ROOT / "scripts" / "install.py")
install = importlib.util.module_from_spec(spec)
sys.modules["strata_install"] = install  # dataclasses look their module up
spec.loader.exec_module(install)


def _fake_torch(folder: Path, version: str, cuda: str | None) -> dict[str, str]:
    """A 'torch' package that reports a version and a CUDA build, on PYTHONPATH."""
    pkg = folder / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\nclass version:\n    cuda = {cuda!r}\n")
    return {**os.environ, "PYTHONPATH": str(folder)}


def test_probe_reads_the_installed_torch(tmp_path):
    env = _fake_torch(tmp_path, "2.11.0+cu130", "13.0")
    got = install.probe_torch(sys.executable, env)
    assert got == install.TorchInfo("2.11.0+cu130", "13.0") and got.kind == "CUDA 13.0"


def test_an_installed_cuda_torch_is_kept_and_pinned(tmp_path):
    installed = install.probe_torch(sys.executable, _fake_torch(tmp_path, "2.11.0+cu130", "13.0"))
    steps, constraints, what = install.plan(installed, "test")
    flat = [a for step in steps for a in step]
    assert not any(a.startswith("torch") for a in flat)  # no torch requirement of ours at all
    assert constraints == "torch==2.11.0+cu130\n" and "--constraint" in flat
    assert "keeping the installed torch 2.11.0+cu130 (CUDA 13.0)" in what
    assert steps[0][:3] == ["install", "-e", ".[test]"]


def test_without_torch_the_cpu_wheel_or_the_chosen_cuda_index():
    steps, constraints, _ = install.plan(None)
    assert steps == [["install", install.CPU_TORCH, "-e", "."]] and constraints == ""
    steps, _, what = install.plan(None, torch_index="https://download.pytorch.org/whl/cu128")
    assert steps[0] == ["install", "torch", "--index-url", "https://download.pytorch.org/whl/cu128"]
    assert install.CPU_TORCH not in [a for s in steps for a in s]


def test_entry_points_are_named_by_path_for_both_platforms():
    v = Path(".venv")
    assert install.venv_command(v, "strata-gui", windows=True) == v / "Scripts/strata-gui.exe"
    assert install.venv_command(v, "strata-gui", windows=False) == v / "bin/strata-gui"
    assert install.venv_python(v, windows=True) == v / "Scripts/python.exe"
