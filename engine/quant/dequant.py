"""GGUF block formats expanded to float on any torch device (CPU or CUDA).

`dequantize(raw, qtype, shape)` takes a tensor's raw bytes (uint8, on the device that should do
the work) and returns its values in torch order.  One function per type family; `DEQUANTIZERS`
maps each supported `GGMLQuantizationType` to its function.

The block layouts are ggml's.  The arithmetic is float32 in the order ggml's reference
dequantiser (and gguf's numpy port of it) uses, one rounding per operation and no fused
multiply-add, so the result is bit for bit what `gguf.quants.dequantize` returns; a lower
precision (the bf16 scratch of the GPU path) is a cast of that float32 result.

On CUDA, where Triton imports, the types `engine.quant.dequant_triton` has kernels for expand there
instead: one launch per tensor, the same bits (see `backend`).  STRATA_DEQUANT=torch keeps
these torch expressions everywhere (an A/B switch); the CPU always uses them.

The lattice and 4-bit-float types read code books (grids, the IQ2/IQ3 sign table, the e2m1
values, the e8m0 and ue4m3 scale decoders applied to every byte) from gguf.quants at import;
they are copied once per device (`code_books.code_book`), and the Triton kernels of those types gather from
the same device tables.  Every quantised type has a kernel (`dequant_triton.TYPES`); with
STRATA_DEQUANT=torch or no triton they take this torch path on CUDA, where every small index
vector is made on the device, so the path captures in a CUDA graph after its first eager call.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES

from engine.quant.code_books import code_book

log = logging.getLogger(__name__)

QK_K = 256
# non-linear 4-bit code book of IQ4_NL / IQ4_XS (ggml's kvalues_iq4nl)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# How much of a large tensor one step expands (bounds the temporaries: ~16 bytes per value).
# On a CPU, values per step (any block size), so that a step's float32 temporaries (~4 MiB a
# value array) stay in cache: on this project's 2-core CI machine 2**20 values a step expanded
# every K-quant and Q8_0 2-7x faster than 2**24, Q4_K's step before (`python
# benchmarks/dequant_bench.py --device cpu --dtype float32 --cpu-steps ...`; docs/benchmarks.md).
# On a GPU, blocks per step, fewer and larger (each step is ~15-25 kernel launches).
CHUNK_VALUES = 1 << 20
CHUNK_BLOCKS_CUDA = 1 << 17  # ~0.5 GiB of temporaries: STEP_BYTES_CUDA
STEP_BYTES_CUDA = 16 * 256 * CHUNK_BLOCKS_CUDA  # float32 temporaries of one torch step on a GPU


class UnsupportedType(ValueError):
    """A GGML type this module cannot expand."""


def block_geometry(qtype: T) -> tuple[int, int]:
    """(values per block, bytes per block)."""
    return GGML_QUANT_SIZES[qtype]


def nbytes_of(qtype: T, n_values: int) -> int:
    """Bytes of `n_values` values stored as `qtype` (n_values a multiple of the block size)."""
    bs, ts = block_geometry(qtype)
    if n_values % bs:
        raise ValueError(f"{n_values} values are not whole {qtype.name} blocks of {bs}")
    return n_values // bs * ts


# ----------------------------------------------------------------------------- helpers
def _f16(b: torch.Tensor) -> torch.Tensor:
    """Bytes [n, 2] (little-endian half) -> float32 [n, 1]."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _u16(b: torch.Tensor) -> torch.Tensor:
    """Bytes [n, 2] little-endian -> int32 [n, 1]."""
    b = b.to(torch.int32)
    return (b[:, 0:1] | (b[:, 1:2] << 8))


