"""The static-shape decode step (issue 32 item 2), CPU: the code a stage's decode CUDA graph
holds, run eagerly.

The position lives in a device tensor (engine/models/decode_pos.py): RoPE rows gathered by it,
KV written by index, attention over a power-of-two span of the cache masked past it
(engine/kernels/decode_attention.py).  Its tokens must be the per-layer step's (a host
position, the path before it) and the prefill argmax continuation, for float and quantised
weights, fp32 and bf16, one stage and two (threads and processes), across a span crossing."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.io import synth
from engine.io.prompt import synthetic
from engine.kernels.decode_attention import decode_attention
from engine.models import decode_pos
from engine.models.decode_graph import static_reason
from engine.models.decode_pos import DevicePos, span_for
from engine.models.kv import LayerKV
from engine.models.layers import Layer
from engine.pipeline import stage_decode
from engine.pipeline.session import Session

K_SHAPES = dict(hidden=256, head_dim=64, n_experts=16, expert_ffn=256, ffn=512)
PROMPT, DECODE = 11, 6  # positions 11..16: spans 16 then 17 (the capacity) with a floor of 4


def _source(quant: str, n_layers: int = 2, arch: str | None = None) -> synth.SyntheticSource:
    extra = {"arch": arch} if arch else {}
    return synth.SyntheticSource(synth.recipe_from_args("demo", quant=quant, n_layers=n_layers, **K_SHAPES, **extra),
                                 "cpu")


def _decode(src, devices: list[str], dtype: str, **config) -> list[int]:
    sess = Session(src, EngineConfig(devices=devices, chunk_tokens=4, dtype=dtype, **config))
    try:
        return sess.run(synthetic(PROMPT, src.spec.vocab, nonce=5), decode_tokens=DECODE).report.generated
    finally:
        sess.close()


def _prefill_argmax(src, gen: list[int], dtype: str) -> list[int]:
    """The argmax of ONE prefill pass over prompt + gen[:-1] at the positions that predicted gen."""
    sess = Session(src, EngineConfig(devices=["cpu"], chunk_tokens=64, dtype=dtype))
    try:
        ids = list(synthetic(PROMPT, src.spec.vocab, nonce=5)) + gen[:-1]
        return sess.run(ids, logits_all=True).logits[PROMPT - 1:].argmax(-1).tolist()
    finally:
        sess.close()


@pytest.fixture
def small_spans(monkeypatch):
    """A floor of 4 tokens: the decode below crosses from span 16 to 17 (its capacity)."""
    monkeypatch.setattr(decode_pos, "MIN_SPAN", 4)


def test_the_span_is_the_next_power_of_two_from_the_floor_within_the_capacity():
    assert span_for(0, 1000, floor=256) == 256
    assert span_for(255, 1000, floor=256) == 256
    assert span_for(256, 1000, floor=256) == 512
    assert span_for(700, 1000, floor=256) == 1000  # capped by the cache
    assert span_for(5, 6, floor=256) == 6
    assert span_for(16, 4096, floor=4) == 32
    with pytest.raises(RuntimeError, match="exceeds its capacity of 6"):
        span_for(6, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_is_sdpa_over_the_keys_up_to_the_position(dtype):
    """Masked past the position, over a span with garbage-free zeros beyond it: the same output
    as SDPA over exactly keys [0, pos] (GQA: 8 query heads over 2 key/value heads)."""
    g = torch.Generator().manual_seed(0)
    span, pos, H, KV, hd = 32, 19, 8, 2, 16
    q = torch.randn(1, H, hd, generator=g).to(dtype)
    keys = torch.randn(span, KV, hd, generator=g).to(dtype)
    values = torch.randn(span, KV, hd, generator=g).to(dtype)
    keys[pos + 1:] = 0
    values[pos + 1:] = 0
    at = DevicePos.at(torch.tensor([pos]), span)
    got = decode_attention(q, keys, values, at.masked, at.index)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys[:pos + 1].transpose(0, 1).unsqueeze(0),
                                         values[:pos + 1].transpose(0, 1).unsqueeze(0), enable_gqa=True)
    ref = ref.squeeze(0).transpose(0, 1).reshape(1, H * hd)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - ref.float()).abs().max().item() <= tol


def test_a_device_position_appends_by_index_and_attends_over_its_span():
    kv = LayerKV(8, 2, 4, torch.device("cpu"), torch.float32)
    kv.k.zero_(), kv.v.zero_()
    k, v = torch.ones(1, 2, 4), torch.full((1, 2, 4), 2.0)
    keys, values = kv.append(k, v, DevicePos.at(torch.tensor([5]), 6))
    assert keys.shape[0] == values.shape[0] == 6
    assert torch.equal(kv.k[5], k[0]) and torch.equal(kv.v[5], v[0]) and not kv.k[:5].any()
    with pytest.raises(RuntimeError, match="over 9 keys"):
        kv.append(k, v, DevicePos.at(torch.tensor([5]), 9))


@pytest.mark.parametrize("quant,dtype", [("f16", "float32"), ("q4_k_m", "float32"), ("f16", "bfloat16"),
                                         ("q4_k_m", "bfloat16")])
def test_static_decode_is_the_per_layer_decode_and_the_prefill_argmax(quant, dtype, small_spans, monkeypatch):
    src = _source(quant)
    static = _decode(src, ["cpu"], dtype)
    monkeypatch.setattr(stage_decode, "STATIC", False)  # the per-layer step with a host position
    per_layer = _decode(src, ["cpu"], dtype)
    assert static == per_layer, f"{quant} {dtype}"
    assert static == _prefill_argmax(src, static, dtype)
    assert len(set(static)) > 1, static  # decode moves: the comparison means something


def test_static_decode_through_two_stages_threads_and_processes(small_spans):
    """Two CPU stages: threads (span floor 4 here) and stage processes (their own default floor)
    decode the one-stage tokens, the prefill argmax continuation."""
    src = _source("q4_k_m", n_layers=3)
    one = _decode(src, ["cpu"], "float32")
    assert _decode(src, ["cpu", "cpu"], "float32") == one
    assert _decode(src, ["cpu", "cpu"], "float32", executor="processes") == one
    assert one == _prefill_argmax(src, one, "float32")


def test_static_decode_of_a_llama_layer_rotates_adjacent_pairs(small_spans, monkeypatch):
    """llama's RoPE pairs (2i, 2i+1) (the reference path's Rope.apply) at a device position."""
    src = _source("f16", arch="llama")
    static = _decode(src, ["cpu"], "float32")
    monkeypatch.setattr(stage_decode, "STATIC", False)
    assert static == _decode(src, ["cpu"], "float32") == _prefill_argmax(src, static, "float32")


def test_rows_past_the_prompt_are_cleared_before_a_sequence_decodes():
    """A masked row weighs 0, and 0 times NaN is NaN: a cache full of NaN from before (an
    uninitialised allocation, an earlier run) must not reach the tokens."""
    src = _source("q4_k_m")
    sess = Session(src, EngineConfig(devices=["cpu"], chunk_tokens=4))
    try:
        ids = synthetic(PROMPT, src.spec.vocab, nonce=5)
        first = sess.run(ids, decode_tokens=DECODE).report.generated
        with torch.inference_mode():
            for kv in sess.stages[0].kvs:
                kv.k.fill_(float("nan"))
                kv.v.fill_(float("nan"))
        assert sess.run(ids, decode_tokens=DECODE).report.generated == first
    finally:
        sess.close()


def test_a_layer_that_reads_the_position_its_own_way_keeps_the_per_layer_step():
    src = _source("f16")
    sess = Session(src, EngineConfig(devices=["cpu"]))
    try:
        st = sess.stages[0]
        sess.run(synthetic(PROMPT, src.spec.vocab, nonce=5), decode_tokens=2)
        assert static_reason(st.layers, st.kvs) == ""

        class OwnAttention(Layer):
            def _attend(self, q, keys, values, n, pos):
                return super()._attend(q, keys, values, n, pos)

        class Declared(OwnAttention):
            static_decode = True

        class OtherState:
            capacity = 8

        layer = st.layers[0]
        assert "(OwnAttention) has no static-shape decode step" in static_reason(
            [OwnAttention(layer.spec, 0, layer.w, layer.rope)], st.kvs[:1])
        assert static_reason([Declared(layer.spec, 0, layer.w, layer.rope)], st.kvs[:1]) == ""
        assert "state (OtherState)" in static_reason(st.layers[:1], [OtherState()])
    finally:
        sess.close()


def test_a_per_layer_decode_says_why_in_the_report(monkeypatch):
    monkeypatch.setattr(stage_decode, "STATIC", False)
    src = _source("f16")
    sess = Session(src, EngineConfig(devices=["cpu"]))
    try:
        notes = sess.run(synthetic(PROMPT, src.spec.vocab, nonce=5), decode_tokens=3).report.notes
    finally:
        sess.close()
    assert sum("decode on cpu: one layer at a time (the static-shape step is off)" in n for n in notes) == 1


def test_a_step_gathers_each_rope_table_once_for_all_its_layers():
    """Every layer of a stage shares its RoPE tables: the step's position gathers a table's row
    once (one slice of the table or another is the same memory), a different table anew."""
    table = torch.arange(40.0).view(10, 4)
    other = table.clone()
    at = DevicePos.at(torch.tensor([3]), 8)
    first = at.row(table[:8])
    assert at.row(table[:8]) is first and torch.equal(first, table[3:4])
    assert at.row(other) is not first and torch.equal(at.row(other), first)
    assert DevicePos.at(torch.tensor([3]), 8).row(table[:8]) is not first  # a new step gathers anew
