"""The shared expert beside the routed ones (Qwen3-Next's, with its sigmoid gate; GLM-4.5's
without): our FFN against transformers' Qwen3NextSparseMoeBlock on the same weights, and the
ungated expert as the plain sum of routed and shared SwiGLU."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.models.blocks import attention_parts
from engine.models.layers import Layer, LayerWeights
from engine.models.spec import ModelSpec

transformers = pytest.importorskip("transformers")

SPEC = ModelSpec(arch="qwen3moe", n_layers=1, hidden=48, n_heads=4, n_kv_heads=2, head_dim=12, n_experts=6,
                 n_experts_used=2, expert_ffn=20, ffn=0, rope_base=1e6, rms_eps=1e-6, vocab=64,
                 context_length=512, qk_norm=True, qkv_bias=False, rope_style="neox", shared_ffn=28,
                 shared_gate=True)


def _hf_block():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    cfg = Qwen3NextConfig(hidden_size=SPEC.hidden, num_experts=SPEC.n_experts, num_experts_per_tok=2,
                          moe_intermediate_size=SPEC.expert_ffn, shared_expert_intermediate_size=SPEC.shared_ffn,
                          norm_topk_prob=True, num_hidden_layers=1, layer_types=["full_attention"])
    torch.manual_seed(0)
    block = Qwen3NextSparseMoeBlock(cfg).float().eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return block


def _weights(block, spec: ModelSpec) -> LayerWeights:
    e = block.experts
    f = spec.expert_ffn
    d = {p.field: torch.zeros(p.shape) for p in attention_parts(spec) if not p.field.endswith("exps")}
    d.update(router=block.gate.weight.detach().clone(), gate_exps=e.gate_up_proj.detach()[:, :f].contiguous(),
             up_exps=e.gate_up_proj.detach()[:, f:].contiguous(), down_exps=e.down_proj.detach().clone())
    if spec.shared_ffn:
        s = block.shared_expert
        d.update(gate_shexp=s.gate_proj.weight.detach(), up_shexp=s.up_proj.weight.detach(),
                 down_shexp=s.down_proj.weight.detach())
    if spec.shared_gate:
        d["gate_inp_shexp"] = block.shared_expert_gate.weight.detach()
    return LayerWeights(**d)


def test_parts_name_the_converters_tensors():
    names = {p.name: p.shape for p in attention_parts(SPEC)}
    assert names["ffn_gate_inp_shexp.weight"] == (1, SPEC.hidden)
    assert names["ffn_down_shexp.weight"] == (SPEC.hidden, SPEC.shared_ffn)
    plain = replace(SPEC, shared_ffn=0, shared_gate=False)
    assert not any("shexp" in p.name for p in attention_parts(plain))
    assert SPEC.layer_params() - plain.layer_params() == 3 * SPEC.hidden * SPEC.shared_ffn + SPEC.hidden


def test_gated_shared_expert_equals_transformers_sparse_moe_block():
    block = _hf_block()
    torch.manual_seed(1)
    h = torch.randn(37, SPEC.hidden)
    with torch.no_grad():
        want = block(h[None])[0]
    got = Layer(SPEC, 0, _weights(block, SPEC), rope=None).ffn(h)
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_ungated_shared_expert_is_added_as_it_is():
    block = _hf_block()
    spec = replace(SPEC, shared_gate=False)
    h = torch.randn(9, SPEC.hidden)
    w = _weights(block, spec)
    routed = Layer(replace(spec, shared_ffn=0), 0, w, rope=None).ffn(h)
    s = block.shared_expert
    with torch.no_grad():
        want = routed + s(h)
    got = Layer(spec, 0, w, rope=None).ffn(h)
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
