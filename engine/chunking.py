"""Prompt chunking and the automatic chunk size.

Auto weighs prompt length AND stage count from costs measured on the main device:

* t0(c): one layer's time for a chunk of c tokens at position 0, measured at each candidate
  size the way a fixed chunk runs (CUDA graph replays when they are on: eager timing is bound
  by host launches at small sizes); small chunks use the GPU less well — not a straight line,
  so no line is fitted;
* e: extra time per (query token x cached key) of attention, measured once with a long
  prefix, because a chunk deep in a long prompt attends to everything before it;
* h: host time to launch one layer.  Stage threads share one Python interpreter, so the
  launches of ALL stages are serialised by the GIL: the run can't be shorter than
  chunks x stages x layers-per-stage x h (0.16 ms a layer replayed on H200, 0.9-1.4 eager).

A stage's time for chunk i is T_i = L x (t0(c_i) + e x c_i x p_i) (L = layers of the deepest
stage).  The makespan of the pipeline is  sum_i T_i + (P - 1) x max_i T_i  (fill and drain),
or the host bound if that is longer.  One stage favours big chunks; more stages favour smaller
ones — until launching them costs more than computing them.

Schedules.  With equal chunks, chunk i+1 costs more than chunk i (it attends to a longer
prefix), so in the overlap each stage waits for its predecessor's costlier chunk, every chunk:
those waits add up to the last chunk's cost (measured on 2x H200: 44 ms of an 870 ms 32K
prefill).  A *balanced* schedule keeps the number of chunks and sizes them so each costs the
same — bigger early, smaller late — and the pipeline's bubble shrinks to one average chunk.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

CPU_CANDIDATES = (16, 32, 64, 128, 256, 512, 1024, 2048)
GPU_CANDIDATES = (1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


def chunk_bounds(n_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """(start, length) of each chunk."""
    if n_tokens <= 0:
        return []
    return [(s, min(chunk, n_tokens - s)) for s in range(0, n_tokens, chunk)]


GRAIN = 64  # balanced chunk sizes are multiples of this many tokens


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
        return self.layers_per_stage * self.layer_time(tokens, position)

    def layer_time(self, tokens: int, position: int) -> float:
        return self.t0(tokens) + self.attn_s_per_token_key * tokens * position


def balanced_bounds(n_tokens: int, n_chunks: int, cost: ChunkCost, grain: int = GRAIN) -> list[tuple[int, int]]:
    """At most `n_chunks` chunks covering the prompt, each of (nearly) equal modelled cost.

    The smallest per-chunk time tau for which a greedy cut (each chunk the largest multiple of
    `grain` tokens costing <= tau) needs no more than n_chunks chunks, found by bisection."""
    if n_tokens <= 0:
        return []
    n_chunks = max(1, min(n_chunks, -(-n_tokens // grain)))
    if n_chunks == 1:
        return [(0, n_tokens)]
    sizes = [k * grain for k in range(1, n_tokens // grain + 1)]

    def cut(tau: float) -> list[tuple[int, int]] | None:
        out, pos = [], 0
        while pos < n_tokens:
            if len(out) == n_chunks:
                return None
            rest = n_tokens - pos
            lo, hi = 0, min(len(sizes), rest // grain) - 1  # largest size <= rest with layer_time <= tau
            best = grain if rest >= grain else rest
            while lo <= hi:
                mid = (lo + hi) // 2
                if cost.layer_time(sizes[mid], pos) <= tau:
                    best, lo = sizes[mid], mid + 1
                else:
                    hi = mid - 1
            if best < rest and rest - best < grain:  # no sliver at the end
                best = rest
            out.append((pos, best))
            pos += best
        return out

    lo = 0.0
    hi = cost.layer_time(n_tokens, 0) + cost.attn_s_per_token_key * n_tokens * n_tokens
    best = chunk_bounds(n_tokens, -(-n_tokens // n_chunks))
    for _ in range(48):
        mid = (lo + hi) / 2
        got = cut(mid)
        if got is None:
            lo = mid
        else:
            best, hi = got, mid
    return best


def bounds_makespan(bounds: list[tuple[int, int]], n_stages: int, cost: ChunkCost) -> float:
    """Modelled prefill time of these chunks through n_stages equal stages (see module doc)."""
    if not bounds:
        return 0.0
    times = [cost.stage_time(n, p) for p, n in bounds]
    pipeline = sum(times) + (n_stages - 1) * max(times)
    host = len(bounds) * n_stages * cost.layers_per_stage * cost.host_s_per_layer
    return max(pipeline, host)


def makespan(n_tokens: int, chunk: int, n_stages: int, cost: ChunkCost) -> float:
    return bounds_makespan(chunk_bounds(n_tokens, chunk), n_stages, cost)


def schedule(n_tokens: int, chunk: int, kind: str, cost: ChunkCost | None) -> list[tuple[int, int]]:
    """The chunks of a prompt: `fixed` cuts every `chunk` tokens; `balanced` makes as many
    chunks of equal modelled cost."""
    if kind == "balanced" and cost is not None:
        return balanced_bounds(n_tokens, -(-n_tokens // chunk), cost)
    return chunk_bounds(n_tokens, chunk)


def choose_chunk(n_tokens: int, n_stages: int, cost: ChunkCost,
                 candidates: tuple[int, ...] = GPU_CANDIDATES) -> tuple[int, str]:
    """The candidate chunk with the smallest modelled makespan (fixed schedule), and why."""
    chunk, _, reason = choose_schedule(n_tokens, n_stages, cost, candidates, ("fixed",))
    return chunk, reason


def choose_schedule(n_tokens: int, n_stages: int, cost: ChunkCost, candidates: tuple[int, ...] = GPU_CANDIDATES,
                    kinds: tuple[str, ...] = ("fixed", "balanced")) -> tuple[int, str, str]:
    """(chunk, schedule kind, why) with the smallest modelled makespan over candidates x kinds."""
    if n_tokens <= 0:
        return 1, "fixed", "empty prompt"
    cands = sorted({min(c, n_tokens) for c in candidates if c > 0})
    options = []
    for c in cands:
        for kind in kinds:
            if kind == "balanced" and (c >= n_tokens or (n_stages < 2 and "fixed" in kinds)):
                continue  # one chunk has nothing to balance; one stage has no bubble to shrink
            est = bounds_makespan(schedule(n_tokens, c, kind, cost), n_stages, cost)
            options.append((est, -c, kind == "balanced", c, kind))
    if not options:
        return n_tokens, "fixed", f"auto: the whole prompt ({n_tokens} tokens) as one chunk"
    est, _, _, best, kind = min(options)
    n = -(-n_tokens // best)
    what = f"{best} tokens x {n} chunks" if kind == "fixed" else f"{n} balanced chunks (about {best} tokens each)"
    reason = (f"auto: {what} over {n_stages} stage(s), modelled {est * 1e3:.1f} ms from costs measured "
              f"on the main device")
    return best, kind, reason
