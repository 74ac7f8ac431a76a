"""Issue 37: the Sweep tab's progress counts the measured run's chunks only (warm-ups shared the
sink and read "chunk 9/4"), and its plan shows a time estimate scaled from a measured run."""
from __future__ import annotations

import threading

import pytest

from engine.events import StageEvent
from strata_gui.sweep.sweep_model import SweepArm, SweepPlan, arm_config, estimate_seconds, estimate_text

BASE = {"devices": "cpu,cpu", "chunk_tokens": "32", "pipeline_depth": 1, "layer_split": "auto", "gpu_order": "pcie"}
ARMS = (SweepArm("join", "pipeline_depth=0"), SweepArm("overlap", "pipeline_depth=1"))


def _ev(run: str, stage: int, chunk: int) -> StageEvent:
    return StageEvent(run, stage, "cpu", chunk, "compute", 0, 1, 32)


def test_the_chunk_counter_counts_one_measured_run_and_no_warm_up():
    from strata_gui.sweep.sweep_job import _ChunkCounter

    got: list[int] = []
    c = _ChunkCounter(got.append, interval_s=0.0)
    c(_ev("warm", 1, 0))  # before the first measured run: nothing
    c.reset(1)
    for k in range(4):
        c(_ev("a", 0, k))  # not the finishing stage
        c(_ev("a", 1, k))
    c(_ev("a", 1, 3))  # a repeated event counts once
    c.pause()  # a warm-up of the next size
    for k in range(8):
        c(_ev("warm", 1, k))
    assert got == [1, 2, 3, 4]
    c.reset(1)
    c(_ev("b", 1, 0))
    assert got[-1] == 1


def test_a_sweep_with_warm_ups_never_reports_more_chunks_than_the_run_has(demo_path):
    from strata_gui.sweep.sweep_job import SweepJob, SweepRequest

    class Outlet:  # keeps the progress calls; every other call of the job is dropped
        def __init__(self) -> None:
            self.seen: list = []

        def progress(self, p) -> None:
            self.seen.append(p)

        def __getattr__(self, name: str):
            return lambda *args: None

    plan = SweepPlan((64, 256), ARMS, repeats=1, warmup=1, model="demo", base=BASE)
    configs = tuple(arm_config(BASE, a, env={}) for a in ARMS)
    out = Outlet()
    SweepJob(SweepRequest(demo_path, "demo", plan, configs), threading.Event(), out).execute()
    progress = out.seen
    with_chunks = [p for p in progress if p.n_chunks]
    assert with_chunks and all(p.chunks_done <= p.n_chunks for p in progress), \
        [(p.chunks_done, p.n_chunks) for p in progress]
    assert all(p.n_chunks == p.step.prompt_tokens // 32 for p in with_chunks)


def test_the_estimate_scales_a_measured_run_by_the_prefill_flops():
    plan = SweepPlan((1024, 2048), ARMS, repeats=3, warmup=1)
    flops = lambda n: float(n * n)  # noqa: E731  (a quadratic model: 2048 costs 4x 1024)
    # a reference of 1024 tokens in 2 s: per run 2 s and 8 s; 2 arms x (3 + 1) runs each
    assert estimate_seconds(plan, flops, 1024, 2.0) == pytest.approx(2 * 4 * (2.0 + 8.0))
    text = estimate_text(plan, flops, (1024, 512.0, 7))
    assert text.startswith("16 runs (12 measured + 4 warm-up) of up to 2K tokens: about 80 s of prefill")
    assert "run #7" in text
    none = estimate_text(plan, flops, None)
    assert "No time estimate yet" in none and "run once in the Run tab" in none
