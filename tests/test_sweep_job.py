"""The sweep without Qt (issue 31): SweepJob runs a plan and saves each point through its
recorder, a stop keeps the finished points, a broken model ends in one `failed`; SweepBook
records the sweep and reads it back as the same results; the arm checks name the bad arm."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from strata_gui.history.history_model import RunHistory
from strata_gui.sweep.sweep_book import SweepBook, arm_configs, sweep_label
from strata_gui.sweep.sweep_job import SWEEP_SIGNALS, SweepJob, SweepRequest
from strata_gui.sweep.sweep_model import SweepArm, SweepPlan, arm_config

BASE = {"devices": "cpu,cpu", "chunk_tokens": "32", "pipeline_depth": 1, "layer_split": "auto", "gpu_order": "pcie"}
ARMS = (SweepArm("join", "pipeline_depth=0"), SweepArm("overlap", "pipeline_depth=1"))


class Outlet:
    """Keeps every call in order; refuses a name the job's signal table does not have."""

    def __init__(self, on_point=None) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.on_point = on_point

    def __getattr__(self, name: str):
        if name not in SWEEP_SIGNALS:
            raise AttributeError(name)

        def call(*args) -> None:
            assert len(args) == len(SWEEP_SIGNALS[name]), (name, args)
            self.calls.append((name, args))
            if name == "point_done" and self.on_point is not None:
                self.on_point(args[0])
        return call

    def names(self) -> list[str]:
        return [n for n, _ in self.calls if n not in ("status", "progress")]


def test_the_sweep_job_needs_no_qt():
    """Imported alone (this test process has Qt loaded by pytest-qt), the job pulls in no Qt."""
    code = ("import sys, strata_gui.sweep.sweep_job, strata_gui.sweep.sweep_book, strata_gui.run.run_state; "
            "print(sorted(m for m in sys.modules if m.startswith(('PySide6', 'pyqtgraph'))))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert got.stdout.strip() == "[]", got.stdout + got.stderr


def test_a_sweep_is_recorded_and_reads_back_as_the_same_results(demo_path, tmp_path):
    history = RunHistory(tmp_path / "h.sqlite3")
    try:
        book = SweepBook(history)
        plan = SweepPlan((64,), ARMS, repeats=2, warmup=0, model="demo", base=BASE)
        sweep_id, note = book.add(plan)
        assert sweep_id is not None and note == ""
        configs = tuple(arm_config(BASE, a, env={}) for a in ARMS)
        out = Outlet()
        SweepJob(SweepRequest(demo_path, "demo", plan, configs, sweep_id), threading.Event(), out,
                 history.add).execute()
        assert out.names() == ["point_done"] * 4 + ["finished", "done"]
        assert out.calls[-2] == ("finished", (False, "finished all 4 runs"))
        book.end(sweep_id, "finished")
        (row,) = book.past()
        assert (row.id, row.status, row.n_runs, row.label) == (sweep_id, "finished", 4, sweep_label(plan))
        live = [args[0] for n, args in out.calls if n == "point_done"]
        again = book.results(sweep_id)
        assert again.plan.sizes == plan.sizes and [a.name for a in again.plan.arms] == ["join", "overlap"]
        assert all(s.run is not None for s in live)
        assert sorted(again.samples, key=lambda s: s.run) == sorted(live, key=lambda s: s.run)
        ref = book.reference("demo", "cpu,cpu")
        assert ref is not None and ref[0] == 64 and ref[1] > 0
        assert book.reference("another model", "cpu,cpu") is None
    finally:
        history.close()


def test_a_stop_keeps_the_finished_points(demo_path):
    cancel = threading.Event()
    plan = SweepPlan((64, 128), ARMS, repeats=1, warmup=0, model="demo", base=BASE)
    configs = tuple(arm_config(BASE, a, env={}) for a in ARMS)
    out = Outlet(on_point=lambda _s: cancel.set())  # stop once the first point is in
    SweepJob(SweepRequest(demo_path, "demo", plan, configs), cancel, out).execute()
    assert out.names() == ["point_done", "finished", "done"]
    assert out.calls[-2] == ("finished", (True, "stopped after 1 of 4 runs; the finished points are kept"))


def test_a_model_that_cannot_load_ends_in_one_failed(tmp_path):
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"not a gguf file")
    plan = SweepPlan((64,), ARMS, repeats=1, warmup=0, model="x", base=BASE)
    out = Outlet()
    SweepJob(SweepRequest(bad, "x", plan, tuple(arm_config(BASE, a, env={}) for a in ARMS)),
             threading.Event(), out).execute()
    assert out.names() == ["failed", "done"]
    assert "not.gguf" in " ".join(out.calls[-2][1])


@pytest.mark.parametrize("settings, wrong", [("pipeline_depth=5", "pipeline_depth"), ("devices=cuda:0,cuda:1", "cuda")])
def test_the_arm_checks_name_each_bad_arm(settings, wrong):
    plan = SweepPlan((64,), (ARMS[0], SweepArm("bad", settings)), repeats=1, base=BASE)
    configs, errors = arm_configs(plan, BASE, env={}, cuda_count=0, n_layers=None)
    assert len(configs) == 1 and len(errors) == 1
    assert errors[0].startswith("arm bad: ") and wrong in errors[0], errors


def test_without_a_history_the_book_records_nothing():
    book = SweepBook(None)
    assert book.add(SweepPlan((64,), ARMS)) == (None, "") and book.past() == [] and book.reference("m", "cpu") is None
    book.end(None, "finished")  # no-op
