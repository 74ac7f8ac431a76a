"""Attention of one decode token over a fixed span of the KV cache, masked past its position.

The static-shape decode step (engine/models/decode_pos.py) attends over the first `span` cached
keys whatever the token's position, so the kernels' shapes and addresses do not change from token
to token and a CUDA graph can hold them.  Two implementations, one result up to rounding:

* torch (CPU, or CUDA without Triton, or STRATA_DECODE_ATTENTION=torch): grouped-query
  attention without expanding K/V — the token's H query heads viewed as [KV, H/KV, hd], both
  products batched GEMMs over the KV heads reading the cache in place (strided), scores in the
  compute dtype with fp32 accumulation, scale, mask (`masked`) and softmax in fp32.  Seven kernels.
* Triton on CUDA, split-K: one program per (query head, slice of `SPLIT` keys) reads the
  position from the device and masks the loads of keys past it (nothing is read there: a short
  context inside a large span costs almost nothing), keeping a running max, sum and weighted sum in fp32; a second kernel merges
  the slices by their log-sum-exp.  Two kernels, every SM busy at long contexts where the
  batched GEMM over four KV heads is not.  Before they serve a shape on a device they run once
  on a small problem against the torch expression (`_self_check`, an eager step: never inside
  a capture); a build whose Triton fails there keeps torch with a warning, and the run
  report's kernels line says why.
"""
from __future__ import annotations

import functools
import logging
import threading

import torch

from engine import settings_table
from engine.kernels.triton_import import load

log = logging.getLogger(__name__)

ENV = settings_table.row("decode_attention").env  # "torch": never the Triton kernels
SPLIT = 128  # keys per program of the split-K kernel
BLOCK = 32  # keys per step inside a program
# (device, dtype, H, KV, hd) -> "" when the split-K kernels agreed with torch there, else why not:
# checked on the first call of a shape (an eager step: never inside a graph capture)
_CHECKED: dict[tuple, str] = {}
_LOCK = threading.Lock()


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, masked: torch.Tensor,
                     index: torch.Tensor) -> torch.Tensor:
    """q [1, H, hd] of one token at position `index` ([1] int64, on the device); keys/values
    [S, KV, hd] (the cache's first S rows); masked [S] bool (True past the position): output
    [1, H*hd] in q's dtype."""
    _, H, hd = q.shape
    KV = keys.shape[1]
    if H % KV:
        raise ValueError(f"{H} query heads are not a multiple of {KV} key/value heads")
    kern = _kernels() if q.is_cuda else None
    if (kern is not None and q.stride(2) == 1 and keys.stride(2) == 1 and values.stride(2) == 1
            and not hd & (hd - 1) and not _refused(kern, q.device, q.dtype, H, KV, hd)):
        return _triton(kern, q, keys, values, index)
    return _torch(q, keys, values, masked)


def _refused(kern, device: torch.device, dtype: torch.dtype, H: int, KV: int, hd: int) -> str:
    """Why the split-K kernels do not serve this shape ('' when they do): they run once on a
    small problem of it against the torch expression first (a build whose Triton fails to
    compile them, or answers wrongly, keeps torch, with a warning)."""
    key = (str(device), dtype, H, KV, hd)
    why = _CHECKED.get(key)
    if why is None:
        with _LOCK:
            why = _CHECKED.get(key)
            if why is None:
                why = _CHECKED[key] = _self_check(kern, device, dtype, H, KV, hd)
                if why:
                    log.warning("decode attention on %s keeps torch: %s", device, why)
    return why


def _self_check(kern, device: torch.device, dtype: torch.dtype, H: int, KV: int, hd: int) -> str:
    gen = torch.Generator(device="cpu").manual_seed(0)
    span, pos = 300, 200
    q = torch.randn(1, H, hd, generator=gen).to(device, dtype)
    keys = torch.randn(span, KV, hd, generator=gen).to(device, dtype)
    values = torch.randn(span, KV, hd, generator=gen).to(device, dtype)
    index = torch.tensor([pos], device=device)
    masked = torch.arange(span, device=device) > index
    keys[pos + 1:], values[pos + 1:] = 0, 0
    try:
        got = _triton(kern, q, keys, values, index).float()
    except Exception as exc:  # a Triton build that cannot compile or launch them
        return f"the split-K kernels failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})"
    want = _torch(q, keys, values, masked).float()
    err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-6)
    return "" if err <= 2e-2 else f"the split-K kernels differ from torch by {err:.3g} of the largest output"


