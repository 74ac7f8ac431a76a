"""What a sweep of the Sweep tab is asked for and what leaves it (no Qt, no torch): the request,
its progress message and SWEEP_SIGNALS (name -> argument types, one Qt signal each in the app's
controller).  Kept apart from sweep_job.py, which imports the engine's Session and torch, so the
window imports these at start-up and the job only when a sweep starts (issue 37)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig

from ..history.history_model import SweepMember
from ..run.record_model import RunRecord
from .sweep_model import SweepPlan, SweepStep, format_tokens

# (record, (sweep id, member)) -> history id; raises on a storage error
SweepRecorder = Callable[[RunRecord, tuple[int, SweepMember] | None], int]

# What leaves a sweep: each name is a method of the job's outlet, called on the job's thread.
SWEEP_SIGNALS: dict[str, tuple[type, ...]] = {
    "progress": (object,),  # SweepProgress
    "point_done": (object,),  # SweepSample, one per finished run
    "status": (str,),
    "finished": (bool, str),  # stopped early, message
    "failed": (str, str, str),  # title, message, details
    "done": (),
}


@dataclass(frozen=True)
class SweepRequest:
    model_path: Path
    model_label: str
    plan: SweepPlan
    configs: tuple[EngineConfig, ...]  # one per arm, in the plan's order
    sweep_id: int | None = None  # the sweep's id in the history


@dataclass(frozen=True)
class SweepProgress:
    done: int  # finished runs
    total: int
    step: SweepStep | None  # the run in flight
    chunks_done: int = 0
    n_chunks: int = 0

    def text(self, plan: SweepPlan) -> str:
        if self.step is None:
            return f"{self.done} of {self.total} runs"
        arm = plan.arms[self.step.arm].name
        chunks = f" · chunk {self.chunks_done}/{self.n_chunks}" if self.n_chunks else ""
        return (f"{self.done} of {self.total} runs · now {format_tokens(self.step.prompt_tokens)} tokens, "
                f"arm {arm}, repeat {self.step.repeat + 1}{chunks}")
