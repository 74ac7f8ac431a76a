"""A model file larger than the memory a process may commit still loads and runs: its weights are
mapped read-only (issue 39: a 26.6 GB file failed its copy-on-write map with ENOMEM, reported as
"corrupt GGUF metadata").  A map that fails for want of address space says so.

The file is the demo model plus an unused 3 GiB tensor left as a hole (sparse: no disk written).
RLIMIT_DATA stands for "more than RAM + swap": since Linux 4.7 it counts private writable
mappings (what a copy-on-write map of the file is, and what the kernel's overcommit accounting
charges), not read-only ones.  RLIMIT_AS (`ulimit -v`) counts every mapping, read-only ones too,
so under it no map of the whole file can succeed: there the error must name memory."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.io import synth

ROOT = Path(__file__).resolve().parent.parent
HOLE = 3 << 30
MARGIN = 768 << 20  # what the run may take above what the process held when the limit was set

CHILD = r"""
import json, resource, sys
import torch  # imported before the limit, as a real run has it
from engine.cli import bench
from engine.io import gguf_model

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

which, path, margin = sys.argv[1], sys.argv[2], int(sys.argv[3])
limit = status("VmData" if which == "data" else "VmSize") + margin
res = resource.RLIMIT_DATA if which == "data" else resource.RLIMIT_AS
resource.setrlimit(res, (limit, limit))
out = {"limit": limit}
try:
    m = gguf_model.load(path)
    out["loaded"] = m.file_bytes
except gguf_model.GGUFError as exc:
    out["error"], out["kind"] = str(exc), exc.kind
out["rc"] = bench.main(["run", "--model", path, "--prompt-tokens", "16", "--warmup", "0"])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    path = synth.write_model(tmp_path_factory.mktemp("big") / "big.gguf", synth.recipe_from_args("demo"),
                             hole_bytes=HOLE)
    assert path.stat().st_size > HOLE > MARGIN
    return path


def _child(which: str, path: Path) -> tuple[dict, str]:
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc/self/status (Linux)")
    out = subprocess.run([sys.executable, "-c", CHILD, which, str(path), str(MARGIN)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_a_file_larger_than_the_commit_limit_loads_and_runs(big_file):
    got, err = _child("data", big_file)
    assert got.get("loaded") == big_file.stat().st_size > got["limit"], (got, err)
    assert got["rc"] == 0, err


def test_a_map_that_fails_for_want_of_address_space_says_memory_not_corrupt(big_file):
    got, err = _child("as", big_file)
    assert got.get("kind") == "memory", got
    assert "cannot map the 3.0 GiB file into memory" in got["error"] and "corrupt" not in got["error"].split(
        "not found")[0], got["error"]
    assert got["rc"] == 2
    line = [x for x in err.splitlines() if "cannot map" in x]
    assert len(line) == 1 and "internal error" not in err and "Traceback" not in err, err
