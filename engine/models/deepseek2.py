"""DeepSeek-V2/V3, Kimi-K2 (llama.cpp `deepseek2`): multi-head latent attention in every layer
(its layer class, weights and latent cache: engine/models/mla.py), `leading_dense_block_count`
layers with a dense SwiGLU FFN, then routed experts plus `expert_shared_count` shared ones, the
router's scores sigmoid (`expert_gating_func` 2; absent: softmax, as llama.cpp reads DeepSeek-V2
files) with the score-correction bias `exp_probs_b` where the file has it, group-limited top-k
(`expert_group_count` / `expert_group_used_count`), renormalised where `expert_weights_norm` says
so and scaled by `expert_weights_scale` (engine/models/routing.py).

The file's attention keys are llama.cpp's MLA form: `head_count_kv` 1, `key_length` kv_lora_rank +
rope and `value_length` kv_lora_rank (the latent as one shared KV head), the per-head sizes in
`key_length_mla` (nope + rope) and `value_length_mla`, and the split `attn_k_b` / `attn_v_b`.
Files without `key_length_mla` are the older layout: `key_length` / `value_length` are the
per-head sizes and `attn_kv_b` is unsplit.  The q LoRA (`attention.q_lora_rank`, tensors
`attn_q_a*`/`attn_q_b`) or a plain `attn_q` (V2-Lite) is whichever the file holds.

RoPE: adjacent pairs (llama.cpp's NORM mode) over the `rope.dimension_count` trailing dims of
q/k.  YaRN as llama.cpp runs this family ([TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]): the converter writes
`yarn_log_multiplier` as 0.1 x mscale_all_dim; with it, cos/sin are not scaled and the softmax
scale is (nope + rope)^-0.5 x (1 + 0.1 mscale_all_dim ln factor)^2 (transformers' DeepseekV3
too); without it, cos/sin carry YaRN's 1 + 0.1 ln factor and the scale its square.

The MTP (nextn) blocks some converters count in `block_count` are skipped, as in glm4moe.
Oracle: tests/test_family_files.py (transformers' DeepseekV3ForCausalLM on the weights the file
was converted from)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from engine.models.blocks import LayerKind, Part, dense_ffn_parts, moe_parts
from engine.models.family import Family, SpecSource, layers_without_mtp
from engine.models.gguf_keys import RopeScaling
from engine.models.spec import ModelSpec


@dataclass(frozen=True)
class DeepSeek2Spec(ModelSpec):
    """`head_dim` is q/k's per-head size (nope + rope), `rope_dim` the rope part, `n_kv_heads` the
    heads (every head has its own expanded k/v)."""

    q_lora_rank: int = 0  # 0: a plain attn_q
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    dense_lead: int = 0  # leading layers with a dense FFN of `ffn`
    kv_b_split: bool = True  # attn_k_b / attn_v_b (else an older file's attn_kv_b)
    kq_factor: float = 1.0  # the softmax scale's factor beyond head_dim^-0.5 (YaRN's mscale^2)

    def has_experts(self, i: int) -> bool:
        return self.is_moe and i >= self.dense_lead

    def attention_params(self) -> int:
        d, H, dk = self.hidden, self.n_heads, self.head_dim
        q = self.q_lora_rank * (d + 1 + H * dk) if self.q_lora_rank else d * H * dk
        kv = d * (self.kv_lora_rank + self.rope_dim) + self.kv_lora_rank
        return q + kv + H * self.kv_lora_rank * (self.qk_nope_dim + self.v_head_dim) + H * self.v_head_dim * d

    def layer_params(self) -> int:
        """Parameters of one expert layer (the dense lead layers have fewer)."""
        ffn = self.n_experts * (3 * self.hidden * self.expert_ffn + self.hidden + (1 if self.expert_bias else 0))
        return self.attention_params() + ffn + self.shared_params() + 2 * self.hidden

    def active_flops_per_token(self, context: int) -> float:
        ffn = self.n_experts_used * 3 * self.hidden * self.expert_ffn + self.n_experts * self.hidden
        attn = self.n_heads * (self.head_dim + self.v_head_dim) * context  # QK^T and PV
        return 2.0 * (self.attention_params() + ffn + self.shared_params() + attn)

    def attention_scratch_bytes(self, chunk: int | None, tokens: int, dsize: int) -> int:
        """The expanded form's per-head k/v of the whole context (the kv_b GEMM's output, the keys
        and the values padded to the q/k width) where the chunk expands (auto: assumed, as GPU
        chunks are hundreds of tokens); the latent form makes only scores."""
        from engine.models.mla import absorbed_wanted

        if chunk is not None and absorbed_wanted(self, chunk):
            return 0
        return tokens * self.n_heads * (self.qk_nope_dim + self.v_head_dim + 2 * self.head_dim) * dsize

    def prefill_flops(self, n_tokens: int) -> float:
        attn = 1.0 * self.n_heads * (self.head_dim + self.v_head_dim) * n_tokens * (n_tokens + 1)
        return self.n_layers * (n_tokens * self.active_flops_per_token(0) + attn)


@dataclass(frozen=True)
class MlaYarn(RopeScaling):
    """YaRN frequencies with the cos/sin factor this family's graph uses (1 with yarn_log_multiplier)."""

    rope_factor: float = 1.0

    @property
    def attention_factor(self) -> float:
        return self.rope_factor


