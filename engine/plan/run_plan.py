"""A run's plan: chunk size and schedule from the settings and the measured costs.

`choice` applies the chunk_tokens and chunk_schedule settings (a user's chunk size, balanced
from it, or auto: the option `chunking`'s model rates fastest) and returns the chunks with the
modelled prefill time; `plan` turns it into the `RunPlan` a run executes.  Both read a
`Planned`: a Session's public side (its config, devices, layer groups, the measured chunk cost
`Session.chunk_cost`, the hand-off time `Session.hop_s_per_token`), or the what-if planner's
run of a cost profile (engine/plan/planner.py), so a prediction chunks a prompt as a run would.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from engine.events import RunPlan, StagePlan
from engine.plan import chunking

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.pipeline.session import Session


class Kind(Protocol):
    """A device as `choice` reads it: its kind ("cuda" or "cpu"), as torch.device.type."""

    @property
    def type(self) -> str: ...


class Shape(Protocol):
    @property
    def n_layers(self) -> int: ...


class Planned(Protocol):
    """What `choice` reads of a session (engine.pipeline.session.Session; the planner's `WhatIf`)."""

    @property
    def config(self) -> EngineConfig: ...  # chunk_tokens, chunk_schedule, prefill_main, layer_split
    @property
    def devices(self) -> Sequence[Kind]: ...
    @property
    def interleave(self) -> int: ...
    @property
    def spec(self) -> Shape: ...
    @property
    def measured_chunk_cost(self) -> chunking.ChunkCost | None: ...
    def chunk_cost(self, n_tokens: int | None = None) -> chunking.ChunkCost: ...
    def hop_s_per_token(self) -> float: ...


BALANCED_GRAIN_CUDA = 512  # balanced chunk sizes on CUDA: multiples of this, so few distinct sizes (graphs)


def grain(session: Planned) -> int:
    return BALANCED_GRAIN_CUDA if session.devices[0].type == "cuda" else chunking.GRAIN


def balanced_floor(session: Planned, chunk: int, n_tokens: int) -> int:
    """The smallest balanced chunk from a user's chunk size: the efficient size, but never
    above the size the user asked for (they asked for that many chunks)."""
    return min(chunking.efficient_floor(session.chunk_cost(n_tokens)), chunk)


def choice(session: Planned, n_tokens: int, interleave: int | None = None) -> chunking.Choice:
    """Chunk size and schedule from the prefill and chunk_schedule settings, with the
    modelled prefill time (auto: the option the model of `chunking` rates fastest).

    `interleave`: model the settings as if the session's devices held that many layer groups
    each (engine/plan/split_choice.py weighs the splits so); the costs are then measured even for a
    fixed chunk, whose own plan needs none."""
    config = session.config
    c, kind = config.chunk_tokens, config.chunk_schedule
    main_only = config.prefill_main
    n_dev = 1 if main_only else len(session.devices)
    what_if = interleave is not None
    v = 1 if main_only else (interleave if what_if else session.interleave)
    g = grain(session)
    hop = session.hop_s_per_token() if n_dev > 1 and (what_if or not isinstance(c, int) or kind != "fixed") else 0.0
    if isinstance(c, int):
        if kind in ("balanced", "auto") and c < n_tokens and n_tokens > 1:
            cost = session.chunk_cost(n_tokens)
            fixed_bounds = chunking.chunk_bounds(n_tokens, c)
            bounds = chunking.schedule(n_tokens, c, "balanced", cost, g, balanced_floor(session, c, n_tokens))
            est = chunking.bounds_makespan(bounds, n_dev, cost, v, hop)
            if kind == "auto":  # a user's chunk size with schedule auto: the cheaper of the two
                fixed = chunking.bounds_makespan(fixed_bounds, n_dev, cost, v, hop)
                if fixed <= est:
                    return chunking.Choice(c, "fixed", fixed, f"fixed {c} (schedule auto: balanced models "
                                                              f"{est * 1e3:.1f} ms, fixed {fixed * 1e3:.1f} ms)", v,
                                           tuple(fixed_bounds))
            return chunking.Choice(c, "balanced", est, f"balanced from {c}-token chunks: equal modelled cost each", v,
                                   tuple(bounds))
        # a fixed size needs no measurement: modelled only when the costs are known already
        known = session.chunk_cost(n_tokens) if what_if and n_tokens > 1 else session.measured_chunk_cost
        bounds = chunking.chunk_bounds(n_tokens, c)
        est = chunking.bounds_makespan(bounds, n_dev, known, v, hop) if known else 0.0
        return chunking.Choice(c, "fixed", est, f"fixed {c}", v, tuple(bounds))
    if n_tokens > 0 and chunking.one_chunk_only(session.devices[0], n_tokens):
        # no shorter chunk is a candidate: nothing to choose, so nothing is probed (a 16-token
        # prompt once paid for timing 64- to 512-token chunks); modelled when costs are known
        # (a what-if, weighing layer splits, measures: up to the prompt's length only)
        known = session.chunk_cost(n_tokens) if what_if and n_tokens > 1 else session.measured_chunk_cost
        est = chunking.bounds_makespan([(0, n_tokens)], n_dev, known, v, hop) if known else 0.0
        return chunking.Choice(n_tokens, "fixed", est, f"auto: the whole prompt ({n_tokens} tokens) as one chunk", v,
                               ((0, n_tokens),))
    cuda = session.devices[0].type == "cuda"
    cost = session.chunk_cost(n_tokens) if n_tokens > 0 else session.chunk_cost()
    cands = cost.sizes if cuda else chunking.CPU_CANDIDATES  # the sizes that fit
    alts: tuple[int, ...] = ()
    if n_dev > 1 and not what_if and (config.layer_split == "auto" or v > 1):
        alts = tuple(k for k in (1, 2, 3, 4) if n_dev * k <= session.spec.n_layers)
    kinds = ("fixed", "balanced") if kind == "auto" else (kind,)
    return chunking.choose(n_tokens, n_dev, cost, cands, kinds, v, hop, g, alts)


def plan(session: Session, n_tokens: int, decode_tokens: int = 0, run_id: str = "") -> RunPlan:
    config = session.config
    chosen = choice(session, n_tokens)
    kind = chosen.kind
    # balanced: buffers are sized by the largest chunk
    chunk = max(n for _, n in chosen.bounds) if kind == "balanced" else chosen.chunk
    return RunPlan(
        run_id=run_id,
        stages=tuple(StagePlan(s.index, s.name, s.first, s.end) for s in session.stages),
        prompt_tokens=n_tokens, chunk=chunk, n_chunks=len(chosen.bounds),
        decode_tokens=decode_tokens, handoff=session.handoff_kind, prefill_main=config.prefill_main,
        pipeline_depth=config.pipeline_depth, chunk_reason=chosen.reason, schedule=kind, interleave=session.interleave,
        bounds=chosen.bounds if kind == "balanced" else (), modelled_s=chosen.modelled_s)
