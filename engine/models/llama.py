"""Llama (llama.cpp `llama`): SwiGLU FFN, no biases, no q/k norm.  llama.cpp's converter permutes
q/k so that RoPE rotates adjacent pairs ("norm" style).

Mixtral converts to a llama file with experts (`llama.expert_count`, `ffn_*_exps`, the router
`ffn_gate_inp`): every layer's FFN is then routed experts — softmax over the router's logits,
the top k renormalised, which is qwen3moe's routing — each of `feed_forward_length` (the
converter writes no expert_feed_forward_length for it).
Oracles: tests/test_numerics.py (transformers' LlamaForCausalLM), tests/test_family_files.py
(MixtralForCausalLM on the weights a file was converted from)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.models.family import Family, SpecSource
from engine.models.spec import ModelSpec


@dataclass(frozen=True)
class Llama(Family):
    def spec_from_metadata(self, m: SpecSource) -> ModelSpec:
        a = self.arch
        if not m.read_int(f"{a}.expert_count", 0, minimum=0):
            return super().spec_from_metadata(m)
        spec = Family.spec_from_metadata(replace(self, moe=True), m)  # Mixtral: experts in every layer
        if not spec.expert_ffn:
            spec = replace(spec, expert_ffn=m.read_int(f"{a}.feed_forward_length"))
        return spec

    def with_experts(self, r: Any) -> Any:
        """Expert flags on a llama: Mixtral's layout (routed experts in every layer of a llama file)."""
        return replace(r, llama_experts=True)

    def has_experts(self, r: Any) -> bool:
        return bool(getattr(r, "llama_experts", False))

    def spec_from_recipe(self, r: Any) -> ModelSpec:
        """A generated llama model; `r.llama_experts` gives it Mixtral's routed experts."""
        return Family.spec_from_recipe(replace(self, moe=bool(getattr(r, "llama_experts", False))), r)


FAMILY = Llama("llama", rope_style="norm")