def mla_parts(s: DeepSeek2Spec) -> tuple[Part, ...]:
    """MLA's tensors (after the FFN's: the converter's order)."""
    d, H, r, rope = s.hidden, s.n_heads, s.kv_lora_rank, s.rope_dim
    kv = [Part("kv_a_norm", "attn_kv_a_norm.weight", (r,), fp32=True),
          Part("kv_a", "attn_kv_a_mqa.weight", (r + rope, d))]
    if s.kv_b_split:
        kv += [Part("k_b", "attn_k_b.weight", (H, r, s.qk_nope_dim)),
               Part("v_b", "attn_v_b.weight", (H, s.v_head_dim, r))]
    else:
        kv += [Part("kv_b", "attn_kv_b.weight", (H * (s.qk_nope_dim + s.v_head_dim), r))]
    kv += [Part("wo", "attn_output.weight", (d, H * s.v_head_dim))]
    if s.q_lora_rank:
        return tuple(kv) + (Part("q_a_norm", "attn_q_a_norm.weight", (s.q_lora_rank,), fp32=True),
                            Part("q_a", "attn_q_a.weight", (s.q_lora_rank, d)),
                            Part("q_b", "attn_q_b.weight", (H * s.head_dim, s.q_lora_rank)))
    return tuple(kv) + (Part("wq", "attn_q.weight", (H * s.head_dim, d)),)


def _norms(s: DeepSeek2Spec, ffn: tuple[Part, ...]) -> tuple[Part, ...]:
    return (Part("attn_norm", "attn_norm.weight", (s.hidden,), fp32=True), *ffn,
            Part("ffn_norm", "ffn_norm.weight", (s.hidden,), fp32=True)) + mla_parts(s)


def moe_layer_parts(s: DeepSeek2Spec) -> tuple[Part, ...]:
    return _norms(s, moe_parts(s))


def dense_layer_parts(s: DeepSeek2Spec) -> tuple[Part, ...]:
    return _norms(s, dense_ffn_parts(s))


@dataclass(frozen=True)
class LatentState:
    """MLA's state: each token's KV latent and RoPE key (kv_lora_rank + rope values)."""

    name: str = "mla-latent"

    def new(self, spec: Any, capacity: int, device: Any, dtype: Any) -> Any:
        from engine.models.mla import LatentCache

        return LatentCache(capacity, spec.kv_lora_rank, spec.rope_dim, device, dtype)

    def nbytes(self, spec: Any, tokens: int, dtype: Any) -> int:
        from engine.models.mla import LatentCache

        return LatentCache.bytes_for(tokens, spec.kv_lora_rank, spec.rope_dim, dtype)


def mla_layer() -> type:
    from engine.models.mla import MLALayer

    return MLALayer


MOE_LAYER = LayerKind("mla", moe_layer_parts, LatentState(), layer=mla_layer)
DENSE_LAYER = LayerKind("mla-dense-ffn", dense_layer_parts, LatentState(), layer=mla_layer)
KEYS = ("expert_gating_func", "expert_weights_norm", "expert_weights_scale", "leading_dense_block_count",
        "nextn_predict_layers", "expert_shared_count", "expert_group_count", "expert_group_used_count",
        "attention.value_length", "rope.scaling.yarn_log_multiplier")


