"""A gated DeltaNet (GDN) block on one device (Qwen3-Next, Qwen3.5-MoE), and the state it carries
from chunk to chunk in place of KV.

The block: RMSNorm, the q/k/v, z and b/a projections, `gated_delta.gdn_mix` (causal conv with its
rolling tail, L2-normed q/k, decay and beta gates, the chunked delta rule, the z-gated RMSNorm),
the output projection, residual; then the FFN norm and `layers.Layer`'s FFN (routed experts,
resident or streamed, plus the shared expert), residual.  It runs the reference path on every
device (matrices in the compute dtype; the delta rule in fp32 torch, or on CUDA in bf16/fp16
flash-linear-attention's kernels where the `gdn` extra is installed: `gated_delta.gdn_mix`) and
is never captured in a CUDA graph (`graphable` is False, so a stage holding one runs eagerly:
`advance` checks the state's position on the host each chunk, and fla autotunes on a shape's
first call).

`GdnLayerState` is the `kv.LayerState` of such a layer: its conv tail and recurrent matrices,
fixed in size, handed over whole by prefill-main (`handoff_views` ignore the length, which only
records how many tokens the state has seen so that a chunk out of order is refused as KV's is).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.models.gated_delta import GdnShape, GdnState, gdn_mix, split_ba
from engine.models.kv import LayerState, copy_state
from engine.models.layers import Layer, LayerWeights, Rope, rms_norm
from engine.models.spec import ModelSpec

if TYPE_CHECKING:
    from engine.models.experts import ExpertCache


class GdnLayerState:
    """One GDN layer's state for one sequence (conv tail in the compute dtype, S in float32)."""

    def __init__(self, shape: GdnShape, capacity: int, device: torch.device, dtype: torch.dtype) -> None:
        self.capacity = capacity  # tokens a run may feed it (the state itself does not grow)
        self.state = GdnState(shape, device, dtype)
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.state.nbytes

    def reset(self) -> None:
        self.state.reset()
        self.length = 0

    def advance(self, pos: int, n: int) -> GdnState:
        """The state before tokens [pos, pos+n), which the caller then moves past them."""
        if pos != self.length:
            raise RuntimeError(f"GDN state at position {pos}, but the state has seen {self.length} tokens")
        if pos + n > self.capacity:
            raise RuntimeError(f"GDN state past its run: {pos + n} tokens exceed the capacity of {self.capacity}")
        self.length = pos + n
        return self.state

    def handoff_length(self) -> int:
        return self.length

    def handoff_views(self, length: int) -> list[torch.Tensor]:
        """The conv tail and the recurrent matrices, whatever the length (a recurrent state holds
        the whole prefix in fixed bytes)."""
        return [self.state.conv, self.state.recurrent]

    def adopt(self, length: int) -> None:
        self.length = length

    def copy_from(self, other: LayerState) -> int:
        return copy_state(self, other)


@dataclass
class _GdnParts:
    """A GDN block's own tensors (names: `qwen3next.gdn_parts`)."""

    attn_norm: torch.Tensor
    ssm_a: torch.Tensor  # [Hv] = -exp(A_log)
    ssm_conv: torch.Tensor  # [conv_dim, K]
    ssm_dt: torch.Tensor  # [Hv] the decay's bias
    ssm_norm: torch.Tensor  # [head_v]
    ssm_out: torch.Tensor  # [d, value_dim]
    ffn_norm: torch.Tensor
    wqkv: torch.Tensor | None = None  # [conv_dim, d]: q of every k head, then k, then v
    wz: torch.Tensor | None = None  # [value_dim, d]
    ssm_in: torch.Tensor | None = None  # [conv_dim + value_dim, d]: older files' fused q/k/v/z, per k head
    ssm_ba: torch.Tensor | None = None  # [2 Hv, d] (Qwen3-Next: per k head its b then its a)
    ssm_beta: torch.Tensor | None = None  # [Hv, d] (Qwen3.5: b and a apart)
    ssm_alpha: torch.Tensor | None = None  # [Hv, d]


# the GDN block's tensors, then every optional field of `LayerWeights` (the FFN's: router, experts,
# shared expert, whatever the FFN grows), so `Layer`'s FFN code reads a GDN block's weights as its own
GdnWeights = make_dataclass(
    "GdnWeights",
    [(f.name, f.type, field(default=None)) for f in fields(LayerWeights)
     if f.default is None and f.name not in {g.name for g in fields(_GdnParts)}],
    bases=(_GdnParts,), namespace={"nbytes": LayerWeights.nbytes, "__module__": __name__})


class GdnLayer(Layer):
    """One GDN block; its FFN is `Layer`'s."""

    weights_type = GdnWeights

    def __init__(self, spec: ModelSpec, index: int, weights: GdnWeights, rope: Rope,
                 cache: ExpertCache | None = None) -> None:
        super().__init__(spec, index, weights, rope, cache=cache)
        self.shape = spec.gdn()

    def fast_ok(self, x: torch.Tensor) -> bool:
        return False  # the reference path everywhere (no fused weights, no CUDA graph)

    def mix(self, x: torch.Tensor, state: GdnLayerState, pos: int) -> torch.Tensor:
        """The token mixer of a chunk x [n, d] at `pos`, continuing `state`: [n, d]."""
        s, w = self.spec, self.w
        h = rms_norm(x, w.attn_norm, s.rms_eps)
        if w.ssm_ba is not None:
            b, a = split_ba(F.linear(h, w.ssm_ba), self.shape)
        else:
            b, a = F.linear(h, w.ssm_beta), F.linear(h, w.ssm_alpha)
        qkv, z = self._qkvz(h)
        core = gdn_mix(qkv, z, b, a, ssm_a=w.ssm_a, dt_bias=w.ssm_dt,
                       conv_weight=w.ssm_conv, norm_weight=w.ssm_norm, shape=self.shape,
                       state=state.advance(pos, x.shape[0]), eps=s.rms_eps)
        return F.linear(core, w.ssm_out)

    def _qkvz(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv's input (q of every k head, then k, then v) and z, from either file layout."""
        w, g = self.w, self.shape
        if w.ssm_in is None:
            return F.linear(h, w.wqkv), F.linear(h, w.wz)
        n, per = h.shape[0], g.value_dim // g.n_k_heads
        qkvz = F.linear(h, w.ssm_in).view(n, g.n_k_heads, -1)
        q, k, v, z = torch.split(qkvz, [g.head_k, g.head_k, per, per], dim=-1)
        return torch.cat([x.reshape(n, -1) for x in (q, k, v)], dim=-1), z.reshape(n, -1)

    def forward(self, x: torch.Tensor, kv: GdnLayerState, pos: int) -> torch.Tensor:
        x = x + self.mix(x, kv, pos)
        return x + self.ffn(rms_norm(x, self.w.ffn_norm, self.spec.rms_eps))

    __call__ = forward
