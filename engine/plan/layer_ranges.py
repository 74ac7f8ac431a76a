"""Which layers each stage owns, and on which device: the one rule the Session loads by and the
what-if planner predicts with.

A contiguous split gives stage j the j-th run of layers: explicit counts, or balanced (every
layer costs the same; the remainder goes to the earliest stages, the last also carries the LM
head).  `interleave` V > 1 (issue 21) makes V x D balanced layer groups, group j on device
j mod D, so a chunk visits the devices V times over.

`split_layers` is the arithmetic (counts to ranges); `stage_ranges` adds the devices.  Both
refuse a split that leaves a stage without layers with `LayerSplitError`, one line saying why
(the Session's config is checked before: `EngineConfig.check_layers`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, NamedTuple, TypeVar

D = TypeVar("D")  # a device: torch.device in a Session, its name in the planner


class LayerSplitError(ValueError):
    """A layer split that cannot be built; the message says which and why."""


class StageRange(NamedTuple, Generic[D]):
    """Stage `index` runs layers [first, end) on `device`."""

    index: int
    device: D
    first: int
    end: int


def split_layers(n_layers: int, n_stages: int, split: str | Sequence[int]) -> list[tuple[int, int]]:
    """(first, end) layers per stage: explicit counts, or balanced when `split` is not a list of
    counts ("auto", or "interleave:V", whose groups are the stages here)."""
    if isinstance(split, (list, tuple)):
        counts = list(split)
    else:
        if n_stages < 1:
            raise LayerSplitError("at least one stage")
        base, extra = divmod(n_layers, n_stages)
        counts = [base + (1 if i < extra else 0) for i in range(n_stages)]
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


def stage_ranges(n_layers: int, devices: Sequence[D], counts: Sequence[int] | None = None,
                 interleave: int = 1) -> list[StageRange[D]]:
    """The stages over `devices` (in order; a device may repeat: stages sharing it): one per
    device with `counts` layers each (None: balanced), or with `interleave` V > 1, V x D
    balanced groups, group j on device j mod D."""
    d = len(devices)
    if d == 0:
        raise LayerSplitError("at least one device")
    v = max(1, interleave)
    if counts:
        if v > 1:
            raise LayerSplitError("an explicit layer split and interleave do not combine")
        if len(counts) != d or sum(counts) != n_layers or min(counts) < 1:
            raise LayerSplitError(f"layer split {list(counts)}: one count per device, >= 1 each, "
                                  f"summing to {n_layers}")
        ranges = split_layers(n_layers, d, list(counts))
    else:
        if d * v > n_layers:
            raise LayerSplitError(f"{d * v} stages for {n_layers} layers: at most one stage per layer")
        ranges = split_layers(n_layers, d * v, "auto")
    return [StageRange(j, devices[j % d], a, b) for j, (a, b) in enumerate(ranges)]
