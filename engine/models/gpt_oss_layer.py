"""gpt-oss's block (llama.cpp `gpt-oss`, transformers' GptOssDecoderLayer): attention with q/k/v/o
biases and per-head sinks, on sliding-window or full layers, then routed experts with biases
and OpenAI's clamped SwiGLU.

Routing: the router's logits (with its bias) -> top k -> softmax over those k (llama.cpp's
SOFTMAX_WEIGHT gating).  An expert: g = x Wg + bg, u = x Wu + bu (the converter splits the
checkpoint's interleaved gate/up columns into two tensors), g clamped above at 7, u to
[-7, 7], out = ((u + 1) * g * sigmoid(1.702 g)) Wd + bd (alpha and limit are constants in
llama.cpp and the authors' code; no file key carries them).

Every device takes the reference path (`fast_ok` is False: no fused q/k/v, no CUDA graphs);
on CUDA with bf16 and grouped GEMMs the resident experts run as grouped GEMMs with each row's
expert bias added (with Triton: the biased clamped SwiGLU in one pass, and the down bias inside
the weighted sum over the k slots, `engine.kernels.moe_kernels`).  Stored experts (MXFP4 as
published, any other type) are expanded right before their GEMMs, only the routed ones where
they are few, as `Layer` does.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.kernels import moe_kernels
from engine.kernels.sink_attention import sink_attention
from engine.models.experts import EXPAND_SCRATCH_BYTES
from engine.models.kv import LayerKV
from engine.models.layers import Layer, LayerWeights, _grouped_mm_ok, rms_norm
from engine.quant.qtensor import QTensor

if TYPE_CHECKING:
    from engine.models.experts import ExpertCache
    from engine.models.layers import Rope
    from engine.models.spec import ModelSpec

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gated unit: gate clamped above, up clamped both ways, (up + 1) * gate * sigmoid(alpha gate)."""
    gate = gate.clamp(max=SWIGLU_LIMIT)
    up = up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))


@dataclass
class GptOssWeights(LayerWeights):
    bo: torch.Tensor | None = None  # attn_output.bias [hidden]
    sinks: torch.Tensor | None = None  # attn_sinks [heads], fp32
    router_b: torch.Tensor | None = None  # ffn_gate_inp.bias [E], fp32
    gate_b: torch.Tensor | None = None  # ffn_gate_exps.bias [E, f]
    up_b: torch.Tensor | None = None  # ffn_up_exps.bias [E, f]
    down_b: torch.Tensor | None = None  # ffn_down_exps.bias [E, hidden]


def _starts(counts: list[int]) -> list[int]:
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return starts


