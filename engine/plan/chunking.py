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

from engine.events import chunk_bounds  # noqa: F401  (chunking's own name for it)

CPU_CANDIDATES = (16, 32, 64, 128, 256, 512, 1024, 2048)
# up to 64K: on one GPU a long prompt runs fastest in few big chunks (H200, 64K prompt: one
# 65536-token chunk 3.8% faster than 16384x4); the probe stops at the first size that does not fit
GPU_CANDIDATES = (1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152, 65536)


GRAIN = 64  # balanced chunk sizes are multiples of this many tokens


def fewest_chunks(device: object, n_dev: int, schedule: str) -> bool:
    """Whether auto takes the fewest chunks of at most CPU_CANDIDATES[-1] tokens unprobed: one
    stage computing the prompt (n_dev 1: one device, or prefill-main) on a CPU, with a fixed or auto
    schedule.  Nothing overlaps there, and each chunk expands every layer's stored experts again."""
    return n_dev == 1 and getattr(device, "type", "cpu") == "cpu" and schedule in ("auto", "fixed")


def one_chunk_only(device: object, n_tokens: int) -> bool:
    """Whether a prompt of n_tokens is no longer than the smallest chunk auto considers on the
    device's kind (`device.type`: a torch.device, or the planner's): then it runs as one chunk
    whatever the costs, and nothing is probed."""
    smallest = GPU_CANDIDATES[0] if getattr(device, "type", "cpu") == "cuda" else CPU_CANDIDATES[0]
    return n_tokens <= smallest


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


EFFICIENT_SLACK = 1.25  # a chunk size is "efficient" within this factor of the best per-token cost


def efficient_floor(cost: ChunkCost, slack: float = EFFICIENT_SLACK) -> int:
    """The smallest measured chunk size whose per-token cost is within `slack` of the best:
    below it the device is used too poorly (on H200 a 1024-token chunk costs 2.5x per token
    what a 6144-token one does), so balanced chunks shrink no further."""
    per_token = {c: t / c for c, t in cost.layer_s.items() if c > 0}
    if not per_token:
        return 1
    best = min(per_token.values())
    return min(c for c, r in per_token.items() if r <= slack * best)


