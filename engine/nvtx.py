"""NVTX ranges named as the Gantt names its blocks, so `nsys profile strata-bench run …` shows
stage, chunk and layer group on the GPU timeline (torch.cuda.nvtx).  A no-op off CUDA, and with
STRATA_NVTX=0."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

ENV = "STRATA_NVTX"


def enabled(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get(ENV, "1") != "0"


def block_name(stage: int, chunk: int, first_layer: int, last_layer: int) -> str:
    """"stage 1 C3 layers 8-15" (a prefill chunk) or "stage 1 decode layers 8-15" (chunk < 0)."""
    what = f"C{chunk}" if chunk >= 0 else "decode"
    return f"stage {stage} {what} layers {first_layer}-{last_layer}"


@contextlib.contextmanager
def span(device: torch.device, name: str) -> Iterator[None]:
    """One NVTX range around the block on `device` (nothing off CUDA)."""
    if not enabled(device):
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
