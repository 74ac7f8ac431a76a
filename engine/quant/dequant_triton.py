"""GGUF blocks expanded to float in a single GPU pass (Triton): one launch per tensor.

The torch dequantiser (`engine.quant.dequant`) makes ~15-25 passes per step with float32 temporaries
of ~16 bytes per value; at prefill sizes that made Q4_K_M experts slower than bf16 ones.  Here
each program expands a few whole blocks: it reads their bytes once and writes their values once,
in the output dtype, in torch order (block b's values at [b*bs, (b+1)*bs) of the flat output).

Numerics are `engine.quant.dequant`'s, bit for bit: float32 arithmetic in ggml's order (the per-block
scale products first, then the per-value product, then the min's subtraction or addition), one
rounding per operation, and no fused multiply-add: every launch passes enable_fp_fusion=False
(Triton would otherwise contract `dl * q - ml` into one FMA, which rounds once and differs from
gguf).  A lower precision output is one round-to-nearest-even cast of the exact float32 value.

The lattice / 4-bit-float types gather their code books (gguf's grids, sign table, e2m1 values,
e8m0 scales) from engine.quant.dequant's float32 device tables, passed to the kernel as pointers
(CODE_BOOKS names them): the torch path's own tables, so both read the same numbers.

Importing this module imports triton (where it is installed); `engine.quant.dequant` imports it only
when a CUDA tensor is expanded.  STRATA_DEQUANT=torch keeps the torch path (A/B measurement).
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from engine import settings_table
from engine.kernels.triton_import import load
from engine.quant.code_books import code_book

log = logging.getLogger(__name__)

ENV = settings_table.row("dequant").env  # "torch": never the Triton kernels
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NUM_WARPS = 4


def _probe() -> None:
    """What engine.kernels.triton_import jits to learn whether this module's kernels can be defined."""


triton, tl, UNAVAILABLE = load(_probe)  # not a dependency (the cuda extra): the torch path serves


