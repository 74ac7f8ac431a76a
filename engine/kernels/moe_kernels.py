"""The MoE's two memory-bound ends as single GPU passes (Triton), with torch fallbacks.

Around the grouped GEMMs a MoE layer moves tensors of [tokens x k, hidden] (k = 8 slots per
token for Qwen3-30B-A3B: 512 MiB at a 16K-token chunk).  Profiled on H200 at 32K tokens, the
elementwise work there was a third of the GPU time.  Two kernels take most of it:

* `swiglu(gu, f)`: silu(gate) * up from the fused gate/up GEMM output [N, 2f] — torch makes
  three strided passes (silu of a slice, a copy, the product); one kernel reads gu once.
* `combine(ys, inv, weights)`: out[t] = sum_j weights[t, j] * ys[inv[t*k + j]] — the expert
  outputs (sorted by expert) gathered back to (token, slot) order, weighted and summed over
  the slots in one pass, in fp32, in a fixed order (deterministic; no atomics).  torch needs a
  gather, a broadcast product and a reduction, each a full pass over [N, hidden].  With a
  per-expert bias (gpt-oss's down-projection bias) each slot adds its expert's row there too.
* `swiglu_oai(g, u, row_e, gate_b, up_b, alpha, limit)`: gpt-oss's clamped SwiGLU with the
  gate and up biases of each row's expert, from the two GEMM outputs: one pass where torch
  makes two bias gathers, two adds and seven elementwise passes.

Both run where Triton can (CUDA with triton installed; STRATA_MOE_KERNELS=torch turns them
off for an A/B) and fall back to the torch expressions elsewhere (CPU, no Triton).  Results
differ from the torch expressions only by rounding (fp32 inside, one rounding at the end).
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from engine import settings_table
from engine.kernels.triton_import import load

log = logging.getLogger(__name__)

ENV = settings_table.row("moe_kernels").env  # "torch": never the Triton kernels


def _probe() -> None:
    """What engine.kernels.triton_import jits to learn whether this module's kernels can be defined."""


@functools.cache
def _load():
    return load(_probe)


@functools.cache
def _kernels():
    """The compiled-on-demand Triton kernels, or None where Triton is missing (`status` says why)."""
    if settings_table.env_text("moe_kernels").lower() == "torch":
        return None
    triton, tl, _why = _load()
    if triton is None:
        return None

    @triton.jit
    def swiglu_kernel(gu_ptr, out_ptr, f, row_stride, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < f
        g = tl.load(gu_ptr + r * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + r * row_stride + f + cols, mask=mask, other=0.0).to(tl.float32)
        a = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + r * f + cols, a.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def combine_kernel(ys_ptr, inv_ptr, w_ptr, out_ptr, bias_ptr, e_ptr, hidden, K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(inv_ptr + t * K + j).to(tl.int64)
            wj = tl.load(w_ptr + t * K + j).to(tl.float32)
            y = tl.load(ys_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                e = tl.load(e_ptr + t * K + j).to(tl.int64)
                y += tl.load(bias_ptr + e * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            acc += wj * y
        tl.store(out_ptr + t * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def swiglu_oai_kernel(g_ptr, u_ptr, e_ptr, gb_ptr, ub_ptr, out_ptr, f, alpha, limit, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < f
        e = tl.load(e_ptr + r).to(tl.int64)
        g = tl.load(g_ptr + r * f + cols, mask=mask, other=0.0).to(tl.float32)
        g += tl.load(gb_ptr + e * f + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + r * f + cols, mask=mask, other=0.0).to(tl.float32)
        u += tl.load(ub_ptr + e * f + cols, mask=mask, other=0.0).to(tl.float32)
        # as torch's clamp, a NaN stays NaN; the enum goes inline (the compiler refuses it in a local)
        g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
        u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                       propagate_nan=tl.PropagateNan.ALL)
        a = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
        tl.store(out_ptr + r * f + cols, a.to(out_ptr.dtype.element_ty), mask=mask)

    log.info("MoE kernels: Triton %s", triton.__version__)
    return swiglu_kernel, combine_kernel, swiglu_oai_kernel


def status() -> tuple[str, str]:
    """("Triton <version>", "") where the kernels serve CUDA tensors, else ("torch", why)."""
    if _kernels() is None:
        return "torch", f"{ENV}=torch" if settings_table.env_text("moe_kernels").lower() == "torch" else _load()[2]
    return f"Triton {_load()[0].__version__}", ""


def available(x: torch.Tensor) -> bool:
    return x.is_cuda and _kernels() is not None


def swiglu(gu: torch.Tensor, f: int) -> torch.Tensor:
    """silu(gu[:, :f]) * gu[:, f:] for gu [N, 2f] with contiguous rows: [N, f]."""
    ks = _kernels() if gu.is_cuda else None
    if ks is None or gu.stride(1) != 1 or gu.shape[0] == 0:
        return F.silu(gu[:, :f]) * gu[:, f:]
    out = torch.empty(gu.shape[0], f, device=gu.device, dtype=gu.dtype)
    block = min(1024, 1 << (f - 1).bit_length())
    ks[0][(gu.shape[0], -(-f // block))](gu, out, f, gu.stride(0), BLOCK=block)
    return out


def combine(ys: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, bias: torch.Tensor | None = None,
            experts: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * (ys[inv[t*k + j]] + bias[experts[t, j]]) for t < n: [n, hidden] in
    ys's dtype (the bias term only where `bias` [E, hidden] is given, with `experts` [n, k]).

    ys [n*k, hidden] (rows sorted by expert), inv [n*k] (the row of each (token, slot)),
    weights [n, k]."""
    n, k = weights.shape
    ks = _kernels() if ys.is_cuda else None
    if ks is None or n == 0:
        y = ys[inv].view(n, k, ys.shape[1])
        if bias is not None:
            y = y + bias[experts].to(ys.dtype)
        return (y * weights.to(ys.dtype).unsqueeze(-1)).sum(1)
    hidden = ys.shape[1]
    out = torch.empty(n, hidden, device=ys.device, dtype=ys.dtype)
    block = min(1024, 1 << (hidden - 1).bit_length())
    has_bias = bias is not None
    ks[1][(n, -(-hidden // block))](ys.contiguous(), inv.contiguous(), weights.float().contiguous(), out,
                                    bias.contiguous() if has_bias else ys, experts.contiguous() if has_bias else inv,
                                    hidden, K=k, HAS_BIAS=has_bias, BLOCK=block)
    return out


def swiglu_oai(g: torch.Tensor, u: torch.Tensor, row_e: torch.Tensor, gate_b: torch.Tensor, up_b: torch.Tensor,
               alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's unit over rows sorted by expert: with g' = g + gate_b[row_e] clamped above at
    `limit` and u' = u + up_b[row_e] clamped to [-limit, limit], (u' + 1) * g' * sigmoid(alpha g').
    g, u [N, f] contiguous; row_e [N] each row's expert; gate_b, up_b [E, f].  CUDA with Triton
    only (`available`): the torch expression lives with the family (engine/models/gpt_oss_layer.py)."""
    ks = _kernels()
    if ks is None or not g.is_cuda:
        raise RuntimeError("moe_kernels.swiglu_oai needs CUDA and Triton (check available() first)")
    n, f = g.shape
    out = torch.empty_like(g)
    if n == 0:
        return out
    block = min(1024, 1 << (f - 1).bit_length())
    ks[2][(n, -(-f // block))](g.contiguous(), u.contiguous(), row_e.contiguous(), gate_b.contiguous(),
                               up_b.contiguous(), out, f, float(alpha), float(limit), BLOCK=block)
    return out
