"""GGUF blocks expanded to float in a single GPU pass (Triton): one launch per tensor.

The torch dequantiser (`engine.dequant`) makes ~15-25 passes per step with float32 temporaries
of ~16 bytes per value; at prefill sizes that made Q4_K_M experts slower than bf16 ones.  Here
each program expands a few whole blocks: it reads their bytes once and writes their values once,
in the output dtype, in torch order (block b's values at [b*bs, (b+1)*bs) of the flat output).

Numerics are `engine.dequant`'s, bit for bit: float32 arithmetic in ggml's order (the per-block
scale products first, then the per-value product, then the min's subtraction or addition), one
rounding per operation, and no fused multiply-add: every launch passes enable_fp_fusion=False
(Triton would otherwise contract `dl * q - ml` into one FMA, which rounds once and differs from
gguf).  A lower precision output is one round-to-nearest-even cast of the exact float32 value.

Importing this module imports triton (where it is installed); `engine.dequant` imports it only
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

log = logging.getLogger(__name__)

ENV = "STRATA_DEQUANT"  # "torch": never the Triton kernels
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NUM_WARPS = 4

try:
    import triton
    import triton.language as tl
except ImportError:  # not a dependency: the torch path serves
    triton = None
    tl = None


if triton is not None:
    # ---------------------------------------------------------------- shared pieces
    @triton.jit
    def _geometry(n_blocks, bpr, row_stride, TS: tl.constexpr, QK: tl.constexpr, R: tl.constexpr):
        """This program's R blocks: their index [R, 1], byte offset [R, 1] (blocks lie in rows
        of `bpr` blocks, `row_stride` bytes apart), the value index j [1, QK] and the masks."""
        blk = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R).to(tl.int64)
        row = blk // bpr
        base = row * row_stride + (blk - row * bpr) * TS
        j = tl.arange(0, QK)
        rmask = blk < n_blocks
        mask = rmask[:, None] & (j < QK)[None, :]
        return blk[:, None], base[:, None], j[None, :], rmask[:, None], mask

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

    @triton.jit
    def _store(out, blk, j, v, mask, QK: tl.constexpr):
        if out.dtype.element_ty == tl.bfloat16:
            tl.store(out + blk * QK + j, _bf16(v), mask=mask)
        else:
            tl.store(out + blk * QK + j, v.to(out.dtype.element_ty), mask=mask)

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
    def _nibble16(src, base, j, mask, OFF: tl.constexpr):
        """Value j of a 32-value block whose 16 bytes at OFF hold low nibbles (values 0-15),
        then high nibbles (16-31)."""
        b = _u8(src, base + OFF + (j & 15), mask)
        return (b >> ((j >> 4) * 4)) & 15

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

    # ---------------------------------------------------------- legacy 32-value blocks
    @triton.jit
    def _q8_0(src, out, n_blocks, bpr, row_stride, R: tl.constexpr):  # d f16 | 32 int8
        blk, base, j, rmask, mask = _geometry(n_blocks, bpr, row_stride, 34, 32, R)
        d = _f16(src, base, rmask)
        q = _i8(src, base + 2 + j, mask).to(tl.float32)
        _store(out, blk, j, q * d, mask, 32)

    @triton.jit
    def _q4_0(src, out, n_blocks, bpr, row_stride, R: tl.constexpr):  # d | 16 bytes of nibbles
        blk, base, j, rmask, mask = _geometry(n_blocks, bpr, row_stride, 18, 32, R)
        d = _f16(src, base, rmask)
        q = (_nibble16(src, base, j, mask, 2) - 8).to(tl.float32)
        _store(out, blk, j, d * q, mask, 32)

    @triton.jit
    def _q4_1(src, out, n_blocks, bpr, row_stride, R: tl.constexpr):  # d | m | 16 bytes
        blk, base, j, rmask, mask = _geometry(n_blocks, bpr, row_stride, 20, 32, R)
        d = _f16(src, base, rmask)
        m = _f16(src, base + 2, rmask)
        q = _nibble16(src, base, j, mask, 4).to(tl.float32)
        p = d * q
        _store(out, blk, j, p + m, mask, 32)

    @triton.jit
    def _q5_0(src, out, n_blocks, bpr, row_stride, R: tl.constexpr):  # d | qh u32 | 16 bytes
        blk, base, j, rmask, mask = _geometry(n_blocks, bpr, row_stride, 22, 32, R)
        d = _f16(src, base, rmask)
        h = (_u8(src, base + 2 + (j >> 3), mask) >> (j & 7)) & 1  # bit j of qh
        q = ((_nibble16(src, base, j, mask, 6) | (h << 4)) - 16).to(tl.float32)
        _store(out, blk, j, d * q, mask, 32)

    @triton.jit
    def _q5_1(src, out, n_blocks, bpr, row_stride, R: tl.constexpr):  # d | m | qh u32 | 16 bytes
        blk, base, j, rmask, mask = _geometry(n_blocks, bpr, row_stride, 24, 32, R)
        d = _f16(src, base, rmask)
        m = _f16(src, base + 2, rmask)
        h = (_u8(src, base + 4 + (j >> 3), mask) >> (j & 7)) & 1
        q = (_nibble16(src, base, j, mask, 8) | (h << 4)).to(tl.float32)
        p = d * q
        _store(out, blk, j, p + m, mask, 32)

    @triton.jit
    def _iq4_nl(src, out, n_blocks, bpr, row_stride, R: tl.constexpr):  # d | 16 bytes of code nibbles
        blk, base, j, rmask, mask = _geometry(n_blocks, bpr, row_stride, 18, 32, R)
        d = _f16(src, base, rmask)
        q = _iq4(_nibble16(src, base, j, mask, 2)).to(tl.float32)
        _store(out, blk, j, d * q, mask, 32)

    # ------------------------------------------------------------ K-quants (256 values)
    @triton.jit
    def _q4_k(src, out, n_blocks, bpr, row_stride, R: tl.constexpr):
        # d | dmin | scales[12] | qs[128]: 32 bytes per 64 values, low nibbles then high
        blk, base, j, rmask, mask = _geometry(n_blocks, bpr, row_stride, 144, 256, R)
        d = _f16(src, base, rmask)
        dmin = _f16(src, base + 2, rmask)
        sc, m = _k_scale_min(src, base, j >> 5, mask)
        dl = d * sc.to(tl.float32)
        ml = dmin * m.to(tl.float32)
        b = _u8(src, base + 16 + ((j >> 6) << 5) + (j & 31), mask)
        q = ((b >> (((j >> 5) & 1) * 4)) & 15).to(tl.float32)
        p = dl * q
        _store(out, blk, j, p - ml, mask, 256)

    @triton.jit
    def _q5_k(src, out, n_blocks, bpr, row_stride, R: tl.constexpr):
        # d | dmin | scales[12] | qh[32] (bit s of byte i -> value 32s+i) | qs[128]
        blk, base, j, rmask, mask = _geometry(n_blocks, bpr, row_stride, 176, 256, R)
        d = _f16(src, base, rmask)
        dmin = _f16(src, base + 2, rmask)
        sc, m = _k_scale_min(src, base, j >> 5, mask)
        dl = d * sc.to(tl.float32)
        ml = dmin * m.to(tl.float32)
        b = _u8(src, base + 48 + ((j >> 6) << 5) + (j & 31), mask)
        lo = (b >> (((j >> 5) & 1) * 4)) & 15
        h = (_u8(src, base + 16 + (j & 31), mask) >> (j >> 5)) & 1
        q = (lo | (h << 4)).to(tl.float32)
        p = dl * q
        _store(out, blk, j, p - ml, mask, 256)

    @triton.jit
    def _q6_k(src, out, n_blocks, bpr, row_stride, R: tl.constexpr):
        # ql[128] (64 bytes per 128 values, low then high nibbles) | qh[64] (2 bits) | scales[16] int8 | d
        blk, base, j, rmask, mask = _geometry(n_blocks, bpr, row_stride, 210, 256, R)
        d = _f16(src, base + 208, rmask)
        half = j >> 7
        ql = (_u8(src, base + (half << 6) + (j & 63), mask) >> (((j >> 6) & 1) * 4)) & 15
        qh = (_u8(src, base + 128 + (half << 5) + (j & 31), mask) >> (((j >> 5) & 3) * 2)) & 3
        q = ((ql | (qh << 4)) - 32).to(tl.float32)
        dl = d * _i8(src, base + 192 + (j >> 4), mask).to(tl.float32)
        _store(out, blk, j, dl * q, mask, 256)

    @triton.jit
    def _q2_k(src, out, n_blocks, bpr, row_stride, R: tl.constexpr):
        # scales[16] (4-bit scale | 4-bit min) | qs[64] (2-bit, 32 bytes per 128 values) | d | dmin
        blk, base, j, rmask, mask = _geometry(n_blocks, bpr, row_stride, 84, 256, R)
        d = _f16(src, base + 80, rmask)
        dmin = _f16(src, base + 82, rmask)
        s = _u8(src, base + (j >> 4), mask)
        dl = d * (s & 15).to(tl.float32)
        ml = dmin * (s >> 4).to(tl.float32)
        q = ((_u8(src, base + 16 + ((j >> 7) << 5) + (j & 31), mask) >> (((j >> 5) & 3) * 2)) & 3)
        p = dl * q.to(tl.float32)
        _store(out, blk, j, p - ml, mask, 256)

    @triton.jit
    def _q3_k(src, out, n_blocks, bpr, row_stride, R: tl.constexpr):
        # hmask[32] | qs[64] (2 low bits) | scales[12] (16 6-bit scales) | d
        blk, base, j, rmask, mask = _geometry(n_blocks, bpr, row_stride, 110, 256, R)
        d = _f16(src, base + 108, rmask)
        s = j >> 4
        low = (_u8(src, base + 96 + (s & 7), mask) >> ((s >> 3) * 4)) & 15
        high = (_u8(src, base + 104 + (s & 3), mask) >> ((s >> 2) * 2)) & 3
        dl = d * ((low | (high << 4)) - 32).to(tl.float32)
        ql = (_u8(src, base + 32 + ((j >> 7) << 5) + (j & 31), mask) >> (((j >> 5) & 3) * 2)) & 3
        h = (_u8(src, base + (j & 31), mask) >> (j >> 5)) & 1
        q = (ql - ((h ^ 1) << 2)).to(tl.float32)
        _store(out, blk, j, dl * q, mask, 256)

    @triton.jit
    def _iq4_xs(src, out, n_blocks, bpr, row_stride, R: tl.constexpr):
        # d | scales_h u16 (2 bits per 32 values) | scales_l[4] (nibbles) | qs[128] (16 bytes per 32 values)
        blk, base, j, rmask, mask = _geometry(n_blocks, bpr, row_stride, 136, 256, R)
        d = _f16(src, base, rmask)
        s = j >> 5
        sh = (_u8(src, base + 2 + (s >> 2), mask) >> ((s & 3) * 2)) & 3
        sl = (_u8(src, base + 4 + (s >> 1), mask) >> ((s & 1) * 4)) & 15
        dl = d * ((sl | (sh << 4)) - 32).to(tl.float32)
        b = _u8(src, base + 8 + (s << 4) + (j & 15), mask)
        q = _iq4((b >> (((j >> 4) & 1) * 4)) & 15).to(tl.float32)
        _store(out, blk, j, dl * q, mask, 256)

    # type -> (kernel, blocks per program); 32-value types take more blocks per program so a
    # program writes ~2K values either way
    _TABLE: dict[T, tuple[Any, int]] = {
        T.Q8_0: (_q8_0, 64), T.Q4_0: (_q4_0, 64), T.Q4_1: (_q4_1, 64), T.Q5_0: (_q5_0, 64),
        T.Q5_1: (_q5_1, 64), T.IQ4_NL: (_iq4_nl, 64),
        T.Q4_K: (_q4_k, 8), T.Q5_K: (_q5_k, 8), T.Q6_K: (_q6_k, 8), T.Q2_K: (_q2_k, 8),
        T.Q3_K: (_q3_k, 8), T.IQ4_XS: (_iq4_xs, 8),
    }
else:
    _TABLE = {}

TYPES: frozenset[T] = frozenset(_TABLE)


@functools.cache
def _kernels() -> dict[T, tuple[Any, int]] | None:
    """The kernels by type, or None where the torch path must serve (logged once)."""
    if os.environ.get(ENV, "").strip().lower() == "torch":
        log.info("GGUF dequantiser: torch (%s=torch)", ENV)
        return None
    if triton is None:
        log.info("GGUF dequantiser: torch (triton is not importable)")
        return None
    log.info("GGUF dequantiser: Triton %s for %s; torch for the other types", triton.__version__,
             ", ".join(sorted(t.name for t in _TABLE)))
    return _TABLE


def handles(qtype: T, dtype: torch.dtype) -> bool:
    """Whether a CUDA tensor of `qtype` expands here into `dtype`."""
    ks = _kernels()
    return ks is not None and qtype in ks and dtype in OUT_DTYPES


def dequantize_into(raw: torch.Tensor, qtype: T, out: torch.Tensor) -> torch.Tensor:
    """Expand whole blocks of `qtype` from `raw` into `out` (contiguous; values in torch
    order) with one launch.  `raw` is uint8: flat, or [rows, bytes] with unit column stride
    and whole blocks per row (a strided slice of a larger buffer: no copy is made).  Nothing
    here synchronises the host or creates a host tensor, so a CUDA graph can hold it."""
    ks = _kernels() if triton is not None else None
    if ks is None or qtype not in ks:
        raise ValueError(f"no Triton dequantiser for {T(qtype).name}")
    kernel, per_program = ks[qtype]
    bs, ts = GGML_QUANT_SIZES[qtype]
    n_blocks = out.numel() // bs
    if out.numel() % bs or raw.numel() != n_blocks * ts or not out.is_contiguous():
        raise ValueError(f"{raw.numel()} bytes do not fill a contiguous {list(out.shape)} of {qtype.name}")
    if n_blocks == 0:
        return out
    if raw.dim() == 2 and raw.stride(1) == 1 and raw.shape[1] % ts == 0:
        bpr, row_stride = raw.shape[1] // ts, raw.stride(0)
    else:
        raw = raw.reshape(-1)  # a view when contiguous
        bpr, row_stride = n_blocks, 0
    grid = (triton.cdiv(n_blocks, per_program),)
    if raw.is_cuda and raw.device.index is not None and raw.device.index != torch.cuda.current_device():
        with torch.cuda.device(raw.device):  # Triton launches on the current device
            kernel[grid](raw, out, n_blocks, bpr, row_stride, R=per_program, num_warps=NUM_WARPS,
                         enable_fp_fusion=False)
    else:
        kernel[grid](raw, out, n_blocks, bpr, row_stride, R=per_program, num_warps=NUM_WARPS,
                     enable_fp_fusion=False)
    return out
