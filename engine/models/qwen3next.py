"""Qwen3-Next (llama.cpp `qwen3next`; Qwen3-Next-80B-A3B, Qwen3-Coder-Next): a hybrid of gated
DeltaNet (GDN) linear-attention layers and gated full-attention layers, every layer with routed
experts plus a sigmoid-gated shared expert.

- Which layers are recurrent: `attention.recurrent_layers` (one bool per block) where the file
  has it, else every layer but each `full_attention_interval`-th (llama.cpp's rule, interval 4).
- GDN layers (`gdn_layer.GdnLayer`, `gated_delta`): sizes from `ssm.*` — `group_count` q/k heads
  of `state_size`, `time_step_rank` value heads of `inner_size / time_step_rank`, a causal conv of
  `conv_kernel` taps; their state is the conv tail and the recurrent matrices (`RecurrentState`).
- Attention layers (`gated_attention.GatedAttentionLayer`): `attn_q` gives each head its query
  and an output gate (interleaved per head: [q_h, gate_h]), QK-norm, partial RoPE over the first
  `rope.dimension_count` dimensions, the output times sigmoid(gate) before `attn_output`.
- The converter writes every RMSNorm but the GDN's gated one as (1 + w) (transformers keeps w
  zero-centred), so the file's norms multiply as they are; the FFN norm is `post_attention_norm`.
- Files of older converters hold a GDN layer's q/k/v/z projection as transformers does
  (`ssm_in`, per k head [q, k, v, z]) instead of `attn_qkv` + `attn_gate`: both are read.
- A file with an MTP block (`nextn_predict_layers`) has it as its last blocks: a draft model,
  not run (llama.cpp runs the first block_count - nextn layers too).
Oracle: tests/test_family_files.py (transformers' Qwen3NextForCausalLM on the weights the file
came from)."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from engine.models.blocks import KVState, LayerKind, Part, moe_parts
from engine.models.family import Family, SpecSource
from engine.models.spec import ModelSpec

if TYPE_CHECKING:  # the registry imports no torch
    import torch

    from engine.models.gated_delta import GdnShape
    from engine.models.gdn_layer import GdnLayerState

OWN_KEYS = ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size",
            "full_attention_interval", "attention.recurrent_layers", "expert_shared_feed_forward_length",
            "nextn_predict_layers")


@dataclass(frozen=True)
class HybridSpec(ModelSpec):
    """A hybrid model's spec: the GDN layers' sizes and which layers they are."""

    conv_kernel: int = 4  # ssm.conv_kernel
    linear_k_heads: int = 0  # ssm.group_count
    linear_v_heads: int = 0  # ssm.time_step_rank
    linear_head_k: int = 0  # ssm.state_size
    linear_head_v: int = 0  # ssm.inner_size / ssm.time_step_rank
    recurrent: tuple[bool, ...] = ()  # per layer: a GDN layer (else gated full attention)
    v_tiled: bool = False  # value heads in ggml's tiled order (Qwen3.5's converter), see GdnShape
    qkvz_fused: bool = False  # older converters' ssm_in (transformers' in_proj_qkvz as it is), not attn_qkv + attn_gate

    def gdn(self) -> GdnShape:
        from engine.models.gated_delta import GdnShape

        return GdnShape(self.linear_k_heads, self.linear_v_heads, self.linear_head_k, self.linear_head_v,
                        self.conv_kernel, self.v_tiled)

    @property
    def n_attention_layers(self) -> int:
        return self.n_layers - sum(self.recurrent)

    def _gdn_dims(self) -> tuple[int, int]:
        key, value = self.linear_k_heads * self.linear_head_k, self.linear_v_heads * self.linear_head_v
        return key, value

    def _ffn_params(self, active: bool) -> int:
        experts = self.n_experts_used if active else self.n_experts
        return experts * 3 * self.hidden * self.expert_ffn + self.n_experts * self.hidden + self.shared_params()

    def attention_layer_params(self) -> int:
        d, hd = self.hidden, self.head_dim
        return d * hd * (3 * self.n_heads + 2 * self.n_kv_heads) + self._ffn_params(False) + 2 * d + 2 * hd

    def gdn_layer_params(self) -> int:
        key, value = self._gdn_dims()
        conv = 2 * key + value
        proj = self.hidden * (conv + value + 2 * self.linear_v_heads) + value * self.hidden
        return proj + conv * self.conv_kernel + 2 * self.linear_v_heads + self.linear_head_v + \
            self._ffn_params(False) + 2 * self.hidden

    def layer_params(self) -> int:
        """Parameters of one layer, the mean over the model's GDN and attention layers."""
        gdn = sum(self.recurrent)
        total = gdn * self.gdn_layer_params() + (self.n_layers - gdn) * self.attention_layer_params()
        return total // max(self.n_layers, 1)

    def active_flops_per_token(self, context: int) -> float:
        """Per layer, the mean: attention layers' projections and scores over `context`; GDN layers'
        projections, conv and the delta rule (about 4 dk x dv products per value head)."""
        d, hd = self.hidden, self.head_dim
        ffn = self._ffn_params(True)
        attn = d * hd * (3 * self.n_heads + 2 * self.n_kv_heads) + ffn + 2 * self.n_heads * hd * context
        key, value = self._gdn_dims()
        conv = 2 * key + value
        rule = 4 * self.linear_v_heads * self.linear_head_k * self.linear_head_v
        gdn = d * (conv + value + 2 * self.linear_v_heads) + value * d + conv * self.conv_kernel + rule + ffn
        n_gdn = sum(self.recurrent)
        return 2.0 * (n_gdn * gdn + (self.n_layers - n_gdn) * attn) / max(self.n_layers, 1)

    def prefill_flops(self, n_tokens: int) -> float:
        """Causal scores only in the attention layers; the rest is linear in the tokens."""
        scores = 2.0 * self.n_heads * self.head_dim * n_tokens * (n_tokens + 1)
        return self.n_layers * n_tokens * self.active_flops_per_token(0) + self.n_attention_layers * scores


