"""Layer kinds the families compose: a kind's tensors (GGUF names -> `LayerWeights` parts) and
the state it carries from chunk to chunk.

Today one kind, `FULL_ATTENTION`: RMSNorm, q/k/v (with the spec's q/k norm and biases), causal
attention over every earlier token (its state: `LayerKV`), then a dense SwiGLU FFN or routed
experts.  A recurrent layer (gated DeltaNet), a sliding-window or a latent-attention layer is
another `LayerKind` with its own parts, `StateKind` and layer class.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.models.spec import ModelSpec

if TYPE_CHECKING:
    import torch

    from engine.models.kv import LayerKV, LayerState


@dataclass(frozen=True)
class Part:
    """One tensor of a layer: its `LayerWeights` field, its GGUF name after `blk.{i}.`, its shape
    (torch order), whether it is kept in float32 (norms, the router) and whether it is an expert
    tensor (kept as stored, or left to the expert cache)."""

    field: str
    name: str
    shape: tuple[int, ...]
    fp32: bool = False
    expert: bool = False


class StateKind(Protocol):
    """How a layer kind's per-sequence state is made and what it costs."""

    name: str

    def new(self, spec: ModelSpec, capacity: int, device: torch.device, dtype: torch.dtype) -> LayerState: ...

    def nbytes(self, spec: ModelSpec, tokens: int, dtype: torch.dtype) -> int: ...


@dataclass(frozen=True)
class KVState:
    """Full attention's state: every earlier token's keys and values."""

    name: str = "kv"

    def new(self, spec: ModelSpec, capacity: int, device: torch.device, dtype: torch.dtype) -> LayerKV:
        from engine.models.kv import LayerKV

        return LayerKV(capacity, spec.n_kv_heads, spec.head_dim, device, dtype)

    def nbytes(self, spec: ModelSpec, tokens: int, dtype: torch.dtype) -> int:
        from engine.models.kv import LayerKV

        return LayerKV.bytes_for(tokens, spec.n_kv_heads, spec.head_dim, dtype)


def attention_layer() -> type:
    """The class that computes a full-attention layer (`engine.models.layers.Layer`; imported
    when a layer is built, so the registry stays free of torch)."""
    from engine.models.layers import Layer

    return Layer


@dataclass(frozen=True)
class LayerKind:
    """A kind of layer: its tensors, the state it carries, and the class that computes it
    (`layer()` returns it; built as `cls(spec, index, weights, rope, cache=...)` from
    `cls.weights_type(**parts)`)."""

    name: str
    parts: Callable[[ModelSpec], tuple[Part, ...]]
    state: StateKind
    layer: Callable[[], type] = attention_layer


def attention_parts(s: ModelSpec) -> tuple[Part, ...]:
    """The tensors of a full-attention block with a dense or routed-expert FFN, in llama.cpp's
    order (the order synthetic files are written and drawn in: it must not change)."""
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    parts = [
        Part("attn_norm", "attn_norm.weight", (s.hidden,), fp32=True),
        Part("wq", "attn_q.weight", (q, s.hidden)),
        Part("wk", "attn_k.weight", (kv, s.hidden)),
        Part("wv", "attn_v.weight", (kv, s.hidden)),
        Part("wo", "attn_output.weight", (s.hidden, q)),
        Part("ffn_norm", "ffn_norm.weight", (s.hidden,), fp32=True),
    ]
    if s.qk_norm:
        parts += [Part("q_norm", "attn_q_norm.weight", (s.head_dim,), fp32=True),
                  Part("k_norm", "attn_k_norm.weight", (s.head_dim,), fp32=True)]
    if s.qkv_bias:
        parts += [Part("bq", "attn_q.bias", (q,)), Part("bk", "attn_k.bias", (kv,)), Part("bv", "attn_v.bias", (kv,))]
    return tuple(parts) + (moe_parts(s) if s.is_moe else dense_ffn_parts(s))


def moe_parts(s: ModelSpec) -> tuple[Part, ...]:
    e, f, d = s.n_experts, s.expert_ffn, s.hidden
    bias = (Part("router_bias", "exp_probs_b.bias", (e,), fp32=True),) if s.expert_bias else ()
    return (Part("router", "ffn_gate_inp.weight", (e, d), fp32=True), *bias,
            Part("gate_exps", "ffn_gate_exps.weight", (e, f, d), expert=True),
            Part("up_exps", "ffn_up_exps.weight", (e, f, d), expert=True),
            Part("down_exps", "ffn_down_exps.weight", (e, d, f), expert=True)) + shared_expert_parts(s)


def shared_expert_parts(s: ModelSpec) -> tuple[Part, ...]:
    """The shared expert beside the routed ones (a dense SwiGLU every token takes), in the
    converter's order; Qwen3-Next's sigmoid gate is a [1, hidden] projection (the converter
    writes transformers' Linear(hidden, 1) as it is).  Resident, never streamed."""
    if not s.shared_ffn:
        return ()
    f, d = s.shared_ffn, s.hidden
    parts = (Part("down_shexp", "ffn_down_shexp.weight", (d, f)),
             Part("gate_shexp", "ffn_gate_shexp.weight", (f, d)),
             Part("up_shexp", "ffn_up_shexp.weight", (f, d)))
    return parts + ((Part("gate_inp_shexp", "ffn_gate_inp_shexp.weight", (1, d)),) if s.shared_gate else ())


def dense_ffn_parts(s: ModelSpec) -> tuple[Part, ...]:
    return (Part("gate", "ffn_gate.weight", (s.ffn, s.hidden)),
            Part("up", "ffn_up.weight", (s.ffn, s.hidden)),
            Part("down", "ffn_down.weight", (s.hidden, s.ffn)))


FULL_ATTENTION = LayerKind("attention", attention_parts, KVState())
