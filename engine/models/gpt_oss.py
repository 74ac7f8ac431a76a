"""gpt-oss (llama.cpp `gpt-oss`; transformers' GptOssForCausalLM): routed experts in every layer,
attention with q/k/v/o biases and per-head sinks, a sliding window on alternate layers, YaRN RoPE.

Which layers slide: llama.cpp's rule, `attention.sliding_window_pattern` n (default 2) makes
layer i slide when i % n < n - 1 (gpt-oss: the even layers, as transformers' `layer_types`
default); an array of flags, where a file carries one, names them layer by layer.  The window
(`attention.sliding_window`, 128 in the published models) counts the query's own token.
A sliding layer keeps only its last window - 1 tokens' keys and values (`SlidingKV`), so the
memory plan and prefill-main's hand-off count those on sliding layers, every token on full ones.

YaRN: the published config says `truncate: false` (the authors' code leaves the ramp's ends
unrounded; llama.cpp rounds them): the family follows the authors' code.  `rope.freq_base_swa`,
where present, must equal `rope.freq_base` (one RoPE table serves every layer).

The block itself: `engine/models/gpt_oss_layer.py`.  Oracle: tests/test_gpt_oss.py
(transformers' GptOssForCausalLM on the weights the converter's file came from, F32 and MXFP4
experts).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from engine.models.blocks import KVState, LayerKind, Part
from engine.models.family import Family, SpecSource
from engine.models.gguf_keys import RopeScaling
from engine.models.spec import ModelSpec

if TYPE_CHECKING:  # the registry imports no torch
    import torch

    from engine.models.sliding_kv import SlidingKV

DEFAULT_WINDOW = 128  # the published models' (recipes: make-model, synthetic presets)
DEFAULT_PATTERN = 2  # llama.cpp's for gpt-oss: every other layer slides, the first included


@dataclass(frozen=True)
class GptOssSpec(ModelSpec):
    sliding_window: int = DEFAULT_WINDOW
    sliding: tuple[bool, ...] = ()  # per layer: whether it slides

    def window_of(self, i: int) -> int | None:
        """The window layer i attends over (None: every earlier token)."""
        return self.sliding_window if self.sliding[i] else None

    def layer_params(self) -> int:
        q, kv, e = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_experts
        biases = q + 2 * kv + self.hidden + self.n_heads + e + e * (2 * self.expert_ffn + self.hidden)
        return super().layer_params() + biases

    def prefill_flops(self, n_tokens: int) -> float:
        """As ModelSpec's, with a sliding layer's token i attending to min(i + 1, window) keys."""
        full = super().prefill_flops(n_tokens)
        w = self.sliding_window
        causal = n_tokens * (n_tokens + 1) / 2
        windowed = causal if n_tokens <= w else w * (w + 1) / 2 + (n_tokens - w) * w
        per_key = 4.0 * self.n_heads * self.head_dim  # QK^T and PV, 2 FLOPs per MAC
        return full - sum(self.sliding) * per_key * (causal - windowed)


def swa_flags(n_layers: int, pattern: int) -> tuple[bool, ...]:
    """llama.cpp's `set_swa_pattern`: layer i slides when i % n < n - 1 (n = 0: every layer)."""
    return tuple(pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers))


def gpt_oss_parts(s: ModelSpec) -> tuple[Part, ...]:
    """A gpt-oss block's tensors (GGUF names after `blk.{i}.`, torch shapes)."""
    q, kv, d, e, f = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.hidden, s.n_experts, s.expert_ffn
    return (
        Part("attn_norm", "attn_norm.weight", (d,), fp32=True),
        Part("wq", "attn_q.weight", (q, d)), Part("bq", "attn_q.bias", (q,)),
        Part("wk", "attn_k.weight", (kv, d)), Part("bk", "attn_k.bias", (kv,)),
        Part("wv", "attn_v.weight", (kv, d)), Part("bv", "attn_v.bias", (kv,)),
        Part("wo", "attn_output.weight", (d, q)), Part("bo", "attn_output.bias", (d,)),
        Part("sinks", "attn_sinks.weight", (s.n_heads,), fp32=True),
        Part("ffn_norm", "post_attention_norm.weight", (d,), fp32=True),
        Part("router", "ffn_gate_inp.weight", (e, d), fp32=True),
        Part("router_b", "ffn_gate_inp.bias", (e,), fp32=True),
        Part("gate_exps", "ffn_gate_exps.weight", (e, f, d), expert=True),
        Part("gate_b", "ffn_gate_exps.bias", (e, f)),
        Part("up_exps", "ffn_up_exps.weight", (e, f, d), expert=True),
        Part("up_b", "ffn_up_exps.bias", (e, f)),
        Part("down_exps", "ffn_down_exps.weight", (e, d, f), expert=True),
        Part("down_b", "ffn_down_exps.bias", (e, d)),
    )


