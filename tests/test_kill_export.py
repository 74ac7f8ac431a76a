"""A process SIGKILLed in the middle of a trace export leaves no half-written file in place."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

WRITER = r"""
import sys
from engine.events import StageEvent
from engine.io import trace
events = [StageEvent("r", i % 4, "cpu", i, "compute", 10 * i, 10 * i + 5, 1, 0, "x" * 40) for i in range(600_000)]
print("writing", flush=True)
while True:
    trace.save(sys.argv[1], events)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX only")
def test_sigkill_during_export_keeps_the_previous_file_whole(tmp_path):
    target = tmp_path / "run.json"
    target.write_text(json.dumps({"traceEvents": [], "otherData": {"old": True}}))
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], cwd=root, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.stdout.readline().strip() == b"writing"
    for delay in (0.5, 1.5):
        time.sleep(delay)
        doc = json.loads(target.read_text())  # at every moment the target parses
        assert "traceEvents" in doc
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    doc = json.loads(target.read_text())
    assert "traceEvents" in doc  # the old file or a complete new one, never a torn one
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "run.json"]
    assert all(name.endswith(".part") for name in leftovers)  # only the temp file can remain
