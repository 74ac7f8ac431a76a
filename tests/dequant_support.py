"""Random GGUF blocks and the bit-exact comparison against gguf's numpy dequantiser."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES

from engine.quant import dequant

ALL_TYPES = sorted(dequant.SUPPORTED, key=lambda t: t.name)


# byte offsets of each block's float16 scale fields (d, and dmin/m where the type has one)
SCALE_OFFSETS: dict[T, tuple[int, ...]] = {
    T.Q8_0: (0,), T.Q4_0: (0,), T.Q5_0: (0,), T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.Q4_1: (0, 2),
    T.Q5_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q6_K: (208,),
    T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,), T.IQ1_S: (0,),
    T.TQ1_0: (52,), T.TQ2_0: (64,),
}
# IQ1_M spreads its f16 scale over the top nibbles of the block's last four u16 (bytes 48-55);
# NVFP4's ue4m3 scales are finite for every byte; MXFP4's e8m0 are, but 2^127 x 6 is not


def _finite_scales(n: int, rng: np.random.Generator) -> np.ndarray:
    """n finite float16 scales of a weight's magnitude (subnormals included), as uint16."""
    scale = rng.standard_normal(n) * 10.0 ** rng.integers(-7, 0, n)
    return scale.astype(np.float16).view(np.uint16)


def random_blocks(qtype: T, rows: int, blocks_per_row: int, seed: int,
                  finite: bool = False) -> tuple[np.ndarray, tuple[int, int]]:
    """Random bytes of rows x blocks_per_row blocks (every bit pattern, NaN scales included),
    as the byte array gguf's dequantiser takes, and the tensor's shape in torch order.

    finite: the scale fields are finite halves of a weight's magnitude instead (a NaN scale
    makes its whole block NaN, where any two dequantisers agree), subnormals included."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks_per_row * ts), dtype=np.uint8)
    if finite and qtype in SCALE_OFFSETS:
        blocks = raw.reshape(rows * blocks_per_row, ts)
        for off in SCALE_OFFSETS[qtype]:
            blocks[:, off:off + 2] = _finite_scales(blocks.shape[0], rng).view(np.uint8).reshape(-1, 2)
    elif finite and qtype == T.MXFP4:  # e8m0 exponents of a weight's magnitude (2^-27..2^0)
        blocks = raw.reshape(rows * blocks_per_row, ts)
        blocks[:, 0] = rng.integers(100, 128, blocks.shape[0], dtype=np.uint8)
    elif finite and qtype == T.IQ1_M:
        blocks = raw.reshape(rows * blocks_per_row, ts)
        d = _finite_scales(blocks.shape[0], rng).reshape(-1, 1)
        nibbles = (d >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 0xF
        sc = blocks[:, 48:56].copy().view(np.uint16)
        blocks[:, 48:56] = ((sc & 0x0FFF) | (nibbles << 12)).astype(np.uint16).view(np.uint8)
    return raw, (rows, blocks_per_row * bs)


def assert_bit_exact(got: torch.Tensor, ref: np.ndarray, what: str) -> None:
    """Same float32 bits everywhere, except that any NaN matches any NaN."""
    assert got.dtype == torch.float32, what
    g = got.cpu().numpy()
    assert g.shape == ref.shape, f"{what}: shape {g.shape} != {ref.shape}"
    both_nan = np.isnan(g) & np.isnan(ref)
    same_bits = g.view(np.uint32) == ref.astype(np.float32).view(np.uint32)
    bad = ~(same_bits | both_nan)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} values differ, first at "
                           f"{np.argwhere(bad)[0].tolist()}: {g[bad][0]!r} != {ref[bad][0]!r}")


def check_type(qtype: T, device: str, rows: int = 7, blocks_per_row: int = 3, seed: int = 0) -> None:
    raw, shape = random_blocks(qtype, rows, blocks_per_row, seed)
    ref = gguf_quants.dequantize(raw, qtype)
    got = dequant.dequantize(torch.from_numpy(raw).to(device), qtype, shape)
    assert got.device.type == torch.device(device).type
    assert_bit_exact(got, ref, f"{qtype.name} on {device}")