if triton is not None:
    # ---------------------------------------------------------------- shared pieces
    # A program expands R whole blocks as an [R, S, L] tile: value j = s*L + i of a block, where
    # the L values of a sub-block s share one scale and read L consecutive bytes, so the bytes
    # load in wide vectors and each scale is decoded once per sub-block, not once per value.
    @triton.jit
    def _blocks(rows, n_blocks, bpr, row_stride, TS: tl.constexpr, R: tl.constexpr, GATHER: tl.constexpr):
        """This program's R blocks: index, byte offset and mask, each [R, 1, 1].  Blocks lie in
        rows of `bpr` blocks, `row_stride` bytes apart; with GATHER, output row r reads source
        row rows[r] (an int64 index on the device: the expert cache's slots, read in place)."""
        blk = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R).to(tl.int64)
        row = blk // bpr
        rmask = blk < n_blocks
        if GATHER:
            src_row = tl.load(rows + row, mask=rmask, other=0)
        else:
            src_row = row
        base = src_row * row_stride + (blk - row * bpr) * TS
        return blk[:, None, None], base[:, None, None], rmask[:, None, None]

    @triton.jit
    def _tile(S: tl.constexpr, L: tl.constexpr):
        """Sub-block index s [1, S, 1] and value-in-sub-block i [1, 1, L]."""
        return tl.arange(0, S)[None, :, None], tl.arange(0, L)[None, None, :]

    @triton.jit
    def _u8(src, off, mask):
        """Bytes at src + off as int32 (0..255)."""
        return tl.load(src + off, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _i8(src, off, mask):
        """Bytes at src + off read as int8, as int32 (-128..127)."""
        return (_u8(src, off, mask) ^ 128) - 128

    @triton.jit
    def _f16(src, off, mask):
        """A little-endian half at src + off as float32 (exact)."""
        bits = _u8(src, off, mask) | (_u8(src, off + 1, mask) << 8)
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _bf16(v):
        """float32 -> bfloat16, round to nearest even (torch's cast), NaN -> a quiet NaN, in
        integer arithmetic: the same bits compiled or interpreted (the interpreter's own cast
        truncates)."""
        b = v.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    # compiled, the hardware's float32 -> bfloat16 conversion (round to nearest even, one
    # instruction per two values) gives torch's bits; the interpreter's would truncate
    _HW_CAST = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on"))

    @triton.jit
    def _store(out, blk, s, i, v, mask, QK: tl.constexpr, L: tl.constexpr):
        off = blk * QK + s * L + i
        if out.dtype.element_ty == tl.bfloat16:
            if _HW_CAST:
                tl.store(out + off, v.to(tl.bfloat16), mask=mask)
            else:
                tl.store(out + off, _bf16(v), mask=mask)
        else:
            tl.store(out + off, v.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _iq4(idx):
        """ggml's kvalues_iq4nl[idx] (idx 0..15) without a table in memory: four int32 words of
        four bytes each hold |value| (the first eight values are negative)."""
        g = idx >> 2
        word = tl.where(g == 0, 0x4153687F, tl.where(g == 1, 0x0A162331,
                        tl.where(g == 2, 0x26190D01, 0x71594535)))
        mag = (word >> ((idx & 3) * 8)) & 255
        return tl.where(idx < 8, -mag, mag)

    @triton.jit
    def _nibbles(src, base, s, i, mask, OFF: tl.constexpr):
        """Legacy 32-value blocks as [2, 16]: the 16 bytes at OFF hold values 0-15 in their low
        nibbles (s = 0) and 16-31 in their high ones (s = 1)."""
        return (_u8(src, base + OFF + i, mask) >> (s * 4)) & 15

    @triton.jit
    def _qh_bit(src, base, s, i, mask, OFF: tl.constexpr):
        """Bit j = 16s + i of the little-endian u32 at OFF (Q5_0, Q5_1)."""
        return (_u8(src, base + OFF + s * 2 + (i >> 3), mask) >> (i & 7)) & 1

    @triton.jit
    def _k_scale_min(src, base, s, mask):
        """The 6-bit scale and min of sub-block s (0..7) packed in the 12 bytes at offset 4
        (Q4_K, Q5_K)."""
        lo = s < 4
        s4 = s & 3
        a = _u8(src, base + 4 + s4, mask)
        b = _u8(src, base + 8 + s4, mask)
        c = _u8(src, base + 12 + s4, mask)
        sc = tl.where(lo, a & 63, (c & 15) | ((a >> 2) & 48))
        m = tl.where(lo, b & 63, (c >> 4) | ((b >> 2) & 48))
        return sc, m

    # ---------------------------------------------------------- legacy 32-value blocks: [R, 2, 16]
    @triton.jit
    def _q8_0(src, out, rows, n_blocks, bpr, row_stride, R: tl.constexpr, GATHER: tl.constexpr):
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 34, R, GATHER)  # d f16 | 32 int8
        s, i = _tile(2, 16)
        d = _f16(src, base, rm)
        q = _i8(src, base + 2 + s * 16 + i, rm).to(tl.float32)
        _store(out, blk, s, i, q * d, rm, 32, 16)

    @triton.jit
    def _q4_0(src, out, rows, n_blocks, bpr, row_stride, R: tl.constexpr, GATHER: tl.constexpr):
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 18, R, GATHER)  # d | 16 bytes
        s, i = _tile(2, 16)
        d = _f16(src, base, rm)
        q = (_nibbles(src, base, s, i, rm, 2) - 8).to(tl.float32)
        _store(out, blk, s, i, d * q, rm, 32, 16)

    @triton.jit
    def _q4_1(src, out, rows, n_blocks, bpr, row_stride, R: tl.constexpr, GATHER: tl.constexpr):
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 20, R, GATHER)  # d | m | 16 bytes
        s, i = _tile(2, 16)
        d = _f16(src, base, rm)
        m = _f16(src, base + 2, rm)
        q = _nibbles(src, base, s, i, rm, 4).to(tl.float32)
        p = d * q
        _store(out, blk, s, i, p + m, rm, 32, 16)

    @triton.jit
    def _q5_0(src, out, rows, n_blocks, bpr, row_stride, R: tl.constexpr, GATHER: tl.constexpr):
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 22, R, GATHER)  # d | qh u32 | 16 bytes
        s, i = _tile(2, 16)
        d = _f16(src, base, rm)
        q = ((_nibbles(src, base, s, i, rm, 6) | (_qh_bit(src, base, s, i, rm, 2) << 4)) - 16).to(tl.float32)
        _store(out, blk, s, i, d * q, rm, 32, 16)

    @triton.jit
    def _q5_1(src, out, rows, n_blocks, bpr, row_stride, R: tl.constexpr, GATHER: tl.constexpr):
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 24, R, GATHER)  # d | m | qh u32 | 16 bytes
        s, i = _tile(2, 16)
        d = _f16(src, base, rm)
        m = _f16(src, base + 2, rm)
        q = (_nibbles(src, base, s, i, rm, 8) | (_qh_bit(src, base, s, i, rm, 4) << 4)).to(tl.float32)
        p = d * q
        _store(out, blk, s, i, p + m, rm, 32, 16)

    @triton.jit
    def _iq4_nl(src, out, rows, n_blocks, bpr, row_stride, R: tl.constexpr, GATHER: tl.constexpr):
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 18, R, GATHER)  # d | 16 bytes of codes
        s, i = _tile(2, 16)
        d = _f16(src, base, rm)
        q = _iq4(_nibbles(src, base, s, i, rm, 2)).to(tl.float32)
        _store(out, blk, s, i, d * q, rm, 32, 16)

    # -------------------------------------------- K-quants (256 values): [R, 8, 32] or [R, 16, 16]
    @triton.jit
    def _q4_k(src, out, rows, n_blocks, bpr, row_stride, R: tl.constexpr, GATHER: tl.constexpr):
        # d | dmin | scales[12] | qs[128]: 32 bytes per 64 values, low nibbles then high
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 144, R, GATHER)
        s, i = _tile(8, 32)
        d = _f16(src, base, rm)
        dmin = _f16(src, base + 2, rm)
        sc, m = _k_scale_min(src, base, s, rm)
        dl = d * sc.to(tl.float32)
        ml = dmin * m.to(tl.float32)
        b = _u8(src, base + 16 + (s >> 1) * 32 + i, rm)
        q = ((b >> ((s & 1) * 4)) & 15).to(tl.float32)
        p = dl * q
        _store(out, blk, s, i, p - ml, rm, 256, 32)

    @triton.jit
    def _q5_k(src, out, rows, n_blocks, bpr, row_stride, R: tl.constexpr, GATHER: tl.constexpr):
        # d | dmin | scales[12] | qh[32] (bit s of byte i -> value 32s+i) | qs[128]
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 176, R, GATHER)
        s, i = _tile(8, 32)
        d = _f16(src, base, rm)
        dmin = _f16(src, base + 2, rm)
        sc, m = _k_scale_min(src, base, s, rm)
        dl = d * sc.to(tl.float32)
        ml = dmin * m.to(tl.float32)
        lo = (_u8(src, base + 48 + (s >> 1) * 32 + i, rm) >> ((s & 1) * 4)) & 15
        h = (_u8(src, base + 16 + i, rm) >> s) & 1
        q = (lo | (h << 4)).to(tl.float32)
        p = dl * q
        _store(out, blk, s, i, p - ml, rm, 256, 32)

    @triton.jit
    def _q6_k(src, out, rows, n_blocks, bpr, row_stride, R: tl.constexpr, GATHER: tl.constexpr):
        # ql[128] (64 bytes per 128 values, low then high nibbles) | qh[64] (2 bits) | scales[16] int8 | d
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 210, R, GATHER)
        s, i = _tile(16, 16)
        d = _f16(src, base + 208, rm)
        ql = (_u8(src, base + (s >> 3) * 64 + (s & 3) * 16 + i, rm) >> (((s >> 2) & 1) * 4)) & 15
        qh = (_u8(src, base + 128 + (s >> 3) * 32 + (s & 1) * 16 + i, rm) >> (((s >> 1) & 3) * 2)) & 3
        q = ((ql | (qh << 4)) - 32).to(tl.float32)
        dl = d * _i8(src, base + 192 + s, rm).to(tl.float32)
        _store(out, blk, s, i, dl * q, rm, 256, 16)

    @triton.jit
    def _q2_k(src, out, rows, n_blocks, bpr, row_stride, R: tl.constexpr, GATHER: tl.constexpr):
        # scales[16] (4-bit scale | 4-bit min) | qs[64] (2-bit, 32 bytes per 128 values) | d | dmin
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 84, R, GATHER)
        s, i = _tile(16, 16)
        d = _f16(src, base + 80, rm)
        dmin = _f16(src, base + 82, rm)
        sb = _u8(src, base + s, rm)
        dl = d * (sb & 15).to(tl.float32)
        ml = dmin * (sb >> 4).to(tl.float32)
        q = (_u8(src, base + 16 + (s >> 3) * 32 + (s & 1) * 16 + i, rm) >> (((s >> 1) & 3) * 2)) & 3
        p = dl * q.to(tl.float32)
        _store(out, blk, s, i, p - ml, rm, 256, 16)

    @triton.jit
    def _q3_k(src, out, rows, n_blocks, bpr, row_stride, R: tl.constexpr, GATHER: tl.constexpr):
        # hmask[32] | qs[64] (2 low bits) | scales[12] (16 6-bit scales) | d
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 110, R, GATHER)
        s, i = _tile(16, 16)
        d = _f16(src, base + 108, rm)
        low = (_u8(src, base + 96 + (s & 7), rm) >> ((s >> 3) * 4)) & 15
        high = (_u8(src, base + 104 + (s & 3), rm) >> ((s >> 2) * 2)) & 3
        dl = d * ((low | (high << 4)) - 32).to(tl.float32)
        ql = (_u8(src, base + 32 + (s >> 3) * 32 + (s & 1) * 16 + i, rm) >> (((s >> 1) & 3) * 2)) & 3
        h = (_u8(src, base + (s & 1) * 16 + i, rm) >> (s >> 1)) & 1
        q = (ql - ((h ^ 1) << 2)).to(tl.float32)
        _store(out, blk, s, i, dl * q, rm, 256, 16)

    @triton.jit
    def _iq4_xs(src, out, rows, n_blocks, bpr, row_stride, R: tl.constexpr, GATHER: tl.constexpr):
        # d | scales_h u16 (2 bits per 32 values) | scales_l[4] (nibbles) | qs[128] (16 bytes per 32 values)
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 136, R, GATHER)
        s, i = _tile(16, 16)
        d = _f16(src, base, rm)
        g = s >> 1  # the 32-value group whose scale this is
        sh = (_u8(src, base + 2 + (g >> 2), rm) >> ((g & 3) * 2)) & 3
        sl = (_u8(src, base + 4 + (g >> 1), rm) >> ((g & 1) * 4)) & 15
        dl = d * ((sl | (sh << 4)) - 32).to(tl.float32)
        q = _iq4((_u8(src, base + 8 + g * 16 + i, rm) >> ((s & 1) * 4)) & 15).to(tl.float32)
        _store(out, blk, s, i, dl * q, rm, 256, 16)

    # ----------------------- lattice (IQ3/IQ2/IQ1), 4-bit-float and ternary types: code books in memory
    # The IQ2/IQ3 kernels tile a block as [R, S, K, C]: sub-block s, grid point k within it, value c
    # of the point.  Each point's code-book word (its values packed as bytes, code_books' `*_packed`)
    # is read once per point and taken apart in registers, and the ksigns sign of a value is
    # computed from its 7-bit index (the 7 bits, then their parity: ksigns_iq2xs[i] = i | parity << 7)
    # instead of gathered per value.  The other code books (IQ1, MXFP4, NVFP4) are float32 tables
    # gathered per value.
    @triton.jit
    def _blocks4(rows, n_blocks, bpr, row_stride, TS: tl.constexpr, R: tl.constexpr, GATHER: tl.constexpr):
        """`_blocks` as [R, 1, 1, 1]."""
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, TS, R, GATHER)
        return blk[:, :, :, None], base[:, :, :, None], rm[:, :, :, None]

    @triton.jit
    def _tile4(S: tl.constexpr, K: tl.constexpr, C: tl.constexpr):
        """Sub-block s [1, S, 1, 1], point k [1, 1, K, 1], value of the point c [1, 1, 1, C]."""
        return (tl.arange(0, S)[None, :, None, None], tl.arange(0, K)[None, None, :, None],
                tl.arange(0, C)[None, None, None, :])

    @triton.jit
    def _point(book, idx, c, mask, WORDS: tl.constexpr):
        """Value c of code-book point idx (WORDS int32 words of four byte values a point), float32."""
        w0 = tl.load(book + idx * WORDS, mask=mask, other=0)
        if WORDS == 2:
            w1 = tl.load(book + idx * WORDS + 1, mask=mask, other=0)
            w0 = tl.where(c < 4, w0, w1)
        return ((w0 >> ((c & 3) * 8)) & 255).to(tl.float32)

    @triton.jit
    def _ksign(idx7, j):
        """+1.0 or -1.0: bit j (0..7) of ggml's ksigns_iq2xs[idx7]."""
        par = idx7 ^ (idx7 >> 4)
        par = par ^ (par >> 2)
        par = (par ^ (par >> 1)) & 1
        bit = tl.where(j == 7, par, (idx7 >> j) & 1)
        return 1.0 - 2.0 * bit.to(tl.float32)

    @triton.jit
    def _row(tab, idx, col, mask, W: tl.constexpr):
        """tab[idx, col] of a float32 [points, W] code book."""
        return tl.load(tab + idx * W + col, mask=mask, other=0.0)

    @triton.jit
    def _aux_u32(src, a, mask):
        """The little-endian u32 at src + a as int32 bits (IQ2_XXS, IQ3_XXS sign words)."""
        return _u8(src, a, mask) | (_u8(src, a + 1, mask) << 8) | (_u8(src, a + 2, mask) << 16) | (_u8(src, a + 3, mask) << 24)

    @triton.jit
    def _iq3_xxs(src, out, rows, n_blocks, bpr, row_stride, grid,
                 R: tl.constexpr, GATHER: tl.constexpr):
        # d | qs[64] (one grid byte per 4 values) | 8 x u32 (four 7-bit sign indices | 4-bit scale)
        blk, base, rm = _blocks4(rows, n_blocks, bpr, row_stride, 98, R, GATHER)
        s, k, c = _tile4(8, 8, 4)
        d = _f16(src, base, rm)
        a = base + 66 + s * 4
        aux = _aux_u32(src, a, rm)
        dl = d * (0.5 + (_u8(src, a + 3, rm) >> 4).to(tl.float32))
        db = dl * 0.5
        g = _point(grid, _u8(src, base + 2 + s * 8 + k, rm), c, rm, 1)
        sg = _ksign((aux >> ((k >> 1) * 7)) & 127, (k & 1) * 4 + c)
        p = db * g
        _store(out, blk, s, k * 4 + c, p * sg, rm, 256, 32)

    @triton.jit
    def _iq3_s(src, out, rows, n_blocks, bpr, row_stride, grid,
               R: tl.constexpr, GATHER: tl.constexpr):
        # d | qs[64] (grid index low 8 bits) | qh[8] (ninth bits) | signs[32] (one bit a value) | scales[4]
        blk, base, rm = _blocks4(rows, n_blocks, bpr, row_stride, 110, R, GATHER)
        s, k, c = _tile4(8, 8, 4)
        d = _f16(src, base, rm)
        sc = (_u8(src, base + 106 + (s >> 1), rm) >> ((s & 1) * 4)) & 15
        db = d * (1 + 2 * sc).to(tl.float32)
        idx = _u8(src, base + 2 + s * 8 + k, rm) | (((_u8(src, base + 66 + s, rm) >> k) & 1) << 8)
        g = _point(grid, idx, c, rm, 1)
        bit = (_u8(src, base + 74 + s * 4 + (k >> 1), rm) >> ((k & 1) * 4 + c)) & 1
        sg = 1.0 - 2.0 * bit.to(tl.float32)
        p = db * g
        _store(out, blk, s, k * 4 + c, p * sg, rm, 256, 32)

    @triton.jit
    def _mxfp4(src, out, rows, n_blocks, bpr, row_stride, e8m0_half, e2m1,
               R: tl.constexpr, GATHER: tl.constexpr):
        # e8m0 scale byte | 16 bytes of e2m1 nibbles (values 0-15 low, 16-31 high)
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 17, R, GATHER)
        s, i = _tile(2, 16)
        d = tl.load(e8m0_half + _u8(src, base, rm), mask=rm, other=0.0)
        q = tl.load(e2m1 + _nibbles(src, base, s, i, rm, 1), mask=rm, other=0.0)
        _store(out, blk, s, i, d * q, rm, 32, 16)

    @triton.jit
    def _iq2_xxs(src, out, rows, n_blocks, bpr, row_stride, grid,
                 R: tl.constexpr, GATHER: tl.constexpr):
        # d | 8 x (4 grid bytes, one per 8 values | u32: four 7-bit sign indices, 4-bit scale on top)
        blk, base, rm = _blocks4(rows, n_blocks, bpr, row_stride, 66, R, GATHER)
        s, k, c = _tile4(8, 4, 8)
        d = _f16(src, base, rm)
        a = base + 2 + s * 8
        aux = _aux_u32(src, a + 4, rm)
        dl = d * (0.5 + (_u8(src, a + 7, rm) >> 4).to(tl.float32))
        db = dl * 0.25
        g = _point(grid, _u8(src, a + k, rm), c, rm, 2)
        sg = _ksign((aux >> (k * 7)) & 127, c)
        p = db * g
        _store(out, blk, s, k * 8 + c, p * sg, rm, 256, 32)

    @triton.jit
    def _iq2_xs(src, out, rows, n_blocks, bpr, row_stride, grid,
                R: tl.constexpr, GATHER: tl.constexpr):
        # d | qs[32] u16 (9-bit grid index | 7-bit sign index, 8 values each) | scales[8] (4-bit per 16 values)
        blk, base, rm = _blocks4(rows, n_blocks, bpr, row_stride, 74, R, GATHER)
        s, k, c = _tile4(16, 2, 8)
        d = _f16(src, base, rm)
        sc = (_u8(src, base + 66 + (s >> 1), rm) >> ((s & 1) * 4)) & 15
        dl = d * (0.5 + sc.to(tl.float32))
        db = dl * 0.25
        a = base + 2 + (s * 2 + k) * 2
        q = _u8(src, a, rm) | (_u8(src, a + 1, rm) << 8)
        g = _point(grid, q & 511, c, rm, 2)
        sg = _ksign(q >> 9, c)
        p = db * g
        _store(out, blk, s, k * 8 + c, p * sg, rm, 256, 16)

    @triton.jit
    def _iq2_s(src, out, rows, n_blocks, bpr, row_stride, grid,
               R: tl.constexpr, GATHER: tl.constexpr):
        # d | qs[32] (grid index low 8 bits) | signs[32] (one bit a value) | qh[8] (2 high bits each) | scales[8]
        blk, base, rm = _blocks4(rows, n_blocks, bpr, row_stride, 82, R, GATHER)
        s, k, c = _tile4(16, 2, 8)
        d = _f16(src, base, rm)
        sc = (_u8(src, base + 74 + (s >> 1), rm) >> ((s & 1) * 4)) & 15
        dl = d * (0.5 + sc.to(tl.float32))
        db = dl * 0.25
        kk = s * 2 + k  # the grid point of these 8 values in the block
        hi = (_u8(src, base + 66 + (kk >> 2), rm) >> ((kk & 3) * 2)) & 3
        g = _point(grid, _u8(src, base + 2 + kk, rm) | (hi << 8), c, rm, 2)
        bit = (_u8(src, base + 34 + kk, rm) >> c) & 1
        sg = 1.0 - 2.0 * bit.to(tl.float32)
        p = db * g
        _store(out, blk, s, k * 8 + c, p * sg, rm, 256, 16)

    @triton.jit
    def _iq1_s(src, out, rows, n_blocks, bpr, row_stride, grid, delta,
               R: tl.constexpr, GATHER: tl.constexpr):
        # d | qs[32] (grid index low 8 bits) | qh[8] u16 (3 high bits x4 | 3-bit scale | delta sign)
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 50, R, GATHER)
        s, i = _tile(8, 32)
        d = _f16(src, base, rm)
        qh = _u8(src, base + 34 + s * 2, rm) | (_u8(src, base + 35 + s * 2, rm) << 8)
        dl = d * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
        dt = tl.load(delta + (qh >> 15), mask=rm, other=0.0)  # [+delta, -delta]
        k = i >> 3
        idx = _u8(src, base + 2 + s * 4 + k, rm) | (((qh >> (k * 3)) & 7) << 8)
        g = _row(grid, idx, i & 7, rm, 8)
        _store(out, blk, s, i, dl * (g + dt), rm, 256, 32)

    @triton.jit
    def _iq1_m(src, out, rows, n_blocks, bpr, row_stride, grid, delta,
               R: tl.constexpr, GATHER: tl.constexpr):
        # qs[32] | qh[16] (a nibble per 8 values: 3 high index bits | delta sign) | 4 x u16: four
        # 3-bit sub-scales each (one per 16 values), the block's f16 scale in their top nibbles
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 56, R, GATHER)
        s, i = _tile(16, 16)
        dbits = ((_u8(src, base + 49, rm) >> 4) | ((_u8(src, base + 51, rm) >> 4) << 4)
                 | ((_u8(src, base + 53, rm) >> 4) << 8) | ((_u8(src, base + 55, rm) >> 4) << 12))
        d = dbits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        a = base + 48 + (s >> 2) * 2
        sc = _u8(src, a, rm) | (_u8(src, a + 1, rm) << 8)
        dl = d * (2 * ((sc >> ((s & 3) * 3)) & 7) + 1).to(tl.float32)
        k = s * 2 + (i >> 3)  # the grid point of these 8 values
        nib = (_u8(src, base + 32 + (k >> 1), rm) >> ((k & 1) * 4)) & 15
        dt = tl.load(delta + (nib >> 3), mask=rm, other=0.0)
        g = _row(grid, _u8(src, base + k, rm) | ((nib & 7) << 8), i & 7, rm, 8)
        _store(out, blk, s, i, dl * (g + dt), rm, 256, 16)

    @triton.jit
    def _nvfp4(src, out, rows, n_blocks, bpr, row_stride, ue4m3, e2m1,
               R: tl.constexpr, GATHER: tl.constexpr):
        # 4 ue4m3 scales (one per 16 values) | 4 x 8 bytes of e2m1 nibbles (8 low, then 8 high)
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 36, R, GATHER)
        s, i = _tile(4, 16)
        d = tl.load(ue4m3 + _u8(src, base + s, rm), mask=rm, other=0.0)
        q = tl.load(e2m1 + ((_u8(src, base + 4 + s * 8 + (i & 7), rm) >> ((i >> 3) * 4)) & 15), mask=rm, other=0.0)
        _store(out, blk, s, i, d * q, rm, 64, 16)

    @triton.jit
    def _tq2_0(src, out, rows, n_blocks, bpr, row_stride, R: tl.constexpr, GATHER: tl.constexpr):
        # qs[64] (2-bit digits: 32 bytes per 128 values, 4 shifts) | d
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 66, R, GATHER)
        s, i = _tile(8, 32)
        d = _f16(src, base + 64, rm)
        q = ((_u8(src, base + (s >> 2) * 32 + i, rm) >> ((s & 3) * 2)) & 3) - 1
        _store(out, blk, s, i, d * q.to(tl.float32), rm, 256, 32)

    @triton.jit
    def _tq1_0(src, out, rows, n_blocks, bpr, row_stride, R: tl.constexpr, GATHER: tl.constexpr):
        # qs[48] (5 base-3 digits per byte, as a fraction of 256) | qh[4] (4 digits each) | d, as
        # [16, 16]: values 0-159 digit m = s//2 of bytes 0-31, 160-239 digit s-10 of bytes 32-47,
        # 240-255 digit i//4 of bytes 48-51
        blk, base, rm = _blocks(rows, n_blocks, bpr, row_stride, 54, R, GATHER)
        s, i = _tile(16, 16)
        d = _f16(src, base + 52, rm)
        b = tl.where(s < 10, (s & 1) * 16 + i, tl.where(s < 15, 32 + i, 48 + (i & 3)))
        m = tl.where(s < 10, s >> 1, tl.where(s < 15, s - 10, i >> 2))
        p3 = tl.full(m.shape, 1, tl.int32)  # 3 ** m
        for k in tl.static_range(4):
            p3 = tl.where(m > k, p3 * 3, p3)
        q = ((((_u8(src, base + b, rm) * p3) & 255) * 3) >> 8) - 1
        _store(out, blk, s, i, d * q.to(tl.float32), rm, 256, 16)

    # type -> (kernel, blocks per program, warps): ~2K values a program for the 32-value types,
    # 4K-8K for K-quants, the fastest measured on an H200 (benchmarks/dequant_bench.py --launch).
    # The lattice kernels (IQ1/IQ2/IQ3) are fastest at 1-4 blocks a program on 1-2 warps.  With
    # packed code-book words and computed signs (session 9): IQ3_XXS 1.15 -> 0.72 ms a layer,
    # IQ3_S 0.90 -> 0.72 (2:1), IQ2_XXS 1.23 -> 0.60, IQ2_XS -> 0.45, IQ2_S 1.41 -> 0.45 (4:2);
    # IQ1_M 1.43 (1:1, before); IQ1_S takes its sibling's shape unmeasured, NVFP4 and TQ the old
    # ones (docs/benchmarks.md, "The lattice kernels' code books")
    _TABLE: dict[T, tuple[Any, int, int]] = {
        T.Q8_0: (_q8_0, 64, NUM_WARPS), T.Q4_0: (_q4_0, 64, NUM_WARPS), T.Q4_1: (_q4_1, 64, NUM_WARPS),
        T.Q5_0: (_q5_0, 64, NUM_WARPS), T.Q5_1: (_q5_1, 64, NUM_WARPS), T.IQ4_NL: (_iq4_nl, 64, NUM_WARPS),
        T.Q4_K: (_q4_k, 16, NUM_WARPS), T.Q5_K: (_q5_k, 32, NUM_WARPS), T.Q6_K: (_q6_k, 16, NUM_WARPS),
        T.Q2_K: (_q2_k, 16, NUM_WARPS), T.Q3_K: (_q3_k, 16, NUM_WARPS), T.IQ4_XS: (_iq4_xs, 32, NUM_WARPS),
        T.IQ3_XXS: (_iq3_xxs, 2, 1), T.IQ3_S: (_iq3_s, 2, 1), T.MXFP4: (_mxfp4, 64, NUM_WARPS),
        T.IQ2_XXS: (_iq2_xxs, 4, 2), T.IQ2_XS: (_iq2_xs, 4, 2), T.IQ2_S: (_iq2_s, 4, 2),
        T.IQ1_S: (_iq1_s, 2, 1), T.IQ1_M: (_iq1_m, 1, 1), T.NVFP4: (_nvfp4, 32, NUM_WARPS),
        T.TQ2_0: (_tq2_0, 16, NUM_WARPS), T.TQ1_0: (_tq1_0, 16, NUM_WARPS),
    }
