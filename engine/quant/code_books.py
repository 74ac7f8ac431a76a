"""gguf's code books for the lattice (IQ1/IQ2/IQ3) and 4-bit-float (MXFP4/NVFP4) types, as float32
tensors (the IQ2/IQ3 grids also as bytes packed in int32 words) copied once per device.  Every
book is read from gguf's own classes at import (its grids, its sign table, its e2m1 values and
its e8m0 / ue4m3 scale decoders), never written out here.  `engine.quant.dequant` (torch) and
`engine.quant.dequant_triton` (the kernels) both gather from them."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import quants as gguf_quants


def _gguf_grid(name: str) -> np.ndarray:
    """gguf's lattice of an IQ type as float32 [points, values per point]."""
    cls = getattr(gguf_quants, name)
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=np.float32)


def _sign_table() -> np.ndarray:
    """ggml's ksigns_iq2xs (128 even-parity sign bytes) as float32 [128, 8] of +1/-1 (bit j set:
    value j negative), the signs the IQ2/IQ3 types index with 7 bits."""
    ks = np.frombuffer(gguf_quants.IQ2_XXS.ksigns, dtype=np.uint8)
    bits = (ks.reshape(-1, 1) >> np.arange(8, dtype=np.uint8)) & 1
    return np.where(bits == 0, np.float32(1), np.float32(-1)).astype(np.float32)


def _packed_grid(name: str) -> np.ndarray:
    """gguf's lattice of an IQ2/IQ3 type with each point's values (small whole numbers, 1..62)
    packed four to an int32 word, value j of a point in byte j % 4 of word j // 4: int32
    [points, values per point / 4].  The Triton kernels read one word per four values and take
    the bytes apart, instead of gathering every value from the float32 book."""
    g = _gguf_grid(name)
    b = g.astype(np.int64)
    if not (np.array_equal(b, g) and b.min() >= 0 and b.max() < 128):
        raise ValueError(f"gguf's {name} grid is not bytes: the packed code book cannot hold it")
    b = b.reshape(b.shape[0], -1, 4)
    return np.ascontiguousarray((b << (8 * np.arange(4))).sum(-1), dtype=np.int32)


_NP_TABLES: dict[str, Callable[[], np.ndarray]] = {
    "IQ2_XXS": lambda: _gguf_grid("IQ2_XXS"), "IQ2_XS": lambda: _gguf_grid("IQ2_XS"),
    "IQ2_S": lambda: _gguf_grid("IQ2_S"), "IQ3_XXS": lambda: _gguf_grid("IQ3_XXS"),
    "IQ3_S": lambda: _gguf_grid("IQ3_S"), "IQ1_S": lambda: _gguf_grid("IQ1_S"),
    "IQ3_XXS_packed": lambda: _packed_grid("IQ3_XXS"), "IQ3_S_packed": lambda: _packed_grid("IQ3_S"),
    "IQ2_XXS_packed": lambda: _packed_grid("IQ2_XXS"), "IQ2_XS_packed": lambda: _packed_grid("IQ2_XS"),
    "IQ2_S_packed": lambda: _packed_grid("IQ2_S"),
    "ksigns": _sign_table,
    "e2m1": lambda: np.array(gguf_quants.MXFP4.kvalues, dtype=np.float32),
    # the scale decoders applied to every byte: a table of 256 exact float32 scales
    "e8m0_half": lambda: gguf_quants.MXFP4.e8m0_to_fp32_half(np.arange(256, dtype=np.uint8)).astype(np.float32),
    "ue4m3": lambda: np.asarray(gguf_quants.NVFP4.ue4m3_to_fp32(np.arange(256, dtype=np.uint8)), dtype=np.float32),
    # IQ1's lattice offset by its sign bit (0: +delta, 1: -delta), for the Triton kernels
    "iq1_delta": lambda: np.array([gguf_quants.IQ1_S.delta, -gguf_quants.IQ1_S.delta], dtype=np.float32),
}
_HOST_TABLES: dict[str, torch.Tensor] = {name: torch.from_numpy(make()) for name, make in _NP_TABLES.items()}
_DEVICE_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def code_book(name: str, device: torch.device) -> torch.Tensor:
    """One of gguf's code books as a tensor on `device` (copied there once): float32, or int32
    for the `*_packed` grids."""
    key = (name, device)
    t = _DEVICE_TABLES.get(key)
    if t is None:
        t = _DEVICE_TABLES[key] = _HOST_TABLES[name].to(device)
    return t
