"""One pipeline model: the planner's simulator (engine/plan/planner.py `_Sim`) agrees with the closed
form the engine chooses chunks by (`chunking.bounds_makespan`) wherever both describe the run.

The closed form knows D equal devices that each run their layers (V groups each) for one chunk
at a time, the chunks' costs, a hand-off per token paid in the fill and drain, and a floor of
serialised host launches.  The simulator knows more (launch order on the host, copies on the
successor's stream, streaming, thread wake-ups, depth 0), so the two are equal exactly where
that extra is absent: depth 1, equal layer counts, no launches, no hand-off time, and with V > 1
chunks of equal cost (for unequal chunks the closed form's interleave is an estimate).  Where
the simulator adds launches or copies, it can only take longer."""
from __future__ import annotations

import pytest

from engine.plan import chunking, planner

N_LAYERS = 24  # equal groups for D in 1..4 and V in 1..2


def profile(kind: str, attn: float = 4e-11, host: float = 0.0, handoff: int = 0) -> planner.CostProfile:
    return planner.CostProfile(layer_s={1024: 1e-3, 2048: 1.6e-3, 4096: 2.8e-3}, attn_s_per_token_key=attn,
                               host_s_per_layer=host, n_layers=N_LAYERS, device_kind=kind,
                               handoff_bytes_per_token=handoff)


def both(prof: planner.CostProfile, n_dev: int, settings: planner.PlanSettings,
         peer_gbs: float = 0.0) -> tuple[float, float]:
    """(simulated, closed-form) prefill seconds of these settings over n_dev devices, the closed
    form over the simulated run's own chunks and with the costs run_plan.choice modelled."""
    names = [f"cuda:{i}" for i in range(n_dev)] if prof.device_kind == "cuda" else ["cpu"] * n_dev
    machine = planner.Machine([planner.DeviceSpec(d) for d in dict.fromkeys(names)], peer_gbs=peer_gbs)
    pred = planner.simulate(prof, machine, settings, devices=names)
    what_if = planner.WhatIf(prof, machine, pred.settings, names, pred.stages)
    closed = chunking.bounds_makespan(pred.bounds, n_dev, what_if.chunk_cost(), settings.interleave,
                                      what_if.hop_s_per_token())
    return pred.prefill_s, closed


CHUNKINGS = [(2048, 1024, "fixed"), (16384, 1024, "fixed"), (16384, 4096, "balanced"), (12288, 4096, "fixed")]


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
@pytest.mark.parametrize("n_dev", [1, 2, 3, 4])
@pytest.mark.parametrize("attn", [0.0, 4e-11])
@pytest.mark.parametrize("prompt,chunk,schedule", CHUNKINGS)
def test_contiguous_stages_simulate_to_the_closed_form(kind, n_dev, attn, prompt, chunk, schedule):
    s = planner.PlanSettings(prompt_tokens=prompt, chunk_tokens=chunk, schedule=schedule)
    sim, closed = both(profile(kind, attn), n_dev, s)
    assert sim == pytest.approx(closed, rel=1e-9)


@pytest.mark.parametrize("n_dev", [2, 3, 4])
@pytest.mark.parametrize("prompt,chunk", [(2048, 1024), (16384, 1024), (4096, 4096)])
def test_interleaved_groups_on_gpus_simulate_to_the_closed_form_for_equal_chunks(n_dev, prompt, chunk):
    """Fewer chunks than devices too (the closed form's serial chains)."""
    s = planner.PlanSettings(prompt_tokens=prompt, chunk_tokens=chunk, interleave=2)
    sim, closed = both(profile("cuda", attn=0.0), n_dev, s)
    assert sim == pytest.approx(closed, rel=1e-9)


@pytest.mark.parametrize("n_dev", [1, 2, 4])
@pytest.mark.parametrize("host,handoff", [(2e-4, 0), (1e-3, 0), (0.0, 4096), (2e-4, 4096)])
def test_launches_and_copies_only_add_to_the_closed_form(n_dev, host, handoff):
    """The host floor (launches serialised) and the fill's hand-offs are in both; the simulator
    also places every launch and copy, so it is never below the closed form."""
    s = planner.PlanSettings(prompt_tokens=16384, chunk_tokens=1024)
    sim, closed = both(profile("cuda", host=host, handoff=handoff), n_dev, s, peer_gbs=50.0)
    zero, _ = both(profile("cuda"), n_dev, s)
    assert sim >= closed * (1 - 1e-9) and closed >= zero * (1 - 1e-9)
    if host >= 1e-3 and n_dev > 1:  # launch-bound: the closed form's floor is what the simulation shows
        assert sim == pytest.approx(closed, rel=0.05)
