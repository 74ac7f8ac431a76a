"""The memory plan shown before Run against what a Session really allocates (CPU)."""
from __future__ import annotations

import pytest
import torch

from engine import models
from engine.config import EngineConfig
from engine.io import gguf_model
from engine.pipeline.session import Session
from engine.plan.memory_plan import plan_memory
from engine.quant.qtensor import QTensor

K_SHAPES = dict(hidden=256, head_dim=64, n_experts=16, expert_ffn=256, ffn=512)
EXPS = ("gate_exps", "up_exps", "down_exps")


def _held(st) -> tuple[int, int]:
    """(dense bytes, resident expert bytes) a stage holds."""
    dense = experts = 0
    for layer in st.layers:
        for t in vars(layer.w).values():
            if isinstance(t, QTensor):
                experts += t.nbytes
            elif isinstance(t, torch.Tensor):
                dense += t.numel() * t.element_size()
    seen = set()
    for t in (st.head.embed, st.head.norm, st.head.out):
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            dense += t.numel() * t.element_size()
    return dense, experts


@pytest.mark.parametrize("cache", ["all", "small"])
def test_plan_matches_what_the_session_holds(make_arch, cache):
    model = gguf_model.load(make_arch("qwen3moe", quant="q4_k_m", **K_SHAPES))
    one = sum(model.nbytes(f"blk.0.{p}.weight") for p in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")) / 16
    expert_cache = "all" if cache == "all" else 6.5 * one / 2**30
    cfg = EngineConfig(devices=["cpu", "cpu"], chunk_tokens=16, expert_cache=expert_cache)
    plan = plan_memory(model, cfg, tokens=80)
    sess = Session(model, cfg)
    try:
        assert plan.streamed == (sess.arena is not None) == (cache == "small")
        for d, st in zip(plan.devices, sess.stages):
            dense, experts = _held(st)
            assert (d.first, d.end) == (st.first, st.end)
            assert d.dense == dense
            if plan.streamed:
                # the slots hold the largest row (Q6_K down)
                assert d.experts == st.cache.pool.numel() and d.expert_slots == st.cache.n_slots == 5
            else:
                assert d.experts == experts
            assert d.kv == 2 * (st.end - st.first) * 2 * 64 * 80 * 4
            assert d.scratch == 16 * 3 * 256 * 256 * 4  # CPU: a batch of whole experts (all 16 fit 256 MiB), fp32
        if plan.streamed:
            assert plan.host_arena == sess.arena.nbytes and plan.pin_lock == 0 and "no CUDA" in plan.pin_note
        text = plan.render()
        assert "stage 0 cpu (layers 0-1)" in text and "stage 1 cpu (layers 2-3)" in text
        assert ("host arena" in text) and (("slots" in text) == plan.streamed)
    finally:
        sess.close()


def test_dense_model_plan_has_no_experts(make_arch):
    model = gguf_model.load(make_arch("llama", quant="q4_k_m", **K_SHAPES))
    plan = plan_memory(model, EngineConfig(devices=["cpu"]), tokens=10)
    d = plan.devices[0]
    assert d.experts == d.scratch == 0 and not plan.streamed and d.dense > 0
    assert "none (every expert resident" in plan.render()


def test_float_experts_are_expanded_once(make_arch):
    """f16-stored experts are expanded at load like dense weights: no per-call scratch."""
    model = gguf_model.load(make_arch("qwen3moe", quant="f16"))
    cfg = EngineConfig(devices=["cpu"], chunk_tokens=16)
    plan = plan_memory(model, cfg, tokens=20)
    sess = Session(model, cfg)
    try:
        d = plan.devices[0]
        layer_experts = sum(getattr(layer.w, k).numel() * 4 for layer in sess.stages[0].layers for k in EXPS)
        assert all(isinstance(getattr(layer.w, k), torch.Tensor) for layer in sess.stages[0].layers for k in EXPS)
        assert d.experts == layer_experts and d.scratch == 0
    finally:
        sess.close()


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_gpu_scratch_reserves_torch_temporaries_only_where_torch_expands(make_arch, monkeypatch, path):
    """A GPU stage's scratch is the expanded batch, plus one torch step's float32 temporaries
    only when some expert type takes the torch dequantiser (the Triton one writes straight
    into the batch): the plan no longer holds back ~0.5 GiB the run will not use."""
    from engine.quant import dequant
    model = gguf_model.load(make_arch("qwen3moe", quant="q4_k_m", **K_SHAPES))
    monkeypatch.setattr(dequant, "backend", lambda device, qtype, dtype=torch.float32: path)
    plan = plan_memory(model, EngineConfig(devices=["cuda:0"], expert_cache="all", dtype="bfloat16"), tokens=64)
    batch = 16 * 3 * 256 * 256 * 2  # every expert of a layer, bf16
    want = batch + (dequant.STEP_BYTES_CUDA if path == "torch" else 0)
    assert [d.scratch for d in plan.devices] == [want]


def test_cpu_attention_scores_are_planned_and_refuse_a_run_that_cannot_hold_them(demo_path):
    """A CPU stage's SDPA holds heads x chunk x keys float32 scores at the last chunk: the plan
    counts them (the chunk when fixed; when auto, the chunk auto takes on one CPU stage, else the
    smallest CPU chunk) and a run whose scores exceed the host's memory is refused with the two
    sizes before anything is allocated."""
    from engine.config import ConfigError
    from engine.plan import memory_check

    model = gguf_model.load(demo_path)
    heads = model.spec.n_heads
    fixed = plan_memory(model, EngineConfig(devices=["cpu"], chunk_tokens=64), tokens=1000)
    assert fixed.devices[0].attention == heads * 64 * 1000 * 4
    assert "attention scores" in fixed.render()
    auto = plan_memory(model, EngineConfig(devices=["cpu"]), tokens=1000)
    assert auto.devices[0].attention == heads * 1000 * 1000 * 4  # one stage: the prompt as one chunk
    assert plan_memory(model, EngineConfig(devices=["cpu"]), tokens=5000).devices[0].attention == heads * 2048 * 5000 * 4
    two = plan_memory(model, EngineConfig(devices=["cpu", "cpu"]), tokens=1000)  # probed: the smallest, a floor
    assert two.devices[0].attention == heads * 16 * 1000 * 4
    cfg = EngineConfig(devices=["cpu"], chunk_tokens=4096)
    n = 20_000_000  # 4096 x 20M scores per head: 1.3 TB for the demo's 4 heads, past any host
    assert plan_memory(model, cfg, tokens=n).devices[0].attention > 10**12
    with pytest.raises(ConfigError, match=r"--prompt-tokens.*attention scores"):
        memory_check.check_run(model, cfg, n, 0, False)


@pytest.mark.parametrize("arch", models.names())
def test_the_dense_figure_is_what_each_family_holds_in_bf16(make_arch, arch):
    """The parts as each family declares them: norms and the router float32, biases in the
    compute dtype (as loaded), so the figure holds below float32 too."""
    model = gguf_model.load(make_arch(arch))
    cfg = EngineConfig(devices=["cpu", "cpu"], chunk_tokens=16, dtype="bfloat16")
    plan = plan_memory(model, cfg, tokens=40)
    sess = Session(model, cfg)
    try:
        for d, st in zip(plan.devices, sess.stages):
            assert d.dense == _held(st)[0]
    finally:
        sess.close()
