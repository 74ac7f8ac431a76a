"""The planner's mechanics: stages on devices (interleave, shared GPUs), links, streaming and
prefill-main, the fits, and predictions of recorded GPU traces (docs/bench)."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.events import busy_histogram
from engine.plan import chunking, planner

BENCH = Path(__file__).resolve().parents[1] / "docs" / "bench"


def gpu_profile(**kw) -> planner.CostProfile:
    base = dict(layer_s={1024: 1e-3, 2048: 1.6e-3, 4096: 2.8e-3}, attn_s_per_token_key=4e-11,
                host_s_per_layer=1e-4, n_layers=16, device_kind="cuda", handoff_bytes_per_token=4096)
    base.update(kw)
    return planner.CostProfile(**base)


def two_gpus(link=55.0, peer=0.0) -> planner.Machine:
    return planner.Machine([planner.DeviceSpec("cuda:0", link), planner.DeviceSpec("cuda:1", link)], peer_gbs=peer)


def test_interleave_puts_group_j_on_device_j_mod_d():
    st = planner.plan_stages(16, ["cuda:0", "cuda:1"], interleave=2)
    assert [(s.device, s.first_layer, s.end_layer) for s in st] == [
        ("cuda:0", 0, 4), ("cuda:1", 4, 8), ("cuda:0", 8, 12), ("cuda:1", 12, 16)]
    with pytest.raises(planner.PlanError):
        planner.plan_stages(3, ["cpu", "cpu"], interleave=2)


def test_stages_on_one_gpu_serialise_there():
    prof, s = gpu_profile(), planner.PlanSettings(prompt_tokens=16384, chunk_tokens=2048)
    shared = planner.simulate(prof, two_gpus(),
                              planner.PlanSettings(prompt_tokens=16384, chunk_tokens=2048, interleave=2),
                              devices=["cuda:0"])
    one = planner.simulate(prof, two_gpus(), s, devices=["cuda:0"])
    two = planner.simulate(prof, two_gpus(), s, devices=["cuda:0", "cuda:1"])
    comp = sorted((e.start_ns, e.end_ns) for e in shared.events if e.kind == "compute")
    assert all(a[1] <= b[0] for a, b in zip(comp, comp[1:]))  # one stream: never two at once
    assert shared.busy_histogram[2] == 0.0
    assert shared.prefill_s == pytest.approx(one.prefill_s, rel=0.02)
    assert two.prefill_s < 0.7 * one.prefill_s


def test_host_staged_hand_off_on_a_slow_link_shows_as_copies():
    prof = gpu_profile()
    s = planner.PlanSettings(prompt_tokens=16384, chunk_tokens=4096)
    peer = planner.simulate(prof, two_gpus(peer=300.0), s)
    slow = planner.simulate(prof, two_gpus(link=0.5), s)
    assert peer.handoff == "peer" and slow.handoff == "host"
    copy = [e for e in slow.events if e.kind == "copy"]
    assert len(copy) == 4 and all(e.dur_ns == pytest.approx(2 * 4096 * 4096 / 0.5, rel=1e-3) for e in copy)
    assert slow.prefill_s > peer.prefill_s


def test_streaming_follows_link_pin_share_and_vram():
    prof = gpu_profile(stream_bytes_per_layer_chunk=1.2e9, expert_layer_bytes=1.2e9)
    s = planner.PlanSettings(prompt_tokens=16384, chunk_tokens=4096, arena_gib=18, pin_limit_gib=18)
    fast = planner.simulate(prof, two_gpus(link=55.0), s)
    slow = planner.simulate(prof, two_gpus(link=5.3), s)
    half = planner.simulate(prof, two_gpus(link=55.0), planner.PlanSettings(**{**s.__dict__, "pin_limit_gib": 9}))
    assert slow.prefill_s > fast.prefill_s and half.prefill_s > fast.prefill_s
    assert any(e.kind == "stream" for e in fast.events)
    big = planner.Machine([planner.DeviceSpec("cuda:0", 55.0, vram_gib=141),
                           planner.DeviceSpec("cuda:1", 55.0, vram_gib=141)])
    resident = planner.simulate(prof, big, s)
    assert not any(e.kind == "stream" for e in resident.events) and resident.prefill_s < fast.prefill_s
    assert "streaming" in slow.bottleneck


def test_prefill_main_copies_the_kv_of_later_stages():
    prof = gpu_profile(kv_bytes_per_token_layer=2048.0)
    s = planner.PlanSettings(prompt_tokens=8192, chunk_tokens=4096, prefill_main=True)
    pred = planner.simulate(prof, two_gpus(link=5.3), s)
    kv = [e for e in pred.events if e.kind == "copy"]
    assert [(e.stage, e.chunk) for e in kv] == [(1, -1)] and kv[0].nbytes == 2048 * 8192 * 8
    assert {e.stage for e in pred.events if e.kind == "compute"} == {0}


def test_the_fit_of_one_stage_totals_recovers_the_costs_it_came_from():
    truth = gpu_profile(host_s_per_layer=0.0)
    machine = planner.Machine([planner.DeviceSpec("cuda:0")])
    points = []
    for n in (8192, 16384, 32768, 65536):
        for c in (1024, 2048, 4096):
            p = planner.simulate(truth, machine, planner.PlanSettings(prompt_tokens=n, chunk_tokens=c))
            points.append(planner.MeasuredTotal(n, c, 16, p.prefill_s))
    fit = planner.profile_from_totals(points)
    for c, v in truth.layer_s.items():
        assert fit.layer_s[c] == pytest.approx(v, rel=1e-3)
    assert fit.attn_s_per_token_key == pytest.approx(truth.attn_s_per_token_key, rel=1e-3)


def test_probe_log_line_and_probe_dict():
    cost = chunking.ChunkCost({1024: 0.001, 2048: 0.0015}, 5e-11, 1.6e-4, 16)
    line = f"INFO engine.pipeline.session: chunk cost on cuda:0: {cost}"
    got = planner.parse_chunk_cost_log(line)
    assert got is not None and got.layer_s == cost.layer_s and got.host_s_per_layer == cost.host_s_per_layer
    d = planner.probe_dict(cost)
    assert planner.probe_dict(None) == {} and d["layer_s"] == {"1024": 0.001, "2048": 0.0015}


@pytest.mark.parametrize("name", ["overlap2-fixed-1024-64k-s3.json.gz", "overlap2-fixed-4096-64k-s3.json.gz",
                                  "stream2-prefill-main-32k.json.gz"])
def test_a_recorded_gpu_trace_is_predicted_from_its_own_profile(name):
    run = planner.load_trace_run(BENCH / name)
    pred = planner.predict_run(planner.profile_from_run(run), run)
    assert abs(pred.prefill_tok_s / run.prefill_tok_s - 1) < 0.05
    assert max(abs(a - b) for a, b in zip(pred.busy_histogram, run.busy_histogram)) < 0.05
    assert pred.busy_histogram == busy_histogram([e for e in pred.events if e.kind != "decode"], len(pred.stages))


def test_another_recorded_configuration_from_a_different_trace_within_10_percent():
    src = planner.load_trace_run(BENCH / "overlap2-fixed-1024-64k-s3.json.gz")
    rows = planner.error_rows([src, planner.load_trace_run(BENCH / "overlap2-fixed-1024-32k-s3.json.gz")])
    cross = [r for r in rows if r.profile_from != r.predicted]
    assert len(cross) == 2 and all(abs(r.error) < 0.10 for r in cross)


def test_interleaved_groups_on_two_gpus_shrink_the_fill_without_overlapping_a_device():
    prof = planner.CostProfile(layer_s={1024: 1e-3}, n_layers=16, device_kind="cuda", handoff_bytes_per_token=4096)
    m = planner.Machine([planner.DeviceSpec("cuda:0"), planner.DeviceSpec("cuda:1")], peer_gbs=300.0)
    s = planner.PlanSettings(prompt_tokens=6 * 1024, chunk_tokens=1024)
    flat = planner.simulate(prof, m, s)
    inter = planner.simulate(prof, m, planner.PlanSettings(**{**s.__dict__, "interleave": 2}))
    assert len(inter.stages) == 4 and [st.device for st in inter.stages] == ["cuda:0", "cuda:1"] * 2
    for dev in ("cuda:0", "cuda:1"):
        comp = sorted((e.start_ns, e.end_ns) for e in inter.events if e.kind == "compute" and e.device == dev)
        assert all(a[1] <= b[0] for a, b in zip(comp, comp[1:]))
    # the same work per device; a chunk reaches the second GPU after half as many layers
    assert inter.prefill_s < flat.prefill_s
    visits = [(e.stage, e.chunk) for e in sorted(inter.events, key=lambda e: e.start_ns) if e.kind == "compute"]
    for c in range(6):  # every chunk visits stages 0..3 in order
        assert [st for st, ch in visits if ch == c] == [0, 1, 2, 3]


def test_recommend_says_what_it_changed():
    from strata_gui.plan.plan_model import settings_changes
    from strata_gui.run.settings_model import RunSettings

    a = RunSettings(chunk_mode="auto", chunk_tokens="256", pipeline_depth=0, prefill_main=True)
    b = RunSettings(chunk_mode="fixed", chunk_tokens="1024", pipeline_depth=1, prefill_main=False)
    assert settings_changes(a, b) == ["chunk mode auto → fixed", "chunk tokens 256 → 1024",
                                      "pipeline depth 0 → 1", "prefill-main on → off"]
    assert settings_changes(a, a) == []