def _torch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    _, H, hd = q.shape
    KV = keys.shape[1]
    qg = q.reshape(KV, H // KV, hd)
    scores = torch.matmul(qg, keys.permute(1, 2, 0))  # [KV, G, S]
    scores = scores.float().mul_(hd ** -0.5).masked_fill_(masked, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(values.dtype)
    o = torch.matmul(p, values.transpose(0, 1))  # [KV, G, hd]
    return o.reshape(1, H * hd)


def _triton(kern, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    partial, combine = kern
    _, H, hd = q.shape
    S, KV = keys.shape[0], keys.shape[1]
    n_splits = -(-S // SPLIT)
    part = torch.empty(H, n_splits, hd + 2, device=q.device, dtype=torch.float32)
    out = torch.empty(1, H * hd, device=q.device, dtype=q.dtype)
    partial[(H, n_splits)](q, q.stride(1), keys, values, keys.stride(0), keys.stride(1), values.stride(0),
                           values.stride(1), index, part, H // KV, n_splits, hd ** -0.5,
                           SPLIT=SPLIT, BLOCK=BLOCK, HD=hd)
    combine[(H,)](part, out, n_splits, HD=hd, SPLITS=max(2, triton_next_pow2(n_splits)))
    return out


def triton_next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _probe() -> None:
    """What engine.kernels.triton_import jits to learn whether this module's kernels can be defined."""


@functools.cache
def _load():
    return load(_probe)


def _kernels():
    """The two kernels, unless STRATA_DECODE_ATTENTION=torch or Triton is missing."""
    if settings_table.env_text("decode_attention").lower() == "torch":
        return None
    return _compiled()


def status() -> tuple[str, str]:
    """("Triton <version>", "") where the kernels serve CUDA tensors, else ("torch", why)."""
    if settings_table.env_text("decode_attention").lower() == "torch":
        return "torch", f"{ENV}=torch"
    if _compiled() is None:
        return "torch", _load()[2]
    refused = sorted({why for why in _CHECKED.values() if why})
    if refused:
        return "torch", "; ".join(refused)
    return f"Triton {_load()[0].__version__}", ""


@functools.cache
def _compiled():
    triton, tl, _why = _load()
    if triton is None:
        return None

    @triton.jit
    def decode_partial(q_ptr, q_stride, k_ptr, v_ptr, k_stride_s, k_stride_h, v_stride_s, v_stride_h, pos_ptr,
                       part_ptr, G, n_splits, scale, SPLIT: tl.constexpr, BLOCK: tl.constexpr, HD: tl.constexpr):
        h = tl.program_id(0)
        s = tl.program_id(1)
        kvh = (h // G).to(tl.int64)
        d = tl.arange(0, HD)
        q = tl.load(q_ptr + h * q_stride + d).to(tl.float32)
        start = s * SPLIT
        end = tl.load(pos_ptr).to(tl.int32) + 1  # keys past the position: masked loads read nothing
        m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        acc_l = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        acc = tl.zeros([HD], tl.float32)
        for b in range(0, SPLIT, BLOCK):
            rows = start + b + tl.arange(0, BLOCK)
            ok = rows < end
            r64 = rows.to(tl.int64)
            k = tl.load(k_ptr + r64[:, None] * k_stride_s + kvh * k_stride_h + d[None, :], mask=ok[:, None],
                        other=0.0).to(tl.float32)
            sc = tl.where(ok, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=0))
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: weights exp(-inf) = 0
            alpha = tl.exp(m - ref)
            p = tl.exp(sc - ref)
            v = tl.load(v_ptr + r64[:, None] * v_stride_s + kvh * v_stride_h + d[None, :], mask=ok[:, None],
                        other=0.0).to(tl.float32)
            acc_l = acc_l * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m = m_new
        base = part_ptr + (h * n_splits + s).to(tl.int64) * (HD + 2)
        tl.store(base + d, acc)
        tl.store(base + HD, m)
        tl.store(base + HD + 1, acc_l)

    @triton.jit
    def decode_combine(part_ptr, out_ptr, n_splits, HD: tl.constexpr, SPLITS: tl.constexpr):
        h = tl.program_id(0)
        s = tl.arange(0, SPLITS)
        d = tl.arange(0, HD)
        ok = s < n_splits
        base = part_ptr + (h * n_splits + s).to(tl.int64) * (HD + 2)
        m = tl.load(base + HD, mask=ok, other=float("-inf"))
        top = tl.max(m, axis=0)  # finite: the first slice holds key 0
        w = tl.where(ok, tl.exp(m - top), 0.0)  # a slice past the position: m = -inf, weight 0
        total = tl.sum(tl.load(base + HD + 1, mask=ok, other=0.0) * w, axis=0)
        acc = tl.load(base[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        o = tl.sum(acc * w[:, None], axis=0) / total
        tl.store(out_ptr + h * HD + d, o.to(out_ptr.dtype.element_ty))

    return decode_partial, decode_combine
