"""Resolve Strata GUI's dependencies for Windows (win_amd64) on Python 3.11, 3.12 and 3.13 with the
`cuda` extra, without a Windows machine, and print a table.

    python scripts/resolve_windows.py                   (uv from this venv: pip install "uv>=0.13,<0.14")
    python scripts/resolve_windows.py --extras cuda,test --python 3.12

Each row is `uv pip compile pyproject.toml --extra cuda --python-platform windows --python-version
3.1x`: resolution only — uv reads wheel metadata from the package index (PyPI unless
`--index-url` or uv's own settings say otherwise; it asks the network), builds nothing
(`--no-build`), installs nothing and downloads no interpreter.  For the torch it picks, the torch
of the same version is resolved for Linux too, to name the triton torch was built with: the
Windows row's `triton-windows` should carry the same major.minor (`match`).  PyPI's Windows torch
is the CPU build; the CUDA builds from PyTorch's index have the same version numbers, so the row
stands for them.  Exit 1 if any resolution fails.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHONS = ("3.11", "3.12", "3.13")
SHOWN = ("torch", "triton-windows", "pyside6-essentials", "numpy", "transformers", "gguf")


@dataclass(frozen=True)
class Resolution:
    python: str
    ok: bool
    pins: dict[str, str]  # name (lower case) -> version
    seconds: float
    error: str = ""


def uv_binary() -> str:
    """uv from this interpreter's environment (the `uv` package), else from PATH."""
    try:
        import uv  # type: ignore[import-not-found]
        return uv.find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found:
            return found
    raise SystemExit('error: uv is not installed: python -m pip install "uv>=0.13,<0.14"')


def parse_pins(text: str) -> dict[str, str]:
    """`name==version` lines of a uv/pip-compile output; comments and options skipped."""
    pins = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line.strip())
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def compile_args(uv: str, requirements: Path, platform: str, python: str, extras: Sequence[str],
                 index_url: str) -> list[str]:
    args = [uv, "pip", "compile", str(requirements), "--python-platform", platform, "--python-version", python,
            "--no-build", "--no-header", "--no-annotate", "--no-python-downloads", "--quiet"]
    for e in extras:
        args += ["--extra", e]
    if index_url:
        args += ["--index-url", index_url]
    return args


def resolve(uv: str, requirements: Path, platform: str, python: str, extras: Sequence[str] = (),
            index_url: str = "") -> Resolution:
    t0 = time.perf_counter()
    out = subprocess.run(compile_args(uv, requirements, platform, python, extras, index_url),
                         capture_output=True, text=True, cwd=ROOT)
    dt = time.perf_counter() - t0
    if out.returncode != 0:
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        return Resolution(python, False, {}, dt, " ".join(lines[-3:])[:300] or f"uv exit {out.returncode}")
    return Resolution(python, True, parse_pins(out.stdout), dt)


def minor(version: str | None) -> str:
    return ".".join(version.split(".")[:2]) if version else ""


def table(rows: Sequence[tuple[Resolution, str]]) -> str:
    """A markdown table: one row per Python, with the triton the same torch asks for on Linux."""
    head = ["Python", "resolves", "packages", *SHOWN, "torch's Linux triton", "match", "s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, linux_triton in rows:
        tw = r.pins.get("triton-windows")
        match = "yes" if tw and minor(tw) == minor(linux_triton) else ("no" if r.ok else "")
        cells = [r.python, "yes" if r.ok else f"NO: {r.error}", str(len(r.pins)) if r.ok else "",
                 *(r.pins.get(n, "") for n in SHOWN), linux_triton, match, f"{r.seconds:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/resolve_windows.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=",".join(PYTHONS), help="comma-separated Python versions (default 3.11,3.12,3.13)")
    ap.add_argument("--extras", default="cuda", help="comma-separated extras to resolve with (default cuda)")
    ap.add_argument("--torch", default="", help="a torch constraint for the Windows rows, e.g. '<2.15'")
    ap.add_argument("--index-url", default="", help="the package index uv asks (default: uv's, i.e. PyPI)")
    ns = ap.parse_args(argv)
    uv = uv_binary()
    extras = [e for e in ns.extras.split(",") if e]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        reqs = ROOT / "pyproject.toml"
        if ns.torch:  # the project's own requirements, plus one constraint on torch
            reqs = Path(tmp) / "requirements.in"
            reqs.write_text(f"strata-gui[{','.join(extras)}] @ {ROOT.as_uri()}\ntorch{ns.torch}\n")
        for py in ns.python.split(","):
            win = resolve(uv, reqs, "windows", py, [] if ns.torch else extras, ns.index_url)
            linux_triton = ""
            if win.ok and "torch" in win.pins:
                pin = Path(tmp) / "torch.in"
                pin.write_text(f"torch=={win.pins['torch']}\n")
                linux = resolve(uv, pin, "x86_64-manylinux_2_28", py, (), ns.index_url)
                linux_triton = linux.pins.get("triton", "") if linux.ok else "?"
            rows.append((win, linux_triton))
    uv_version = subprocess.run([uv, "--version"], capture_output=True, text=True).stdout.strip()
    print(f"win_amd64 resolution of strata-gui (extras: {','.join(extras) or 'none'}"
          f"{', torch' + ns.torch if ns.torch else ''}), {uv_version}")
    print(table(rows))
    return 0 if all(r.ok for r, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
