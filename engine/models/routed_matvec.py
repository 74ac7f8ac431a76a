"""Decode's routed experts straight from their stored blocks (issue 32 item 1): for a few rows
(a decode token's k routed (token, expert) pairs), one matrix-vector product per row and
weight from the stored bytes (`engine.quant.qmatvec_triton`), instead of gathering the routed
experts into a compute-dtype scratch and running grouped GEMMs over it.

The rule (`wanted`) is one threshold on the rows, `MATVEC_MAX_ROWS`, measured with
`benchmarks/routed_experts_bench.py` on the device: each row reads its expert's weights once,
so the work grows with the rows where the grouped GEMM's does not.  It depends on the chunk
size only (n * k rows), so a CUDA graph captured at one size holds the same path."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.quant.qtensor import QTensor

if TYPE_CHECKING:
    from engine.models.experts import ExpertCache
    from engine.models.layers import LayerWeights

# rows (tokens x experts used) up to which the stored-block products beat gather + grouped GEMM:
# one H200, Qwen3-30B-A3B's MoE layer (128 experts of 768, top-8, Q4_K/Q6_K), eager, best of 20
# (`benchmarks/routed_experts_bench.py --device cuda:0 --tokens 1,2,4,8 --repeat 20`): 8 rows
# 0.43 vs 0.74 ms (compact scratch), 16 rows 0.42 vs 0.83, 32 rows 0.53 vs 0.80, 64 rows 1.00 vs 1.04
MATVEC_MAX_ROWS = 32


def _types_ok(rows: int, x: torch.Tensor, qtypes: list) -> bool:
    if rows > MATVEC_MAX_ROWS or x.device.type != "cuda":
        return False
    from engine.quant import qmatvec_triton  # imports triton: only where a GPU runs

    return qmatvec_triton.available() and all(q in qmatvec_triton.TYPES for q in qtypes)


def wanted(w: LayerWeights, rows: int, x: torch.Tensor) -> bool:
    """Whether a chunk of `rows` (token, expert) rows computes its resident experts here."""
    parts = (w.gate_exps, w.up_exps, w.down_exps)
    return all(isinstance(t, QTensor) for t in parts) and _types_ok(rows, x, [t.qtype for t in parts])


def cache_wanted(cache: ExpertCache, layer: int, rows: int, x: torch.Tensor) -> bool:
    """The same rule for streamed experts (the expert cache's slots hold them as stored), so a
    chunk computes the same way resident or streamed: one digest."""
    return _types_ok(rows, x, [part.qtype for part in cache.arena.layouts[layer].parts])


def cache_experts(cache: ExpertCache, layer: int, xs: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    """`experts` over the cache's slots: row m's expert sits in slot `row_slots[m]`."""
    from engine.quant import qmatvec_triton

    flat = cache.pool.view(-1)
    parts = cache.arena.layouts[layer].parts

    def mv(i: int, x: torch.Tensor) -> torch.Tensor:
        part = parts[i]
        return qmatvec_triton.matvec(flat[part.offset:], part.qtype, (cache.n_slots, *part.shape), x, row_slots,
                                     expert_stride=cache.pool.stride(0))

    a = F.silu(mv(0, xs)) * mv(1, xs)
    return mv(2, a)


def experts(w: LayerWeights, xs: torch.Tensor, row_experts: torch.Tensor) -> torch.Tensor:
    """The SiLU-gated expert FFN of rows `xs` (`row_experts` each row's expert id, int64 on the
    device; rows in any order: each row's product is computed on its own): [rows, hidden] in
    xs's dtype, as the grouped-GEMM path computes it."""
    from engine.quant import qmatvec_triton

    def mv(t: QTensor, x: torch.Tensor) -> torch.Tensor:
        return qmatvec_triton.matvec(t.raw, t.qtype, t.shape, x, row_experts)

    a = F.silu(mv(w.gate_exps, xs)) * mv(w.up_exps, xs)
    return mv(w.down_exps, a)
