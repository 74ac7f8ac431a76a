"""A CPU stage's one reusable buffer for expanding stored experts.

A chunk on the CPU expands a layer's stored experts into float tensors of tens of MiB, layer
after layer.  glibc's allocator hands a block that large (over its 32 MiB mmap ceiling) back to
the system when it is freed, so every fresh expansion page-faults its memory in again: on the
2-core CI machine that cost as much as the expansion itself.  A GPU's caching allocator already
keeps such blocks; a `HostScratch` keeps them on the host.

A stage owns one (`StageRuntime.scratch`) and hands it to its layers: a stage's layers run one
after another, on its own thread for prefill and on the caller's for decode, never two at once,
so one buffer per CPU stage is what the memory plan counts (its expansion batch,
`memory_plan.cpu_expert_batch`).  `carve(shapes, dtype)` cuts it into contiguous tensors, grown
to the largest request and never shrunk until `release()`; what is carved is valid until the
next `carve`: callers use it within one batch and let go before asking again.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)


class HostScratch:
    """One growing uint8 buffer on the host, cut into tensors per request."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._buf: torch.Tensor | None = None

    @property
    def held(self) -> int:
        """Bytes the buffer holds (0 before the first carve and after release)."""
        return 0 if self._buf is None else self._buf.numel()

    def release(self) -> None:
        """Drop the buffer (its memory goes back to the system)."""
        self._buf = None

    def carve(self, shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> list[torch.Tensor]:
        """Contiguous tensors of `shapes` in `dtype`, laid end to end in the buffer (grown to fit
        them where it is smaller).  Valid until the next carve."""
        size = torch.empty((), dtype=dtype).element_size()
        counts = []
        for shape in shapes:
            n = 1
            for d in shape:
                n *= int(d)
            counts.append(n)
        need = sum(counts) * size
        if self._buf is None or self._buf.numel() < need:
            self._buf = None  # the old buffer goes before the new one is made: one at a time
            self._buf = torch.empty(need, dtype=torch.uint8)
            log.debug("host scratch %s grown to %.1f MiB", self.name, need / 2**20)
        out, at = [], 0
        for shape, n in zip(shapes, counts):
            out.append(self._buf[at:at + n * size].view(dtype).view(tuple(int(d) for d in shape)))
            at += n * size
        return out
