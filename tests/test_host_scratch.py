"""The CPU's reusable expansion buffer: carved tensors are disjoint, the memory is kept between
calls, each thread has its own, and a layer's experts expanded into it give the values of a
fresh expansion (so the CPU path's logits do not depend on what the buffer held before)."""
from __future__ import annotations

import threading

import numpy as np
import torch
from dequant_support import random_blocks
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from engine.quant import dequant, host_scratch
from engine.quant.qtensor import QTensor


def test_carved_tensors_are_disjoint_and_the_memory_is_kept():
    host_scratch.release()
    a, b = host_scratch.carve([(3, 4), (5,)], torch.float32)
    assert a.shape == (3, 4) and b.shape == (5,) and a.is_contiguous()
    a.fill_(1.0)
    b.fill_(2.0)
    assert torch.all(a == 1.0) and torch.all(b == 2.0)  # no overlap
    held = host_scratch.held()
    assert held == 17 * 4
    (c,) = host_scratch.carve([(2, 2)], torch.bfloat16)  # smaller: the same memory, not grown
    assert host_scratch.held() == held and c.data_ptr() == a.data_ptr()
    (d,) = host_scratch.carve([(100,)], torch.float32)  # larger: grown once
    assert host_scratch.held() == 400
    host_scratch.release()
    assert host_scratch.held() == 0


def test_each_thread_has_its_own_buffer():
    host_scratch.release()
    (mine,) = host_scratch.carve([(64,)], torch.float32)
    theirs: list[int] = []

    def other() -> None:
        (t,) = host_scratch.carve([(64,)], torch.float32)
        theirs.append(t.data_ptr())
        host_scratch.release()

    th = threading.Thread(target=other)
    th.start()
    th.join()
    assert theirs and theirs[0] != mine.data_ptr()
    host_scratch.release()


def test_expansion_into_a_dirty_buffer_gives_gguf_values():
    """Experts expanded into the kept buffer, over what an earlier expansion left there, equal
    gguf's dequantiser, for the slice (every expert) and the gather (routed ones) paths."""
    raw, (rows, cols) = random_blocks(T.Q4_K, 8, 2, seed=11)  # 8 rows of 2 blocks
    qt = QTensor(torch.from_numpy(raw).reshape(-1), T.Q4_K, (4, 2, cols))
    ref = torch.from_numpy(np.nan_to_num(gguf_quants.dequantize(raw, T.Q4_K))).reshape(4, 2, cols)
    host_scratch.release()
    for fill in (0.0, float("nan"), 7.0):
        (out,) = host_scratch.carve([(4, 2, cols)], torch.float32)
        out.fill_(fill)
        got = qt.dequantize(torch.float32, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(got.nan_to_num(), ref)
        (g,) = host_scratch.carve([(2, 2, cols)], torch.float32)
        g.fill_(fill)
        picked = qt.gather(torch.tensor([3, 1]), torch.float32, out=g)
        assert torch.equal(picked.nan_to_num(), ref[[3, 1]])
    host_scratch.release()


def test_the_cpu_step_is_whole_blocks_for_any_block_size():
    """A CPU step is CHUNK_VALUES values whatever the block size: Q8_0's 32-value blocks and
    Q4_K's 256 step over the same number of values, and a tensor of many steps expands the
    same as one of a single step."""
    for qtype in (T.Q8_0, T.Q4_K):
        raw, (rows, cols) = random_blocks(qtype, 16, 8, seed=3)
        t = torch.from_numpy(raw).reshape(-1)
        whole = dequant.dequantize(t, qtype, (rows, cols))
        old = dequant.CHUNK_VALUES
        try:
            dequant.CHUNK_VALUES = 3 * dequant.block_geometry(qtype)[0]  # 3 blocks a step: ragged end
            stepped = dequant.dequantize(t, qtype, (rows, cols), out=torch.empty(rows, cols))
        finally:
            dequant.CHUNK_VALUES = old
        assert torch.equal(whole.nan_to_num(), stepped.nan_to_num())
