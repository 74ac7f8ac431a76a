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
                            v_ptr, pos_ptr, HD: tl.constexpr, HAS_NORM: tl.constexpr, ROT: tl.constexpr,
                            AT_POS: tl.constexpr):
        # ROT: the rotated dimensions (the first ones; HD for full RoPE): pairs (i, i + ROT/2)
        # within them, the rest pass through (cos 1, sin 0: x * 1 + x * 0 is x exactly).
        # AT_POS (a decode step): k_ptr / v_ptr are the KV cache, token t's row is pos + t (pos read
        # from pos_ptr on the device), and programs H + KV .. H + 2 KV copy the v heads there.
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs = tl.arange(0, HD)
        kv_row = t
        if AT_POS:
            kv_row = t + tl.load(pos_ptr)
        if h >= H + KV:  # AT_POS's v heads: a plain copy into the cache
            vr = tl.load(qkv_ptr + t * row_stride + h * HD + offs)
            tl.store(v_ptr + (kv_row * KV + (h - H - KV)) * HD + offs, vr.to(v_ptr.dtype.element_ty))
        else:
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
            else:  # k token-first: [n, KV, HD] (the KV cache's layout; AT_POS: the cache itself)
                tl.store(k_ptr + (kv_row * KV + (h - H)) * HD + offs, out.to(k_ptr.dtype.element_ty))

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
    kern[(n, heads)](qk, qk.stride(0), w, cos, sin, q, k, n, n_heads, kv, eps, k, cos, HD=hd,
                     HAS_NORM=weight is not None, ROT=cos.shape[-1], AT_POS=False)
    return q.transpose(0, 1), k


def at_serves(keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype, rot: int) -> bool:
    """Whether `qk_norm_rope_at` can write into these caches (CUDA, the kernel on, a power-of-two
    head size, the caches contiguous in the compute dtype, an even rotary part within the head)."""
    hd = keys.shape[-1]
    return (keys.is_cuda and _kernel() is not None and not hd & (hd - 1) and keys.is_contiguous()
            and values.is_contiguous() and keys.dtype == dtype and values.dtype == dtype
            and not rot % 2 and rot <= hd)


def qk_norm_rope_at(qkv: torch.Tensor, n_heads: int, n_kv: int, weight: torch.Tensor | None, cos: torch.Tensor,
                    sin: torch.Tensor, eps: float, keys: torch.Tensor, values: torch.Tensor,
                    index: torch.Tensor) -> torch.Tensor | None:
    """A decode step's q/k norm and RoPE with its KV append in the same launch: k (normed, turned)
    and v written into the caches keys/values [capacity, KV, hd] at row index[0] + t, from the fused
    projection's rows qkv [n, (H + 2 KV) * hd]; returns q [n, H, hd].  None where the kernel
    cannot serve (the caller then takes `qk_norm_rope` and appends by itself)."""
    n = qkv.shape[0]
    hd = keys.shape[-1]
    if (not at_serves(keys, values, qkv.dtype, cos.shape[-1]) or n == 0 or qkv.stride(1) != 1
            or not cos.is_contiguous() or not sin.is_contiguous()):
        return None
    kern = _kernel()
    q = torch.empty(n_heads, n, hd, device=qkv.device, dtype=qkv.dtype)
    w = weight.contiguous() if weight is not None else qkv
    kern[(n, n_heads + 2 * n_kv)](qkv, qkv.stride(0), w, cos, sin, q, keys, n, n_heads, n_kv, eps, values, index,
                                  HD=hd, HAS_NORM=weight is not None, ROT=cos.shape[-1], AT_POS=True)
    return q.transpose(0, 1)