def _norm(field: str, name: str, n: int) -> Part:
    return Part(field, name, (n,), fp32=True)


def gdn_parts(s: ModelSpec) -> tuple[Part, ...]:
    """A GDN layer's tensors in the converter's order (attn_qkv: q of every k head, then k, then
    v; attn_gate: z; ssm_ba: per k head its value heads' b then a; ssm_a = -exp(A_log))."""
    g = s.gdn()
    if s.qkvz_fused:  # per k head [q, k, v, z] rows, as transformers' in_proj_qkvz
        proj: tuple[Part, ...] = (Part("ssm_in", "ssm_in.weight", (g.conv_dim + g.value_dim, s.hidden)),)
    else:
        proj = (Part("wqkv", "attn_qkv.weight", (g.conv_dim, s.hidden)),
                Part("wz", "attn_gate.weight", (g.value_dim, s.hidden)))
    return (_norm("attn_norm", "attn_norm.weight", s.hidden),
            Part("ssm_a", "ssm_a", (g.n_v_heads,), fp32=True),
            Part("ssm_conv", "ssm_conv1d.weight", (g.conv_dim, g.conv_kernel), fp32=True),
            Part("ssm_dt", "ssm_dt.bias", (g.n_v_heads,), fp32=True),
            Part("ssm_ba", "ssm_ba.weight", (2 * g.n_v_heads, s.hidden))) + proj + (
            _norm("ssm_norm", "ssm_norm.weight", g.head_v),
            Part("ssm_out", "ssm_out.weight", (s.hidden, g.value_dim))) + _ffn_parts(s)


def gated_attention_parts(s: ModelSpec) -> tuple[Part, ...]:
    """A gated full-attention layer's tensors: attn_q is [query; gate] per head."""
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    return (_norm("attn_norm", "attn_norm.weight", s.hidden),
            _norm("k_norm", "attn_k_norm.weight", s.head_dim),
            Part("wk", "attn_k.weight", (kv, s.hidden)),
            Part("wo", "attn_output.weight", (s.hidden, q)),
            _norm("q_norm", "attn_q_norm.weight", s.head_dim),
            Part("wq", "attn_q.weight", (2 * q, s.hidden)),
            Part("wv", "attn_v.weight", (kv, s.hidden))) + _ffn_parts(s)


def _ffn_parts(s: ModelSpec) -> tuple[Part, ...]:
    return moe_parts(s) + (_norm("ffn_norm", "post_attention_norm.weight", s.hidden),)


@dataclass(frozen=True)
class RecurrentState:
    """A GDN layer's state: the conv's last K-1 inputs and each value head's dk x dv matrix, the
    same bytes whatever the prompt's length."""

    name: str = "gdn"

    def new(self, spec: ModelSpec, capacity: int, device: torch.device, dtype: torch.dtype) -> GdnLayerState:
        from engine.models.gdn_layer import GdnLayerState

        return GdnLayerState(spec.gdn(), capacity, device, dtype)

    def nbytes(self, spec: ModelSpec, tokens: int, dtype: torch.dtype) -> int:
        return spec.gdn().state_bytes(dtype)


def _gdn_class() -> type:
    from engine.models.gdn_layer import GdnLayer

    return GdnLayer


def _gated_attention_class() -> type:
    from engine.models.gated_attention import GatedAttentionLayer

    return GatedAttentionLayer


GDN = LayerKind("gdn", gdn_parts, RecurrentState(), _gdn_class)
GATED_ATTENTION = LayerKind("gated_attention", gated_attention_parts, KVState(), _gated_attention_class)


def _bools(m: SpecSource, key: str, n: int) -> tuple[bool, ...]:
    raw = m.get(key)
    try:  # an array is left undecoded in the mapped file until asked
        values = [bool(x) for x in (raw.decode() if hasattr(raw, "decode") else raw)]
    except (TypeError, ValueError):
        raise m.problem(f"metadata key {key} is not a list of booleans") from None
    if len(values) < n:
        raise m.problem(f"metadata key {key} has {len(values)} entries for {n} layers")
    return tuple(values[:n])


