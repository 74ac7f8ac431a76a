"""One reusable buffer per thread for expansions on the CPU.

A chunk on the CPU expands a layer's stored experts into float tensors of tens of MiB, layer
after layer.  glibc's allocator hands a block that large (over its 32 MiB mmap ceiling) back to
the system when it is freed, so every fresh expansion page-faults its memory in again: on the
2-core CI machine that cost as much as the expansion itself.  A GPU's caching allocator already
keeps such blocks; this keeps them on the host.

`take(nbytes)` returns this thread's buffer, grown to at least `nbytes` (never shrunk), and
`carve(buf, shapes, dtype)` cuts it into contiguous tensors.  What is carved is valid until the
same thread takes the buffer again: callers use it within one call and let go before returning.
Each thread (a stage thread, the GUI's runner) has its own, so stages never share one.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

_local = threading.local()


def take(nbytes: int) -> torch.Tensor:
    """This thread's host buffer (uint8) of at least `nbytes`."""
    buf: torch.Tensor | None = getattr(_local, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.buf = torch.empty(int(nbytes), dtype=torch.uint8)
        log.debug("host scratch grown to %.1f MiB", nbytes / 2**20)
    return buf


def held() -> int:
    """Bytes this thread's buffer holds (0 before the first take)."""
    buf = getattr(_local, "buf", None)
    return 0 if buf is None else buf.numel()


def release() -> None:
    """Drop this thread's buffer (the memory returns to the system)."""
    _local.buf = None


def carve(shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Contiguous tensors of `shapes` in `dtype`, laid end to end in this thread's buffer."""
    size = torch.empty((), dtype=dtype).element_size()
    counts = []
    for shape in shapes:
        n = 1
        for d in shape:
            n *= int(d)
        counts.append(n)
    buf = take(sum(counts) * size)
    out, at = [], 0
    for shape, n in zip(shapes, counts):
        out.append(buf[at:at + n * size].view(dtype).view(tuple(int(d) for d in shape)))
        at += n * size
    return out