else:
    _TABLE = {}

# the code books a type's kernel takes after its row stride, by engine.quant.code_books' names
CODE_BOOKS: dict[T, tuple[str, ...]] = {
    T.IQ3_XXS: ("IQ3_XXS_packed",), T.IQ3_S: ("IQ3_S_packed",), T.MXFP4: ("e8m0_half", "e2m1"),
    T.IQ2_XXS: ("IQ2_XXS_packed",), T.IQ2_XS: ("IQ2_XS_packed",), T.IQ2_S: ("IQ2_S_packed",),
    T.IQ1_S: ("IQ1_S", "iq1_delta"), T.IQ1_M: ("IQ1_S", "iq1_delta"), T.NVFP4: ("ue4m3", "e2m1"),
}

TYPES: frozenset[T] = frozenset(_TABLE)


@functools.cache
def _kernels() -> dict[T, tuple[Any, int, int]] | None:
    """The kernels by type, or None where the torch path must serve (logged once)."""
    if settings_table.env_text("dequant").lower() == "torch":
        log.info("GGUF dequantiser: torch (%s=torch)", ENV)
        return None
    if triton is None:
        log.info("GGUF dequantiser: torch (%s)", UNAVAILABLE)
        return None
    log.info("GGUF dequantiser: Triton %s for %s; torch for the other types", triton.__version__,
             ", ".join(sorted(t.name for t in _TABLE)))
    return _TABLE