@dataclass(frozen=True)
class SlidingState:
    """A sliding layer's state: the window's keys and values (engine/models/sliding_kv.py)."""

    name: str = "sliding-kv"

    def new(self, spec: ModelSpec, capacity: int, device: torch.device, dtype: torch.dtype) -> SlidingKV:
        from engine.models.sliding_kv import SlidingKV

        return SlidingKV(capacity, spec.sliding_window, spec.n_kv_heads, spec.head_dim, device, dtype)  # type: ignore[attr-defined]

    def nbytes(self, spec: ModelSpec, tokens: int, dtype: torch.dtype) -> int:
        from engine.models.sliding_kv import SlidingKV

        return SlidingKV.bytes_for(tokens, spec.sliding_window, spec.n_kv_heads, spec.head_dim, dtype)  # type: ignore[attr-defined]


def gpt_oss_layer() -> type:
    from engine.models.gpt_oss_layer import GptOssLayer

    return GptOssLayer


SLIDING = LayerKind("sliding-attention", gpt_oss_parts, SlidingState(), layer=gpt_oss_layer)
FULL = LayerKind("attention", gpt_oss_parts, KVState(), layer=gpt_oss_layer)


def _as_gpt_oss(spec: ModelSpec, window: int, sliding: tuple[bool, ...]) -> GptOssSpec:
    scaling = spec.rope_scaling
    if scaling is not None and scaling.kind == "yarn":
        scaling = replace(scaling, truncate=False)
    values = {f.name: getattr(spec, f.name) for f in fields(ModelSpec)}
    values["rope_scaling"] = scaling
    return GptOssSpec(**values, sliding_window=window, sliding=sliding)


@dataclass(frozen=True)
class GptOss(Family):
    def spec_from_metadata(self, m: SpecSource) -> ModelSpec:
        a = self.arch
        spec = super().spec_from_metadata(m)
        window = m.read_int(f"{a}.attention.sliding_window")
        bkey = f"{a}.rope.freq_base_swa"
        if m.has(bkey) and m.read_float(bkey, spec.rope_base) != spec.rope_base:
            raise m.problem(f"metadata key {bkey} is {m.get(bkey)}, not rope.freq_base {spec.rope_base:g}: "
                            f"another RoPE base on the sliding layers is not implemented")
        return _as_gpt_oss(spec, window, self._sliding(m, spec.n_layers))

    def _sliding(self, m: SpecSource, n_layers: int) -> tuple[bool, ...]:
        key = f"{self.arch}.attention.sliding_window_pattern"
        value: Any = m.get(key)
        if value is None:
            return swa_flags(n_layers, DEFAULT_PATTERN)
        if hasattr(value, "decode"):  # an array is left undecoded in the mapped file until asked
            value = value.decode()
        if isinstance(value, (list, tuple)):
            if len(value) != n_layers or any(not isinstance(v, (bool, int)) for v in value):
                raise m.problem(f"metadata key {key} holds {len(value)} entries: one flag per layer "
                                f"({n_layers}) expected")
            return tuple(bool(v) for v in value)
        return swa_flags(n_layers, m.read_int(key, DEFAULT_PATTERN, minimum=0))

    def attention_kernel(self, spec: ModelSpec, device: Any, dtype: torch.dtype) -> str:
        import torch

        from engine.kernels import sink_attention

        window = spec.sliding_window if any(spec.sliding) else None  # type: ignore[attr-defined]
        return sink_attention.describe(torch.device(device), spec.n_heads, spec.n_kv_heads, spec.head_dim, dtype,
                                       window)

    def layer_kind(self, spec: ModelSpec, i: int) -> LayerKind:
        return SLIDING if spec.sliding[i] else FULL  # type: ignore[attr-defined]  # a GptOssSpec

    def spec_from_recipe(self, r: Any) -> ModelSpec:
        """A generated model: the recipe's shapes with gpt-oss's window, pattern and YaRN."""
        spec = replace(super().spec_from_recipe(r), qkv_bias=True,
                       rope_scaling=RopeScaling("yarn", 32.0, 4096, truncate=False))
        return _as_gpt_oss(spec, DEFAULT_WINDOW, swa_flags(r.n_layers, DEFAULT_PATTERN))

    def file_metadata(self, s: ModelSpec) -> list[tuple[str, int | float | str]]:
        """The shared keys, then the window and the YaRN scaling (read back by spec_from_metadata)."""
        a = self.arch
        keys: list[tuple[str, int | float | str]] = list(super().file_metadata(s))
        keys.append((f"{a}.attention.sliding_window", s.sliding_window))  # type: ignore[attr-defined]
        sc = s.rope_scaling
        if sc is not None:
            keys += [(f"{a}.rope.scaling.type", sc.kind), (f"{a}.rope.scaling.factor", float(sc.factor)),
                     (f"{a}.rope.scaling.original_context_length", sc.original_context)]
        return keys

FAMILY = GptOss("gpt-oss", moe=True, qkv_bias=True)
