"""Install Strata GUI into a virtual environment without replacing a torch that is already there.

    python3 scripts/install.py            (Linux/macOS)      py scripts\\install.py     (Windows)
    ... --test                            also the test extras
    ... --torch-index https://download.pytorch.org/whl/cu128   a CUDA torch when the venv has none

`pip install torch==2.13.0 -e .` (the README's CPU command) replaces whatever torch the venv holds
with the CPU wheel — a user's CUDA build included.  This script asks the venv's Python which torch
it has first: one that is there (CUDA or not) is kept, pinned by a constraint so pip refuses to
change it rather than quietly swapping it; without one it installs the CPU wheel the README pins,
or the CUDA build from `--torch-index`.  Standard library only: it runs before anything is
installed, with any Python 3.11+.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import venv
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_TORCH = "torch==2.13.0"  # the README's and CI's CPU wheel
PROBE = ("import json, torch; print(json.dumps({'version': torch.__version__, "
         "'cuda': getattr(torch.version, 'cuda', None)}))")


@dataclass(frozen=True)
class TorchInfo:
    version: str
    cuda: str | None  # the CUDA version torch was built with; None: a CPU build

    @property
    def kind(self) -> str:
        return f"CUDA {self.cuda}" if self.cuda else "CPU"


def venv_python(folder: Path, windows: bool | None = None) -> Path:
    """The venv's interpreter: Scripts\\python.exe on Windows, bin/python elsewhere."""
    windows = os.name == "nt" if windows is None else windows
    return folder / ("Scripts/python.exe" if windows else "bin/python")


def venv_command(folder: Path, name: str, windows: bool | None = None) -> Path:
    """A console entry point of the venv, callable without activating it."""
    windows = os.name == "nt" if windows is None else windows
    return folder / (f"Scripts/{name}.exe" if windows else f"bin/{name}")


def probe_torch(python: Path | str, env: Mapping[str, str] | None = None) -> TorchInfo | None:
    """Which torch `python` imports, or None when it has none (or it cannot be imported)."""
    out = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode != 0:
        return None
    try:
        d = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return TorchInfo(str(d["version"]), d.get("cuda") or None)


def plan(installed: TorchInfo | None, extras: str = "", torch_index: str = "") -> tuple[list[list[str]], str, str]:
    """(pip argument lists to run in order, a constraints file's text or "", what happens, in words)."""
    target = f".[{extras}]" if extras else "."
    if installed is not None:
        return ([["install", "-e", target, "--constraint", "{constraints}"]], f"torch=={installed.version}\n",
                f"keeping the installed torch {installed.version} ({installed.kind}); pip may not change it")
    if torch_index:
        return ([["install", "torch", "--index-url", torch_index], ["install", "-e", target]], "",
                f"no torch yet: installing it from {torch_index}")
    return [["install", CPU_TORCH, "-e", target]], "", f"no torch yet: installing the CPU wheel {CPU_TORCH}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/install.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv", help="the virtual environment (made if missing)")
    ap.add_argument("--test", action="store_true", help="also install the test extras (pytest, pytest-qt, …)")
    ap.add_argument("--torch-index", default="", help="a PyTorch wheel index for a CUDA torch, used only when the "
                                                      "venv has no torch (e.g. https://download.pytorch.org/whl/cu128)")
    ap.add_argument("--dry-run", action="store_true", help="say what would be installed, install nothing")
    ns = ap.parse_args(argv)
    python = venv_python(ns.venv)
    if not python.exists():
        print(f"creating the virtual environment {ns.venv}")
        if not ns.dry_run:
            venv.create(ns.venv, with_pip=True)
    installed = probe_torch(python) if python.exists() else None
    steps, constraints, what = plan(installed, "test" if ns.test else "", ns.torch_index)
    print(what)
    with tempfile.TemporaryDirectory() as tmp:
        cfile = Path(tmp) / "constraints.txt"
        cfile.write_text(constraints)
        for args in steps:
            cmd = [str(python), "-m", "pip", *[a.replace("{constraints}", str(cfile)) for a in args]]
            print("+", " ".join(cmd))
            if not ns.dry_run and subprocess.run(cmd, cwd=ROOT).returncode != 0:
                return 1
    print(f"done: start the app with {venv_command(ns.venv, 'strata-gui')} "
          f"(and the benchmarks with {venv_command(ns.venv, 'strata-bench')}); no activation needed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
