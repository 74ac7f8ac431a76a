"""Install Strata GUI into a virtual environment without replacing a torch that is already there.

    python3 scripts/install.py            (Linux/macOS)      py scripts\\install.py     (Windows)
    ... --test                            also the test extras
    ... --cuda                            also the `cuda` extra (Triton: triton-windows on Windows)
    ... --extra package                   also any other extra (repeatable)
    ... --torch-index https://download.pytorch.org/whl/cu128   a CUDA torch when the venv has none
    ... --dry-run                         pip's own dry run: what would change, nothing installed

`pip install torch==2.13.0 -e .` (the README's CPU command) replaces whatever torch the venv holds
with the CPU wheel — a user's CUDA build included — and so does a plain `pip install -e .` when the
installed torch is outside `pyproject.toml`'s range (PyPI's torch for Windows is the CPU build).
This script asks the venv's Python which torch it has first: one that is there (CUDA or not) is
kept, pinned by a constraints file so pip refuses to change it rather than quietly swapping it;
without one it installs the CPU wheel the README pins, or — with `--torch-index` — a torch in the
project's range from that index, which it then pins the same way for the `-e .` step.  Before
installing anything beside a kept torch it runs pip's dry run and refuses (exit 1, one line) if
pip would replace that torch, above all a CUDA build with a CPU one.  Standard library only: it
runs before anything is installed, with any Python 3.11+.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
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


@dataclass(frozen=True)
class DryRun:
    """What pip's dry run of the `-e .` step said."""
    ok: bool
    torch: str | None  # the torch version pip would install (None: torch stays as it is)
    count: int  # how many distributions pip would install
    error: str  # pip's last error line when not ok


def venv_python(folder: Path, windows: bool | None = None) -> Path:
    """The venv's interpreter: Scripts\\python.exe on Windows, bin/python elsewhere."""
    windows = os.name == "nt" if windows is None else windows
    return folder / ("Scripts/python.exe" if windows else "bin/python")


def venv_command(folder: Path, name: str, windows: bool | None = None) -> Path:
    """A console entry point of the venv, callable without activating it."""
    windows = os.name == "nt" if windows is None else windows
    return folder / (f"Scripts/{name}.exe" if windows else f"bin/{name}")


def torch_requirement(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The project's own torch requirement (e.g. 'torch>=2.5,<2.16'), so an index never gives one it refuses."""
    deps = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]
    for d in deps:
        if re.match(r"torch\s*[<>=!~]", d):
            return d.replace(" ", "")
    return "torch"


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


def target(extras: Sequence[str]) -> str:
    return f".[{','.join(extras)}]" if extras else "."


def plan(installed: TorchInfo | None, extras: Sequence[str] = (), torch_index: str = "") -> tuple[list[list[str]], str, str]:
    """(pip argument lists to run in order, a constraints file's text or "", what happens, in words).

    A torch in the venv is kept: one `-e .` step under a constraints file that pins it.  With
    `torch_index` and no torch, the first step installs the project's torch range from the index;
    `main` then probes what it got and pins that for the `-e .` step ({constraints} is filled in
    then)."""
    if installed is not None:
        return ([["install", "-e", target(extras), "--constraint", "{constraints}"]], pin(installed),
                f"keeping the installed torch {installed.version} ({installed.kind}); pip may not change it")
    if torch_index:
        return ([["install", torch_requirement(), "--index-url", torch_index],
                 ["install", "-e", target(extras), "--constraint", "{constraints}"]], "",
                f"no torch yet: installing {torch_requirement()} from {torch_index}, then pinning it for the rest")
    return [["install", CPU_TORCH, "-e", target(extras)]], "", f"no torch yet: installing the CPU wheel {CPU_TORCH}"


def pin(installed: TorchInfo) -> str:
    return f"torch=={installed.version}\n"


def read_report(returncode: int, report: Path, stderr: str) -> DryRun:
    """pip's `--dry-run --report` JSON, reduced to what the keep-torch check needs."""
    if returncode != 0 or not report.is_file():
        lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
        err = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "pip failed")
        return DryRun(False, None, 0, err)
    items = json.loads(report.read_text(encoding="utf-8")).get("install", [])
    versions = {str(i["metadata"]["name"]).lower(): str(i["metadata"]["version"]) for i in items}
    return DryRun(True, versions.get("torch"), len(items), "")


