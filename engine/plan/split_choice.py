"""`layer_split=auto` over several devices: contiguous or interleave:V, chosen per prompt length.

A contiguous split gives each device one run of layers; `interleave:V` gives it V smaller runs
(engine/plan/chunking.py's module doc: a chunk then visits every device V times, so the pipeline's
fill and drain shrink about V-fold, at V times the hand-offs).  Which is faster depends on the
prompt: few big chunks favour interleave, many chunks contiguous.  The split is fixed when a
Session loads its weights, so choosing means modelling every V with the costs an open Session
measured (one layer's chunk cost, the hand-off's time per token) and, when another V models
clearly faster, building the Session for it.  Both the CLI (engine/cli/bench.py) and the app's
session cache use `choose_split` and `split_config`.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.plan import run_plan

if TYPE_CHECKING:
    from engine.pipeline.session import Session

log = logging.getLogger(__name__)

GAIN = 0.03  # another split must model at least this much faster to be worth a rebuild
MAX_V = 4


@dataclass(frozen=True)
class SplitChoice:
    """The split to run a prompt of `prompt_tokens` with, the modelled prefill per V, and why."""

    prompt_tokens: int
    interleave: int  # 1: contiguous
    modelled_s: dict[int, float]  # V -> the best modelled prefill over chunk sizes and schedules
    reason: str

    @property
    def layer_split(self) -> str:
        return "auto" if self.interleave == 1 else f"interleave:{self.interleave}"


def distinct_devices(config: EngineConfig) -> int:
    """How many different devices the stages run on (cpu,cpu and cuda:0,cuda:0 are one)."""
    return len(set(config.devices))


def applies(config: EngineConfig) -> bool:
    """Whether the user's settings leave the split to auto, over at least two different devices
    (no prefill-main).  Stages sharing one device serialise their work whatever the split, so
    interleave's shorter fill/drain buys nothing there (the demo's cpu,cpu keeps two stages)."""
    return config.layer_split == "auto" and distinct_devices(config) > 1 and not config.prefill_main


def choose_split(session: Session, config: EngineConfig, n_tokens: int) -> SplitChoice | None:
    """The V the model rates fastest for `n_tokens` under the user's `config` (None: the
    settings fix the split), from the costs `session` measured.  The session's own split wins
    ties within GAIN, so a close call never costs a rebuild."""
    if not applies(config) or n_tokens <= 0:
        return None
    n_dev = len(session.devices)
    hop = session.hop_s_per_token()
    modelled = {v: run_plan.choice(session, n_tokens, interleave=v).modelled_s  # as the run would plan it
                for v in range(1, MAX_V + 1) if n_dev * v <= session.spec.n_layers}
    current = session.interleave if session.interleave in modelled else 1
    best = min(modelled, key=lambda v: (modelled[v], v))
    pick = best if modelled[best] < modelled[current] * (1 - GAIN) else current
    table = ", ".join(("contiguous" if v == 1 else f"interleave:{v}") + f" {s * 1e3:.1f} ms"
                      for v, s in modelled.items())
    what = "a contiguous split" if pick == 1 else f"interleave:{pick}"
    reason = (f"layer split auto: {what} for {n_tokens} tokens over {n_dev} devices (modelled {table}; "
              f"hand-off {hop * 1e9:.1f} ns/token)")
    return SplitChoice(n_tokens, pick, modelled, reason)


def split_config(config: EngineConfig, choice: SplitChoice) -> EngineConfig:
    """The user's settings with the chosen split in place of auto."""
    return dataclasses.replace(config, layer_split=choice.layer_split)


def fit(session: Session, config: EngineConfig, n_tokens: int,
        rebuild: Callable[[EngineConfig], Session]) -> Session:
    """The session to run a prompt of n_tokens with under the user's `config`: `session`, or
    what `rebuild` makes for the split `choose_split` picks (rebuild releases the old session);
    the choice is said in the notes."""
    choice = choose_split(session, config, n_tokens)
    if choice is None:
        return session
    if choice.interleave != session.interleave:
        log.info("%s; rebuilding the session", choice.reason)
        session = rebuild(split_config(config, choice))
    note(session, choice)
    return session


def note(session: Session, choice: SplitChoice) -> None:
    """Say the choice in the session's set-up notes (every run's report carries them)."""
    session.setup_notes[:] = [n for n in session.setup_notes if not n.startswith("layer split auto:")]
    session.setup_notes.append(choice.reason)