def _u32(b: torch.Tensor) -> torch.Tensor:
    """Bytes [n, 4] little-endian -> int64 [n, 1] (int64: the top bit stays positive)."""
    b = b.to(torch.int64)
    return b[:, 0:1] | (b[:, 1:2] << 8) | (b[:, 2:3] << 16) | (b[:, 3:4] << 24)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Bytes [n, G*group] -> [n, G*2*group] of 4-bit values: for each `group` bytes, first
    their low nibbles, then their high nibbles (ggml's order)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group)
    return torch.cat((q & 0x0F, q >> 4), dim=2).reshape(n, -1)


def _bits(b: torch.Tensor, shifts: Sequence[int], mask: int) -> torch.Tensor:
    """Bytes [n, m] -> [n, len(shifts), m]: (b >> s) & mask for each shift."""
    return torch.stack([(b >> s) & mask for s in shifts], dim=1)


_TABLES: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _lookup(table: tuple[int, ...], idx: torch.Tensor) -> torch.Tensor:
    """table[idx] as float32; the table is made once per device (no copy per call)."""
    key = (table, idx.device)
    values = _TABLES.get(key)
    if values is None:
        values = _TABLES[key] = torch.tensor(table, dtype=torch.float32, device=idx.device)
    return values[idx.to(torch.int64)]


def _result(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor of a and b's broadcast shape in `dtype` on a's device.  On a CPU the
    shape is worked out here: `torch.broadcast_shapes` goes through torch._refs, whose first
    call imports sympy and the decompositions (~0.45 s on the CI machine) and each call after
    costs ~1 ms, more than a CPU step's arithmetic.  A GPU keeps torch's (its steps are few)."""
    if a.device.type != "cpu":
        return torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=dtype, device=a.device)
    return torch.empty(broadcast_shape(a.shape, b.shape), dtype=dtype)


def broadcast_shape(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    """The broadcast of two shapes, by torch's rules (ValueError where they do not broadcast)."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise ValueError(f"shapes {list(a)} and {list(b)} do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(out)


def _mul(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a * b computed in float32 (integer codes promote exactly) and written in `dtype`: the
    last operation of a dequantiser writes its result once, in the caller's dtype."""
    return torch.mul(a, b, out=_result(a, b, dtype))


def _sub(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.sub(a, b, out=_result(a, b, dtype))


def _add(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.add(a, b, out=_result(a, b, dtype))


# Each dequantiser takes [n_blocks, type_size] bytes and returns [n_blocks, ...] values in
# `dtype`: float32 arithmetic in ggml's order, the last operation writing `dtype` (for bf16
# that is the cast of the exact float32 result: one rounding after it, as a separate cast).
# ------------------------------------------------------------------------ float formats
def _float32(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32).to(dtype)


def _float16(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).to(torch.float32).to(dtype)


def _bfloat16(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # the bf16 bits become the high half of a float32 (exact; NaN payloads kept)
    b = blocks.to(torch.int32)
    bits = (b[:, 0::2] | (b[:, 1::2] << 8)) << 16
    return bits.view(torch.float32).to(dtype)


# ------------------------------------------------------------------- legacy 32-value blocks
def _q4_0(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # d f16 | 16 bytes of nibbles
    d = _f16(blocks[:, 0:2])
    q = _nibbles(blocks[:, 2:], 16).view(torch.int8) - 8  # 0..15 -> -8..7
    return _mul(d, q, dtype)


def _q4_1(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # d f16 | m f16 | 16 bytes
    d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    return _add(d * _nibbles(blocks[:, 4:], 16), m, dtype)


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """The 32 fifth bits of a Q5 block, bit i -> value i, as 0/16 (uint8)."""
    bits = _u32(qh) >> torch.arange(32, device=qh.device, dtype=torch.int64)
    return ((bits & 1) << 4).to(torch.uint8)


def _q5_0(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # d f16 | qh u32 | 16 bytes
    d = _f16(blocks[:, 0:2])
    q = (_nibbles(blocks[:, 6:], 16) | _q5_high(blocks[:, 2:6])).view(torch.int8) - 16
    return _mul(d, q, dtype)


def _q5_1(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # d f16 | m f16 | qh u32 | 16 bytes
    d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 8:], 16) | _q5_high(blocks[:, 4:8])
    return _add(d * q, m, dtype)


def _q8_0(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # d f16 | 32 int8
    d = _f16(blocks[:, 0:2])
    return _mul(blocks[:, 2:].contiguous().view(torch.int8), d, dtype)


def _iq4_nl(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # d f16 | 16 bytes of code-book nibbles
    d = _f16(blocks[:, 0:2])
    return _mul(d, _lookup(IQ4_VALUES, _nibbles(blocks[:, 2:], 16)), dtype)


# ------------------------------------------------------------------ K-quants (256 values)
def _q2_k(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # scales[16] (4-bit scale | 4-bit min) | qs[64] (2-bit) | d f16 | dmin f16
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    dl = (d * (scales & 0x0F)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4)).reshape(n, 16, 1)
    qs = blocks[:, 16:80].reshape(n, 2, 1, 32)
    q = torch.cat([(qs >> s) & 3 for s in (0, 2, 4, 6)], dim=2).reshape(n, 16, 16)
    return _sub(dl * q, ml, dtype).reshape(n, QK_K)


def _q3_k(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # hmask[32] | qs[64] (2 low bits) | scales[12] (16 6-bit scales) | d f16
    n = blocks.shape[0]
    hmask, qs, sc = blocks[:, 0:32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16(blocks[:, 108:110])
    low = torch.cat((sc[:, 0:8] & 0x0F, sc[:, 0:8] >> 4), dim=1)  # scales 0-7, 8-15 low bits
    high = torch.cat([(sc[:, 8:12] >> s) & 3 for s in (0, 2, 4, 6)], dim=1)
    scales = (low | (high << 4)).view(torch.int8) - 32
    dl = (d * scales).reshape(n, 16, 1)
    ql = torch.cat([(qs.reshape(n, 2, 1, 32) >> s) & 3 for s in (0, 2, 4, 6)], dim=2).reshape(n, 16, 16)
    qh = torch.cat([(hmask.reshape(n, 1, 1, 32) >> s) & 1 for s in range(8)], dim=2).reshape(n, 16, 16)
    q = ql.view(torch.int8) - ((qh ^ 1) << 2).view(torch.int8)  # -4..3
    return _mul(dl, q, dtype).reshape(n, QK_K)


def _k_scale_min(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 6-bit scales and 8 6-bit mins packed in 12 bytes (Q4_K, Q5_K), as uint8."""
    a, b, c = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scale = torch.cat((a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)), dim=1)
    mins = torch.cat((b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)), dim=1)
    return scale, mins


def _q4_k(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d f16 | dmin f16 | scales[12] | qs[128] (nibbles, 64 values per 32 bytes)
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = _k_scale_min(blocks[:, 4:16])
    dl = (d * sc).reshape(n, 8, 1)
    ml = (dmin * m).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 16:144], 32).reshape(n, 8, 32)
    return _sub(dl * q, ml, dtype).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d f16 | dmin f16 | scales[12] | qh[32] (bit j of byte i -> value 32j+i) | qs[128]
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = _k_scale_min(blocks[:, 4:16])
    dl = (d * sc).reshape(n, 8, 1)
    ml = (dmin * m).reshape(n, 8, 1)
    ql = _nibbles(blocks[:, 48:176], 32).reshape(n, 8, 32)
    qh = _bits(blocks[:, 16:48], range(8), 1)
    return _sub(dl * (ql | (qh << 4)), ml, dtype).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # ql[128] (low nibbles) | qh[64] (2 high bits) | scales[16] int8 | d f16
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, 0:128], 64).reshape(n, 8, 32)
    qh = torch.cat([(blocks[:, 128:192].reshape(n, 2, 1, 32) >> s) & 3 for s in (0, 2, 4, 6)],
                   dim=2).reshape(n, 8, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8)
    d = _f16(blocks[:, 208:210])
    dl = (d * scales).reshape(n, 16, 1)
    q = ((ql | (qh << 4)).view(torch.int8) - 32).reshape(n, 16, 16)  # -32..31
    return _mul(dl, q, dtype).reshape(n, QK_K)


def _iq4_xs(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d f16 | scales_h u16 (2 bits per 32 values) | scales_l[4] (nibbles) | qs[128]
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    sh = _u16(blocks[:, 2:4]) >> torch.arange(0, 16, 2, device=blocks.device, dtype=torch.int32)
    sl = blocks[:, 4:8]
    low = torch.stack((sl & 0x0F, sl >> 4), dim=2).reshape(n, 8).to(torch.int32)
    scales = (low | ((sh & 3) << 4)) - 32
    dl = (d * scales).reshape(n, 8, 1)
    q = _lookup(IQ4_VALUES, _nibbles(blocks[:, 8:136], 16)).reshape(n, 8, 32)
    return _mul(dl, q, dtype).reshape(n, QK_K)


# ---------------------------------------------------- lattice (IQ1/IQ2/IQ3) and 4-bit-float types
# The code books (gguf's grids, sign table, e2m1 values and scale decoders) are engine.quant.code_books'.
def _rows(name: str, idx: torch.Tensor) -> torch.Tensor:
    """table[idx] of a code book: idx [...] -> [..., table width] (or [...] for a flat table)."""
    return code_book(name, idx.device)[idx.to(torch.int64)]


def _steps(start: int, step: int, n: int, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """start, start+step, ... (n values) made on the device by a kernel: no host-to-device copy,
    so the torch path stays capturable in a CUDA graph."""
    return torch.arange(start, start + step * n, step, device=device, dtype=dtype)


def _bit_signs(b: torch.Tensor) -> torch.Tensor:
    """Sign bytes [n, m] -> float32 [n, m, 8] of +1/-1, bit j of a byte the sign of value j."""
    bits = (b.unsqueeze(-1) >> torch.arange(8, device=b.device, dtype=torch.uint8)) & 1
    return 1.0 - 2.0 * bits.to(torch.float32)


def _iq2_xxs(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d f16 | 8 x (4 grid bytes | u32: four 7-bit sign indices, 4-bit scale on top)
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    q = blocks[:, 2:66].reshape(n, 8, 8)
    aux = _u32(q[:, :, 4:8].reshape(n * 8, 4)).reshape(n, 8)
    db = (d * (0.5 + (aux >> 28).to(torch.float32)) * 0.25).reshape(n, 8, 1, 1)
    sidx = (aux.unsqueeze(-1) >> _steps(0, 7, 4, blocks.device)) & 0x7F
    signs = _rows("ksigns", sidx)  # [n, 8, 4, 8]
    grid = _rows("IQ2_XXS", q[:, :, 0:4])  # [n, 8, 4, 8]
    return _mul(db * grid, signs, dtype).reshape(n, QK_K)


def _iq2_xs(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d f16 | qs[32] u16 (9-bit grid index | 7-bit sign index) | scales[8] (two 4-bit each)
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    qs = _u16(blocks[:, 2:66].reshape(n * 32, 2)).reshape(n, 32)
    sc = blocks[:, 66:74]
    scales = torch.stack((sc & 0x0F, sc >> 4), dim=2).reshape(n, 16)
    db = (d * (0.5 + scales.to(torch.float32)) * 0.25).reshape(n, 16, 1, 1)
    signs = _rows("ksigns", qs >> 9).reshape(n, 16, 2, 8)
    grid = _rows("IQ2_XS", qs & 511).reshape(n, 16, 2, 8)
    return _mul(db * grid, signs, dtype).reshape(n, QK_K)


def _iq2_s(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d f16 | qs[32] (grid index low 8 bits) | signs[32] | qh[8] (2 high bits each) | scales[8]
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    sc = blocks[:, 74:82]
    scales = torch.stack((sc & 0x0F, sc >> 4), dim=2).reshape(n, 16)
    db = (d * (0.5 + scales.to(torch.float32)) * 0.25).reshape(n, 16, 1, 1)
    signs = _bit_signs(blocks[:, 34:66]).reshape(n, 16, 2, 8)
    qh = _bits(blocks[:, 66:74], (0, 2, 4, 6), 3).transpose(1, 2).reshape(n, 32)
    idx = blocks[:, 2:34].to(torch.int64) | (qh.to(torch.int64) << 8)
    grid = _rows("IQ2_S", idx).reshape(n, 16, 2, 8)
    return _mul(db * grid, signs, dtype).reshape(n, QK_K)


def _iq3_xxs(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d f16 | qs[64] (grid bytes, 4 values each) | 8 x u32 (four 7-bit sign indices | 4-bit scale)
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    aux = _u32(blocks[:, 66:98].reshape(n * 8, 4)).reshape(n, 8)
    db = (d * (0.5 + (aux >> 28).to(torch.float32)) * 0.5).reshape(n, 8, 1, 1)
    sidx = (aux.unsqueeze(-1) >> _steps(0, 7, 4, blocks.device)) & 0x7F
    signs = _rows("ksigns", sidx)  # [n, 8, 4, 8]
    grid = _rows("IQ3_XXS", blocks[:, 2:66]).reshape(n, 8, 4, 8)
    return _mul(db * grid, signs, dtype).reshape(n, QK_K)


def _iq3_s(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d f16 | qs[64] (grid index low 8 bits) | qh[8] (ninth bits) | signs[32] | scales[4]
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    sc = blocks[:, 106:110]
    scales = torch.stack((sc & 0x0F, sc >> 4), dim=2).reshape(n, 8).to(torch.int32)
    db = (d * (1 + 2 * scales)).reshape(n, 8, 1, 1)
    signs = _bit_signs(blocks[:, 74:106]).reshape(n, 8, 4, 8)
    qh = _bits(blocks[:, 66:74], range(8), 1).transpose(1, 2).reshape(n, 64)
    idx = blocks[:, 2:66].to(torch.int64) | (qh.to(torch.int64) << 8)
    grid = _rows("IQ3_S", idx).reshape(n, 8, 4, 8)
    return _mul(db * grid, signs, dtype).reshape(n, QK_K)


IQ1_DELTA = float(gguf_quants.IQ1_S.delta)  # ggml's IQ1S_DELTA, 0.125: the lattice's offset


def _iq1_s(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # d f16 | qs[32] (grid index low 8 bits) | qh[8] u16 (3 high bits x4 | 3-bit scale | delta sign)
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    qh = _u16(blocks[:, 34:50].reshape(n * 8, 2)).reshape(n, 8)
    dl = (d * (2 * ((qh >> 12) & 7) + 1)).reshape(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, IQ1_DELTA, -IQ1_DELTA).reshape(n, 8, 1, 1)
    hi = (qh.unsqueeze(-1) >> _steps(0, 3, 4, blocks.device, torch.int32)) & 7
    idx = blocks[:, 2:34].to(torch.int64) | (hi.reshape(n, 32).to(torch.int64) << 8)
    grid = _rows("IQ1_S", idx).reshape(n, 8, 4, 8)
    return _mul(dl, grid + delta, dtype).reshape(n, QK_K)


def _iq1_m(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # qs[32] | qh[16] (per 8 values: 3 high index bits | delta sign) | 4 x u16 scales: four 3-bit
    # sub-scales each, and the block's f16 scale spread over their top nibbles
    n = blocks.shape[0]
    sc = _u16(blocks[:, 48:56].reshape(n * 4, 2)).reshape(n, 4)
    top = (sc & 0xF000) >> _steps(12, -4, 4, blocks.device, torch.int32)
    dbits = top[:, 0] | top[:, 1] | top[:, 2] | top[:, 3]
    d = (dbits - ((dbits & 0x8000) << 1)).to(torch.int16).view(torch.float16).to(torch.float32).reshape(n, 1)
    sub = (sc.unsqueeze(-1) >> _steps(0, 3, 4, blocks.device, torch.int32)) & 7
    dl = (d * (2 * sub.reshape(n, 16) + 1)).reshape(n, 8, 2, 1, 1)
    qh = blocks[:, 32:48]
    nib = torch.stack((qh & 0x0F, qh >> 4), dim=2).reshape(n, 32)
    idx = blocks[:, 0:32].to(torch.int64) | ((nib & 7).to(torch.int64) << 8)
    delta = torch.where((nib & 8) == 0, IQ1_DELTA, -IQ1_DELTA).reshape(n, 8, 2, 2, 1)
    grid = _rows("IQ1_S", idx).reshape(n, 8, 2, 2, 8)
    return _mul(dl, grid + delta, dtype).reshape(n, QK_K)


def _mxfp4(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # e8m0 scale (1 byte, as half its power of two) | 16 bytes of e2m1 nibbles (doubled values)
    d = _rows("e8m0_half", blocks[:, 0:1])
    q = _rows("e2m1", _nibbles(blocks[:, 1:17], 16))
    return _mul(d, q, dtype)


def _nvfp4(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # 4 ue4m3 scales (one per 16 values) | 4 x 8 bytes of e2m1 nibbles (doubled values)
    n = blocks.shape[0]
    d = _rows("ue4m3", blocks[:, 0:4]).reshape(n, 4, 1)
    q = _rows("e2m1", _nibbles(blocks[:, 4:36], 8)).reshape(n, 4, 16)
    return _mul(d, q, dtype).reshape(n, 64)


def _tq1_0(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # qs[48] (5 base-3 digits per byte, as a fraction of 256) | qh[4] (4 digits each) | d f16
    n = blocks.shape[0]
    dev = blocks.device
    d = _f16(blocks[:, 52:54])
    p5 = torch.pow(3, _steps(0, 1, 5, dev, torch.int32)).reshape(1, 5, 1)  # 1, 3, 9, 27, 81
    qs = blocks[:, 0:48].to(torch.int32)
    q0 = ((qs[:, 0:32].reshape(n, 1, 32) * p5) & 0xFF).reshape(n, 160)  # uint8 products wrap
    q1 = ((qs[:, 32:48].reshape(n, 1, 16) * p5) & 0xFF).reshape(n, 80)
    qh = ((blocks[:, 48:52].to(torch.int32).reshape(n, 1, 4) * p5[:, :4]) & 0xFF).reshape(n, 16)
    q = ((torch.cat((q0, q1, qh), dim=1) * 3) >> 8) - 1
    return _mul(d, q, dtype)


def _tq2_0(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # qs[64] (2-bit digits, 4 per byte) | d f16
    n = blocks.shape[0]
    d = _f16(blocks[:, 64:66])
    q = _bits(blocks[:, 0:64].reshape(n, 2, 32), (0, 2, 4, 6), 3)  # [n, 4, 2, 32]
    q = q.transpose(1, 2).reshape(n, QK_K).view(torch.int8) - 1
    return _mul(d, q, dtype)


DEQUANTIZERS: dict[T, Callable[[torch.Tensor, torch.dtype], torch.Tensor]] = {
    T.F32: _float32, T.F16: _float16, T.BF16: _bfloat16,
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
    T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs,
    T.IQ2_XXS: _iq2_xxs, T.IQ2_XS: _iq2_xs, T.IQ2_S: _iq2_s, T.IQ3_XXS: _iq3_xxs, T.IQ3_S: _iq3_s,
    T.IQ1_S: _iq1_s, T.IQ1_M: _iq1_m, T.MXFP4: _mxfp4, T.NVFP4: _nvfp4, T.TQ1_0: _tq1_0, T.TQ2_0: _tq2_0,
}
SUPPORTED: frozenset[T] = frozenset(DEQUANTIZERS)


def supported_names() -> str:
    return ", ".join(sorted(t.name for t in SUPPORTED))


def backend(device: torch.device | str, qtype: T | int, dtype: torch.dtype = torch.float32) -> str:
    """Which dequantiser expands `qtype` into `dtype` on `device`: "triton" (CUDA, triton
    importable, a kernel for the type, STRATA_DEQUANT not "torch") or "torch"."""
    if torch.device(device).type != "cuda":
        return "torch"
    from engine.quant import dequant_triton  # imports triton: only once a GPU tensor is expanded
    return "triton" if dequant_triton.handles(T(qtype), dtype) else "torch"


def gpu_temporaries(device: torch.device | str, qtypes: Iterable[T | int], dtype: torch.dtype) -> int:
    """Device bytes the dequantiser needs besides its output while expanding `qtypes` into
    `dtype` on a GPU: one torch step's float32 temporaries where any type takes the torch path,
    none where each is one Triton launch writing straight into the output."""
    if any(backend(device, q, dtype) == "torch" for q in qtypes):
        return STEP_BYTES_CUDA
    return 0


def _gather_rows(raw: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of raw [rows, bytes] as one contiguous tensor, for the torch path's gather.

    A uint8 `index_select` is slow (measured on the 2-core dev machine: 64 ms for 4 rows of
    288 KiB, 1.8 ms viewed as int64, 0.03 ms as row copies): on a CPU the rows are copied one by
    one (the index is on the host there); on a GPU they move as the widest integer the layout
    allows (no host synchronisation, so a CUDA graph can hold it)."""
    if raw.device.type == "cpu":
        picked = rows.tolist()
        out = torch.empty((len(picked), raw.shape[1]), dtype=torch.uint8)
        for j, r in enumerate(picked):
            out[j].copy_(raw[r])
        return out
    return _gather_wide(raw, rows)


def _gather_wide(raw: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """raw[rows] by `index_select` on raw viewed as the widest integer its layout allows."""
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if (raw.stride(1) == 1 and raw.shape[1] % size == 0 and raw.stride(0) % size == 0
                and raw.storage_offset() % size == 0):
            return raw.view(dt).index_select(0, rows).view(torch.uint8)
    return raw.index_select(0, rows)


def dequantize(raw: torch.Tensor, qtype: T | int, shape: Sequence[int], dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Expand raw GGUF bytes (a uint8 tensor of whole blocks, on any device) to `shape` (torch
    order, last dimension a multiple of the block size) in `dtype` on raw's device.

    On CUDA with a Triton kernel for the type (`backend`), one launch writes the values
    straight into the result (or `out`); `raw` may then be a [rows, bytes] slice with unit
    column stride and whole blocks per row, read in place.  Otherwise (torch path), with `out`
    (a contiguous tensor of `shape`), and for any tensor over one step, works in steps of
    CHUNK_VALUES values (CHUNK_BLOCKS_CUDA blocks on a GPU), so the float32 temporaries stay small
    whatever the tensor's size.

    With `rows` (an int64 index on raw's device), raw is [rows, bytes] and the result holds
    raw's rows rows[0], rows[1], ...: the Triton kernel gathers them as it reads, the torch
    path copies them first."""
    qtype = T(qtype)
    fn = DEQUANTIZERS.get(qtype)
    if fn is None:
        raise UnsupportedType(f"unsupported type {qtype.name}; supported: {supported_names()}")
    bs, ts = block_geometry(qtype)
    n_values = 1
    for s in shape:
        n_values *= int(s)
    if raw.dtype != torch.uint8:
        raise TypeError(f"raw bytes must be uint8, got {raw.dtype}")
    if n_values % bs or (shape and int(shape[-1]) % bs):
        raise ValueError(f"shape {list(shape)} is not whole {qtype.name} blocks of {bs} values")
    n_blocks = n_values // bs
    triton_path = raw.is_cuda and backend(raw.device, qtype, out.dtype if out is not None else dtype) == "triton"
    if rows is not None and not triton_path:
        raw = _gather_rows(raw, rows)
        rows = None
    step = CHUNK_BLOCKS_CUDA if raw.device.type == "cuda" else max(1, CHUNK_VALUES // bs)
    if rows is None and raw.numel() != n_blocks * ts:
        raise ValueError(f"{raw.numel()} bytes for {n_blocks} {qtype.name} blocks of {ts} bytes")
    if triton_path:
        from engine.quant import dequant_triton
        if out is None:
            out = torch.empty(tuple(shape), dtype=dtype, device=raw.device)
        elif tuple(out.shape) != tuple(shape) or not out.is_contiguous() or out.device != raw.device:
            raise ValueError(f"out must be a contiguous tensor of shape {list(shape)} on {raw.device}")
        return dequant_triton.dequantize_into(raw, qtype, out, rows=rows)
    blocks = raw.reshape(n_blocks, ts)
    if out is None:
        if n_blocks <= step:
            if n_blocks == 0:
                return torch.empty(tuple(shape), dtype=dtype, device=raw.device)
            return fn(blocks, dtype).reshape(tuple(shape))
        out = torch.empty(tuple(shape), dtype=dtype, device=raw.device)  # large: in steps
    if tuple(out.shape) != tuple(shape) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of shape {list(shape)}")
    flat = out.view(n_blocks, bs)
    for b0 in range(0, n_blocks, step):
        flat[b0:b0 + step].copy_(fn(blocks[b0:b0 + step], out.dtype))
    return out
