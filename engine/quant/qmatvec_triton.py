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

`gate_up` takes an expert's gate and up rows in one program and writes silu(gate) * up: one
launch where the separate products, the SiLU and the product were four (a decode step's time
inside its graph is mostly its launches' count).  Each type's row product is one `@triton.jit`
helper (`_dot_<type>`), so both kernels compile the same arithmetic.

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

    # Each row product takes BK blocks of a row a step (a constexpr: all of a 2048-value row at
    # once where BK is 8, so a program's loads are in flight together instead of one block's after
    # another's) and keeps a product per value until the end: one cross-lane reduction a program,
    # not one a step.  Blocks past the row's end are masked to zero.  `rb` holds the byte offset of
    # each of the program's BN rows, `xr` points at the row's K activations.

    @triton.jit
    def _dot_q4_k(w, rb, nmask, xr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # d | dmin | scales[12] | qs[128]: value 64g + 32h + r in the low (h=0) / high nibble of byte 32g + r
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
            v = _round(p - ml, xr)
            xv = tl.load(xr + blk * 256 + g * 64 + h * 32 + r, mask=inside, other=0.0).to(tl.float32)
            acc += v * xv
        return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)

    @triton.jit
    def _dot_q5_k(w, rb, nmask, xr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # d | dmin | scales[12] | qh[32] (bit s of byte r -> value 32s + r) | qs[128]
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
            v = _round(p - ml, xr)
            xv = tl.load(xr + blk * 256 + s * 32 + r, mask=inside, other=0.0).to(tl.float32)
            acc += v * xv
        return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)

    # The same products reading the quants as 32-bit words where the bytes are 4-aligned (Q4_K's
    # 144- and Q5_K's 176-byte blocks; every row and expert offset a multiple of 4): one load gives
    # eight nibbles, where the byte form loads each byte once per nibble.  Word i of sub-row g
    # (bytes 32g + 4i .. 32g + 4i + 3) holds in nibble j = 2b + h the value 64g + 32h + 4i + b.

    @triton.jit
    def _dot_q4_k_words(w, rb, nmask, xr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        NB: tl.constexpr = K // 256
        ww = w.to(tl.pointer_type(tl.int32))
        gi = tl.arange(0, 4 * BK)[None, :, None, None]  # (block of the step, g)
        g = gi % 4
        i = tl.arange(0, 8)[None, None, :, None]
        j = tl.arange(0, 8)[None, None, None, :]
        h = j & 1
        acc = tl.zeros([BN, 4 * BK, 8, 8], dtype=tl.float32)
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
            word = tl.load(ww + ((base + 16) >> 2) + g * 8 + i, mask=mask, other=0)
            q = ((word >> (4 * j)) & 15).to(tl.float32)
            p = dl * q
            v = _round(p - ml, xr)
            xv = tl.load(xr + blk * 256 + g * 64 + h * 32 + 4 * i + (j >> 1), mask=inside, other=0.0).to(tl.float32)
            acc += v * xv
        return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)

    @triton.jit
    def _dot_q5_k_words(w, rb, nmask, xr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # qh word i (bytes 4i .. 4i + 3 of qh): bit s of byte b -> value 32s + 4i + b, s = 2g + h
        NB: tl.constexpr = K // 256
        ww = w.to(tl.pointer_type(tl.int32))
        gi = tl.arange(0, 4 * BK)[None, :, None, None]
        g = gi % 4
        i = tl.arange(0, 8)[None, None, :, None]
        j = tl.arange(0, 8)[None, None, None, :]
        h = j & 1
        acc = tl.zeros([BN, 4 * BK, 8, 8], dtype=tl.float32)
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
            lo = (tl.load(ww + ((base + 48) >> 2) + g * 8 + i, mask=mask, other=0) >> (4 * j)) & 15
            hi = (tl.load(ww + ((base + 16) >> 2) + i, mask=mask, other=0) >> (8 * (j >> 1) + s)) & 1
            q = (lo | (hi << 4)).to(tl.float32)
            p = dl * q
            v = _round(p - ml, xr)
            xv = tl.load(xr + blk * 256 + s * 32 + 4 * i + (j >> 1), mask=inside, other=0.0).to(tl.float32)
            acc += v * xv
        return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)

    @triton.jit
    def _dot_q6_k(w, rb, nmask, xr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # ql[128] | qh[64] | scales[16] int8 | d: value 128n + 32t + l from ql byte 64n + 32(t&1) + l
        # (nibble t>>1), qh byte 32n + l (bits 2t), scale 8n + 2t + l//16
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
            v = _round(dl * q, xr)
            xv = tl.load(xr + blk * 256 + n * 128 + t * 32 + li, mask=inside, other=0.0).to(tl.float32)
            acc += v * xv
        return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)

    @triton.jit
    def _dot_q8_0(w, rb, nmask, xr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # blocks of d | 32 int8, BK blocks a step, the last step masked
        b = tl.arange(0, BK)[None, :, None]
        i = tl.arange(0, 32)[None, None, :]
        n_blocks: tl.constexpr = K // 32
        acc = tl.zeros([BN, BK, 32], dtype=tl.float32)
        for kb in range(0, (n_blocks + BK - 1) // BK):
            blk = kb * BK + b
            mask = nmask[:, None, None] & (blk < n_blocks)
            base = rb[:, None, None] + blk * 34
            d = _f16(w, base, mask)
            q = _i8(w, base + 2 + i, mask).to(tl.float32)
            v = _round(q * d, xr)
            xv = tl.load(xr + blk * 32 + i, mask=blk < n_blocks, other=0.0).to(tl.float32)
            acc += v * xv
        return tl.sum(tl.sum(acc, axis=2), axis=1)

    @triton.jit
    def _dot(w, rb, nmask, xr, K: tl.constexpr, TYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             WORDS: tl.constexpr):
        """The products [BN] of a type's rows (TYPE: its ggml id, a constexpr: one body compiled;
        WORDS: the quants read as 4-aligned words, Q4_K and Q5_K)."""
        if TYPE == 12:
            if WORDS:
                acc = _dot_q4_k_words(w, rb, nmask, xr, K, BN, BK)
            else:
                acc = _dot_q4_k(w, rb, nmask, xr, K, BN, BK)
        elif TYPE == 13:
            if WORDS:
                acc = _dot_q5_k_words(w, rb, nmask, xr, K, BN, BK)
            else:
                acc = _dot_q5_k(w, rb, nmask, xr, K, BN, BK)
        elif TYPE == 14:
            acc = _dot_q6_k(w, rb, nmask, xr, K, BN, BK)
        else:
            acc = _dot_q8_0(w, rb, nmask, xr, K, BN, BK)
        return acc

    @triton.jit
    def _rows(ids, m, N, row_bytes, expert_bytes, BN: tl.constexpr):
        """Program (m, j)'s BN output rows, their mask and their byte offsets in row m's expert."""
        e = tl.load(ids + m).to(tl.int64)
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        return rows, rows < N, e * expert_bytes + rows.to(tl.int64) * row_bytes

    @triton.jit
    def _mv(w, x, ids, out, N, K: tl.constexpr, row_bytes, expert_bytes, XDIV: tl.constexpr,
            TYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WORDS: tl.constexpr):
        """out[m] = W[ids[m]] @ x[m // XDIV]."""
        m = tl.program_id(0)
        rows, nmask, rb = _rows(ids, m, N, row_bytes, expert_bytes, BN)
        _finish(_dot(w, rb, nmask, x + (m // XDIV) * K, K, TYPE, BN, BK, WORDS), out, m, N, rows, nmask)

    @triton.jit
    def _mv_gate_up(wg, wu, x, ids, out, N, K: tl.constexpr, row_bytes, expert_bytes, XDIV: tl.constexpr,
                    TYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WORDS: tl.constexpr):
        """out[m] = silu(G[e] @ x) * (U[e] @ x), e = ids[m], x = x[m // XDIV]: each product rounded to
        the compute dtype, then the SiLU rounded, as the separate products and torch's F.silu(g) * u."""
        m = tl.program_id(0)
        rows, nmask, rb = _rows(ids, m, N, row_bytes, expert_bytes, BN)
        xr = x + (m // XDIV) * K
        g = _round(_dot(wg, rb, nmask, xr, K, TYPE, BN, BK, WORDS), xr)
        u = _round(_dot(wu, rb, nmask, xr, K, TYPE, BN, BK, WORDS), xr)
        _finish(_round(g / (1.0 + tl.exp(-g)), xr) * u, out, m, N, rows, nmask)

    # type -> (rows a program, warps, blocks a step): on one H100, a decode token's 8 rows of
    # Qwen3-30B-A3B's experts, 20 calls a CUDA graph (`benchmarks/matvec_bench.py --tokens 1`;
    # docs/benchmarks.md): Q4_K 768x2048 9.5 µs at 2:1:8 (16:4:1 before), Q6_K 2048x768 15.3 µs at
    # 2:1:1, Q5_K 11.8 µs and Q8_0 10.1 µs at 2:1:8; the fastest shapes were within 4% of these
    _TABLE: dict[T, tuple[int, int, int]] = {
        T.Q4_K: (2, 1, 8), T.Q5_K: (2, 1, 8), T.Q6_K: (2, 1, 1), T.Q8_0: (2, 1, 8),
    }
else:
    _TABLE = {}

TYPES: frozenset[T] = frozenset(_TABLE)
WORD_TYPES: frozenset[T] = frozenset({T.Q4_K, T.Q5_K})  # blocks of whole 32-bit words: read as words where aligned
# The word form is built and tested (bit for bit the byte form's values, every launch shape, and
# compiled for sm_90) but not yet timed on a GPU: off until `benchmarks/matvec_bench.py`'s gate/up
# table (both forms in one call) shows it faster; then True, through the GPU gate.
WORDS = False


def available() -> bool:
    return triton is not None


def _check(raw: torch.Tensor, qtype: T, shape: tuple[int, ...], x: torch.Tensor, experts: torch.Tensor,
           expert_stride: int | None, rows_per_x: int) -> tuple[int, int]:
    """(row bytes, expert stride) of a stored [E, N, K] expert tensor, or ValueError naming what
    does not fit."""
    if qtype not in _TABLE:
        raise ValueError(f"no stored-block matrix-vector kernel for {T(qtype).name}")
    E, N, K = shape
    bs, ts = GGML_QUANT_SIZES[qtype]
    if K % 256 and qtype != T.Q8_0 or K % bs:
        raise ValueError(f"a {T(qtype).name} row of {K} values is not whole 256-value steps")
    M = experts.shape[0] if experts.dim() == 1 else -1
    if (rows_per_x < 1 or x.shape != (M // rows_per_x, K) or M % rows_per_x or experts.shape != (M,)
            or experts.dtype != torch.int64):
        raise ValueError(f"x {list(x.shape)} and experts {list(experts.shape)} do not match "
                         f"[{M} / {rows_per_x}, {K}] / [{M}] int64")
    row_bytes = K // bs * ts
    stride = N * row_bytes if expert_stride is None else expert_stride
    if (raw.numel() != E * N * row_bytes if expert_stride is None
            else stride < N * row_bytes or raw.numel() < (E - 1) * stride + N * row_bytes):
        raise ValueError(f"{raw.numel()} bytes are not a {T(qtype).name} tensor of {list(shape)}")
    return row_bytes, stride


def _launch(kernel: Any, weights: tuple[torch.Tensor, ...], qtype: T, shape: tuple[int, ...], x: torch.Tensor,
            experts: torch.Tensor, out: torch.Tensor | None, row_bytes: int, stride: int,
            rows_per_x: int) -> torch.Tensor:
    M, (_, N, K) = experts.shape[0], shape
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    bn, warps, bk = _TABLE[qtype]
    grid = (M, triton.cdiv(N, bn))
    # K is a constexpr (the loop's trip count): one compile per row length of the model
    args = (*(w.reshape(-1) for w in weights), x.contiguous(), experts.contiguous(), out, N, K, row_bytes, stride)
    words = (WORDS and qtype in WORD_TYPES and row_bytes % 4 == 0 and stride % 4 == 0
             and all(w.data_ptr() % 4 == 0 for w in weights))
    consts = dict(XDIV=rows_per_x, TYPE=int(qtype), BN=bn, BK=bk, WORDS=words, num_warps=warps,
                  enable_fp_fusion=False)
    raw = weights[0]
    if raw.is_cuda and raw.device.index is not None and raw.device.index != torch.cuda.current_device():
        with torch.cuda.device(raw.device):
            kernel[grid](*args, **consts)
    else:
        kernel[grid](*args, **consts)
    return out


def matvec(raw: torch.Tensor, qtype: T, shape: tuple[int, ...], x: torch.Tensor, experts: torch.Tensor,
           out: torch.Tensor | None = None, expert_stride: int | None = None, rows_per_x: int = 1) -> torch.Tensor:
    """`out[m] = W[experts[m]] @ x[m // rows_per_x]` for a stored [E, N, K] expert tensor (`raw`:
    its bytes, uint8, contiguous), activations x [M / rows_per_x, K] and a 1-D int64 expert index
    of M entries on x's device (each in [0, E): not checked, a check would synchronise the host).
    Returns [M, N] in x's dtype.  No host synchronisation: a CUDA graph can hold it.
    `expert_stride`: bytes from one expert's first block to the next's where they are not packed
    (the expert cache's slots: `raw` then starts at the part's first byte and runs to the pool's
    end).  `rows_per_x`: consecutive rows sharing one row of x (a token's k routed slots read the
    token's activations in place, with no expanded copy)."""
    row_bytes, stride = _check(raw, qtype, shape, x, experts, expert_stride, rows_per_x)
    return _launch(_mv, (raw,), qtype, shape, x, experts, out, row_bytes, stride, rows_per_x)


def gate_up(gate: torch.Tensor, up: torch.Tensor, qtype: T, shape: tuple[int, ...], x: torch.Tensor,
            experts: torch.Tensor, expert_stride: int | None = None, rows_per_x: int = 1) -> torch.Tensor:
    """`silu(G[e] @ x) * (U[e] @ x)` for e = experts[m], x = x[m // rows_per_x]: the SiLU-gated
    half of an expert FFN in one launch, from two stored [E, N, K] tensors of one type and shape
    (`gate`, `up`: their bytes, as `matvec` takes them, `expert_stride` apart where not packed).
    The same values as `F.silu(matvec(gate, ...)) * matvec(up, ...)` up to the ulp of the exponential."""
    row_bytes, stride = _check(gate, qtype, shape, x, experts, expert_stride, rows_per_x)
    _check(up, qtype, shape, x, experts, expert_stride, rows_per_x)
    return _launch(_mv_gate_up, (gate, up), qtype, shape, x, experts, None, row_bytes, stride, rows_per_x)
