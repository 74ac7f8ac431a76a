"""NVTX ranges carry the Gantt's names (issue 37 item 5); off CUDA they cost nothing."""
from __future__ import annotations

import torch

from engine import nvtx


def test_names_are_the_gantts():
    assert nvtx.block_name(1, 3, 8, 15) == "stage 1 C3 layers 8-15"
    assert nvtx.block_name(0, -1, 0, 7) == "stage 0 decode layers 0-7"


def test_off_cuda_no_range_is_pushed(monkeypatch):
    pushed: list[str] = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", pushed.append)
    with nvtx.span(torch.device("cpu"), "stage 0 C0 layers 0-3"):
        pass
    assert pushed == [] and not nvtx.enabled(torch.device("cpu"))
    monkeypatch.setenv(nvtx.ENV, "0")
    assert not nvtx.enabled(torch.device("cuda", 0))
