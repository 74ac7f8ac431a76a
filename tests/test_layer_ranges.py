"""The one layer-range rule (engine/plan/layer_ranges.py): the Session loads by it, the planner
predicts with it."""
from __future__ import annotations

import pytest

from engine.plan import layer_ranges, planner
from engine.plan.layer_ranges import LayerSplitError, split_layers, stage_ranges


def test_balanced_ranges_give_the_remainder_to_the_earliest_stages():
    assert split_layers(48, 2, "auto") == [(0, 24), (24, 48)]
    assert split_layers(10, 3, "auto") == [(0, 4), (4, 7), (7, 10)]
    assert split_layers(4, 2, [1, 3]) == [(0, 1), (1, 4)]


def test_interleave_puts_group_j_on_device_j_mod_d():
    got = stage_ranges(10, ["cuda:0", "cuda:1"], interleave=2)
    assert got == [(0, "cuda:0", 0, 3), (1, "cuda:1", 3, 6), (2, "cuda:0", 6, 8), (3, "cuda:1", 8, 10)]
    assert [r.device for r in stage_ranges(6, ["cpu", "cpu", "cpu"])] == ["cpu"] * 3  # stages sharing a device


def test_explicit_counts_one_per_device():
    assert stage_ranges(16, ["cuda:0", "cuda:1"], [4, 12]) == [(0, "cuda:0", 0, 4), (1, "cuda:1", 4, 16)]


@pytest.mark.parametrize("args,why", [
    ((4, []), "at least one device"),
    ((4, ["cpu", "cpu"], [1, 2]), "summing to 4"),
    ((4, ["cpu", "cpu"], [4, 0]), ">= 1 each"),
    ((4, ["cpu"], [2, 2]), "one count per device"),
    ((4, ["cpu", "cpu"], [2, 2], 2), "do not combine"),
    ((3, ["cpu", "cpu"], None, 2), "4 stages for 3 layers"),
])
def test_a_split_without_layers_for_a_stage_is_refused_in_one_line(args, why):
    with pytest.raises(LayerSplitError, match=why):
        stage_ranges(*args)


def test_the_planner_predicts_the_stages_the_session_loads():
    """The planner's stages are the layer-range rule's, named as events name them."""
    for n, devs, counts, v in [(16, ["cuda:0", "cuda:1"], None, 2), (7, ["cpu"] * 3, None, 1),
                               (8, ["cuda:0", "cuda:1"], [3, 5], 1)]:
        got = [(s.stage, s.device, s.first_layer, s.end_layer) for s in planner.plan_stages(n, devs, counts, v)]
        assert got == [tuple(r) for r in layer_ranges.stage_ranges(n, devs, counts, v)]
    with pytest.raises(planner.PlanError, match="at most one stage per layer"):
        planner.plan_stages(3, ["cpu", "cpu"], interleave=2)
