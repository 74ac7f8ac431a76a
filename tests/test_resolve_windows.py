"""The `cuda` extra's markers and scripts/resolve_windows.py's reading of uv's output (offline; the
resolution itself asks PyPI and runs in .ci/run)."""
from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("strata_resolve_windows", ROOT / "scripts" / "resolve_windows.py")
resolve = importlib.util.module_from_spec(spec)
sys.modules["strata_resolve_windows"] = resolve
spec.loader.exec_module(resolve)


def _cuda_extra_for(sys_platform: str) -> set[str]:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cuda"]
    env = {"sys_platform": sys_platform, "extra": "cuda"}
    return {r.name for r in map(Requirement, extra) if r.marker is None or r.marker.evaluate(env)}


def test_the_cuda_extra_brings_triton_windows_on_windows_and_triton_on_linux():
    assert _cuda_extra_for("win32") == {"triton-windows"}
    assert _cuda_extra_for("linux") == {"triton"}
    assert _cuda_extra_for("darwin") == set()  # no CUDA there


def test_the_triton_ranges_admit_what_current_torches_ask_for():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cuda"]
    reqs = {r.name: r for r in map(Requirement, extra)}
    for v in ("3.6.0", "3.8.0", "3.9.0"):  # torch 2.11, 2.14, 2.15 on Linux
        assert reqs["triton"].specifier.contains(v)
    assert reqs["triton-windows"].specifier.contains("3.8.0.post29")


def test_pins_are_read_from_uv_output_and_the_table_names_a_mismatch():
    text = "numpy==2.5.5\nPySide6_Essentials==6.11.3\ntorch==2.15.0\ntriton-windows==3.8.0.post29 ; sys_platform == 'win32'\n" \
           "    # via strata-gui\n--index-url https://pypi.org/simple\n"
    pins = resolve.parse_pins(text)
    assert pins == {"numpy": "2.5.5", "pyside6-essentials": "6.11.3", "torch": "2.15.0", "triton-windows": "3.8.0.post29"}
    ok = resolve.Resolution("3.12", True, pins, 1.0)
    rows = resolve.table([(ok, "3.9.0"), (ok, "3.8.0"), (resolve.Resolution("3.13", False, {}, 0.5, "no solution"), "")])
    lines = rows.splitlines()
    assert lines[2].split(" | ")[-2] == "no" and lines[3].split(" | ")[-2] == "yes"
    assert "NO: no solution" in lines[4]


def test_uv_is_asked_for_resolution_only():
    args = resolve.compile_args("uv", ROOT / "pyproject.toml", "windows", "3.11", ["cuda"], "")
    assert args[1:3] == ["pip", "compile"] and "--no-build" in args and "--no-python-downloads" in args
    assert args[args.index("--python-platform") + 1] == "windows" and args[args.index("--extra") + 1] == "cuda"
