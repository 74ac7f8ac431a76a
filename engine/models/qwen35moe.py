"""Qwen3.5-MoE / Qwen3.6-MoE, text only (llama.cpp `qwen35moe`; 35B-A3B, 122B-A10B, 397B-A17B):
Qwen3-Next's layers (`qwen3next`: GDN and gated attention, routed plus gated shared experts,
(1 + w) norms written as they multiply) with two differences in the file:

- a GDN layer's b and a come from two projections, `ssm_beta` and `ssm_alpha` (Qwen3-Next fuses
  them per k head into `ssm_ba`);
- the converter reorders the value heads from transformers' grouped order (k head g's value
  heads side by side) to ggml's tiled one (value head h belongs to k head h % n_k) in every
  tensor that has them (qkv's v rows, z, b, a, A, dt, the conv's v channels, ssm_out's columns),
  so q and k are tiled over the value heads (`GdnShape.v_tiled`) and nothing else changes.

RoPE is interleaved MRoPE (`rope.dimension_sections`, required by llama.cpp): a text token has
one position in every section, so it is the partial neox RoPE of Qwen3-Next; the sections are
checked, then need no code.  The vision tower is another file (mmproj).
Oracle: tests/test_family_files.py (transformers' Qwen3_5MoeForCausalLM)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.models.blocks import LayerKind, Part
from engine.models.family import SpecSource, whole_numbers
from engine.models.qwen3next import GATED_ATTENTION, OWN_KEYS, Qwen3Next, RecurrentState, _gdn_class, gdn_parts
from engine.models.spec import ModelSpec


def gdn_parts_apart(s: ModelSpec) -> tuple[Part, ...]:
    """Qwen3-Next's GDN tensors with ssm_ba replaced by ssm_alpha and ssm_beta (the converter's order)."""
    parts = gdn_parts(s)
    at = next(i for i, p in enumerate(parts) if p.field == "ssm_ba")
    n = s.linear_v_heads
    apart = (Part("ssm_alpha", "ssm_alpha.weight", (n, s.hidden)), Part("ssm_beta", "ssm_beta.weight", (n, s.hidden)))
    return parts[:at] + apart + parts[at + 1:]


GDN_APART = LayerKind("gdn", gdn_parts_apart, RecurrentState(), _gdn_class)


def mrope_sections(rotary_dim: int) -> list[int]:
    """Qwen3.5's [t, h, w, 0] split of the rotated pairs ([11, 11, 10, 0] of 32), for other sizes alike."""
    pairs = rotary_dim // 2
    side = (pairs * 11 + 31) // 32
    return [side, side, max(pairs - 2 * side, 0), 0]


@dataclass(frozen=True)
class Qwen35Moe(Qwen3Next):
    def spec_from_metadata(self, m: SpecSource) -> ModelSpec:
        spec = replace(super().spec_from_metadata(m), v_tiled=True)
        key = f"{self.arch}.rope.dimension_sections"
        values = whole_numbers(m, key)
        if values is None:
            raise m.problem(f"missing metadata key {key} (llama.cpp requires Qwen3.5's MRoPE sections)")
        if any(v < 0 for v in values) or sum(values) * 2 > spec.rotary_dim:
            raise m.problem(f"metadata key {key} is {values}: the sections must be >= 0 and cover at most the "
                            f"{spec.rotary_dim} rotated dimensions (one entry per rotated pair)")
        return spec

    def spec_from_recipe(self, r: Any) -> ModelSpec:
        """Qwen3-Next's proportions (see there), the value heads tiled as Qwen3.5's files hold them."""
        return replace(super().spec_from_recipe(r), v_tiled=True)

    def file_metadata(self, s: ModelSpec) -> list[tuple[str, Any]]:
        return super().file_metadata(s) + [(f"{self.arch}.rope.dimension_sections", mrope_sections(s.rotary_dim))]

    def layer_kind(self, spec: ModelSpec, i: int) -> LayerKind:
        return GDN_APART if spec.recurrent[i] else GATED_ATTENTION


FAMILY = Qwen35Moe("qwen35moe", moe=True, qk_norm=True, partial_rotary=True,
                   own_keys=OWN_KEYS + ("rope.dimension_sections",))
