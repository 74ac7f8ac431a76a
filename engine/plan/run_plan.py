"""A run's plan: chunk size and schedule from the settings and the measured costs.

`choice` applies the chunk_tokens and chunk_schedule settings (a user's chunk size, balanced
from it, or auto: the option `chunking`'s model rates fastest) and returns the chunks with the
modelled prefill time; `plan` turns it into the `RunPlan` a run executes.  Both read a
`Planned`: a Session's public side (its config, devices, layer groups, the measured chunk cost
`Session.chunk_cost`, the hand-off time `Session.hop_s_per_token`), or the what-if planner's
run of a cost profile (engine/plan/planner.py), so a prediction chunks a prompt as a run would.

Auto is steady (issue 37: one command picked 128x4, 512x1 and 16x32 on three runs).  A probe on
a busy machine is noisy, and near the best the modelled times of several sizes differ by less
than that noise, so the pick followed the noise.  Sizes modelled within `NEAR_TIE` of the best
are taken as tied, and of those the largest is picked (the fewest chunks: the least the model's
per-chunk terms can mislead).  And a run of a Session remembers its pick for the same model,
devices, prompt length and chunk settings (`plan`): a later repeat, arm or run of this process
keeps it while it stays within `NEAR_TIE` of the best its own costs model (hysteresis), and
plans with the hand-off time the key's first run measured (each Session times its own first
hand-off; on a busy machine two arms' measurements differed by enough to flip the pick), so the
repeats and the arms of one command run the same chunks.  The reason says which rule decided.
"""
from __future__ import annotations

import threading
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


NEAR_TIE = 0.05  # auto: sizes modelled within 5% of the fastest are tied (the probe's noise on a busy CPU is larger)
_KEPT: dict[tuple, tuple[int, float]] = {}  # per process and run key (`_kept_key`): (auto's pick, hop s/token)
_KEPT_LOCK = threading.Lock()
BALANCED_GRAIN_CUDA = 512  # balanced chunk sizes on CUDA: multiples of this, so few distinct sizes (graphs)


def grain(session: Planned) -> int:
    return BALANCED_GRAIN_CUDA if session.devices[0].type == "cuda" else chunking.GRAIN


def balanced_floor(session: Planned, chunk: int, n_tokens: int) -> int:
    """The smallest balanced chunk from a user's chunk size: the efficient size, but never
    above the size the user asked for (they asked for that many chunks)."""
    return min(chunking.efficient_floor(session.chunk_cost(n_tokens)), chunk)


def choice(session: Planned, n_tokens: int, interleave: int | None = None, keep: int | None = None) -> chunking.Choice:
    """Chunk size and schedule from the prefill and chunk_schedule settings, with the
    modelled prefill time (auto: the option the model of `chunking` rates fastest).

    `interleave`: model the settings as if the session's devices held that many layer groups
    each (engine/plan/split_choice.py weighs the splits so); the costs are then measured even for a
    fixed chunk, whose own plan needs none.  `keep`: auto's earlier pick, kept while it models
    within NEAR_TIE of the fastest size."""
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
    if n_tokens > 0 and not what_if and chunking.fewest_chunks(session.devices[0], n_dev, kind):
        # one CPU stage has nothing to overlap, and every chunk expands each layer's stored experts
        # once more: the model's pick was the largest size on every probe measured (64 tokens
        # 0.66 ms a token, 512 0.19 ms on the CI machine), so nothing is probed (the probe cost a
        # 512-token run 40% of its wall there); modelled when costs are known
        c = min(n_tokens, chunking.CPU_CANDIDATES[-1])
        bounds = chunking.chunk_bounds(n_tokens, c)
        known = session.measured_chunk_cost
        est = chunking.bounds_makespan(bounds, n_dev, known, v, hop) if known else 0.0
        return chunking.Choice(c, "fixed", est, f"auto: one CPU stage, the fewest chunks of at most "
                                                f"{chunking.CPU_CANDIDATES[-1]} tokens (nothing to overlap)",
                               v, tuple(bounds))
    cuda = session.devices[0].type == "cuda"
    cost = session.chunk_cost(n_tokens) if n_tokens > 0 else session.chunk_cost()
    cands = cost.sizes if cuda else chunking.CPU_CANDIDATES  # the sizes that fit
    alts: tuple[int, ...] = ()
    if n_dev > 1 and not what_if and (config.layer_split == "auto" or v > 1):
        alts = tuple(k for k in (1, 2, 3, 4) if n_dev * k <= session.spec.n_layers)
    kinds = ("fixed", "balanced") if kind == "auto" else (kind,)
    return steady_choice(n_tokens, n_dev, cost, cands, kinds, v, hop, g, alts, keep)


