"""GLM-4.5 / 4.6 (llama.cpp `glm4moe`): `leading_dense_block_count` layers with a dense SwiGLU
FFN, then routed experts plus a shared expert (`expert_shared_count` x the expert size), a
sigmoid router whose score-correction bias (`exp_probs_b.bias`) picks the top k, the k weights
renormalised where `expert_weights_norm` says so (absent: not, as llama.cpp reads it) and
multiplied by `expert_weights_scale` (routed_scaling_factor; the shared expert unscaled), q/k/v
biases, per-head q/k RMSNorm where the file has it (GLM-4.5; Air has none), partial RoPE (neox
over half the head) and the FFN norm stored as `post_attention_norm`.

The MTP (nextn) block: llama.cpp's converter writes it as the last `nextn_predict_layers`
blocks, counted in `block_count` (llama.cpp's n_layer is block_count minus them, and its main
graph runs only those; the block is a draft model for speculative decoding).  Those blocks are
skipped here: the model is the first block_count - nextn_predict_layers blocks, and their
tensors are left unread.  Grouped top-k where the file says more than one expert group
(`expert_group_count`, `expert_group_used_count`; engine/models/routing.py).
Oracle: tests/test_family_files.py (transformers' Glm4MoeForCausalLM on the weights the file was
converted from, its checkpoint holding an MTP block as published ones do)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.models.blocks import FULL_ATTENTION, KVState, LayerKind, Part, attention_parts
from engine.models.family import Family, SpecSource, layers_without_mtp
from engine.models.spec import ModelSpec


@dataclass(frozen=True)
class Glm4MoeSpec(ModelSpec):
    dense_lead: int = 0  # the leading layers with a dense FFN (of `ffn` wide); experts in the rest

    def has_experts(self, i: int) -> bool:
        return i >= self.dense_lead

    def prefill_flops(self, n_tokens: int) -> float:
        """The dense lead layers at a dense FFN's cost, the others at the expert layers' (the
        report's TFLOP/s divides by this)."""
        lead = min(self.dense_lead, self.n_layers)
        dense = replace(self, n_layers=lead, n_experts=0, n_experts_used=0, shared_ffn=0, dense_lead=0)
        moe = replace(self, n_layers=self.n_layers - lead, dense_lead=0)
        return ModelSpec.prefill_flops(dense, n_tokens) + ModelSpec.prefill_flops(moe, n_tokens)


def _post_attention_norm(parts: tuple[Part, ...]) -> tuple[Part, ...]:
    """GLM's FFN norm is stored as post_attention_norm."""
    return tuple(replace(p, name="post_attention_norm.weight") if p.name == "ffn_norm.weight" else p for p in parts)


def moe_layer_parts(s: ModelSpec) -> tuple[Part, ...]:
    return _post_attention_norm(attention_parts(s))


def dense_layer_parts(s: ModelSpec) -> tuple[Part, ...]:
    return _post_attention_norm(attention_parts(replace(s, n_experts=0, n_experts_used=0, shared_ffn=0)))


def dense_layer() -> type:
    """The dense lead layers' class (imported when built: the registry stays free of torch)."""
    from engine.models.dense_lead import DenseFFNLayer

    return DenseFFNLayer


MOE_LAYER = replace(FULL_ATTENTION, parts=moe_layer_parts)
DENSE_LAYER = LayerKind("attention-dense-ffn", dense_layer_parts, KVState(), layer=dense_layer)
KEYS = ("expert_gating_func", "expert_weights_norm", "expert_weights_scale", "leading_dense_block_count",
        "nextn_predict_layers", "expert_shared_count", "expert_group_count", "expert_group_used_count")


@dataclass(frozen=True)
class Glm4Moe(Family):
    def spec_from_metadata(self, m: SpecSource) -> ModelSpec:
        a = self.arch
        spec = super().spec_from_metadata(m)
        n_layers = layers_without_mtp(m, a, spec.n_layers)
        lead = m.read_int(f"{a}.leading_dense_block_count", 0, minimum=0)
        if lead > n_layers:
            raise m.problem(f"metadata key {a}.leading_dense_block_count is {lead}: more than the {n_layers} layers")
        groups, used = self._groups(m, spec)
        if not spec.expert_ffn:
            raise m.problem(f"metadata key {a}.expert_feed_forward_length is missing or 0")
        shared = m.read_int(f"{a}.expert_shared_count", 0, minimum=0)
        fields = {**vars(spec), **self.routing_from_metadata(m, gating="sigmoid", norm=False),
                  "n_layers": n_layers, "dense_lead": lead, "expert_bias": True, "shared_ffn": shared * spec.expert_ffn,
                  "ffn": m.read_int(f"{a}.feed_forward_length") if lead else 0,
                  "qk_norm": m.has_tensor("blk.0.attn_q_norm.weight"), "expert_groups": groups,
                  "expert_groups_used": used}
        return Glm4MoeSpec(**fields)

    def _groups(self, m: SpecSource, spec: ModelSpec) -> tuple[int, int]:
        """Grouped top-k as the file says it ((0, 0): none; GLM-4.5's files say one group)."""
        a = self.arch
        groups = m.read_int(f"{a}.expert_group_count", 0, minimum=0)
        used = m.read_int(f"{a}.expert_group_used_count", 0, minimum=0)
        if groups <= 1:
            return 0, 0
        e, k = spec.n_experts, spec.n_experts_used
        if e % groups or e // groups < 2 or not 0 < used <= groups or k > used * (e // groups):
            raise m.problem(f"metadata keys {a}.expert_group_count {groups} / expert_group_used_count {used}: the "
                            f"{e} experts must split into groups of 2 or more, of which 1..{groups} are used and "
                            f"hold the {k} chosen experts")
        return groups, used

    def spec_from_recipe(self, r: Any) -> ModelSpec:
        """A synthetic GLM as GLM-4.5-Air is made: one dense lead layer of `ffn`, one shared expert
        of the expert size, q/k/v biases, no q/k norm, sigmoid routing with the bias, renormalised,
        routed scale 1 (Air's routed_scaling_factor; GLM-4.5's 2.5 is the oracle file's)."""
        spec = super().spec_from_recipe(r)
        return Glm4MoeSpec(**{**vars(spec), "ffn": r.ffn, "dense_lead": min(1, r.n_layers), "expert_bias": True,
                              "shared_ffn": r.expert_ffn, "expert_gating": "sigmoid"})

    def file_metadata(self, s: ModelSpec) -> list[tuple[str, int | float | bool]]:
        a = self.arch
        keys = [k for k in super().file_metadata(s) if k[0] != f"{a}.feed_forward_length"]
        return keys + [(f"{a}.feed_forward_length", s.ffn or s.expert_ffn),
                       (f"{a}.leading_dense_block_count", getattr(s, "dense_lead", 0)),
                       (f"{a}.expert_shared_count", s.shared_ffn // s.expert_ffn if s.expert_ffn else 0),
                       (f"{a}.expert_gating_func", 2 if s.expert_gating == "sigmoid" else 1),
                       (f"{a}.expert_weights_norm", s.expert_weights_norm),
                       (f"{a}.expert_weights_scale", float(s.expert_weights_scale))]

    def layer_kind(self, spec: ModelSpec, i: int) -> LayerKind:
        return DENSE_LAYER if i < getattr(spec, "dense_lead", 0) else MOE_LAYER


FAMILY = Glm4Moe("glm4moe", moe=True, qkv_bias=True, partial_rotary=True, own_keys=KEYS)
