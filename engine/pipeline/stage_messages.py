"""The messages between the controller and its stage processes (executor=processes).

Every message on a stage's pipe (or, for an attached stage, its `engine.pipeline.wire` channel) is one
of the frozen dataclasses below or a `StageEvent` (engine/events.py), never a positional
tuple: a receiver dispatches on the type and reads named fields.  All of them are registered
with `engine.pipeline.wire`, the one network codec (typed JSON with an HMAC; nothing is unpickled from a
socket).  `PROTOCOL` is their version: it travels in every stage's `Hello` (through
`versions()`), and a controller refuses a stage that speaks another.

Commands go controller -> stage; reports go stage -> controller.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from engine.events import StageEvent
from engine.pipeline import wire

PROTOCOL = 1  # bump on any change to a message below

wire.register(StageEvent)  # a stage's events travel as they are


def versions() -> dict[str, str]:
    """What must match between the controller and every stage (hosts run the same code)."""
    from importlib import metadata

    import torch

    try:
        strata = metadata.version("strata-gui")
    except metadata.PackageNotFoundError:
        strata = "source"
    return {"strata": strata, "torch": torch.__version__.split("+")[0],
            "python": f"{sys.version_info.major}.{sys.version_info.minor}", "protocol": str(PROTOCOL)}


# ------------------------------------------------------------------ commands (controller -> stage)
@wire.register
@dataclass(frozen=True)
class Ping:
    """Answered by a `Pong` with the stage's clock (the clock offset at start-up)."""


@wire.register
@dataclass(frozen=True)
class BeginRun:
    """Start a run: its `RunOrder` (engine/pipeline/stage_process.py)."""

    order: Any


@wire.register
@dataclass(frozen=True)
class RunChunk:
    """Stage 0: run chunk `chunk` of the order (answered by `Returned`)."""

    chunk: int


@wire.register
@dataclass(frozen=True)
class EndPrefill:
    """Stage 0: drain the split (the finish guard); every stage answers `PrefillDone`."""


@wire.register
@dataclass(frozen=True)
class DecodeStep:
    """Stage 0: one greedy decode step of `token` at `pos` (the last stage answers `Token`)."""

    step: int
    token: int
    pos: int


@wire.register
@dataclass(frozen=True)
class EndRun:
    """Stage 0: close the run (every stage answers `RunClosed`)."""


@wire.register
@dataclass(frozen=True)
class Measure:
    """Stage 0: the chunk-cost probe (engine/plan/chunk_cost.py), answered by `Measured`."""

    sizes: tuple[int, ...]
    prefix: int
    probe: int
    reps: int
    graphs: bool = False


@wire.register
@dataclass(frozen=True)
class Stop:
    """Leave the process group and exit."""


@wire.register
@dataclass(frozen=True)
class Assign:
    """An attached stage's answer to its `Hello`: its `StageSpec`."""

    spec: Any


@wire.register
@dataclass(frozen=True)
class Refused:
    """An attached stage's answer to its `Hello`: why it may not join."""

    reason: str


# --------------------------------------------------------------------- reports (stage -> controller)
@wire.register
@dataclass(frozen=True)
class Hello:
    """An attached stage introduces itself (the first message after the key handshake)."""

    rank: int
    world: int
    pid: int
    host: str
    versions: dict

    def check(self) -> Hello:
        """Itself, or ValueError naming what is off (it came from the network)."""
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (self.rank, self.world, self.pid))
        vers = self.versions
        if not (ints and isinstance(self.host, str) and len(self.host) <= 255 and isinstance(vers, dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in vers.items())):
            raise ValueError("a malformed hello")
        return self


@wire.register
@dataclass(frozen=True)
class Ready:
    """A stage loaded its layers and joined the process group."""

    rank: int
    pid: int
    host: str
    device: str


@wire.register
@dataclass(frozen=True)
class Loaded:
    """A stage loaded layer `layer` (the load's progress)."""

    rank: int
    layer: int


@wire.register
@dataclass(frozen=True)
class ArenaFilled:
    """A stage's host expert arena: its bytes, the page-locked bytes, and why that much."""

    rank: int
    nbytes: int
    pinned_bytes: int
    pin_note: str


@wire.register
@dataclass(frozen=True)
class Note:
    """A line for the report of run `run_id` (a graph capture, a fallback to eager)."""

    rank: int
    run_id: str
    text: str


@wire.register
@dataclass(frozen=True)
class Waiting:
    """The stage now blocks on stage `peer` (-1: on nobody), so a hang is blamed on the right one."""

    rank: int
    peer: int


@wire.register
@dataclass(frozen=True)
class Computed:
    """The stage computed chunk `chunk` (the last chunk a fault message names)."""

    rank: int
    chunk: int


@wire.register
@dataclass(frozen=True)
class Returned:
    """Stage 0's run of chunk `chunk` returned (the root prefill loop's step)."""

    rank: int
    chunk: int


@wire.register
@dataclass(frozen=True)
class PrefillDone:
    """The split is drained; the stage holding the output sends its digest and logits (numpy)."""

    rank: int
    digest: str | None = None
    last_logits: Any = None
    logits: Any = None


@wire.register
@dataclass(frozen=True)
class Token:
    """The last stage's greedy token of decode step `step`."""

    rank: int
    step: int
    token: int


@wire.register
@dataclass(frozen=True)
class RunClosed:
    rank: int


@wire.register
@dataclass(frozen=True)
class Pong:
    rank: int
    t_ns: int  # the stage's perf_counter_ns


@wire.register
@dataclass(frozen=True)
class Measured:
    """The chunk-cost probe: seconds per chunk size (pairs: the wire's dicts have str keys),
    seconds per key of attention, the launch overhead."""

    rank: int
    layer_s: tuple[tuple[int, float], ...]
    attn_s: float
    host_s: float


@wire.register
@dataclass(frozen=True)
class ExpertReport:
    """A stage's expert statistics of run `run_id` so far (`ExpertStats.as_dict()`)."""

    rank: int
    run_id: str
    stats: dict


@wire.register
@dataclass(frozen=True)
class Failure:
    """An exception in a stage process: where (chunk, layer), what, and its traceback."""

    rank: int
    chunk: int
    layer: int | None
    type_name: str
    text: str
    traceback: str
