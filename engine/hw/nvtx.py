"""NVTX ranges for Nsight Systems: `nsys profile strata-bench run …` shows each stage's compute
of each chunk, its hand-offs and decode steps under the names the Gantt uses
(`stage 1 · cuda:1 (layers 12-23) C3 compute`, `g2 · cuda:0 … C3 copy peer`).

A range is opened only for a CUDA stage (torch.cuda.nvtx: a push/pop of about a microsecond on
the host thread that launches the work, so the range spans the launches; Nsight lines it up with
the kernels).  On the CPU, or with STRATA_NVTX=0, `span` is a no-op context.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from engine import settings_table

ENV = settings_table.row("nvtx").env  # 0: no ranges even on CUDA


def enabled(device: torch.device) -> bool:
    """Ranges for work on this device: CUDA, and not turned off."""
    return device.type == "cuda" and settings_table.env_text("nvtx") != "0"


@contextlib.contextmanager
def _range(name: str) -> Iterator[None]:
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def span(device: torch.device, name: str) -> contextlib.AbstractContextManager:
    """An NVTX range named `name` around a block of work for `device` (a no-op off CUDA)."""
    return _range(name) if enabled(device) else contextlib.nullcontext()


def stage_label(index: int, device: torch.device | str, first: int, end: int, interleaved: bool = False) -> str:
    """A stage as RunPlan.stage_names names it (the Gantt's and the trace's name)."""
    who = f"g{index}" if interleaved else f"stage {index}"
    layers = f" (layers {first}-{end - 1})" if end > first else ""
    return f"{who} · {device}{layers}"
