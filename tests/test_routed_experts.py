"""Only the routed experts expanded (engine/models/routed_experts.py): the compact slots, and the compact
path giving the full path's output on the reference and the grouped-GEMM paths, CPU."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.io import synth
from engine.io.prompt import synthetic
from engine.models import routed_experts
from engine.models.layers import Layer, Rope
from engine.models.loading import load_layer_weights
from engine.pipeline.session import Session
from engine.quant.qtensor import QTensor

# rows of 256 values so the K-quants apply; 16 experts, top-2
K_SHAPES = dict(hidden=256, head_dim=64, n_experts=16, expert_ffn=256, ffn=512)


def _source(quant: str, n_layers: int = 2) -> synth.SyntheticSource:
    return synth.SyntheticSource(synth.recipe_from_args("demo", quant=quant, n_layers=n_layers, **K_SHAPES), "cpu")


def _force(monkeypatch, compact: bool) -> None:
    """Every device type takes the compact path (compact) or the full path (not compact)."""
    for dev in ("cpu", "cuda"):
        monkeypatch.setitem(routed_experts.COMPACT_MAX_FRACTION, dev, 2.0 if compact else 0.0)


def test_compact_routing_slots():
    g = torch.Generator().manual_seed(0)
    for m, E in ((1, 8), (6, 16), (24, 128), (40, 16)):
        flat = torch.randint(0, E, (m,), generator=g)
        order = torch.argsort(flat, stable=True)
        slots = routed_experts.slot_bound(m, 1, E)
        cr = routed_experts.compact_routing(flat[order], slots)
        uniq, counts = torch.unique(flat, return_counts=True)
        d = uniq.numel()
        assert cr.experts.dtype == torch.int64 and cr.experts.is_contiguous() and cr.experts.shape == (slots,)
        assert torch.equal(cr.experts[:d], uniq) and not cr.experts[d:].any()  # padding: expert 0
        assert int(cr.experts.min()) >= 0 and int(cr.experts.max()) < E
        assert cr.offsets.dtype == torch.int32
        assert torch.equal(cr.offsets[:d], torch.cumsum(counts, 0).to(torch.int32))
        assert (cr.offsets[d:] == m).all()  # padding slots own no rows


def test_one_tokens_routing_takes_the_distinct_shortcut_to_the_same_slots():
    """A decode token's top-k experts are distinct: slot j is row j, offsets 1..k, exactly what
    the general rule gives for those rows."""
    g = torch.Generator().manual_seed(1)
    for k, E in ((1, 8), (2, 16), (8, 128), (16, 16)):
        flat = torch.randperm(E, generator=g)[:k]
        order = torch.argsort(flat, stable=True)
        slots = routed_experts.slot_bound(1, k, E)
        fast = routed_experts.compact_routing(flat[order], slots, distinct=True)
        general = routed_experts.compact_routing(flat[order], slots)
        assert torch.equal(fast.experts, general.experts) and torch.equal(fast.offsets, general.offsets)
        assert fast.experts.dtype == torch.int64 and fast.offsets.dtype == torch.int32


def test_rule_and_batches():
    assert routed_experts.slot_bound(1, 8, 128) == 8 and routed_experts.slot_bound(64, 8, 128) == 128
    frac = routed_experts.COMPACT_MAX_FRACTION["cuda"]
    assert routed_experts.compact_wanted(8, 128, "cuda") and not routed_experts.compact_wanted(128, 128, "cuda")
    assert routed_experts.compact_wanted(int(frac * 128) - 1, 128, "cuda")
    assert routed_experts.batches([3, 5, 7, 9, 11], 10, budget=25) == [[3, 5], [7, 9], [11]]
    assert routed_experts.batches([3, 5], 100, budget=25) == [[3], [5]]


def test_gather_is_the_rows_of_the_full_expansion():
    src = _source("q4_k_m", 1)
    w = load_layer_weights(src, 0, torch.device("cpu"), torch.float32)
    assert isinstance(w.down_exps, QTensor)
    idx = torch.tensor([5, 0, 5, 15])
    for t in (w.gate_exps, w.up_exps, w.down_exps):
        full = t.dequantize(torch.float32)
        assert torch.equal(t.gather(idx, torch.float32), full[idx])
        assert torch.equal(t.experts(3, 7).dequantize(torch.float32), full[3:7])
    with pytest.raises(IndexError, match="outside 0..15"):
        w.gate_exps.gather(torch.tensor([3, 16]))


def _layer(src, dtype: torch.dtype) -> Layer:
    spec = src.spec
    w = load_layer_weights(src, 1, torch.device("cpu"), dtype)
    return Layer(spec, 1, w, Rope(spec.head_dim, spec.rope_base, spec.rope_style, torch.device("cpu")))


@pytest.mark.parametrize("grouped", [False, True], ids=["reference", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compact_moe_equals_full_moe(monkeypatch, grouped, dtype):
    """The experts of a layer in a Q4_K_M mix (Q4_K gate/up, Q6_K down): the compact path gives
    the full path's output for a decode token and small chunks, on the per-expert reference
    path and on the grouped-GEMM path (the GPU's, run here on the CPU)."""
    if grouped and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    src = _source("q4_k_m")
    layer = _layer(src, dtype)
    assert isinstance(layer.w.gate_exps, QTensor)
    layer.use_grouped_mm = grouped
    g = torch.Generator().manual_seed(1)
    calls = {"gather": 0}
    real_gather = QTensor.gather

    def counting_gather(self, experts, dt=torch.float32, out=None):
        calls["gather"] += 1
        return real_gather(self, experts, dt, out=out)

    monkeypatch.setattr(QTensor, "gather", counting_gather)
    for n in (1, 3, 5):
        h = torch.randn(n, src.spec.hidden, generator=g).to(dtype)
        _force(monkeypatch, False)
        before = calls["gather"]
        full = layer.moe(h)
        assert calls["gather"] == before  # the full path gathers nothing
        _force(monkeypatch, True)
        compact = layer.moe(h)
        assert calls["gather"] == before + 3  # gate, up and down of the routed experts only
        assert torch.equal(compact, full), (n, (compact.float() - full.float()).abs().max())


@pytest.mark.parametrize("quant", ["q4_k_m", "f16"])
def test_session_digest_and_logits_equal_on_both_paths(monkeypatch, quant):
    """A whole run (prefill chunks of 4 and 1 tokens, decode): logits, digest and generated tokens
    are the same whichever path each layer's experts take."""
    src = _source(quant)
    ids = synthetic(9, src.spec.vocab, nonce=3)
    out = {}
    for compact in (False, True):
        _force(monkeypatch, compact)
        res = Session(src, EngineConfig(devices=["cpu"], chunk_tokens=4)).run(ids, decode_tokens=3, logits_all=True)
        out[compact] = res
    assert torch.equal(out[True].logits, out[False].logits)
    assert out[True].report.digest == out[False].report.digest
    assert out[True].report.generated == out[False].report.generated


@pytest.mark.parametrize("width,offset", [(288, 0), (288, 16), (288, 13), (210, 2), (210, 0), (34, 4), (18, 1)])
def test_row_gathers_of_the_torch_path(width, offset):
    """The torch path's gather (CPU: row copies; GPU: index_select on the widest integer view the
    layout allows) picks exactly raw[rows], for slices of a larger buffer as the expert cache has."""
    from engine.quant import dequant

    buf = torch.randint(0, 256, (6, width + 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(width))
    raw = buf[:, offset:offset + width]
    idx = torch.tensor([4, 0, 4, 5])
    assert torch.equal(dequant._gather_rows(raw, idx), raw[idx])
    assert torch.equal(dequant._gather_wide(raw, idx), raw[idx])
