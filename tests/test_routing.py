"""Routing variants (engine/models/routing.py) against the model authors' routers in
transformers: MiniMax-M2's sigmoid + selection bias + renormalisation, GLM-4.5's sigmoid + bias
(+ renormalisation) x routed scaling; and the default routing is the one the engine always ran
(softmax, top k, renormalised), computed bit for bit as before."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from engine.io import synth
from engine.models import routing

SPEC = synth.recipe_from_args("demo").spec()  # 8 experts, top 2
N, E, D = 40, 8, 16


def _logits_and_bias(seed: int):
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(N, D, generator=g), torch.randn(E, D, generator=g)
    return h, w, torch.randn(E, generator=g)  # a bias as large as the scores: it changes the choice


def _same_choice(ours, theirs):
    (w1, i1), (w2, i2) = ours, theirs
    o1, o2 = i1.sort(-1), i2.sort(-1)
    assert torch.equal(o1.values, o2.values)
    assert torch.allclose(w1.gather(-1, o1.indices), w2.gather(-1, o2.indices), atol=1e-6)


def test_the_default_is_softmax_top_k_renormalised_bit_for_bit():
    h, w, _ = _logits_and_bias(0)
    logits = torch.nn.functional.linear(h, w)
    probs = torch.softmax(logits, dim=-1)  # what Layer.moe computed before the variants
    want_w, want_i = torch.topk(probs, SPEC.n_experts_used, dim=-1)
    got_w, got_i = routing.route(logits, SPEC)
    assert torch.equal(got_i, want_i) and torch.equal(got_w, want_w / want_w.sum(-1, keepdim=True))


def test_minimax_m2_router():
    mm = pytest.importorskip("transformers.models.minimax_m2.modeling_minimax_m2")
    h, w, bias = _logits_and_bias(1)
    ref = mm.MiniMaxM2TopKRouter(SimpleNamespace(num_experts_per_tok=2, num_local_experts=E, hidden_size=D))
    with torch.no_grad():
        ref.weight.copy_(w)
        _, tw, ti = ref(h, bias)
    spec = replace(SPEC, expert_gating="sigmoid", expert_bias=True)
    ours = routing.route(torch.nn.functional.linear(h, w), spec, bias)
    _same_choice(ours, (tw, ti))
    unbiased = routing.route(torch.nn.functional.linear(h, w), spec)
    assert not torch.equal(unbiased[1].sort(-1).values, ours[1].sort(-1).values)  # the bias chose


def _glm_router(glm, h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, **config) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' GLM-4.5 router (DeepSeek-V3's too) with these weights: (top weights, top ids)."""
    ref = glm.Glm4MoeTopkRouter(SimpleNamespace(hidden_size=D, **config))
    with torch.no_grad():
        ref.weight.copy_(w)
        ref.e_score_correction_bias.copy_(bias)
        _, tw, ti = ref(h)
    return tw, ti


@pytest.mark.parametrize("norm", [True, False])
def test_glm4moe_router_with_routed_scaling(norm):
    glm = pytest.importorskip("transformers.models.glm4_moe.modeling_glm4_moe")
    h, w, bias = _logits_and_bias(2)
    tw, ti = _glm_router(glm, h, w, bias, num_experts_per_tok=2, num_local_experts=E, routed_scaling_factor=2.5,
                         n_group=1, topk_group=1, norm_topk_prob=norm)
    spec = replace(SPEC, expert_gating="sigmoid", expert_bias=True, expert_weights_norm=norm, expert_weights_scale=2.5)
    _same_choice(routing.route(torch.nn.functional.linear(h, w), spec, bias), (tw, ti))


def test_softmax_without_renormalising_keeps_the_probabilities():
    h, w, _ = _logits_and_bias(3)
    logits = torch.nn.functional.linear(h, w)
    tw, ti = routing.route(logits, replace(SPEC, expert_weights_norm=False, expert_weights_scale=0.5))
    assert torch.allclose(tw, 0.5 * torch.softmax(logits, -1).gather(-1, ti))


def test_grouped_top_k_is_glm4moes_and_deepseeks():
    """n_group / topk_group of transformers' router (the same as DeepSeek-V3's): 16 experts in 4
    groups, the best 2 groups by their top-2 scores, top 4 from them."""
    glm = pytest.importorskip("transformers.models.glm4_moe.modeling_glm4_moe")
    g = torch.Generator().manual_seed(4)
    h, w, bias = torch.randn(N, D, generator=g), torch.randn(16, D, generator=g), torch.randn(16, generator=g)
    tw, ti = _glm_router(glm, h, w, bias, num_experts_per_tok=4, num_local_experts=16, routed_scaling_factor=1.0,
                         n_group=4, topk_group=2, norm_topk_prob=True)
    spec = replace(SPEC, n_experts=16, n_experts_used=4, expert_gating="sigmoid", expert_bias=True,
                   expert_groups=4, expert_groups_used=2)
    ours = routing.route(torch.nn.functional.linear(h, w), spec, bias)
    _same_choice(ours, (tw, ti))
    ungrouped = routing.route(torch.nn.functional.linear(h, w), replace(spec, expert_groups=0), bias)
    assert not torch.equal(ungrouped[1].sort(-1).values, ours[1].sort(-1).values)  # the groups chose
