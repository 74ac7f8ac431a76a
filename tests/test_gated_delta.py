"""Gated DeltaNet against transformers' Qwen3-Next layer on the same random weights (issue 34):
one pass over the prompt there, our chunks with the state carried between them here — any cut
of the prompt, and token-by-token decode after it, give the same outputs."""
from __future__ import annotations

import pytest
import torch

from engine.models.gated_delta import GdnShape, GdnState, causal_conv1d, gated_delta, gdn_mix, l2norm, split_ba

transformers = pytest.importorskip("transformers")


def _hf_layer(n_k: int, n_v: int, seed: int = 0):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    cfg = Qwen3NextConfig(hidden_size=48, linear_num_key_heads=n_k, linear_num_value_heads=n_v,
                          linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                          num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    layer = Qwen3NextGatedDeltaNet(cfg, 0).float().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        layer.A_log.copy_(torch.rand_like(layer.A_log).mul(2).log())  # decays of every size
    shape = GdnShape(n_k, n_v, 16, 8, 4)
    return layer, shape


def _gguf_weights(layer, shape: GdnShape) -> dict[str, torch.Tensor]:
    """The layer's weights as llama.cpp's converter writes them: attn_qkv with q of every k head
    first, then k, then v; attn_gate (z); ssm_ba as it was; ssm_a = -exp(A_log); the conv squeezed."""
    ratio = shape.n_v_heads // shape.n_k_heads
    w = layer.in_proj_qkvz.weight.detach()  # [out, hidden], per k head [q, k, v, z]
    per = w.t().reshape(w.shape[1], shape.n_k_heads, -1)
    q, k, v, z = torch.split(per, [shape.head_k, shape.head_k, ratio * shape.head_v, ratio * shape.head_v], dim=-1)
    flat = [x.reshape(w.shape[1], -1) for x in (q, k, v, z)]
    return {"attn_qkv": torch.cat(flat[:3], dim=-1).t().contiguous(), "attn_gate": flat[3].t().contiguous(),
            "ssm_ba": layer.in_proj_ba.weight.detach(), "ssm_a": -layer.A_log.detach().exp(),
            "dt_bias": layer.dt_bias.detach(), "conv": layer.conv1d.weight.detach().squeeze(1),
            "norm": layer.norm.weight.detach(), "out": layer.out_proj.weight.detach()}


def _ours(x: torch.Tensor, w: dict, shape: GdnShape, state: GdnState) -> torch.Tensor:
    b, a = split_ba(x @ w["ssm_ba"].t(), shape)
    core = gdn_mix(x @ w["attn_qkv"].t(), x @ w["attn_gate"].t(), b, a, ssm_a=w["ssm_a"], dt_bias=w["dt_bias"],
                   conv_weight=w["conv"], norm_weight=w["norm"], shape=shape, state=state, eps=1e-6)
    return core @ w["out"].t()


@pytest.mark.parametrize("n_k,n_v", [(2, 2), (2, 4)])
@pytest.mark.parametrize("cuts", [(), (37,), (64, 128), (1, 2, 70, 149)])
def test_chunks_with_carried_state_equal_transformers_one_pass(n_k, n_v, cuts):
    layer, shape = _hf_layer(n_k, n_v)
    torch.manual_seed(1)
    x = torch.randn(1, 150, 48)
    with torch.no_grad():
        want = layer(x)[0]
    w = _gguf_weights(layer, shape)
    state = GdnState(shape, torch.device("cpu"))
    bounds = [0, *cuts, 150]
    got = torch.cat([_ours(x[0, a:b], w, shape, state) for a, b in zip(bounds, bounds[1:])])
    assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())


def test_decode_after_a_prefill_continues_the_one_pass_outputs():
    layer, shape = _hf_layer(2, 4, seed=3)
    torch.manual_seed(2)
    x = torch.randn(1, 90, 48)
    with torch.no_grad():
        want = layer(x)[0]
    w = _gguf_weights(layer, shape)
    state = GdnState(shape, torch.device("cpu"))
    head = _ours(x[0, :80], w, shape, state)
    steps = [_ours(x[0, t:t + 1], w, shape, state) for t in range(80, 90)]
    got = torch.cat([head, *steps])
    assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())


def test_the_blocked_rule_equals_the_token_recurrence():
    """The WY blocks against the recurrence they stand for, written out token by token."""
    torch.manual_seed(5)
    t, h, dk, dv = 70, 3, 8, 5
    q, k = l2norm(torch.randn(t, h, dk)) * dk ** -0.5, l2norm(torch.randn(t, h, dk))
    v, g, beta = torch.randn(t, h, dv), -torch.rand(t, h) * 3, torch.rand(t, h)
    s0 = torch.randn(h, dk, dv)
    s = s0.clone()
    ref = torch.empty(t, h, dv)
    for i in range(t):
        s = s * g[i].exp()[:, None, None]
        u = beta[i][:, None] * (v[i] - torch.einsum("hkv,hk->hv", s, k[i]))
        s = s + k[i][:, :, None] * u[:, None, :]
        ref[i] = torch.einsum("hkv,hk->hv", s, q[i])
    state = s0.clone()
    out = gated_delta(q, k, v, g, beta, state, block=16)
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(state, s, atol=1e-5)


def test_conv_state_carries_the_last_inputs():
    torch.manual_seed(6)
    x, w = torch.randn(20, 6), torch.randn(6, 4)
    whole = causal_conv1d(x, w, torch.zeros(6, 3))
    st = torch.zeros(6, 3)
    parts = torch.cat([causal_conv1d(x[:7], w, st), causal_conv1d(x[7:8], w, st), causal_conv1d(x[8:], w, st)])
    assert torch.allclose(whole, parts, atol=1e-6) and torch.equal(st, x[-3:].t())


def test_state_bytes_are_what_the_state_holds():
    shape = GdnShape(16, 32, 128, 128, 4)  # Qwen3-Next-80B-A3B's GDN layers
    st = GdnState(shape, torch.device("cpu"), dtype=torch.bfloat16)
    assert st.nbytes == shape.state_bytes(torch.bfloat16) == 8192 * 3 * 2 + 32 * 128 * 128 * 4
