"""A weight kept in its GGUF block format on a device, expanded only when used.

`QTensor` is raw bytes + type + shape (torch order).  MoE experts stay this way from the file to
the device: `expert(e)` is a byte slice (an expert's blocks are contiguous: they are the leading
dimension), and `dequantize` expands into the compute dtype right before a GEMM.

`stored(src, name, device)` makes one from any weight source: sources that expose their blocks
(`raw`/`qtype`, as `LoadedModel` and `SyntheticSource` do) give them as stored; others (floats
only) are wrapped as F32.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as T

from engine.quant import dequant

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QTensor:
    raw: torch.Tensor  # uint8, whole blocks
    qtype: T
    shape: tuple[int, ...]  # torch order

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def expert(self, e: int) -> QTensor:
        """Row e of the leading dimension (an expert), as a view of the same bytes."""
        per = self.raw.numel() // self.shape[0]
        return QTensor(self.raw[e * per:(e + 1) * per], self.qtype, self.shape[1:])

    def experts(self, lo: int, hi: int) -> QTensor:
        """Rows lo..hi-1 of the leading dimension, as a view of the same bytes."""
        per = self.raw.numel() // self.shape[0]
        return QTensor(self.raw[lo * per:hi * per], self.qtype, (hi - lo, *self.shape[1:]))

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """The values in `dtype` (into `out`, a contiguous tensor of this shape, where given)."""
        return dequant.dequantize(self.raw, self.qtype, self.shape, dtype, out=out)

    def gather(self, experts: torch.Tensor, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `experts` of the leading dimension expanded into one [len(experts), ...] scratch
        in `dtype`: the Triton dequantiser reads them in place, the torch path copies their
        blocks first.  `experts`: a 1-D int64 index on this tensor's device, each entry in
        [0, shape[0]) (checked where the index is on the host; on a GPU a check would
        synchronise it with the host, and `routed_experts.compact_routing` makes it in range).
        With `out` (contiguous, [len(experts), ...]) the values are written there."""
        rows = self.shape[0]
        per = self.raw.numel() // rows
        if experts.device.type == "cpu" and experts.numel() and not (
                0 <= int(experts.min()) and int(experts.max()) < rows):
            raise IndexError(f"expert index {experts.tolist()} outside 0..{rows - 1}")
        index = experts.to(device=self.raw.device, dtype=torch.int64).contiguous()
        return dequant.dequantize(self.raw.view(rows, per), self.qtype, (index.numel(), *self.shape[1:]), dtype,
                                  out=out, rows=index)

    def to(self, device: torch.device | str) -> QTensor:
        return QTensor(self.raw.to(device), self.qtype, self.shape)


def has_blocks(src) -> bool:
    """Whether a weight source can hand out its tensors as stored."""
    return hasattr(src, "raw") and hasattr(src, "qtype")


def stored(src, name: str, device: torch.device | str = "cpu") -> QTensor:
    """The tensor `name` of `src` as stored, on `device` (read from the file without mapping
    it into this process's memory where the source can, so host RAM holds it at most once)."""
    device = torch.device(device)
    if not has_blocks(src):
        t = src.tensor(name).to(torch.float32).contiguous()
        return QTensor(t.reshape(-1).view(torch.uint8).to(device), T.F32, tuple(t.shape))
    qtype, shape = src.qtype(name), tuple(src.shape(name))
    if hasattr(src, "read_into"):
        host = torch.empty(src.nbytes(name), dtype=torch.uint8)
        src.read_into(name, 0, host)
        return QTensor(host.to(device), qtype, shape)
    return QTensor(src.raw(name).to(device), qtype, shape)