class GptOssLayer(Layer):
    """One gpt-oss block; `window` is the file's sliding window on sliding layers, else None."""

    weights_type = GptOssWeights

    def __init__(self, spec: ModelSpec, index: int, weights: GptOssWeights, rope: Rope,
                 cache: ExpertCache | None = None) -> None:
        super().__init__(spec, index, weights, rope, cache=cache)
        self.window: int | None = spec.window_of(index)  # type: ignore[attr-defined]  # GptOssSpec

    def fast_ok(self, x: torch.Tensor) -> bool:
        return False  # the fused path has no sinks, window or expert biases: the reference path everywhere

    # ------------------------------------------------------------------ attention
    def attention(self, x: torch.Tensor, kv: LayerKV, pos: int) -> torch.Tensor:
        s, w = self.spec, self.w
        n = x.shape[0]
        h = rms_norm(x, w.attn_norm, s.rms_eps)
        q = self.rope.apply(F.linear(h, w.wq, w.bq).view(n, s.n_heads, s.head_dim), pos)
        k = self.rope.apply(F.linear(h, w.wk, w.bk).view(n, s.n_kv_heads, s.head_dim), pos)
        v = F.linear(h, w.wv, w.bv).view(n, s.n_kv_heads, s.head_dim)
        keys, values = kv.append(k, v, pos)
        return F.linear(sink_attention(q, keys, values, pos, w.sinks, self.window), w.wo, w.bo)

    # ------------------------------------------------------------------------ FFN
    def moe(self, h: torch.Tensor) -> torch.Tensor:
        """Router (fp32, with its bias) -> top k -> softmax of those k -> biased clamped-SwiGLU
        experts over rows sorted by expert -> weighted sum over the k slots (no atomics)."""
        s, w = self.spec, self.w
        n, k = h.shape[0], s.n_experts_used
        top_v, top_i = torch.topk(F.linear(h.float(), w.router, w.router_b), k, dim=-1)
        top_w = torch.softmax(top_v, dim=-1)
        flat = top_i.reshape(-1)
        order = torch.argsort(flat, stable=True)
        xs = h[order // k]
        counts = torch.zeros(s.n_experts, dtype=torch.int64, device=h.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        if self.use_grouped_mm is None:
            self.use_grouped_mm = _grouped_mm_ok(h)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        if self.use_grouped_mm and moe_kernels.available(h):
            # one pass each for the biased unit and the weighted sum with the down bias (fp32 inside),
            # resident or streamed: the same arithmetic per row, so the same digest
            ys = (self._streamed(xs, counts, flat[order], fused=True) if self.cache is not None
                  else self._grouped(xs, flat, order, counts, n, fused=True))
            return moe_kernels.combine(ys, inv, top_w, w.down_b, top_i)
        if self.cache is not None:
            ys = self._streamed(xs, counts, flat[order])
        elif self.use_grouped_mm:
            ys = self._grouped(xs, flat, order, counts, n)
        else:
            ys = self._per_expert(xs, counts)
        y = ys[inv].view(n, k, s.hidden).float() * top_w.unsqueeze(-1)
        return y.sum(1).to(h.dtype)

    def _ffn(self, seg: torch.Tensor, e: int, gate: torch.Tensor, up: torch.Tensor,
             down: torch.Tensor) -> torch.Tensor:
        w = self.w
        a = swiglu_oai(F.linear(seg, gate, w.gate_b[e]), F.linear(seg, up, w.up_b[e]))
        return F.linear(a, down, w.down_b[e])

    def _resident_batches(self, used: list[int], dtype: torch.dtype,
                          device: torch.device) -> Iterator[tuple[list[int], tuple[torch.Tensor, ...]]]:
        """(experts, (gate, up, down) of them in `dtype`) for the resident experts `used`: float
        ones as views, stored ones as `Layer._expanded_batches` expands them."""
        w = self.w
        parts = (w.gate_exps, w.up_exps, w.down_exps)
        if not isinstance(w.gate_exps, QTensor):
            for e in used:
                yield [e], tuple(t[e:e + 1] for t in parts)
            return
        yield from self._expanded_batches(used, dtype, device)

    def _per_expert(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One expert at a time over rows sorted by expert (CPU, or a GPU without grouped GEMMs)."""
        counts_host = counts.tolist()
        starts = _starts(counts_host)
        ys = torch.empty_like(xs)
        used = [e for e, c in enumerate(counts_host) if c]
        for batch, (gate, up, down) in self._resident_batches(used, xs.dtype, xs.device):
            for j, e in enumerate(batch):
                if counts_host[e]:
                    lo, hi = starts[e], starts[e + 1]
                    ys[lo:hi] = self._ffn(xs[lo:hi], e, gate[j], up[j], down[j])
        return ys

    def _grouped(self, xs: torch.Tensor, flat: torch.Tensor, order: torch.Tensor, counts: torch.Tensor,
                 n: int, fused: bool = False) -> torch.Tensor:
        """Grouped GEMMs over rows sorted by expert (CUDA, bf16), each row's expert bias added:
        no host synchronisation.  `fused`: the unit with its biases in one Triton pass, and the
        down bias left to the caller's weighted sum (`moe_kernels.combine`)."""
        w = self.w
        row_e = flat[order]
        gate, up, down, offs = self._grouped_experts(flat, order, counts, n, xs.dtype)
        g = torch._grouped_mm(xs, gate.transpose(-2, -1), offs=offs)
        u = torch._grouped_mm(xs, up.transpose(-2, -1), offs=offs)
        if fused:
            a = moe_kernels.swiglu_oai(g, u, row_e, w.gate_b, w.up_b, SWIGLU_ALPHA, SWIGLU_LIMIT)
            return torch._grouped_mm(a, down.transpose(-2, -1), offs=offs)
        a = swiglu_oai(g + w.gate_b[row_e], u + w.up_b[row_e])
        return torch._grouped_mm(a, down.transpose(-2, -1), offs=offs) + w.down_b[row_e]

    def _streamed(self, xs: torch.Tensor, counts: torch.Tensor, row_e: torch.Tensor,
                  fused: bool = False) -> torch.Tensor:
        """Experts from the device's ExpertCache, in batches it can hold (the biases stay resident
        with the layer).  With grouped GEMMs each batch runs as the resident path's `_grouped` does
        over its rows (`row_e`: each sorted row's expert; `fused`: the unit's Triton pass, the down
        bias left to the caller's weighted sum), so a streamed run gives the resident digest;
        without them, one expert at a time over its rows."""
        s, cache, w = self.spec, self.cache, self.w
        counts_host = counts.tolist()
        starts = _starts(counts_host)
        needed = [e for e, c in enumerate(counts_host) if c]
        ys = torch.empty_like(xs)
        seq = cache.begin_layer()
        expanded = 3 * s.expert_ffn * s.hidden * xs.element_size()
        step = max(1, min(cache.n_slots, s.n_experts, EXPAND_SCRATCH_BYTES // expanded))
        for b0 in range(0, len(needed), step):
            batch = needed[b0:b0 + step]
            slots = cache.ensure(self.index, batch, cache.chunk)
            gate, up, down = cache.expand(self.index, slots, xs.dtype)
            if self.use_grouped_mm:
                lo, hi = starts[batch[0]], starts[batch[-1] + 1]
                offs = torch.tensor([starts[e + 1] - lo for e in batch], dtype=torch.int32).to(xs.device)
                seg, seg_e = xs[lo:hi], row_e[lo:hi]
                g = torch._grouped_mm(seg, gate.transpose(-2, -1), offs=offs)
                u = torch._grouped_mm(seg, up.transpose(-2, -1), offs=offs)
                if fused:
                    a = moe_kernels.swiglu_oai(g, u, seg_e, w.gate_b, w.up_b, SWIGLU_ALPHA, SWIGLU_LIMIT)
                    ys[lo:hi] = torch._grouped_mm(a, down.transpose(-2, -1), offs=offs)
                else:
                    a = swiglu_oai(g + w.gate_b[seg_e], u + w.up_b[seg_e])
                    ys[lo:hi] = torch._grouped_mm(a, down.transpose(-2, -1), offs=offs) + w.down_b[seg_e]
                continue
            for j, e in enumerate(batch):
                lo, hi = starts[e], starts[e + 1]
                ys[lo:hi] = self._ffn(xs[lo:hi], e, gate[j], up[j], down[j])
        cache.end_layer(seq)
        if (self.prefetch_next is not None and cache.n_slots >= 2 * s.n_experts
                and xs.shape[0] >= 2 * s.n_experts):
            cache.ensure(self.prefetch_next, range(s.n_experts), cache.chunk, prefetch=True)
        return ys

