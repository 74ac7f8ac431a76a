"""A CPU stage's expansion buffer: carved tensors are disjoint, the memory is kept between
batches and layers and freed with the stage, and experts expanded into it, over whatever an
earlier batch left there, give the values of fresh tensors (so a CPU run's logits and digest do
not depend on the buffer)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from dequant_support import random_blocks
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from engine.io import synth
from engine.models import routed_experts
from engine.models.layers import Layer, Rope
from engine.models.loading import load_layer_weights
from engine.pipeline.stage_runtime import StageRuntime
from engine.quant import dequant
from engine.quant.host_scratch import HostScratch
from engine.quant.qtensor import QTensor


def test_carved_tensors_are_disjoint_and_the_memory_is_kept():
    sc = HostScratch("t")
    a, b = sc.carve([(3, 4), (5,)], torch.float32)
    assert a.shape == (3, 4) and b.shape == (5,) and a.is_contiguous() and a.dtype == torch.float32
    a.fill_(1.0)
    b.fill_(2.0)
    assert torch.all(a == 1.0) and torch.all(b == 2.0)  # no overlap
    assert sc.held == 17 * 4
    (c,) = sc.carve([(2, 2)], torch.bfloat16)  # smaller: the same memory, not grown
    assert sc.held == 17 * 4 and c.data_ptr() == a.data_ptr()
    sc.carve([(100,)], torch.float32)  # larger: grown
    assert sc.held == 400
    sc.release()
    assert sc.held == 0


def test_expansion_into_a_dirty_buffer_gives_gguf_values():
    """Experts expanded into the kept buffer over what an earlier expansion left there equal
    gguf's dequantiser, on the slice (every expert) and the gather (routed ones) paths."""
    raw, (rows, cols) = random_blocks(T.Q4_K, 8, 2, seed=11)  # 8 rows of 2 blocks
    qt = QTensor(torch.from_numpy(raw).reshape(-1), T.Q4_K, (4, 2, cols))
    ref = torch.from_numpy(np.nan_to_num(gguf_quants.dequantize(raw, T.Q4_K))).reshape(4, 2, cols)
    sc = HostScratch()
    for fill in (0.0, float("nan"), 7.0):
        (out,) = sc.carve([(4, 2, cols)], torch.float32)
        out.fill_(fill)
        got = qt.dequantize(torch.float32, out=out)
        assert got.data_ptr() == out.data_ptr() and torch.equal(got.nan_to_num(), ref)
        (g,) = sc.carve([(2, 2, cols)], torch.float32)
        g.fill_(fill)
        assert torch.equal(qt.gather(torch.tensor([3, 1]), torch.float32, out=g).nan_to_num(), ref[[3, 1]])


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_a_cpu_step_is_chunk_values_values(monkeypatch, qtype):
    """A CPU step expands CHUNK_VALUES values, whatever the block size (Q8_0's 32, Q4_K's 256):
    a tensor of 13 steps' worth is 13 dequantiser calls, and gives one call's values."""
    raw, (rows, cols) = random_blocks(qtype, 13, 3, seed=3)  # 39 blocks
    t = torch.from_numpy(raw).reshape(-1)
    whole = dequant.dequantize(t, qtype, (rows, cols))
    real = dequant.DEQUANTIZERS[qtype]
    calls = []
    monkeypatch.setitem(dequant.DEQUANTIZERS, qtype, lambda b, dt: calls.append(b.shape[0]) or real(b, dt))
    monkeypatch.setattr(dequant, "CHUNK_VALUES", 3 * dequant.block_geometry(qtype)[0])
    stepped = dequant.dequantize(t, qtype, (rows, cols), out=torch.empty(rows, cols))
    assert calls == [3] * math.ceil(39 / 3)
    assert torch.equal(whole.nan_to_num(), stepped.nan_to_num())


def test_a_layer_over_several_batches_in_the_scratch_equals_fresh_tensors(monkeypatch):
    """A CPU layer whose experts expand in several batches (a tiny budget), each batch carved
    over the last, gives the bits of the same layer expanding into fresh tensors, for a chunk
    (every expert) and a decode token (the routed ones)."""
    src = synth.SyntheticSource(synth.recipe_from_args("demo", quant="q4_k_m", n_layers=2, hidden=256,
                                                       head_dim=64, n_experts=16, expert_ffn=256, ffn=512), "cpu")
    spec = src.spec
    w = load_layer_weights(src, 1, torch.device("cpu"), torch.float32)
    layer = Layer(spec, 1, w, Rope(spec.head_dim, spec.rope_base, spec.rope_style, torch.device("cpu")))
    assert isinstance(layer.w.gate_exps, QTensor)
    per_expert = 3 * spec.expert_ffn * spec.hidden * 4
    real_batches = routed_experts.batches
    seen: list[int] = []

    def small(experts, per, budget=0):
        out = real_batches(experts, per, budget=3 * per_expert)  # three experts a batch
        seen.append(len(out))
        return out

    monkeypatch.setattr(routed_experts, "batches", small)
    g = torch.Generator().manual_seed(2)
    for n in (24, 1):
        h = torch.randn(n, spec.hidden, generator=g)
        layer.scratch = None
        fresh = layer.moe(h)
        layer.scratch = HostScratch()
        kept = layer.moe(h)
        if n > 1:
            assert seen[-1] > 1, "the chunk should expand in several batches"
        assert layer.scratch.held <= 3 * per_expert
        assert torch.equal(kept, fresh), (n, (kept - fresh).abs().max())


def test_a_cpu_stage_shares_one_scratch_and_frees_it():
    src = synth.SyntheticSource(synth.recipe_from_args("demo", quant="q4_k_m", n_layers=2, hidden=256,
                                                       head_dim=64, n_experts=16, expert_ffn=256, ffn=512), "cpu")
    st = StageRuntime(0, torch.device("cpu"), 0, 2, torch.float32)
    spec = src.spec
    rope = Rope(spec.head_dim, spec.rope_base, spec.rope_style, torch.device("cpu"))
    layers = st.load_layers(src, rope, range(2), False, lambda what, dev, n, advice, make: make())
    assert st.scratch is not None and all(layer.scratch is st.scratch for layer in layers)
    layers[1].moe(torch.randn(24, spec.hidden))
    assert st.scratch.held > 0
    st.release()
    assert st.scratch.held == 0