def steady_choice(n_tokens: int, n_dev: int, cost: chunking.ChunkCost, candidates: Sequence[int],
                  kinds: tuple[str, ...], v: int, hop: float, g: int, alts: tuple[int, ...] = (),
                  keep: int | None = None) -> chunking.Choice:
    """`chunking.choose` over the candidates with near-ties settled steadily: of the sizes
    modelled within NEAR_TIE of the fastest, `keep` when it is one of them, else the largest."""
    sizes = sorted({min(c, n_tokens) for c in candidates if c > 0})
    per = {c: chunking.choose(n_tokens, n_dev, cost, (c,), kinds, v, hop, g) for c in sizes}
    if len(per) < 2:
        return chunking.choose(n_tokens, n_dev, cost, tuple(sizes), kinds, v, hop, g, alts)
    fastest = min(per, key=lambda c: (per[c].modelled_s, -c))
    best_s = per[fastest].modelled_s
    tied = [c for c in sizes if per[c].modelled_s <= best_s * (1 + NEAR_TIE)]
    pick = keep if keep in tied else max(tied)
    chosen = chunking.choose(n_tokens, n_dev, cost, (pick,), kinds, v, hop, g, alts)
    if pick != max(tied):
        note = (f"; kept from this command's earlier run: within {NEAR_TIE:.0%} of the fastest modelled "
                f"({fastest} tokens, {best_s * 1e3:.1f} ms)")
    elif pick != fastest:
        note = (f"; {', '.join(str(c) for c in tied if c != pick)} modelled within {NEAR_TIE:.0%} of it "
                f"(fastest {fastest} tokens, {best_s * 1e3:.1f} ms): a near tie goes to the larger chunk")
    else:
        note = ""
    return chunking.Choice(chosen.chunk, chosen.kind, chosen.modelled_s, chosen.reason + note, chosen.interleave,
                           chosen.bounds)


def _kept_key(session: Session, n_tokens: int) -> tuple:
    """What auto's pick and hand-off time are remembered by: the model, the devices, the prompt's
    length, the chunk settings and what shapes a hand-off or a chunk's cost (not the pipeline
    depth: arms that differ in depth run the same chunks)."""
    c = session.config
    return (repr(session.spec), tuple(str(d) for d in session.devices), n_tokens, str(c.chunk_tokens),
            c.chunk_schedule, c.prefill_main, str(c.layer_split), session.interleave, c.handoff, c.executor,
            c.dtype, str(c.expert_cache), str(c.pin_limit_gib))


class _KeptHop:
    """A Session as `choice` reads it, with the hand-off time its run key's first run measured."""

    def __init__(self, session: Session, hop_s_per_token: float) -> None:
        self._session, self._hop = session, hop_s_per_token

    def __getattr__(self, name: str):
        return getattr(self._session, name)

    def hop_s_per_token(self) -> float:
        return self._hop


def forget_choices() -> None:
    """Drop the remembered auto picks (a new command: the next run chooses afresh)."""
    with _KEPT_LOCK:
        _KEPT.clear()


def plan(session: Session, n_tokens: int, decode_tokens: int = 0, run_id: str = "") -> RunPlan:
    config = session.config
    if isinstance(config.chunk_tokens, int):
        chosen = choice(session, n_tokens)
    else:  # auto: the pick of an earlier run of this key is kept while near the best (module doc)
        key = _kept_key(session, n_tokens)
        with _KEPT_LOCK:
            kept = _KEPT.get(key)
        if kept is None:
            n_dev = 1 if config.prefill_main else len(session.devices)
            kept = (0, session.hop_s_per_token() if n_dev > 1 else 0.0)
        chosen = choice(_KeptHop(session, kept[1]), n_tokens, keep=kept[0] or None)
        with _KEPT_LOCK:
            _KEPT[key] = (chosen.chunk, kept[1])
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