def balanced_bounds(n_tokens: int, n_chunks: int, cost: ChunkCost, grain: int = GRAIN,
                    floor: int = 0) -> list[tuple[int, int]]:
    """At most `n_chunks` chunks covering the prompt, each of (nearly) equal modelled cost.

    The smallest per-chunk time tau for which a greedy cut (each chunk the largest multiple of
    `grain` tokens costing <= tau, and at least `floor` tokens) needs no more than n_chunks
    chunks, found by bisection.  A coarse grain keeps the distinct sizes few (each size is a
    CUDA graph to capture); the floor keeps late chunks efficient."""
    if n_tokens <= 0:
        return []
    n_chunks = max(1, min(n_chunks, -(-n_tokens // grain)))
    if n_chunks == 1:
        return [(0, n_tokens)]
    first = max(1, -(-floor // grain))  # the smallest size allowed, in grains
    sizes = [k * grain for k in range(min(first, max(n_tokens // grain, 1)), n_tokens // grain + 1)]

    def cut(tau: float) -> list[tuple[int, int]] | None:
        out, pos = [], 0
        while pos < n_tokens:
            if len(out) == n_chunks:
                return None
            rest = n_tokens - pos
            fits = bisect.bisect_right(sizes, rest)  # sizes <= rest
            lo, hi = 0, fits - 1  # the largest size <= rest with layer_time <= tau
            best = sizes[0] if fits else rest
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


def bounds_makespan(bounds: list[tuple[int, int]], n_stages: int, cost: ChunkCost, interleave: int = 1,
                    hop_s_per_token: float = 0.0) -> float:
    """Modelled prefill time of these chunks through n_stages equal devices (see module doc).

    With `interleave` V layer groups per device a chunk visits every device V times: each
    device still does all of its layers' work, but the fill and drain that leave devices idle
    shrink to (P - 1) x (one group's time + one hand-off) instead of (P - 1) x a whole stage's
    time.  `hop_s_per_token` is the hand-off's time per token of a chunk (activations over
    the link between devices); it is paid in the fill/drain, the copies of the steady state
    overlap compute.  With fewer chunks than devices the chunks' chains are serial (see below).

    Check, equal chunks of per-device time T: M >= D gives (M + (D - 1) / V) T; M < D gives
    (D + (M - 1) / V) T (one chunk: D x T, whatever V).  The two agree at M = D."""
    if not bounds:
        return 0.0
    v = max(interleave, 1)
    times = [cost.stage_time(n, p) for p, n in bounds]
    big = max(range(len(bounds)), key=lambda i: times[i])
    hop = hop_s_per_token * bounds[big][1] if n_stages > 1 else 0.0
    if v > 1 and len(bounds) < n_stages:
        # fewer chunks than devices: the pipeline never fills.  Each chunk walks all D x V groups
        # (a group's time is T/V) one group behind the chunk before it, and no two chunks meet on
        # a device (that needs D chunks in flight): a flow shop of D x V equal steps per chunk
        pipeline = sum(times) / v + (n_stages * v - 1) * (times[big] / v + hop)
    else:
        pipeline = sum(times) + (n_stages - 1) * (times[big] / v + hop)
    host = len(bounds) * n_stages * cost.layers_per_stage * cost.host_s_per_layer
    return max(pipeline, host)


def schedule(n_tokens: int, chunk: int, kind: str, cost: ChunkCost | None, grain: int = GRAIN,
             floor: int = 0) -> list[tuple[int, int]]:
    """The chunks of a prompt: `fixed` cuts every `chunk` tokens; `balanced` makes as many
    chunks of equal modelled cost (multiples of `grain`, at least `floor` tokens)."""
    if kind == "balanced" and cost is not None:
        return balanced_bounds(n_tokens, -(-n_tokens // chunk), cost, grain, floor)
    return chunk_bounds(n_tokens, chunk)


@dataclass(frozen=True)
class Choice:
    """What auto picked, its modelled prefill time, and why."""

    chunk: int
    kind: str  # fixed | balanced
    modelled_s: float
    reason: str
    interleave: int = 1
    bounds: tuple[tuple[int, int], ...] = ()  # (start, length) of each chunk: what the run executes


def choose(n_tokens: int, n_stages: int, cost: ChunkCost, candidates: tuple[int, ...] = GPU_CANDIDATES,
           kinds: tuple[str, ...] = ("fixed", "balanced"), interleave: int = 1, hop_s_per_token: float = 0.0,
           grain: int = GRAIN, other_interleaves: tuple[int, ...] = ()) -> Choice:
    """The (chunk, schedule) with the smallest modelled makespan over candidates x kinds for
    the session's interleave; `other_interleaves` are modelled too, and the reason says when
    one of them would be faster (they need another layer split, so a new session)."""
    if n_tokens <= 0:
        return Choice(1, "fixed", 0.0, "empty prompt", interleave, ())
    floor = efficient_floor(cost)

    def best_for(v: int) -> tuple[float, int, str, tuple[tuple[int, int], ...]] | None:
        options = []
        for c in sorted({min(c, n_tokens) for c in candidates if c > 0}):
            for kind in kinds:
                if kind == "balanced" and (c >= n_tokens or (n_stages < 2 and "fixed" in kinds)):
                    continue  # one chunk has nothing to balance; one stage has no bubble to shrink
                bounds = schedule(n_tokens, c, kind, cost, grain, floor)
                est = bounds_makespan(bounds, n_stages, cost, v, hop_s_per_token)
                options.append((est, -c, kind == "balanced", c, kind, tuple(bounds)))
        if not options:
            return None
        est, _, _, c, kind, bounds = min(options)
        return est, c, kind, bounds

    got = best_for(interleave)
    if got is None:
        return Choice(n_tokens, "fixed", 0.0, f"auto: the whole prompt ({n_tokens} tokens) as one chunk", interleave,
                      ((0, n_tokens),))
    est, best, kind, bounds = got
    n = -(-n_tokens // best)
    what = f"{best} tokens x {n} chunks" if kind == "fixed" else f"{n} balanced chunks (about {best} tokens each)"
    over = f"{n_stages} stage(s)" + (f" x {interleave} layer groups" if interleave > 1 else "")
    reason = f"auto: {what} over {over}, modelled {est * 1e3:.1f} ms from costs measured on the main device"
    alts = [(alt[0], v) for v in other_interleaves if v != interleave and (alt := best_for(v)) is not None]
    if alts:
        alt_s, v = min(alts)
        if alt_s < est * 0.97:
            split = f"interleave:{v}" if v > 1 else "a contiguous split"
            reason += f"; {split} would model {alt_s * 1e3:.1f} ms ({(est / alt_s - 1) * 100:.0f}% faster)"
    return Choice(best, kind, est, reason, interleave, bounds)
