"""Causal attention of a prompt chunk over its prefix, on the fastest kernel the device has.

A chunk of n queries at position p attends to keys [0, p+n): all p prefix keys, and the n
keys of its own chunk causally.  Asked as one call with a lower-right causal mask, PyTorch
runs the flash/efficient kernels (about 345 TFLOP/s on H200); cuDNN's fused attention runs
plain causal and non-causal blocks at 650-660 (docs/design.md, "Attention on H200").  So on
CUDA the chunk's attention is split in two cuDNN calls — the prefix block (non-causal) and
the diagonal block (causal, square) — each returning its log-sum-exp, merged exactly:

    o = o_diag + s * (o_pre - o_diag),   s = exp(lse_pre) / (exp(lse_pre) + exp(lse_diag)) = sigmoid(lse_pre - lse_diag)

(one fp32 lerp; s from the fp32 log-sum-exps).  Which kernel a device uses is decided once, at the
first call on it, by running the split on a small problem and comparing it with PyTorch's
own attention: a GPU or build without cuDNN attention (or one that answers wrongly) keeps
`scaled_dot_product_attention` with the mask, and the run report says which was chosen.
Grouped-query attention is passed to cuDNN as is (no repeated K/V) where the build accepts
it, else K/V heads are expanded for that device.  The CPU always takes the reference call.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import settings_table

log = logging.getLogger(__name__)

SDPA = "sdpa"  # scaled_dot_product_attention (lower-right mask for a chunk after a prefix)
CUDNN_SPLIT = "cudnn-split"  # cuDNN prefix block + cuDNN causal diagonal, log-sum-exp merge


@dataclass(frozen=True)
class AttentionKernel:
    name: str  # SDPA | CUDNN_SPLIT
    native_gqa: bool = False  # cuDNN takes fewer K/V heads than Q heads as they are
    reason: str = ""

    def describe(self) -> str:
        if self.name == CUDNN_SPLIT:
            return f"cuDNN prefix+diagonal split ({'GQA native' if self.native_gqa else 'K/V heads expanded'})"
        return f"PyTorch SDPA{f' ({self.reason})' if self.reason else ''}"


_CHOSEN: dict[tuple, AttentionKernel] = {}
_LOCK = threading.Lock()
FORCE_ENV = settings_table.row("attention").env  # sdpa: never the split (A/B and a way out)


def kernel_for(device: torch.device, n_heads: int, n_kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> AttentionKernel:
    """The kernel for attention of this shape and dtype on this device, decided on first call by
    a self-check of that shape (thread-safe, once per process)."""
    key = (str(device), n_heads, n_kv_heads, head_dim, dtype)
    k = _CHOSEN.get(key)
    if k is None:
        with _LOCK:
            k = _CHOSEN.get(key)
            if k is None:
                k = _CHOSEN[key] = _choose(device, n_heads, n_kv_heads, head_dim, dtype)
                log.info("attention on %s (%d/%d heads of %d, %s): %s", device, n_heads, n_kv_heads, head_dim,
                         str(dtype).removeprefix("torch."), k.describe())
    return k


def _choose(device: torch.device, H: int, KV: int, hd: int, dtype: torch.dtype) -> AttentionKernel:
    if device.type != "cuda":
        return AttentionKernel(SDPA, reason="CPU")
    if dtype not in (torch.bfloat16, torch.float16):
        return AttentionKernel(SDPA, reason=f"cuDNN attention needs bf16/fp16, not {str(dtype).removeprefix('torch.')}")
    if settings_table.env_text("attention").lower() == "sdpa":
        return AttentionKernel(SDPA, reason=f"{FORCE_ENV}=sdpa")
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return AttentionKernel(SDPA, reason="this torch has no cuDNN attention")
    errors = []
    for native in (True, False) if KV != H else (True,):
        cand = AttentionKernel(CUDNN_SPLIT, native_gqa=native or KV == H)
        try:
            err = _self_check(device, cand, H, KV, hd, dtype)
        except Exception as exc:  # a build or GPU without the kernel: keep the reference call
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
            continue
        if err < 2e-2:
            return cand
        errors.append(f"max error {err:.3g} against SDPA")
    return AttentionKernel(SDPA, reason="cuDNN attention unusable here: " + "; ".join(errors))


def _self_check(device: torch.device, cand: AttentionKernel, H: int, KV: int, hd: int, dtype: torch.dtype) -> float:
    """Max abs difference of the candidate from SDPA on a small problem of this shape: a chunk
    behind a prefix, and a first chunk (the causal block alone)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    n, pos = 64, 192
    q = torch.randn(n, H, hd, generator=gen).to(device, dtype)
    k = torch.randn(pos + n, KV, hd, generator=gen).to(device, dtype)
    v = torch.randn(pos + n, KV, hd, generator=gen).to(device, dtype)
    ref = AttentionKernel(SDPA)
    err = 0.0
    for p in (pos, 0):
        got = chunk_attention(q, k[:p + n], v[:p + n], p, cand)
        want = chunk_attention(q, k[:p + n], v[:p + n], p, ref)
        err = max(err, float((got.float() - want.float()).abs().max()))
    torch.cuda.synchronize(device)
    return err


def chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int,
                    kernel: AttentionKernel) -> torch.Tensor:
    """q [n, H, hd] of tokens [pos, pos+n); keys/values [pos+n, KV, hd]: output [n, H*hd]."""
    n, H, hd = q.shape
    total = keys.shape[0]
    assert total == pos + n, (total, pos, n)
    qt = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
    kt = keys.transpose(0, 1).unsqueeze(0)  # [1, KV, L, hd]
    vt = values.transpose(0, 1).unsqueeze(0)
    if kernel.name == CUDNN_SPLIT and n > 1 and q.is_cuda:
        o = _split(qt, kt, vt, pos, kernel.native_gqa)
    else:
        gqa = H != keys.shape[1]
        if n == 1:
            o = F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=gqa)
        elif pos == 0:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)
        else:
            # imported here: torch.nn.attention.bias imports torch._dynamo (seconds at start-up)
            from torch.nn.attention.bias import causal_lower_right

            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(n, total), enable_gqa=gqa)
    return o.squeeze(0).transpose(0, 1).reshape(n, H * hd)


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [1, H, n, hd], log-sum-exp [1, H, n] fp32) of one cuDNN attention call."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
    o, lse = out[0], out[1]
    return o, lse.reshape(o.shape[:3]).float()


def _split(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, pos: int, native_gqa: bool) -> torch.Tensor:
    H = qt.shape[1]
    if not native_gqa and kt.shape[1] != H:
        rep = H // kt.shape[1]
        kt = kt.repeat_interleave(rep, dim=1)
        vt = vt.repeat_interleave(rep, dim=1)
    q = qt.contiguous()
    if pos == 0:
        return _cudnn(q, kt.contiguous(), vt.contiguous(), causal=True)[0]
    o_pre, lse_pre = _cudnn(q, kt[:, :, :pos].contiguous(), vt[:, :, :pos].contiguous(), causal=False)
    o_diag, lse_diag = _cudnn(q, kt[:, :, pos:].contiguous(), vt[:, :, pos:].contiguous(), causal=True)
    # the prefix block's share of each query's softmax mass: exp(lse_pre) / (exp(lse_pre) + exp(lse_diag))
    # in fp32: a bf16 share (8 bits) tripled the split's error against an fp32 reference
    share = torch.sigmoid(lse_pre - lse_diag).unsqueeze(-1)
    return torch.lerp(o_diag.float(), o_pre.float(), share).to(qt.dtype)  # o_diag + share * (o_pre - o_diag)