def dry_run(python: Path, args: Sequence[str], tmp: Path, env: Mapping[str, str] | None = None) -> DryRun:
    """pip's own dry run of one `install` step (resolves, installs nothing)."""
    report = tmp / "report.json"
    cmd = [str(python), "-m", "pip", *args, "--dry-run", "--quiet", "--report", str(report)]
    print("+", " ".join(cmd))
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    return read_report(out.returncode, report, out.stderr)


def refusal(installed: TorchInfo, got: DryRun) -> str:
    """One line when the `-e .` step would not keep the installed torch; "" when it would."""
    if not got.ok:
        return (f"refusing: pip cannot install Strata GUI beside the installed torch {installed.version} "
                f"({installed.kind}) — pyproject.toml asks for {torch_requirement()}; pip said: {got.error}")
    if got.torch is not None:
        kind = "a CPU build" if "+cu" not in got.torch else "another build"
        return (f"refusing: pip would replace the installed torch {installed.version} ({installed.kind}) "
                f"with {got.torch} ({kind})")
    return ""


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/install.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv", help="the virtual environment (made if missing)")
    ap.add_argument("--test", action="store_true", help="also install the test extras (pytest, pytest-qt, …)")
    ap.add_argument("--cuda", action="store_true", help="also install the cuda extra (Triton for the fast kernels)")
    ap.add_argument("--extra", action="append", default=[], help="also this extra of pyproject.toml (e.g. package); repeatable")
    ap.add_argument("--torch-index", default="", help="a PyTorch wheel index for a CUDA torch, used only when the "
                                                      "venv has no torch (e.g. https://download.pytorch.org/whl/cu128)")
    ap.add_argument("--dry-run", action="store_true", help="pip's dry run: say what would be installed, install nothing")
    ns = ap.parse_args(argv)
    python = venv_python(ns.venv)
    if not python.exists():
        print(f"creating the virtual environment {ns.venv}")
        if not ns.dry_run:
            venv.create(ns.venv, with_pip=True)
    installed = probe_torch(python, env) if python.exists() else None
    extras = [e for e, on in (("test", ns.test), ("cuda", ns.cuda)) if on] + [e for e in ns.extra if e not in ("test", "cuda")]
    steps, constraints, what = plan(installed, extras, ns.torch_index)
    print(what)
    with tempfile.TemporaryDirectory() as tmp:
        cfile = Path(tmp) / "constraints.txt"
        for args in steps:
            if "{constraints}" in args and installed is None:  # after --torch-index: pin what the index gave
                installed = probe_torch(python, env) if not ns.dry_run else None
                if installed is None and not ns.dry_run:
                    print(f"error: no torch importable after installing it from {ns.torch_index}")
                    return 1
                if installed is not None:
                    print(f"installed torch {installed.version} ({installed.kind}); pinning it for the rest")
                    constraints = pin(installed)
            cfile.write_text(constraints, encoding="utf-8")
            cmd_args = [a.replace("{constraints}", str(cfile)) for a in args]
            if installed is not None and "{constraints}" in args and python.exists():
                got = dry_run(python, cmd_args, Path(tmp), env)
                if why := refusal(installed, got):
                    print(why)
                    return 1
                print(f"pip's dry run: {got.count} distributions to install; torch {installed.version} stays")
            cmd = [str(python), "-m", "pip", *cmd_args]
            print("+", " ".join(cmd))
            if not ns.dry_run and subprocess.run(cmd, cwd=ROOT, env=env).returncode != 0:
                return 1
    if installed is not None and not ns.dry_run:
        after = probe_torch(python, env)
        if after is None or (installed.cuda and not (after and after.cuda)):
            print(f"error: torch {installed.version} ({installed.kind}) was replaced by "
                  f"{after.version + ' (' + after.kind + ')' if after else 'nothing importable'}")
            return 1
    print(f"done: start the app with {venv_command(ns.venv, 'strata-gui')} "
          f"(and the benchmarks with {venv_command(ns.venv, 'strata-bench')}); no activation needed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