@dataclass(frozen=True)
class Qwen3Next(Family):
    def spec_from_metadata(self, m: SpecSource) -> ModelSpec:
        a = self.arch
        spec = super().spec_from_metadata(m)
        blocks = spec.n_layers
        nextn = m.read_int(f"{a}.nextn_predict_layers", 0, minimum=0)
        if nextn >= blocks:
            raise m.problem(f"metadata key {a}.nextn_predict_layers is {nextn}: the file's {blocks} blocks hold no "
                            f"layer besides the MTP block")
        n = blocks - nextn
        rkey = f"{a}.attention.recurrent_layers"
        if m.has(rkey):
            recurrent = _bools(m, rkey, n)
        else:
            interval = m.read_int(f"{a}.full_attention_interval", 4)
            recurrent = tuple((i + 1) % interval != 0 for i in range(n))
        v_heads = m.read_int(f"{a}.ssm.time_step_rank")
        k_heads = m.read_int(f"{a}.ssm.group_count")
        inner = m.read_int(f"{a}.ssm.inner_size")
        if v_heads % k_heads or inner % v_heads:
            raise m.problem(f"ssm.time_step_rank {v_heads} must be a multiple of ssm.group_count {k_heads}, and "
                            f"ssm.inner_size {inner} a multiple of it (value heads of one size)")
        shared = m.read_int(f"{a}.expert_shared_feed_forward_length", 0, minimum=0)
        gdn = [i for i in range(n) if recurrent[i]]
        fused = bool(gdn) and m.has_tensor(f"blk.{gdn[0]}.ssm_in.weight") and \
            not m.has_tensor(f"blk.{gdn[0]}.attn_qkv.weight")
        base = {f.name: getattr(spec, f.name) for f in fields(ModelSpec)}
        base.update(n_layers=n, shared_ffn=shared or m.read_int(f"{a}.feed_forward_length"), shared_gate=True)
        return HybridSpec(**base, conv_kernel=m.read_int(f"{a}.ssm.conv_kernel", minimum=2),
                          linear_k_heads=k_heads, linear_v_heads=v_heads,
                          linear_head_k=m.read_int(f"{a}.ssm.state_size"), linear_head_v=inner // v_heads,
                          recurrent=recurrent, qkvz_fused=fused)

    def spec_from_recipe(self, r: Any) -> ModelSpec:
        """A generated model of Qwen3-Next's proportions from the recipe's attention shapes (as
        the 80B-A3B has them): GDN with n_heads q/k heads and 2 x n_heads value heads of
        head_dim / 2, a 4-tap conv, every fourth layer attention, RoPE over a quarter of each
        head (unless the recipe's rope_dim says), a gated shared expert of expert_ffn."""
        spec = super().spec_from_recipe(replace(r, rope_dim=r.rope_dim or r.head_dim // 4))
        base = {f.name: getattr(spec, f.name) for f in fields(ModelSpec)}
        base.update(shared_ffn=r.expert_ffn, shared_gate=True)
        head = max(r.head_dim // 2, 1)
        return HybridSpec(**base, conv_kernel=4, linear_k_heads=r.n_heads, linear_v_heads=2 * r.n_heads,
                          linear_head_k=head, linear_head_v=head,
                          recurrent=tuple((i + 1) % 4 != 0 for i in range(r.n_layers)))

    def file_metadata(self, s: ModelSpec) -> list[tuple[str, int | float]]:
        a = self.arch
        keys = super().file_metadata(s) + [
            (f"{a}.expert_shared_feed_forward_length", s.shared_ffn), (f"{a}.ssm.conv_kernel", s.conv_kernel),
            (f"{a}.ssm.state_size", s.linear_head_k), (f"{a}.ssm.group_count", s.linear_k_heads),
            (f"{a}.ssm.time_step_rank", s.linear_v_heads),
            (f"{a}.ssm.inner_size", s.linear_v_heads * s.linear_head_v)]
        interval = [i for i, r in enumerate(s.recurrent) if not r]
        step = interval[0] + 1 if interval else s.n_layers + 1
        if s.recurrent != tuple((i + 1) % step != 0 for i in range(s.n_layers)):
            raise ValueError("a file's layer pattern is written as full_attention_interval: every step-th layer "
                             "attention")
        return keys + [(f"{a}.full_attention_interval", step)]

    def layer_kind(self, spec: ModelSpec, i: int) -> LayerKind:
        return GDN if spec.recurrent[i] else GATED_ATTENTION

    def layer_params(self, spec: ModelSpec, i: int) -> int:
        return spec.gdn_layer_params() if spec.recurrent[i] else spec.attention_layer_params()


FAMILY = Qwen3Next("qwen3next", moe=True, qk_norm=True, partial_rotary=True, own_keys=OWN_KEYS)
