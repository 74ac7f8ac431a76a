"""The planner (engine/planner.py) against real CPU runs with the deterministic sleep hook.

A profile fitted to ONE one-stage run predicts 1, 2 and 3 stages at depth 0 and 1; the
interleaved mode (V groups per device, issue 21) is checked against a contiguous run whose
stages share one device ("cpu,cpu,cpu": the same mechanism).  The runs are real Sessions; the
machine is shared, so each configuration is measured best of three (as the benchmarks do)."""
from __future__ import annotations

import time

import pytest
import torch

from engine import gguf_model, planner
from engine.config import EngineConfig
from engine.events import busy_histogram
from engine.pipeline import PipelineHooks, Session
from engine.prompt import synthetic

SLEEP = 0.03  # per layer and chunk: the modelled work, releases the GIL like a GPU wait
TOKENS, CHUNK = 96, 16
# The bar is 5%; one best-of-3 CPU measurement on a 2-core CI machine jitters by up to
# ~5.5% (seen in a clean CI run), so the tests hold 8% and 8 points, and
# benchmarks/plan_cpu_check.py prints the figures against the 5% bar (docs/benchmarks.md).
TIME_TOL, HIST_POINTS = 0.08, 8.0


@pytest.fixture(scope="module")
def demo(make_arch):
    """The demo's shapes with float weights: the demo's own Q8_0 experts are expanded per call
    on the CPU (threads contending for the GIL), which the sleep model does not describe."""
    return gguf_model.load(make_arch("qwen3moe", quant="f32"))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the demo's own arithmetic small and steady beside the sleeps
    yield
    torch.set_num_threads(n)


def measure(demo, devices, depth, repeat=3, **kw) -> planner.MeasuredRun:
    def hook(stage, layer, chunk):
        time.sleep(SLEEP)

    cfg = EngineConfig(devices=list(devices), pipeline_depth=depth, chunk_tokens=CHUNK, **kw)
    sess = Session(demo, cfg, hooks=PipelineHooks(after_layer=hook), telemetry_interval_s=None)
    best = None
    try:
        for _ in range(repeat):
            rep = sess.run(synthetic(TOKENS, demo.spec.vocab, nonce=3)).report
            run = planner.measured_from_report(f"{len(devices)} stages depth {depth}", rep.to_dict(), list(sess.events))
            if best is None or run.prefill_s < best.prefill_s:
                best = run
    finally:
        sess.close()
    return best


@pytest.fixture(scope="module")
def profile(demo):
    """Fitted to one two-stage overlap run (it has hand-offs: the thread wake-up is measured too)."""
    return planner.profile_from_run(measure(demo, ["cpu", "cpu"], 1))


@pytest.mark.parametrize("n_stages", [1, 2, 3])
@pytest.mark.parametrize("depth", [0, 1])
def test_prediction_within_the_bar_of_measured(demo, profile, n_stages, depth):
    run = measure(demo, ["cpu"] * n_stages, depth)
    pred = planner.predict_run(profile, run)
    assert all(e.predicted for e in pred.events)
    err = pred.prefill_s / run.prefill_s - 1
    assert abs(err) <= TIME_TOL, f"predicted {pred.prefill_s * 1e3:.1f} ms, measured {run.prefill_s * 1e3:.1f} ms"
    points = planner.ErrorRow("", "", run.prefill_tok_s, pred.prefill_tok_s, run.busy_histogram,
                              pred.busy_histogram).hist_points
    assert points <= HIST_POINTS, (run.busy_histogram, pred.busy_histogram)


def test_interleaved_groups_predict_stages_sharing_a_device(demo, profile):
    run = measure(demo, ["cpu", "cpu", "cpu"], 1)
    machine = planner.Machine([planner.DeviceSpec("cpu")])
    settings = planner.PlanSettings(prompt_tokens=TOKENS, chunk_tokens=CHUNK, pipeline_depth=1, interleave=3)
    pred = planner.simulate(profile, machine, settings)
    assert [(s.device, s.first_layer, s.end_layer) for s in pred.stages] == \
        [(s.device, s.first_layer, s.end_layer) for s in run.plan.stages]
    assert abs(pred.prefill_s / run.prefill_s - 1) <= TIME_TOL
    assert max(abs(a - b) for a, b in zip(pred.busy_histogram, run.busy_histogram)) <= HIST_POINTS / 100


def test_overlap_beats_join_and_events_keep_the_seeds_order(profile):
    machine = planner.Machine([planner.DeviceSpec("cpu")])
    s = planner.PlanSettings(prompt_tokens=TOKENS, chunk_tokens=CHUNK, pipeline_depth=0, layer_split=[2, 1, 1])
    join = planner.simulate(profile, machine, s, devices=["cpu"] * 3)
    over = planner.simulate(profile, machine, planner.PlanSettings(**{**s.__dict__, "pipeline_depth": 1}),
                            devices=["cpu"] * 3)
    assert over.prefill_s < join.prefill_s
    comp = {(e.stage, e.chunk): e for e in join.events if e.kind == "compute"}
    for c in range(len(join.bounds) - 1):  # join: stage 0 starts C(c+1) only after the last stage ended Cc
        assert comp[(0, c + 1)].start_ns >= comp[(2, c)].end_ns
    assert any(e.kind == "wait" and e.note == "join" for e in join.events)
    oc = {(e.stage, e.chunk): e for e in over.events if e.kind == "compute"}
    assert any(oc[(0, c + 1)].start_ns < oc[(1, c)].end_ns for c in range(len(over.bounds) - 1))
    assert over.busy_histogram == busy_histogram(over.events, 3)