def _yarn(m: SpecSource, a: str, scaling: RopeScaling | None) -> tuple[RopeScaling | None, float]:
    """(the RoPE scaling with this family's cos/sin factor, the softmax scale's factor), as
    llama.cpp's deepseek2 graph computes them from YaRN and `yarn_log_multiplier`."""
    if scaling is None:
        return None, 1.0
    if scaling.kind != "yarn":
        raise m.problem(f"metadata key {a}.rope.scaling.type is {scaling.kind!r}: this family runs YaRN or no "
                        f"scaling (llama.cpp's deepseek2 graph scales attention for YaRN only)")
    log_mul = m.read_float(f"{a}.rope.scaling.yarn_log_multiplier", 0.0, positive=False) / 0.1
    ln = math.log(scaling.factor)
    rope_factor = 1.0 if log_mul else 1.0 + 0.1 * ln
    mscale = rope_factor * (1.0 + 0.1 * log_mul * ln)
    return (MlaYarn(scaling.kind, scaling.factor, scaling.original_context, scaling.beta_fast, scaling.beta_slow,
                    rope_factor=rope_factor), mscale * mscale)


def _attention_sizes(m: SpecSource, a: str, spec: ModelSpec) -> dict[str, Any]:
    """MLA's sizes from the file (the MLA layout with key_length_mla, or the older one)."""
    rope = m.read_int(f"{a}.rope.dimension_count")
    rank = m.read_int(f"{a}.attention.kv_lora_rank")
    split = m.has(f"{a}.attention.key_length_mla")
    if split:  # the latent as one KV head: key_length = rank + rope, value_length = rank
        dk, dv = m.read_int(f"{a}.attention.key_length_mla"), m.read_int(f"{a}.attention.value_length_mla")
        value = m.read_int(f"{a}.attention.value_length", rank)
        if spec.n_kv_heads != 1 or spec.head_dim != rank + rope or value != rank:
            raise m.problem(f"MLA keys: head_count_kv {spec.n_kv_heads}, key_length {spec.head_dim}, value_length "
                            f"{value} are not 1, kv_lora_rank + rope ({rank + rope}) and kv_lora_rank ({rank})")
    else:
        dk, dv = spec.head_dim, m.read_int(f"{a}.attention.value_length", spec.head_dim)
    if not 0 < rope < dk or rope % 2:
        raise m.problem(f"metadata key {a}.rope.dimension_count is {rope}: it must be even and below the q/k head "
                        f"size {dk} (nope + rope)")
    q_lora = 0
    if m.has_tensor("blk.0.attn_q_a.weight"):
        q_lora = m.read_int(f"{a}.attention.q_lora_rank")
    return dict(head_dim=dk, rope_dim=rope, kv_lora_rank=rank, qk_nope_dim=dk - rope, v_head_dim=dv,
                q_lora_rank=q_lora, kv_b_split=split, n_kv_heads=spec.n_heads)


def _routing_layout(m: SpecSource, a: str, spec: ModelSpec) -> dict[str, Any]:
    """Layers (MTP blocks skipped, leading dense ones) and the expert groups."""
    n_layers = layers_without_mtp(m, a, spec.n_layers)
    lead = m.read_int(f"{a}.leading_dense_block_count", 0, minimum=0)
    if lead >= n_layers:
        raise m.problem(f"metadata key {a}.leading_dense_block_count is {lead}: no layer of the {n_layers} "
                        f"is left for the experts")
    groups = m.read_int(f"{a}.expert_group_count", 0, minimum=0)
    used = m.read_int(f"{a}.expert_group_used_count", 0, minimum=0)
    if groups > 1 and (spec.n_experts % groups or groups >= spec.n_experts or not 0 < used < groups):
        raise m.problem(f"expert groups {groups} (used {used}) of {spec.n_experts} experts: the groups must "
                        f"divide the experts, and between 1 and the groups less one be used")
    if not spec.expert_ffn:
        raise m.problem(f"metadata key {a}.expert_feed_forward_length is missing or 0")
    return dict(n_layers=n_layers, dense_lead=lead, expert_groups=groups if groups > 1 else 0,
                expert_groups_used=used if groups > 1 else 0,
                ffn=m.read_int(f"{a}.feed_forward_length") if lead else 0,
                shared_ffn=m.read_int(f"{a}.expert_shared_count", 0, minimum=0) * spec.expert_ffn,
                expert_bias=m.has_tensor(f"blk.{lead}.exp_probs_b.bias"))


