"""Which GGML type each tensor of a generated model gets, and random valid blocks of any type.

`tensor_type` follows the per-tensor choices of llama.cpp's quantiser (its
`llama_tensor_get_type`) for the mixes users download: Q4_K_M (Q4_K for most matrices; Q6_K for
the output, and for attn_v and ffn_down(_exps) of the layers `use_more_bits` picks), Q6_K, Q8_0
and IQ4_XS, including the 8-expert bumps (attn_v/attn_k Q8_0, attn_output Q5_K) and the fallback
to a legacy type when a row is not a multiple of 256 values.  1-D tensors and the MoE router
stay F32, as llama.cpp keeps them.

The low-bit mixes follow the same function (`_low_bit_type`): IQ3_XXS and IQ3_S (attn_v Q4_K
where 4+ query heads share a KV head; IQ3_XXS files also take attn_q/attn_k in IQ2_S, the token
embedding and attn_output in IQ3_S and the output in Q5_K), the 1-2 bit IQ2_XXS/IQ2_XS/IQ1_S/IQ1_M
(token embedding and the first eighth of ffn_down in Q2_K, attn_v Q4_K, IQ1's attn_output
IQ2_XXS, output Q5_K), and MXFP4_MOE as gpt-oss files are stored (expert tensors MXFP4,
everything else quantised Q8_0).  These types need an importance matrix in llama.cpp, so the
mixes are its choices with one.

`random_blocks` fills a tensor of a quantized type with random bytes whose fp16 super-scales are
rewritten to finite values of a chosen size, so the expanded weights have about the standard
deviation asked for (gguf can quantise only the legacy types; K-quants are made this way).
Works on any device, so benchmarks can generate full-size quantized weights on the GPU; given a
numpy Generator (the file writer) it draws the bytes there, at GB/s on one core, where torch's CPU
`randint` of bytes makes ~150 MB/s.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from engine.io.gguf_model import ModelSpec
from engine.quant import dequant

log = logging.getLogger(__name__)

LOW_BIT_FTYPES = ("iq3_xxs", "iq3_s", "iq2_xxs", "iq2_xs", "iq1_s", "iq1_m", "mxfp4")
FTYPES = ("q4_k_m", "q6_k", "q8_0", "iq4_xs", *LOW_BIT_FTYPES)
_DEFAULT = {"q4_k_m": T.Q4_K, "q6_k": T.Q6_K, "q8_0": T.Q8_0, "iq4_xs": T.IQ4_XS,
            "iq3_xxs": T.IQ3_XXS, "iq3_s": T.IQ3_S, "iq2_xxs": T.IQ2_XXS, "iq2_xs": T.IQ2_XS,
            "iq1_s": T.IQ1_S, "iq1_m": T.IQ1_M, "mxfp4": T.MXFP4}
_ONE_TWO_BIT = frozenset({"iq2_xxs", "iq2_xs", "iq1_s", "iq1_m"})
# llama.cpp's fallback when a row does not split into the type's blocks (the 256-value lattice
# types go to the 32-value IQ4_NL; Q2_K/Q3_K to Q4_0 as in its current tensor_type_fallback)
_FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.IQ4_XS: T.IQ4_NL, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1,
             T.Q6_K: T.Q8_0, T.IQ3_XXS: T.IQ4_NL, T.IQ3_S: T.IQ4_NL, T.IQ2_XXS: T.IQ4_NL,
             T.IQ2_XS: T.IQ4_NL, T.IQ2_S: T.IQ4_NL, T.IQ1_S: T.IQ4_NL, T.IQ1_M: T.IQ4_NL}
_LAYER = re.compile(r"^blk\.(\d+)\.")


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth and every
    third layer between them."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], ftype: str, spec: ModelSpec) -> T:
    """The type of one tensor (shape in torch order) in a model of mix `ftype`."""
    if ftype not in _DEFAULT:
        raise ValueError(f"unknown quant mix {ftype!r}: use {', '.join(FTYPES)}")
    if len(shape) < 2 or "ffn_gate_inp" in name or not name.endswith("weight") or "ssm_conv1d" in name:
        return T.F32  # llama.cpp's quantizer leaves what is not a weight (gpt-oss's 2-D expert biases) and the conv's taps
    if ftype in LOW_BIT_FTYPES:
        return _fit_rows(_low_bit_type(name, shape, ftype, spec), shape[-1])
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
    return _fit_rows(new, shape[-1])


def _fit_rows(new: T, row: int) -> T:
    """llama.cpp's fallback for rows that are not whole blocks of `new`: a type of smaller
    blocks, else F16."""
    if row % dequant.block_geometry(new)[0]:
        new = _FALLBACK.get(new, new)
        if row % dequant.block_geometry(new)[0]:
            new = T.F16
    return new


def _low_bit_type(name: str, shape: tuple[int, ...], ftype: str, spec: ModelSpec) -> T:
    """The IQ3 / IQ2 / IQ1 / MXFP4 mixes' choice for a 2-D or 3-D weight (llama.cpp's
    llama_tensor_get_type with an importance matrix), before the row-size fallback."""
    default = _DEFAULT[ftype]
    m = _LAYER.match(name)
    layer = int(m.group(1)) if m else -1
    n_gqa = spec.n_heads // max(spec.n_kv_heads, 1)
    n_experts = spec.n_experts
    tiny = ftype in _ONE_TWO_BIT
    is_output = name == "output.weight" or (spec.tied_embeddings and name == "token_embd.weight")
    if is_output:
        if ftype == "mxfp4" or shape[-1] % dequant.block_geometry(default)[0]:
            return T.Q8_0
        return T.Q6_K if ftype == "iq3_s" else T.Q5_K
    if ftype == "mxfp4":  # experts (3-D) in MXFP4, every other weight Q8_0
        return T.MXFP4 if len(shape) == 3 and shape[0] > 1 else T.Q8_0
    if name == "token_embd.weight":
        return T.Q2_K if tiny else T.IQ3_S if ftype == "iq3_xxs" else default
    if tiny:
        if name.endswith("attn_v.weight"):
            return T.Q4_K if n_gqa >= 4 or n_experts >= 4 else T.Q2_K
        if name.endswith("attn_k.weight"):
            return T.Q4_K if n_experts == 8 else default
        if ".ffn_down" in name:
            return T.Q2_K if layer < spec.n_layers // 8 else default
        if name.endswith("attn_output.weight"):
            if n_experts == 8:
                return T.Q5_K
            return T.IQ2_XXS if ftype in ("iq1_s", "iq1_m") else default
        return default
    # iq3_xxs, iq3_s
    if name.endswith("attn_v.weight"):
        if n_experts == 8:
            return T.Q8_0
        return T.Q4_K if n_gqa >= 4 else default
    if name.endswith("attn_k.weight"):
        if n_experts == 8:
            return T.Q8_0
        return T.IQ2_S if ftype == "iq3_xxs" else default
    if name.endswith("attn_q.weight"):
        return T.IQ2_S if ftype == "iq3_xxs" else default
    if name.endswith("attn_output.weight"):
        if n_experts == 8:
            return T.Q5_K
        return T.IQ3_S if ftype == "iq3_xxs" else default
    return default


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
    form: str = "f16"  # "f16"; "iq1_m": fp16 spread over the top nibbles of 4 u16; "e8m0": a power of two


_SCALES: dict[T, _Scales] = {
    T.Q4_0: _Scales(0), T.Q4_1: _Scales(0, 2, -7.5), T.Q5_0: _Scales(0), T.Q5_1: _Scales(0, 2, -15.5),
    T.Q8_0: _Scales(0), T.IQ4_NL: _Scales(0),
    T.Q2_K: _Scales(80, 82, 1.5), T.Q3_K: _Scales(108), T.Q4_K: _Scales(0, 2, 7.5),
    T.Q5_K: _Scales(0, 2, 15.5), T.Q6_K: _Scales(208), T.IQ4_XS: _Scales(0),
    T.IQ3_XXS: _Scales(0), T.IQ3_S: _Scales(0), T.IQ2_XXS: _Scales(0), T.IQ2_XS: _Scales(0),
    T.IQ2_S: _Scales(0), T.IQ1_S: _Scales(0), T.IQ1_M: _Scales(48, form="iq1_m"),
    T.MXFP4: _Scales(0, form="e8m0"),
}
QUANTIZED = frozenset(_SCALES)


def _set_f16(blocks: torch.Tensor, offset: int, values: torch.Tensor) -> None:
    blocks[:, offset:offset + 2] = values.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def _set_scale(blocks: torch.Tensor, sc: _Scales, values: torch.Tensor) -> None:
    """Write each block's scale (float32 `values`, one per block) in the type's own form."""
    if sc.form == "f16":
        _set_f16(blocks, sc.d, values)
    elif sc.form == "iq1_m":  # nibble k of the fp16 into the top nibble of u16 k (its high byte)
        bits = values.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
        for k in range(4):
            hi = sc.d + 2 * k + 1
            nib = ((bits >> (4 * k)) & 0xF).to(torch.uint8)
            blocks[:, hi] = (blocks[:, hi] & 0x0F) | (nib << 4)
    elif sc.form == "e8m0":  # byte e stands for 2**(e - 128) (ggml's halved e8m0): nearest power
        e = torch.round(torch.log2(values.clamp_min(2.0 ** -120))) + 128
        blocks[:, sc.d] = e.clamp(1, 254).to(torch.uint8)
    else:
        raise ValueError(f"unknown scale form {sc.form!r}")


def random_blocks(qtype: T, shape: tuple[int, ...], std: float, generator: torch.Generator | np.random.Generator,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Raw bytes (uint8) of a random tensor of `shape` stored as `qtype`, whose expanded values
    have a standard deviation of about `std`; every scale is a finite fp16 number.  A torch
    generator draws on `device` (the synthetic source's stream); a numpy one draws on the CPU
    (the file writer's: same kind of blocks, another stream)."""
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
    if isinstance(generator, np.random.Generator):
        if device.type != "cpu":
            raise ValueError("random blocks from a numpy generator are made on the CPU")
        words = generator.integers(0, 1 << 64, size=-(-n * ts // 8), dtype=np.uint64)  # 8 random bytes a draw
        blocks = torch.from_numpy(words.view(np.uint8)[:n * ts]).view(n, ts)
    else:
        blocks = torch.randint(0, 256, (n, ts), dtype=torch.uint8, generator=generator, device=device)
    # unit scales first, to measure the spread the random sub-scales and codes give
    sample = blocks[: min(n, 4096)].clone()
    ones = torch.ones(sample.shape[0], device=device)
    _set_scale(sample, sc, ones)
    if sc.m is not None:
        _set_f16(sample, sc.m, ones * sc.m_ratio)
    unit = float(dequant.dequantize(sample.reshape(-1), qtype, (sample.shape[0], bs)).std())
    scale = std / max(unit, 1e-12)
    # per-block variation of the scale, as real files have
    if isinstance(generator, np.random.Generator):
        u = torch.from_numpy(0.75 + 0.5 * generator.random(n, dtype=np.float32))
    else:
        u = 0.75 + 0.5 * torch.rand(n, generator=generator, device=device)
    d = (scale * u).to(torch.float16)
    _set_scale(blocks, sc, d.to(torch.float32))
    if sc.m is not None:
        _set_f16(blocks, sc.m, d.to(torch.float32) * sc.m_ratio)
    return blocks.reshape(-1)
