"""MiniMax-M2 (llama.cpp `minimax-m2`): routed experts in every layer, partial RoPE (neox over
each head's first `rope.dimension_count` dims), a sigmoid router whose score-correction bias
(`exp_probs_b.bias`) picks the top k and renormalised top-k weights, and a q/k RMSNorm over the
whole projection — one norm across all query heads (weight [heads x head_dim]) and one across
all key heads, before the heads are split (transformers' MiniMaxM2Attention; llama.cpp's
minimax-m2.cpp norms Qcur/Kcur before reshaping them to heads), not Qwen3's per-head norm.

llama.cpp reads `expert_gating_func` for it (absent: the converter writes sigmoid from the
config's scoring_func) and always renormalises (norm_w true) without a routed scale.
Oracle: tests/test_family_files.py (transformers' MiniMaxM2ForCausalLM on the weights the file
was converted from)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.models.blocks import KVState, LayerKind, Part, attention_parts
from engine.models.family import Family, SpecSource
from engine.models.spec import ModelSpec


def minimax_parts(s: ModelSpec) -> tuple[Part, ...]:
    """Attention with q/k norms as wide as the q and k projections, then the routed experts."""
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    return attention_parts(s) + (Part("q_norm_full", "attn_q_norm.weight", (q,), fp32=True),
                                 Part("k_norm_full", "attn_k_norm.weight", (kv,), fp32=True))


def minimax_layer() -> type:
    """The layer class (imported when a layer is built: the registry stays free of torch)."""
    from engine.models.full_qk_norm import FullQKNormLayer

    return FullQKNormLayer


MINIMAX_LAYER = LayerKind("attention", minimax_parts, KVState(), layer=minimax_layer)


@dataclass(frozen=True)
class MiniMaxM2(Family):
    def spec_from_metadata(self, m: SpecSource) -> ModelSpec:
        spec = super().spec_from_metadata(m)
        return replace(spec, expert_bias=True, **self.routing_from_metadata(m, gating="sigmoid"))

    def spec_from_recipe(self, r: Any) -> ModelSpec:
        return replace(super().spec_from_recipe(r), expert_gating="sigmoid", expert_bias=True)

    def file_metadata(self, s: ModelSpec) -> list[tuple[str, int | float | bool]]:
        return super().file_metadata(s) + [(f"{self.arch}.expert_gating_func", 2 if s.expert_gating == "sigmoid" else 1)]

    def layer_kind(self, spec: ModelSpec, i: int) -> LayerKind:
        return MINIMAX_LAYER


# the per-head qk_norm flag stays off: this family's norms are its own parts and layer class
FAMILY = MiniMaxM2("minimax-m2", moe=True, partial_rotary=True, own_keys=("expert_gating_func",))
