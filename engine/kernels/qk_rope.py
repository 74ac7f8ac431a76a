"""Per-head RMSNorm of q and k and their rotary embedding in one GPU pass (Triton).

The GPU path of a layer takes q and k from the fused q/k/v projection, normalises each head
(Qwen3's q_norm/k_norm), and rotates them (neox RoPE).  As torch ops that is a norm, a weight
product, a negation, a concatenation and three products/sums over [tokens, heads + kv heads,
head_dim] — about 25 ms of a 32K prefill on H200 (16 layers).  `qk_norm_rope` reads each row
once, computes in fp32 and writes q already laid out heads-first ([H, n, hd] memory, returned
as an [n, H, hd] view), which is the layout cuDNN attention takes without a copy.

Where Triton is missing (CPU, a torch build without it) or the kernel is off
(STRATA_QK_KERNEL=torch, for an A/B) the torch expressions run.  The two differ by rounding
only (one bf16 rounding instead of several).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine import settings_table
from engine.kernels.triton_import import load

ENV = settings_table.row("qk_kernel").env  # "torch": never the Triton kernel


def _kernel():
    """The kernel, unless STRATA_QK_KERNEL=torch.  (It was opt-in for a while: runs with it
    measured a fixed ~25-38 ms slower on H200.  That was two bugs of the run, not the kernel: a
    one-chunk prompt's warm-up did not capture its CUDA graphs, and the logits' finite check ran
    as slow host ops; docs/benchmarks.md, issue 18.)"""
    if settings_table.env_text("qk_kernel").lower() == "torch":
        return None
    return _compiled()


def _probe() -> None:
    """What engine.kernels.triton_import jits to learn whether this module's kernel can be defined."""


@functools.cache
def _load():
    return load(_probe)


@functools.cache
def _compiled():
    triton, tl, _why = _load()
    if triton is None:
        return None

    @triton.jit
    def qk_norm_rope_kernel(qkv_ptr, row_stride, w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, n, H, KV, eps,
                            HD: tl.constexpr, HAS_NORM: tl.constexpr, ROT: tl.constexpr):
        # ROT: the rotated dimensions (the first ones; HD for full RoPE): pairs (i, i + ROT/2)
        # within them, the rest pass through (cos 1, sin 0: x * 1 + x * 0 is x exactly)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs = tl.arange(0, HD)
        half: tl.constexpr = ROT // 2
        turned = offs < ROT
        partner = tl.where(turned, (offs + half) % ROT, offs)
        row = qkv_ptr + t * row_stride + h * HD
        x = tl.load(row + offs).to(tl.float32)
        xp = tl.load(row + partner).to(tl.float32)
        if HAS_NORM:
            inv = tl.rsqrt(tl.sum(x * x, axis=0) / HD + eps)
            x = x * inv * tl.load(w_ptr + h * HD + offs).to(tl.float32)
            xp = xp * inv * tl.load(w_ptr + h * HD + partner).to(tl.float32)
        c = tl.load(cos_ptr + t * ROT + offs, mask=turned, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + t * ROT + offs, mask=turned, other=0.0).to(tl.float32)
        out = x * c + tl.where(offs < half, -xp, xp) * s
        if h < H:  # q heads-first: [H, n, HD]
            tl.store(q_ptr + (h.to(tl.int64) * n + t) * HD + offs, out.to(q_ptr.dtype.element_ty))
        else:  # k token-first: [n, KV, HD] (the KV cache's layout)
            tl.store(k_ptr + (t * KV + (h - H)) * HD + offs, out.to(k_ptr.dtype.element_ty))

    return qk_norm_rope_kernel


def status() -> tuple[str, str]:
    """("Triton <version>", "") where the kernel serves CUDA tensors, else ("torch", why)."""
    if settings_table.env_text("qk_kernel").lower() == "torch":
        return "torch", f"{ENV}=torch"
    if _compiled() is None:
        return "torch", _load()[2]
    return f"Triton {_load()[0].__version__}", ""


def rotate_lowp(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox RoPE of x [n, heads, head_dim] with cos/sin tables [n, 1, rot]: five kernels, no
    position argument, so a CUDA graph can hold it with the tables as its inputs.  rot below
    head_dim (partial rotary): the first rot dimensions turn, the rest pass through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((rotate_lowp(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def _torch(qk: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
           eps: float, n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    hd = qk.shape[-1]
    if weight is not None:
        qk = F.rms_norm(qk, (hd,), None, eps) * weight
    qk = rotate_lowp(qk, cos, sin)
    return qk[:, :n_heads], qk[:, n_heads:]


def qk_norm_rope(qk: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float, n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, hd] and k [n, KV, hd] from qk [n, H + KV, hd] (rows of the fused projection):
    per-head RMSNorm with `weight` [H + KV, hd] (None: no norm), then neox RoPE with cos/sin
    [n, 1, rot] over each head's first rot dimensions (rot < hd: partial rotary)."""
    n, heads, hd = qk.shape
    kern = _kernel() if qk.is_cuda else None
    if (kern is None or qk.stride(2) != 1 or qk.stride(1) != hd or hd & (hd - 1) or n == 0
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.shape[-1] % 2 or cos.shape[-1] > hd):
        return _torch(qk, weight, cos, sin, eps, n_heads)
    kv = heads - n_heads
    q = torch.empty(n_heads, n, hd, device=qk.device, dtype=qk.dtype)
    k = torch.empty(n, kv, hd, device=qk.device, dtype=qk.dtype)
    w = weight.contiguous() if weight is not None else qk  # unused without the norm
    kern[(n, heads)](qk, qk.stride(0), w, cos, sin, q, k, n, n_heads, kv, eps, HD=hd, HAS_NORM=weight is not None,
                     ROT=cos.shape[-1])
    return q.transpose(0, 1), k
