"""Which GGML type each tensor of a generated model gets, and random valid blocks of any type.

`tensor_type` follows the per-tensor choices of llama.cpp's quantiser (its
`llama_tensor_get_type`) for the mixes users download: Q4_K_M (Q4_K for most matrices; Q6_K for
the output, and for attn_v and ffn_down(_exps) of the layers `use_more_bits` picks), Q6_K, Q8_0
and IQ4_XS, including the 8-expert bumps (attn_v/attn_k Q8_0, attn_output Q5_K) and the fallback
to a legacy type when a row is not a multiple of 256 values.  1-D tensors and the MoE router
stay F32, as llama.cpp keeps them.

`random_blocks` fills a tensor of a quantized type with random bytes whose fp16 super-scales are
rewritten to finite values of a chosen size, so the expanded weights have about the standard
deviation asked for (gguf can quantise only the legacy types; K-quants are made this way).
Works on any device, so benchmarks can generate full-size quantized weights on the GPU.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as T

from . import dequant
from .gguf_model import ModelSpec

log = logging.getLogger(__name__)

FTYPES = ("q4_k_m", "q6_k", "q8_0", "iq4_xs")
_DEFAULT = {"q4_k_m": T.Q4_K, "q6_k": T.Q6_K, "q8_0": T.Q8_0, "iq4_xs": T.IQ4_XS}
# llama.cpp's fallback when a row does not split into the type's blocks
_FALLBACK = {T.Q2_K: T.IQ4_NL, T.Q3_K: T.IQ4_NL, T.IQ4_XS: T.IQ4_NL, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1,
             T.Q6_K: T.Q8_0}
_LAYER = re.compile(r"^blk\.(\d+)\.")


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth and every
    third layer between them."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], ftype: str, spec: ModelSpec) -> T:
    """The type of one tensor (shape in torch order) in a model of mix `ftype`."""
    if ftype not in _DEFAULT:
        raise ValueError(f"unknown quant mix {ftype!r}: use {', '.join(FTYPES)}")
    if len(shape) < 2 or "ffn_gate_inp" in name:
        return T.F32
    new = _DEFAULT[ftype]
    m = _LAYER.match(name)
    layer = int(m.group(1)) if m else -1
    n_gqa = spec.n_heads // max(spec.n_kv_heads, 1)
    eight_experts = spec.n_experts == 8
    is_output = name == "output.weight" or (spec.tied_embeddings and name == "token_embd.weight")
    if is_output:
        if new != T.Q8_0:
            new = T.Q6_K
    elif name.endswith("attn_v.weight"):
        if ftype == "iq4_xs" and n_gqa >= 4:
            new = T.Q5_K
        elif ftype == "q4_k_m" and use_more_bits(layer, spec.n_layers):
            new = T.Q6_K
        if eight_experts:
            new = T.Q8_0
    elif name.endswith("attn_k.weight"):
        if eight_experts:
            new = T.Q8_0
    elif ".ffn_down" in name:
        if ftype == "q4_k_m" and use_more_bits(layer, spec.n_layers):
            new = T.Q6_K
        elif ftype == "iq4_xs" and layer < spec.n_layers // 8:
            new = T.Q5_K
    elif name.endswith("attn_output.weight"):
        if eight_experts and ftype in ("q4_k_m", "iq4_xs"):
            new = T.Q5_K
    return _fit_row(new, shape[-1])


def _fit_row(new: T, row: int) -> T:
    """llama.cpp's fallback when a row of `row` values does not split into the type's blocks."""
    if row % dequant.block_geometry(new)[0]:
        new = _FALLBACK.get(new, new)
        if row % dequant.block_geometry(new)[0]:
            new = T.F16
    return new


def explain_fallbacks(shapes: dict[str, tuple[int, ...]], ftype: str, spec: ModelSpec) -> str | None:
    """One sentence on the tensors that got a fallback type because their rows do not split into
    the chosen type's blocks (256 values for the K-quants and IQ4_XS), or None when none did."""
    if ftype not in _DEFAULT:
        return None
    moved: dict[tuple[str, str], int] = {}
    rows: dict[int, set[int]] = {}  # block size -> the rows that did not fit it
    for name, shape in shapes.items():
        want, got = _wanted_before_fit(name, shape, ftype, spec), tensor_type(name, shape, ftype, spec)
        if want != got:
            moved[(want.name, got.name)] = moved.get((want.name, got.name), 0) + 1
            rows.setdefault(dequant.block_geometry(want)[0], set()).add(shape[-1])
    if not moved:
        return None
    parts = ", ".join(f"{w}→{g} for {k}" for (w, g), k in sorted(moved.items()))
    why = "; ".join(f"rows of {', '.join(map(str, sorted(r)))} values are not a multiple of {bs}"
                    for bs, r in sorted(rows.items()))
    return (f"{sum(moved.values())} of {len(shapes)} tensors use a fallback type ({parts}): {why}, the "
            f"block of the type the mix wants, so llama.cpp's per-tensor fallback applies, as its quantizer "
            f"does; sizes that are multiples of 256 (--hidden, --expert-ffn, --ffn, --head-dim x heads) keep "
            f"the mix's types")


