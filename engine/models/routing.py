"""Which experts a token goes to and with what weights: the router's scores, the top k, their
weights — the variants llama.cpp's `build_moe_ffn` takes from a file (src/llama-graph.cpp).

* scores: softmax over the experts (qwen3moe, Mixtral) or a sigmoid per expert
  (`expert_gating_func` 2: GLM-4.5, MiniMax-M2, DeepSeek-V3);
* a per-expert score-correction bias (`exp_probs_b.bias`, DeepSeek-V3's
  e_score_correction_bias) added to the scores to *select* the top k only: the weights are
  the unbiased scores of the selected experts;
* the k weights renormalised to sum 1 or not (`expert_weights_norm`);
* then scaled (`expert_weights_scale`, GLM's routed_scaling_factor);
* grouped top-k (`expert_group_count` / `expert_group_used_count`, DeepSeek-V3's n_group /
  topk_group): the experts in equal groups, each group scored by the sum of its two best
  (biased) scores, the top k taken only from the best `expert_groups_used` groups.

The spec's defaults (softmax, no bias, renormalised, scale 1) are the routing of the families
the engine ran before these fields existed, computed by the same torch calls.  The same code
serves the CPU's fp32 path and the GPU path (its logits in bf16, scores in fp32); it holds no
host synchronisation, so a CUDA graph captures it."""
from __future__ import annotations

import torch

from engine.models.spec import ModelSpec


def route(logits: torch.Tensor, spec: ModelSpec, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [n, k] fp32, experts [n, k]) from the router's logits [n, E]."""
    k = spec.n_experts_used
    if spec.expert_gating == "sigmoid":
        probs = torch.sigmoid(logits.float())
    else:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if bias is None and spec.expert_groups <= 1:
        top_w, top_i = torch.topk(probs, k, dim=-1)
    else:  # the bias (and the groups) choose; the weights stay the unbiased scores
        choice = probs if bias is None else probs + bias.float()
        if spec.expert_groups > 1:
            choice = _best_groups(choice, spec.expert_groups, spec.expert_groups_used)
        top_i = torch.topk(choice, k, dim=-1).indices
        top_w = probs.gather(-1, top_i)
    if spec.expert_weights_norm:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    if spec.expert_weights_scale != 1.0:
        top_w = top_w * spec.expert_weights_scale
    return top_w, top_i


def _best_groups(choice: torch.Tensor, groups: int, used: int) -> torch.Tensor:
    """`choice` [n, E] with the experts outside each token's `used` best groups at -inf (a group's
    score: the sum of its two best choice scores, as llama.cpp's build_moe_ffn and DeepSeek-V3)."""
    n, e = choice.shape
    per_group = choice.view(n, groups, e // groups)
    best = torch.topk(per_group.topk(2, dim=-1).values.sum(-1), used, dim=-1).indices  # [n, used]
    keep = torch.zeros(n, groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, e)