@dataclass(frozen=True)
class DeepSeek2(Family):
    def spec_from_metadata(self, m: SpecSource) -> ModelSpec:
        a = self.arch
        spec = super().spec_from_metadata(m)
        # the gating absent: softmax (DeepSeek-V2's files), but sigmoid for GLM-4.7-Flash's, as llama.cpp guesses
        glm_lite = spec.n_layers in (47, 48) and spec.vocab == 154880
        routing = self.routing_from_metadata(m, gating="sigmoid" if glm_lite else "softmax", norm=False)
        scaling, kq = _yarn(m, a, spec.rope_scaling)
        return DeepSeek2Spec(**{**vars(spec), **routing, **_attention_sizes(m, a, spec),
                                **_routing_layout(m, a, spec), "rope_scaling": scaling, "kq_factor": kq})

    def spec_from_recipe(self, r: Any) -> ModelSpec:
        """A synthetic DeepSeek (`synth.ModelRecipe`): head_dim is nope + rope, rope_dim the rope part
        (0: a quarter of the head), the MLA ranks and routing from the recipe's own fields
        (kv_lora_rank 0: twice the head), every head its own KV head; sigmoid routing with the
        bias, renormalised."""
        rope = r.rope_dim or max(2, r.head_dim // 8 * 2)
        rank, dv = r.kv_lora_rank or 2 * r.head_dim, r.v_head_dim or r.head_dim - rope
        spec = super().spec_from_recipe(replace(r, rope_dim=0, n_kv_heads=r.n_heads))
        if not 0 < rope < r.head_dim or rope % 2:
            raise ValueError(f"rope_dim {rope} for deepseek2: an even number below head_dim {r.head_dim} (nope + rope)")
        if not 0 <= r.dense_lead < r.n_layers or (r.expert_groups > 1 and (
                r.n_experts % r.expert_groups or not 0 < r.expert_groups_used < r.expert_groups)):
            raise ValueError(f"deepseek2's dense_lead {r.dense_lead} must leave expert layers of the {r.n_layers}, "
                             f"and its expert_groups {r.expert_groups} divide the experts with 1..groups-1 used")
        grouped = r.expert_groups > 1
        return DeepSeek2Spec(**{**vars(spec), "rope_dim": rope, "q_lora_rank": r.q_lora_rank, "kv_lora_rank": rank,
                                "qk_nope_dim": r.head_dim - rope, "v_head_dim": dv, "dense_lead": r.dense_lead,
                                "ffn": r.ffn if r.dense_lead else 0, "shared_ffn": r.shared_experts * r.expert_ffn,
                                "expert_gating": "sigmoid", "expert_bias": True,
                                "expert_weights_scale": r.expert_weights_scale,
                                "expert_groups": r.expert_groups if grouped else 0,
                                "expert_groups_used": r.expert_groups_used if grouped else 0})

    def file_metadata(self, s: ModelSpec) -> list[tuple[str, int | float | bool]]:
        """The MLA form llama.cpp's converter writes (the latent as one KV head); no RoPE scaling."""
        a = self.arch
        mine = {f"{a}.attention.head_count_kv", f"{a}.attention.key_length", f"{a}.attention.value_length",
                f"{a}.feed_forward_length", f"{a}.rope.dimension_count"}
        keys = [k for k in super().file_metadata(s) if k[0] not in mine]
        return keys + [
            (f"{a}.attention.head_count_kv", 1), (f"{a}.attention.key_length", s.kv_lora_rank + s.rope_dim),
            (f"{a}.attention.value_length", s.kv_lora_rank), (f"{a}.attention.key_length_mla", s.head_dim),
            (f"{a}.attention.value_length_mla", s.v_head_dim), (f"{a}.attention.kv_lora_rank", s.kv_lora_rank),
            (f"{a}.rope.dimension_count", s.rope_dim), (f"{a}.feed_forward_length", s.ffn or s.expert_ffn),
            (f"{a}.leading_dense_block_count", s.dense_lead),
            (f"{a}.expert_shared_count", s.shared_ffn // s.expert_ffn),
            (f"{a}.expert_group_count", s.expert_groups), (f"{a}.expert_group_used_count", s.expert_groups_used),
            (f"{a}.expert_gating_func", 2 if s.expert_gating == "sigmoid" else 1),
            (f"{a}.expert_weights_norm", s.expert_weights_norm),
            (f"{a}.expert_weights_scale", float(s.expert_weights_scale)),
        ] + ([(f"{a}.attention.q_lora_rank", s.q_lora_rank)] if s.q_lora_rank else [])

    def layer_kind(self, spec: ModelSpec, i: int) -> LayerKind:
        return DENSE_LAYER if i < getattr(spec, "dense_lead", 0) else MOE_LAYER


FAMILY = DeepSeek2("deepseek2", moe=True, rope_style="norm", partial_rotary=True, own_keys=KEYS)