def _wanted_before_fit(name: str, shape: tuple[int, ...], ftype: str, spec: ModelSpec) -> T:
    """The type the mix picks for a tensor before the row fit (a row as wide as 2^20: always fits)."""
    wide = (*shape[:-1], 256 * 4096)
    return tensor_type(name, wide, ftype, spec)


# --------------------------------------------------------------------------- random blocks
@dataclass(frozen=True)
class _Scales:
    d: int  # byte offset of the fp16 scale in a block
    m: int | None = None  # byte offset of the fp16 min / second scale
    m_ratio: float = 0.0  # m = m_ratio * d: centres the values on zero


_SCALES: dict[T, _Scales] = {
    T.Q4_0: _Scales(0), T.Q4_1: _Scales(0, 2, -7.5), T.Q5_0: _Scales(0), T.Q5_1: _Scales(0, 2, -15.5),
    T.Q8_0: _Scales(0), T.IQ4_NL: _Scales(0),
    T.Q2_K: _Scales(80, 82, 1.5), T.Q3_K: _Scales(108), T.Q4_K: _Scales(0, 2, 7.5),
    T.Q5_K: _Scales(0, 2, 15.5), T.Q6_K: _Scales(208), T.IQ4_XS: _Scales(0),
}
QUANTIZED = frozenset(_SCALES)


def _set_f16(blocks: torch.Tensor, offset: int, values: torch.Tensor) -> None:
    blocks[:, offset:offset + 2] = values.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def random_blocks(qtype: T, shape: tuple[int, ...], std: float, generator: torch.Generator,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Raw bytes (uint8) of a random tensor of `shape` stored as `qtype`, whose expanded values
    have a standard deviation of about `std`; every scale is a finite fp16 number."""
    qtype = T(qtype)
    sc = _SCALES.get(qtype)
    if sc is None:
        raise ValueError(f"random blocks of {qtype.name} are not made (quantized types: "
                         f"{', '.join(sorted(t.name for t in QUANTIZED))})")
    device = torch.device(device)
    n_values = 1
    for s in shape:
        n_values *= int(s)
    bs, ts = dequant.block_geometry(qtype)
    n = n_values // bs
    blocks = torch.randint(0, 256, (n, ts), dtype=torch.uint8, generator=generator, device=device)
    # unit scales first, to measure the spread the random sub-scales and codes give
    sample = blocks[: min(n, 4096)].clone()
    ones = torch.ones(sample.shape[0], device=device)
    _set_f16(sample, sc.d, ones)
    if sc.m is not None:
        _set_f16(sample, sc.m, ones * sc.m_ratio)
    unit = float(dequant.dequantize(sample.reshape(-1), qtype, (sample.shape[0], bs)).std())
    scale = std / max(unit, 1e-12)
    # per-block variation of the scale, as real files have
    u = 0.75 + 0.5 * torch.rand(n, generator=generator, device=device)
    d = (scale * u).to(torch.float16)
    _set_f16(blocks, sc.d, d)
    if sc.m is not None:
        _set_f16(blocks, sc.m, d.to(torch.float32) * sc.m_ratio)
    return blocks.reshape(-1)
