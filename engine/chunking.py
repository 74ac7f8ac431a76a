"""Prompt chunking and the automatic chunk size.

Auto weighs prompt length AND stage count: per-chunk stage time is modelled as
fixed + per-token (fitted from measured layer times), and the chunk minimising the pipeline's
makespan  sum_i t(c_i) + (P - 1) * max_i t(c_i)  wins.  One stage favours big chunks (fewer
fixed costs); more stages favour smaller ones (shorter fill and drain).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

CPU_CANDIDATES = (16, 32, 64, 128, 256, 512, 1024, 2048)
GPU_CANDIDATES = (256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


def chunk_bounds(n_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """(start, length) of each chunk."""
    if n_tokens <= 0:
        return []
    return [(s, min(chunk, n_tokens - s)) for s in range(0, n_tokens, chunk)]


@dataclass(frozen=True)
class ChunkCost:
    """Time of one stage's share of one chunk: fixed_s + per_token_s * tokens."""

    fixed_s: float
    per_token_s: float

    def time(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens

    @classmethod
    def fit(cls, samples: list[tuple[int, float]]) -> "ChunkCost":
        """Least-squares line through (tokens, seconds); clamps to non-negative terms."""
        if len(samples) == 1:
            n, t = samples[0]
            return cls(0.0, t / max(n, 1))
        xs = [float(n) for n, _ in samples]
        ys = [t for _, t in samples]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else my / max(mx, 1)
        b = max(b, 1e-12)
        a = max(my - b * mx, 0.0)
        return cls(a, b)


def makespan(n_tokens: int, chunk: int, n_stages: int, cost: ChunkCost) -> float:
    times = [cost.time(n) for _, n in chunk_bounds(n_tokens, chunk)]
    if not times:
        return 0.0
    return sum(times) + (n_stages - 1) * max(times)


def choose_chunk(n_tokens: int, n_stages: int, cost: ChunkCost,
                 candidates: tuple[int, ...] = GPU_CANDIDATES) -> tuple[int, str]:
    """The candidate chunk with the smallest modelled makespan, and why."""
    if n_tokens <= 0:
        return 1, "empty prompt"
    cands = sorted({min(c, n_tokens) for c in candidates if c > 0})
    best = min(cands, key=lambda c: (makespan(n_tokens, c, n_stages, cost), -c))
    est = makespan(n_tokens, best, n_stages, cost)
    reason = (f"auto: {best} tokens x {math.ceil(n_tokens / best)} chunks over {n_stages} stage(s), "
              f"modelled {est * 1e3:.1f} ms (fixed {cost.fixed_s * 1e3:.2f} ms + "
              f"{cost.per_token_s * 1e6:.2f} us/token per stage-chunk)")
    return best, reason