def status() -> tuple[str, str]:
    """("Triton <version>", "") where the kernels serve CUDA tensors, else ("torch", why)."""
    if _kernels() is None:
        return "torch", f"{ENV}=torch" if triton is not None else UNAVAILABLE
    return f"Triton {triton.__version__}", ""


def handles(qtype: T, dtype: torch.dtype) -> bool:
    """Whether a CUDA tensor of `qtype` expands here into `dtype`."""
    ks = _kernels()
    return ks is not None and qtype in ks and dtype in OUT_DTYPES


def dequantize_into(raw: torch.Tensor, qtype: T, out: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Expand whole blocks of `qtype` from `raw` into `out` (contiguous; values in torch
    order) with one launch.  `raw` is uint8: flat, or [rows, bytes] with unit column stride
    and whole blocks per row (a strided slice of a larger buffer: no copy is made).  With
    `rows` (an int64 index on raw's device), out's row r is raw's row rows[r]: a gather read in
    place (the expert cache's slots), out then holding len(rows) rows.  Nothing here
    synchronises the host or creates a host tensor, so a CUDA graph can hold it."""
    ks = _kernels() if triton is not None else None
    if ks is None or qtype not in ks:
        raise ValueError(f"no Triton dequantiser for {T(qtype).name}")
    kernel, per_program, warps = ks[qtype]
    bs, ts = GGML_QUANT_SIZES[qtype]
    n_blocks = out.numel() // bs
    if rows is not None:
        if raw.dim() != 2 or raw.stride(1) != 1 or raw.shape[1] % ts or rows.dim() != 1:
            raise ValueError("a gather needs raw as [rows, bytes] of whole blocks and a 1-D index")
        if out.numel() % bs or n_blocks != rows.numel() * (raw.shape[1] // ts) or not out.is_contiguous():
            raise ValueError(f"{rows.numel()} rows of {raw.shape[1]} bytes do not fill a contiguous "
                             f"{list(out.shape)} of {qtype.name}")
        if rows.dtype != torch.int64 or rows.device != raw.device:
            raise ValueError(f"the row index must be int64 on {raw.device}")
    elif out.numel() % bs or raw.numel() != n_blocks * ts or not out.is_contiguous():
        raise ValueError(f"{raw.numel()} bytes do not fill a contiguous {list(out.shape)} of {qtype.name}")
    if n_blocks == 0:
        return out
    if raw.dim() == 2 and raw.stride(1) == 1 and raw.shape[1] % ts == 0:
        bpr, row_stride = raw.shape[1] // ts, raw.stride(0)
    else:
        raw = raw.reshape(-1)  # a view when contiguous
        bpr, row_stride = n_blocks, 0
    gather = rows is not None
    index = rows if gather else raw  # an unused pointer when there is no gather
    grid = (triton.cdiv(n_blocks, per_program),)
    # gguf's code books, copied to raw's device once (engine.quant.code_books keeps them per device)
    books = tuple(code_book(name, raw.device) for name in CODE_BOOKS.get(qtype, ()))
    args = (raw, out, index, n_blocks, bpr, row_stride, *books)
    opts = dict(R=per_program, GATHER=gather, num_warps=warps, enable_fp_fusion=False)
    if raw.is_cuda and raw.device.index is not None and raw.device.index != torch.cuda.current_device():
        with torch.cuda.device(raw.device):  # Triton launches on the current device
            kernel[grid](*args, **opts)
    else:
        kernel[grid](*args, **opts)
    return out
