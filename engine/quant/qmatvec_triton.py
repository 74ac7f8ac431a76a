"""Routed experts' matrix-vector products straight from their stored blocks (issue 32 item 1).

A decode token routes to k experts of a layer.  Gathering them into a bf16 scratch and running
grouped GEMMs writes and reads every routed weight once more in bf16 (3.5x the bytes of a Q4_K
weight); here each program reads its rows' blocks once, expands them in registers and takes
the dot product with its row of activations: `out[m] = W[expert[m]] @ x[m]`.

Numerics are the grouped-GEMM path's up to the order of a float32 sum: a value is expanded in
float32 in ggml's order (`engine.quant.dequant`'s arithmetic; enable_fp_fusion=False, so no FMA
contracts it), rounded to the activations' dtype as the scratch would hold it (bf16 on the GPU
path), multiplied by the activation in float32 and summed in float32; the result is written
in the output's dtype.

Types: Q4_K, Q5_K, Q6_K, Q8_0 (what Q4_K_M/Q5_K_M/Q6_K/Q8_0 files store experts as); other types
take the gather-and-GEMM path.  `TYPES` lists them; `matvec` raises for the rest.
"""
from __future__ import annotations

from typing import Any

import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from engine.kernels.triton_import import load


def _probe() -> None:
    """What engine.kernels.triton_import jits to learn whether this module's kernels can be defined."""


triton, tl, UNAVAILABLE = load(_probe)

