"""The planner chunks a prompt as the engine's run of the same settings does: both go through
run_plan.choice (a Session, or the planner's WhatIf of a profile with the session's costs)."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.io import gguf_model
from engine.pipeline.session import Session
from engine.plan import planner, run_plan


@pytest.fixture(scope="module")
def demo(make_arch):
    return gguf_model.load(make_arch("qwen3moe", quant="f32"))


@pytest.mark.parametrize("devices,chunk,schedule,interleave", [
    (["cpu"], "auto", "fixed", 1),
    (["cpu"], "auto", "auto", 1),
    (["cpu", "cpu"], "auto", "auto", 1),  # the hand-off's time weighs in
    (["cpu", "cpu"], "auto", "fixed", 2),  # two layer groups per device: modelled as the engine does
    (["cpu", "cpu"], 32, "balanced", 1),  # balanced from a user's size: the engine's grain and floor
    (["cpu", "cpu"], 48, "fixed", 1),
])
def test_a_prediction_runs_the_chunks_the_session_plans(demo, devices, chunk, schedule, interleave):
    n = 300
    split = f"interleave:{interleave}" if interleave > 1 else "auto"
    run_plan.forget_choices()  # this session's own hop, not an earlier test's run of the same key
    sess = Session(demo, EngineConfig(devices=devices, chunk_tokens=chunk, chunk_schedule=schedule,
                                      layer_split=split), telemetry_interval_s=None)
    try:
        plan = sess.plan(n)
        cost = sess.chunk_cost(n)
        hop = sess.hop_s_per_token() if len(devices) > 1 else 0.0
    finally:
        sess.close()
    per_token = 4 * demo.spec.hidden  # the planner's hand-off: these bytes at copy_gbs take the session's hop
    profile = planner.CostProfile(layer_s=dict(cost.layer_s), attn_s_per_token_key=cost.attn_s_per_token_key,
                                  n_layers=demo.spec.n_layers, device_kind="cpu", handoff_bytes_per_token=per_token,
                                  copy_gbs=per_token / hop / 1e9 if hop > 0 else 0.0)
    settings = planner.PlanSettings(prompt_tokens=n, chunk_tokens=chunk, schedule=schedule, interleave=interleave)
    pred = planner.simulate(profile, planner.Machine([planner.DeviceSpec("cpu")]), settings, devices=devices)
    assert [(s.device, s.first_layer, s.end_layer) for s in pred.stages] == \
        [(s.device, s.first_layer, s.end_layer) for s in plan.stages]
    assert pred.bounds == plan.chunk_bounds()
    assert (pred.chunk, pred.settings.schedule) == (plan.chunk, plan.schedule)
