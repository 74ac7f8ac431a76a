"""Prompt chunking and the automatic chunk size.

Auto weighs prompt length AND stage count from costs measured on the main device:

* t0(c): one layer's time for a chunk of c tokens at position 0, measured at each candidate
  size (small chunks use the GPU less well — not a straight line, so no line is fitted);
* e: extra time per (query token x cached key) of attention, measured once with a long
  prefix, because a chunk deep in a long prompt attends to everything before it;
* h: host time to launch one layer.  Stage threads share one Python interpreter, so the
  launches of ALL stages are serialised by the GIL: the run can't be shorter than
  chunks x stages x layers-per-stage x h.

A stage's time for chunk i is T_i = L x (t0(c_i) + e x c_i x p_i) (L = layers of the deepest
stage).  The makespan of the pipeline is  sum_i T_i + (P - 1) x max_i T_i  (fill and drain),
or the host bound if that is longer.  One stage favours big chunks; more stages favour smaller
ones — until launching them costs more than computing them.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

CPU_CANDIDATES = (16, 32, 64, 128, 256, 512, 1024, 2048)
GPU_CANDIDATES = (1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


def chunk_bounds(n_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """(start, length) of each chunk."""
    if n_tokens <= 0:
        return []
    return [(s, min(chunk, n_tokens - s)) for s in range(0, n_tokens, chunk)]


@dataclass(frozen=True)
class ChunkCost:
    """Measured per-layer costs (seconds) on the main device; see the module doc."""

    layer_s: dict[int, float]  # chunk tokens -> one layer's time at position 0
    attn_s_per_token_key: float = 0.0
    host_s_per_layer: float = 0.0
    layers_per_stage: int = 1
    sizes: tuple[int, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(sorted(self.layer_s)))

    def t0(self, tokens: int) -> float:
        """One layer at position 0, interpolated between measured sizes (linear beyond)."""
        xs = self.sizes
        if tokens in self.layer_s:
            return self.layer_s[tokens]
        if len(xs) == 1:
            return self.layer_s[xs[0]] * tokens / xs[0]
        i = min(max(bisect.bisect_left(xs, tokens), 1), len(xs) - 1)
        x0, x1 = xs[i - 1], xs[i]
        y0, y1 = self.layer_s[x0], self.layer_s[x1]
        if tokens < x0:  # below the smallest: no cheaper than its per-token rate allows
            return max(y0 * tokens / x0, y0 - (y1 - y0) * (x0 - tokens) / (x1 - x0))
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def stage_time(self, tokens: int, position: int) -> float:
        return self.layers_per_stage * (self.t0(tokens) + self.attn_s_per_token_key * tokens * position)


def makespan(n_tokens: int, chunk: int, n_stages: int, cost: ChunkCost) -> float:
    bounds = chunk_bounds(n_tokens, chunk)
    if not bounds:
        return 0.0
    times = [cost.stage_time(n, p) for p, n in bounds]
    pipeline = sum(times) + (n_stages - 1) * max(times)
    host = len(bounds) * n_stages * cost.layers_per_stage * cost.host_s_per_layer
    return max(pipeline, host)


def choose_chunk(n_tokens: int, n_stages: int, cost: ChunkCost,
                 candidates: tuple[int, ...] = GPU_CANDIDATES) -> tuple[int, str]:
    """The candidate chunk with the smallest modelled makespan, and why."""
    if n_tokens <= 0:
        return 1, "empty prompt"
    cands = sorted({min(c, n_tokens) for c in candidates if c > 0})
    best = min(cands, key=lambda c: (makespan(n_tokens, c, n_stages, cost), -c))
    est = makespan(n_tokens, best, n_stages, cost)
    reason = (f"auto: {best} tokens x {math.ceil(n_tokens / best)} chunks over {n_stages} stage(s), "
              f"modelled {est * 1e3:.1f} ms from costs measured on the main device")
    return best, reason