if triton is not None:
    from engine.quant.dequant_triton import _HW_CAST, _bf16, _f16, _i8, _k_scale_min, _u8

    @triton.jit
    def _finish(acc, out, m, N, rows, nmask):
        if out.dtype.element_ty == tl.bfloat16 and not _HW_CAST:
            tl.store(out + m * N + rows, _bf16(acc), mask=nmask)
        else:
            tl.store(out + m * N + rows, acc.to(out.dtype.element_ty), mask=nmask)

    @triton.jit
    def _round(v, x):
        """The expanded weight as the compute dtype holds it (the scratch path's rounding;
        bf16 through `_bf16` where interpreted, whose own cast truncates)."""
        if x.dtype.element_ty == tl.bfloat16 and not _HW_CAST:
            return _bf16(v).to(tl.float32)
        return v.to(x.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _row_bases(w, ids, m, N, row_bytes, expert_bytes, BN: tl.constexpr):
        e = tl.load(ids + m).to(tl.int64)
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = rows < N
        return e * expert_bytes + rows.to(tl.int64) * row_bytes, rows, nmask

    # Each kernel takes BK blocks of a row a step (a constexpr: all of a 2048-value row at once
    # where BK is 8, so a program's loads are in flight together instead of one block's after
    # another's) and keeps a product per value until the end: one cross-lane reduction a program,
    # not one a step.  Blocks past the row's end are masked to zero.

    @triton.jit
    def _mv_q4_k(w, x, ids, out, N, K: tl.constexpr, row_bytes, expert_bytes, BN: tl.constexpr, BK: tl.constexpr):
        # d | dmin | scales[12] | qs[128]: value 64g + 32h + r in the low (h=0) / high nibble of byte 32g + r
        m = tl.program_id(0)
        rb, rows, nmask = _row_bases(w, ids, m, N, row_bytes, expert_bytes, BN)
        NB: tl.constexpr = K // 256
        gi = tl.arange(0, 4 * BK)[None, :, None, None]  # (block of the step, g)
        g = gi % 4
        h = tl.arange(0, 2)[None, None, :, None]
        r = tl.arange(0, 32)[None, None, None, :]
        acc = tl.zeros([BN, 4 * BK, 2, 32], dtype=tl.float32)
        for kb in range(0, (NB + BK - 1) // BK):
            blk = kb * BK + gi // 4
            inside = blk < NB
            mask = nmask[:, None, None, None] & inside
            base = rb[:, None, None, None] + blk * 144
            d = _f16(w, base, mask)
            dmin = _f16(w, base + 2, mask)
            sc, mn = _k_scale_min(w, base, g * 2 + h, mask)
            dl = d * sc.to(tl.float32)
            ml = dmin * mn.to(tl.float32)
            q = ((_u8(w, base + 16 + g * 32 + r, mask) >> (h * 4)) & 15).to(tl.float32)
            p = dl * q
            v = _round(p - ml, x)
            xv = tl.load(x + m * K + blk * 256 + g * 64 + h * 32 + r, mask=inside, other=0.0).to(tl.float32)
            acc += v * xv
        _finish(tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1), out, m, N, rows, nmask)

    @triton.jit
    def _mv_q5_k(w, x, ids, out, N, K: tl.constexpr, row_bytes, expert_bytes, BN: tl.constexpr, BK: tl.constexpr):
        # d | dmin | scales[12] | qh[32] (bit s of byte r -> value 32s + r) | qs[128]
        m = tl.program_id(0)
        rb, rows, nmask = _row_bases(w, ids, m, N, row_bytes, expert_bytes, BN)
        NB: tl.constexpr = K // 256
        gi = tl.arange(0, 4 * BK)[None, :, None, None]
        g = gi % 4
        h = tl.arange(0, 2)[None, None, :, None]
        r = tl.arange(0, 32)[None, None, None, :]
        acc = tl.zeros([BN, 4 * BK, 2, 32], dtype=tl.float32)
        for kb in range(0, (NB + BK - 1) // BK):
            blk = kb * BK + gi // 4
            inside = blk < NB
            mask = nmask[:, None, None, None] & inside
            base = rb[:, None, None, None] + blk * 176
            d = _f16(w, base, mask)
            dmin = _f16(w, base + 2, mask)
            s = g * 2 + h
            sc, mn = _k_scale_min(w, base, s, mask)
            dl = d * sc.to(tl.float32)
            ml = dmin * mn.to(tl.float32)
            lo = (_u8(w, base + 48 + g * 32 + r, mask) >> (h * 4)) & 15
            hi = (_u8(w, base + 16 + r, mask) >> s) & 1
            q = (lo | (hi << 4)).to(tl.float32)
            p = dl * q
            v = _round(p - ml, x)
            xv = tl.load(x + m * K + blk * 256 + s * 32 + r, mask=inside, other=0.0).to(tl.float32)
            acc += v * xv
        _finish(tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1), out, m, N, rows, nmask)

    @triton.jit
    def _mv_q6_k(w, x, ids, out, N, K: tl.constexpr, row_bytes, expert_bytes, BN: tl.constexpr, BK: tl.constexpr):
        # ql[128] | qh[64] | scales[16] int8 | d: value 128n + 32t + l from ql byte 64n + 32(t&1) + l
        # (nibble t>>1), qh byte 32n + l (bits 2t), scale 8n + 2t + l//16
        m = tl.program_id(0)
        rb, rows, nmask = _row_bases(w, ids, m, N, row_bytes, expert_bytes, BN)
        NB: tl.constexpr = K // 256
        ni = tl.arange(0, 2 * BK)[None, :, None, None]  # (block of the step, n)
        n = ni % 2
        t = tl.arange(0, 4)[None, None, :, None]
        li = tl.arange(0, 32)[None, None, None, :]
        acc = tl.zeros([BN, 2 * BK, 4, 32], dtype=tl.float32)
        for kb in range(0, (NB + BK - 1) // BK):
            blk = kb * BK + ni // 2
            inside = blk < NB
            mask = nmask[:, None, None, None] & inside
            base = rb[:, None, None, None] + blk * 210
            d = _f16(w, base + 208, mask)
            ql = (_u8(w, base + n * 64 + (t & 1) * 32 + li, mask) >> ((t >> 1) * 4)) & 15
            qh = (_u8(w, base + 128 + n * 32 + li, mask) >> (t * 2)) & 3
            q = ((ql | (qh << 4)) - 32).to(tl.float32)
            dl = d * _i8(w, base + 192 + n * 8 + t * 2 + (li >> 4), mask).to(tl.float32)
            v = _round(dl * q, x)
            xv = tl.load(x + m * K + blk * 256 + n * 128 + t * 32 + li, mask=inside, other=0.0).to(tl.float32)
            acc += v * xv
        _finish(tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1), out, m, N, rows, nmask)

    @triton.jit
    def _mv_q8_0(w, x, ids, out, N, K: tl.constexpr, row_bytes, expert_bytes, BN: tl.constexpr, BK: tl.constexpr):
        # blocks of d | 32 int8, BK blocks a step, the last step masked
        m = tl.program_id(0)
        rb, rows, nmask = _row_bases(w, ids, m, N, row_bytes, expert_bytes, BN)
        b = tl.arange(0, BK)[None, :, None]
        i = tl.arange(0, 32)[None, None, :]
        n_blocks = K // 32
        acc = tl.zeros([BN, BK, 32], dtype=tl.float32)
        for kb in range(0, (K // 32 + BK - 1) // BK):
            blk = kb * BK + b
            mask = nmask[:, None, None] & (blk < n_blocks)
            base = rb[:, None, None] + blk * 34
            d = _f16(w, base, mask)
            q = _i8(w, base + 2 + i, mask).to(tl.float32)
            v = _round(q * d, x)
            xv = tl.load(x + m * K + blk * 32 + i, mask=blk < n_blocks, other=0.0).to(tl.float32)
            acc += v * xv
        _finish(tl.sum(tl.sum(acc, axis=2), axis=1), out, m, N, rows, nmask)

    # type -> (kernel, rows a program, warps, blocks a step): on one H100, a decode token's 8 rows of
    # Qwen3-30B-A3B's experts, 20 calls a CUDA graph (`benchmarks/matvec_bench.py --tokens 1`;
    # docs/benchmarks.md): Q4_K 768x2048 9.5 µs at 2:1:8 (16:4:1 before), Q6_K 2048x768 15.3 µs at
    # 2:1:1, Q5_K 11.8 µs and Q8_0 10.1 µs at 2:1:8; the fastest shapes were within 4% of these
    _TABLE: dict[T, tuple[Any, int, int, int]] = {
        T.Q4_K: (_mv_q4_k, 2, 1, 8), T.Q5_K: (_mv_q5_k, 2, 1, 8), T.Q6_K: (_mv_q6_k, 2, 1, 1),
        T.Q8_0: (_mv_q8_0, 2, 1, 8),
    }
else:
    _TABLE = {}

TYPES: frozenset[T] = frozenset(_TABLE)


def available() -> bool:
    return triton is not None


def matvec(raw: torch.Tensor, qtype: T, shape: tuple[int, ...], x: torch.Tensor, experts: torch.Tensor,
           out: torch.Tensor | None = None, expert_stride: int | None = None) -> torch.Tensor:
    """`out[m] = W[experts[m]] @ x[m]` for a stored [E, N, K] expert tensor (`raw`: its bytes,
    uint8, contiguous), activations x [M, K] and a 1-D int64 expert index of M entries on x's
    device (each in [0, E): not checked, a check would synchronise the host).  Returns [M, N]
    in x's dtype.  No host synchronisation: a CUDA graph can hold it.  `expert_stride`: bytes
    from one expert's first block to the next's where they are not packed (the expert cache's
    slots: `raw` then starts at the part's first byte and runs to the pool's end)."""
    if qtype not in _TABLE:
        raise ValueError(f"no stored-block matrix-vector kernel for {T(qtype).name}")
    E, N, K = shape
    bs, ts = GGML_QUANT_SIZES[qtype]
    if K % 256 and qtype != T.Q8_0 or K % bs:
        raise ValueError(f"a {T(qtype).name} row of {K} values is not whole 256-value steps")
    M = x.shape[0]
    if x.shape != (M, K) or experts.shape != (M,) or experts.dtype != torch.int64:
        raise ValueError(f"x {list(x.shape)} and experts {list(experts.shape)} do not match [{M}, {K}] / [{M}] int64")
    row_bytes = K // bs * ts
    stride = N * row_bytes if expert_stride is None else expert_stride
    if (raw.numel() != E * N * row_bytes if expert_stride is None
            else stride < N * row_bytes or raw.numel() < (E - 1) * stride + N * row_bytes):
        raise ValueError(f"{raw.numel()} bytes are not a {T(qtype).name} tensor of {list(shape)}")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    kernel, bn, warps, bk = _TABLE[qtype]
    grid = (M, triton.cdiv(N, bn))
    # K is a constexpr (the loop's trip count): one compile per row length of the model
    args = (raw.reshape(-1), x.contiguous(), experts.contiguous(), out, N, K, row_bytes, stride)
    if raw.is_cuda and raw.device.index is not None and raw.device.index != torch.cuda.current_device():
        with torch.cuda.device(raw.device):
            kernel[grid](*args, BN=bn, BK=bk, num_warps=warps, enable_fp_fusion=False)
    else:
        kernel[grid](*args, BN=bn, BK=bk, num_warps=warps, enable_fp_fusion=False)
    return out
