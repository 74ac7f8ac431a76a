"""Decode's roofline (engine/plan/roofline.py): the weight bytes a decode token reads, counted by hand on
tiny models, and the limit they put on tok/s through a split."""
from __future__ import annotations

import pytest
import torch

from engine.io import synth
from engine.plan import roofline


def test_bytes_per_token_of_an_fp32_moe_counted_by_hand():
    # the demo's shapes as plain fp32: hidden 128, 4 heads / 2 KV heads of 32, 8 experts of 64, top-2
    src = synth.SyntheticSource(synth.recipe_from_args("demo", quant="f32", n_layers=3), "cpu")
    s = src.spec
    assert (s.hidden, s.n_heads, s.n_kv_heads, s.head_dim, s.n_experts, s.n_experts_used, s.expert_ffn) == \
        (128, 4, 2, 32, 8, 2, 64)
    per_layer = (128 + 128 * 128 + 64 * 128 + 64 * 128 + 128 * 128 + 128  # norms, q, k, v, o
                 + 32 + 32 + 8 * 128  # q/k norm, router
                 + 2 * 3 * 64 * 128)  # the two routed experts' gate, up, down
    db = roofline.decode_weight_bytes(src)
    assert db.layers == (4 * per_layer,) * 3
    assert db.embed == 4 * 128  # one row of the embedding
    assert db.head == 4 * (128 + s.vocab * 128)  # final norm + output
    assert db.total == 4 * (3 * per_layer + 128 + 128 + s.vocab * 128)
    assert db.of_stage(1, 3, False, True) == 2 * 4 * per_layer + db.head


def test_routed_experts_count_at_their_quantized_size():
    """Q4_K_M: gate and up in Q4_K (144 bytes per 256 values), down Q4_K or Q6_K (210) by layer;
    a token reads top-2 of 16 experts of [256 x 256] each."""
    shapes = dict(n_layers=4, hidden=256, head_dim=64, n_experts=16, expert_ffn=256, ffn=512)
    src = synth.SyntheticSource(synth.recipe_from_args("demo", quant="q4_k_m", **shapes), "cpu")
    db = roofline.decode_weight_bytes(src)
    top4 = roofline.decode_weight_bytes(synth.SyntheticSource(
        synth.recipe_from_args("demo", quant="q4_k_m", n_experts_used=4, **shapes), "cpu"))
    blocks = 256 * 256 // 256
    for i, layer_bytes in enumerate(db.layers):
        down = {"Q4_K": 144, "Q6_K": 210}[src.qtype(f"blk.{i}.ffn_down_exps.weight").name]
        experts = 2 * (2 * blocks * 144 + blocks * down)
        others = sum(src.nbytes(f"blk.{i}.{n}.weight") for n in (
            "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "attn_q_norm", "attn_k_norm",
            "ffn_gate_inp"))
        assert layer_bytes == experts + others
        assert top4.layers[i] == 2 * experts + others  # twice the routed experts
    assert {src.qtype(f"blk.{i}.ffn_down_exps.weight").name for i in range(4)} == {"Q4_K", "Q6_K"}


def test_roofline_through_stages_and_unknown_bandwidth():
    db = roofline.DecodeBytes(embed=10, layers=(100, 200, 300), head=50)
    bw = {"a": 1000.0, "b": 500.0}
    roof = roofline.roofline(db, [("a", 0, 2), ("b", 2, 3)], lambda d: (bw[d], "given"))
    # stage a reads the embedding row and layers 0-1, then b reads layer 2 and the head
    assert roof.limit_tok_s == pytest.approx(1 / ((10 + 300) / 1000 + (300 + 50) / 500))
    assert roof.weight_bytes == 660
    assert roof.share(roof.limit_tok_s / 2) == pytest.approx(0.5)
    unknown = roofline.roofline(db, [("a", 0, 2), ("cpu", 2, 3)], roofline.bandwidth_of())
    assert unknown.limit_tok_s is None and unknown.share(5.0) is None and "unknown" in unknown.how
    measured = roofline.roofline(db, [("cpu", 0, 3)], roofline.bandwidth_of(2.0))
    assert measured.limit_tok_s == pytest.approx(2e9 / 660)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_cuda_bandwidth_of_a_cpu_is_unknown():
    assert roofline.cuda_bandwidth("cpu")[0] is None
