"""Expand only the experts a chunk routes to (issue 32 item 1, issue 33 item 4).

A decode token routes to k of a layer's E experts (8 of 128 for Qwen3-30B-A3B); expanding all
E stored experts into the compute dtype for it spends the step dequantising weights it never
reads.  After routing, the experts used are gather-dequantised (by expert index) into a compact
scratch of S slots, and the expert GEMMs run over those S slots with the expert ids remapped to
slot ids.  Large prefill chunks touch most experts; there the full expansion (one pass over the
whole tensor, no gather) is kept.

The rule (`compact_wanted`) compares the experts used with the total against one threshold per
device type, `COMPACT_MAX_FRACTION`, measured with `benchmarks/routed_experts_bench.py`:

* CPU (the reference path, which reads the routing on the host): S is the number of distinct
  experts the chunk routes to.
* CUDA (the grouped-GEMM path, which must not synchronise with the host: it runs inside CUDA
  graphs, decode's included): S is the bound min(n_tokens * k, E), known on the host from the
  chunk size alone.  A chunk's distinct experts fill the first slots in ascending expert order;
  the slots beyond them (when tokens share experts) hold expert 0 with no rows: dequantised,
  never read.  The shapes then depend only on the chunk size, so a graph captured at one size
  replays correctly for any routing (`compact_routing` has no host synchronisation).

Streamed experts (engine/models/experts.py `ExpertCache`) were already fetched and expanded per needed
expert (`ExpertCache.expand` of the needed slots), so only resident experts change here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Expand compactly when the experts used (CPU: distinct; CUDA: the bound n*k) are fewer than
# this fraction of the layer's experts.  CPU 1.0 (compact unless every expert is used): measured
# on the 2-core dev machine with benchmarks/routed_experts_bench.py (issue 33's shapes, Q4_K_M:
# a decode token 79 -> 7 ms per layer; 16 of 16 experts used: both paths within noise, 0.94-1.04).
# CUDA 0.5: a first value, not measured (decode, 8 of 128, is far below it); the lead measures
# the switch point on the device with the same benchmark (`--device cuda:0`).
COMPACT_MAX_FRACTION: dict[str, float] = {"cpu": 1.0, "cuda": 0.5}
DEFAULT_FRACTION = 0.5  # any other device type
# bytes of compute-dtype experts expanded at once on the reference (CPU) path: bounds the
# scratch whatever the model (a real Qwen3-30B-A3B layer is 2.4 GB of fp32 experts)
REFERENCE_SCRATCH_BYTES = 256 << 20


def compact_wanted(used: int, total: int, device_type: str) -> bool:
    """Whether `used` of `total` experts are few enough to gather-dequantise just them."""
    return used < COMPACT_MAX_FRACTION.get(device_type, DEFAULT_FRACTION) * total


def slot_bound(n_tokens: int, k: int, n_experts: int) -> int:
    """The most distinct experts n tokens of top-k routing can use (static: a graph may hold it)."""
    return min(n_tokens * k, n_experts)


@dataclass(frozen=True)
class CompactRouting:
    """Slot j of the compact scratch holds expert `experts[j]` and the sorted rows
    `offsets[j-1]:offsets[j]` (int32 cumulative counts, for `torch._grouped_mm`)."""

    experts: torch.Tensor  # [S] int64, contiguous, every entry in [0, E)
    offsets: torch.Tensor  # [S] int32


def compact_routing(sorted_experts: torch.Tensor, slots: int, distinct: bool = False) -> CompactRouting:
    """The compact slots of rows sorted by expert (`sorted_experts`: the expert of each sorted
    (token, slot) row, ascending), on their device without a host synchronisation.

    `slots` must be at least the number of distinct experts (`slot_bound` guarantees it).
    `distinct`: no two rows share an expert (one token's top-k, a decode step): slot j is row j,
    the same slots and offsets as the general rule in one kernel instead of twelve (a decode
    graph runs this in every layer of every token)."""
    dev = sorted_experts.device
    m = sorted_experts.numel()
    if distinct and slots == m:
        return CompactRouting(sorted_experts.to(torch.int64).contiguous(),
                              torch.arange(1, m + 1, dtype=torch.int32, device=dev))
    first = torch.ones(m, dtype=torch.int64, device=dev)  # 1 where a new expert's rows begin
    if m > 1:
        first[1:] = (sorted_experts[1:] != sorted_experts[:-1]).to(torch.int64)
    slot_of = torch.cumsum(first, 0) - 1  # each row's compact slot
    experts = torch.zeros(slots, dtype=torch.int64, device=dev)
    experts.scatter_(0, slot_of, sorted_experts.to(torch.int64))  # every write to a slot is the same expert
    counts = torch.zeros(slots, dtype=torch.int64, device=dev)
    counts.index_add_(0, slot_of, torch.ones_like(slot_of))
    return CompactRouting(experts.contiguous(), torch.cumsum(counts, 0, dtype=torch.int32))


def batches(experts: list[int], per_expert_bytes: int, budget: int = REFERENCE_SCRATCH_BYTES) -> list[list[int]]:
    """`experts` cut into consecutive batches whose expansion fits `budget` bytes (at least one
    expert per batch)."""
    step = max(1, budget // max(per_expert_bytes, 1))
    return [experts[i:i + step] for i in range(0, len(experts), step)]
