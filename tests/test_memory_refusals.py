"""Runs and model files too large for the machine are refused before they allocate, with what
they need, what there is, and the setting to change (issue 39: `--prompt-tokens 10000000` ended
in `internal error … kv.py:13 … alloc_cpu.cpp`, make-model with 1M experts in
`quant_recipe.random_blocks`).

Each case runs in a child process with RLIMIT_DATA set 2 GiB above what it uses once torch is
imported (so "available" is the same on any machine) and measures its peak RSS: the refusal
must come before more than a small bound was taken."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import failure

ROOT = Path(__file__).resolve().parent.parent
ROOM = 2 << 30
RSS_BOUND = 300 << 20  # peak RSS growth allowed while refusing

CHILD = r"""
import json, resource, sys
import torch  # imported before the limit, as a real run has it
from engine.cli import bench
from engine.plan.memory_check import host_available

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

room, argv = int(sys.argv[1]), json.loads(sys.argv[2])
limit = status("VmData") + room
resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
base = status("VmHWM")
rc = bench.main(argv)
print(json.dumps({"rc": rc, "peak_growth": status("VmHWM") - base, "available": host_available()}))
"""


def _run(argv: list[str]) -> tuple[dict, str]:
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc/self/status (Linux)")
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOM), json.dumps(argv)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def _refused(got: dict, err: str, flag: str) -> str:
    assert got["rc"] == 2, err
    lines = [x for x in err.splitlines() if x.startswith("strata-bench: error:")]
    assert len(lines) == 1 and "internal error" not in err and "Traceback" not in err, err
    line = lines[0]
    assert flag in line and "needs" in line and "available" in line, line
    assert got["peak_growth"] < RSS_BOUND, (got, line)
    return line


def test_ten_million_prompt_tokens_are_refused_before_the_kv_is_allocated():
    got, err = _run(["run", "--model", "demo", "--prompt-tokens", "10000000", "--warmup", "0"])
    line = _refused(got, err, "--prompt-tokens")
    assert "KV cache 19.07 GiB" in line and "lower --prompt-tokens" in line, line


def test_a_billion_decode_tokens_are_refused():
    got, err = _run(["run", "--model", "demo", "--prompt-tokens", "16", "--decode-tokens", "1000000000"])
    line = _refused(got, err, "--decode-tokens")
    assert "lower --decode-tokens" in line, line


def test_ten_million_prompt_ids_are_counted_not_read_before_the_refusal(tmp_path):
    ids = tmp_path / "ids.txt"
    with ids.open("w") as fh:
        for _ in range(1000):
            fh.write("17 " * 10_000 + "\n")
    got, err = _run(["run", "--model", "demo", "--prompt-ids", str(ids), "--warmup", "0"])
    line = _refused(got, err, "--prompt-ids")
    assert "10000000" in line or "10,000,000" in line or "KV cache" in line, line


def test_make_model_with_a_million_experts_is_refused_before_drawing(tmp_path):
    target = tmp_path / "huge.gguf"
    got, err = _run(["make-model", str(target), "--experts", "1000000"])
    line = _refused(got, err, "--experts")
    assert "lower --experts" in line and "ffn_" in line, line
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_run_that_fits_is_not_refused():
    got, err = _run(["run", "--model", "demo", "--prompt-tokens", "64", "--warmup", "0"])
    assert got["rc"] == 0, err


def test_a_host_allocation_that_still_fails_is_reported_as_out_of_memory_with_its_size():
    exc = RuntimeError("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 20480000000 bytes. Error code 12 (Cannot allocate memory)")
    line = failure.host_out_of_memory(exc)
    assert line is not None and line.startswith("out of memory on the host allocating 19.07 GiB"), line
    assert failure.host_out_of_memory(RuntimeError("shape mismatch")) is None


class _Outlet:
    """A RunOutlet keeping every call (as the Qt worker would emit it)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str):
        return lambda *args: self.calls.append((name, args))


def test_the_apps_run_refuses_a_prompt_that_cannot_fit_before_its_kv_is_taken(demo_path, monkeypatch):
    """The app's Run (RunJob, no Qt): the Session's weights are loaded, what grows with the
    tokens is checked against what is left (here: a host with 64 MiB to spare)."""
    import threading

    from engine.config import EngineConfig
    from engine.plan import memory_check
    from strata_gui.run.run_job import RunJob, RunRequest
    from strata_gui.run.session_cache import SessionCache

    monkeypatch.setattr(memory_check, "host_available", lambda: 64 << 20)
    sessions = SessionCache()
    out = _Outlet()
    req = RunRequest(demo_path, EngineConfig.from_sources({"devices": "cpu"}, env={}), prompt_tokens=100_000)
    try:
        RunJob(req, sessions, threading.Event(), out).execute()
    finally:
        sessions.close()
    failed = [args for name, args in out.calls if name == "failed"]
    assert len(failed) == 1, out.calls
    title, message, _ = failed[0]
    assert "prompt_tokens=100000" in message and "KV cache" in message and "64.0 MiB available" in message, message
    assert not any(name == "run_started" for name, _ in out.calls)
