"""What a run of the Run tab is asked for and what leaves it (no Qt, no torch): the request, the
messages its job sends (RUN_SIGNALS: name -> argument types, one Qt signal each in the app's
controller) and the history's recorder type.  Kept apart from run_job.py, which imports the
engine's Session and torch, so that the window and its controller import these at start-up and
the job itself only when a run starts (issue 37: the window shows before torch is imported)."""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.events import RunPlan, RunReport

from .record_model import RunRecord


@dataclass(frozen=True)
class RunRequest:
    model_path: Path
    config: EngineConfig
    prompt_tokens: int = 512  # a synthetic prompt of this size when prompt_text is None
    prompt_text: str | None = None
    decode_tokens: int = 0
    nonce: int = 0
    model_label: str = ""  # how the history names the model ("" : the file name)
    warmup: bool = False  # an unmeasured pass first, when this shape is new to the session
    repeats: int = 1  # measured runs of the prompt


@dataclass(frozen=True)
class RepeatDone:
    """One measured repeat finished (index from 0)."""

    index: int
    total: int
    report: RunReport
    warmed_up: bool = False  # a warm-up pass ran before the measured runs (this press of Run)
    cold: bool = False  # this repeat was the shape's first pass in the session (no warm-up)


# a run for the history -> its id there; raises on a storage error
RunRecorder = Callable[[RunRecord], int]


@dataclass(frozen=True)
class SaveResult:
    """How saving a run to the history went."""

    run: int | None  # its id in the history
    status: str  # finished | cancelled
    error: str = ""


def describe_prompt(req: RunRequest) -> str:
    """The prompt as the history records it: enough to tell two prompts apart in a diff."""
    if req.prompt_text is None:
        return f"synthetic, nonce {req.nonce}"
    digest = hashlib.md5(req.prompt_text.encode("utf-8")).hexdigest()[:8]
    head = req.prompt_text if len(req.prompt_text) <= 60 else req.prompt_text[:59] + "…"
    return f"text {digest}: {head!r}"


@dataclass(frozen=True)
class RunStarted:
    """What the GUI learns before the first chunk."""

    plan: RunPlan
    origin_ns: int  # perf_counter_ns() when the plan was made: the Gantt's time zero
    model: str
    session_reused: bool
    telemetry_available: bool
    telemetry_reason: str


# What leaves a run, in order: each name is a method of the job's outlet, called on the job's
# thread with arguments of these types (the app's controller has one Qt signal per name:
# job_runner.signals_class).  Every outcome ends in one of finished / cancelled / failed, then done.
RUN_SIGNALS: dict[str, tuple[type, ...]] = {
    "run_started": (object,),  # RunStarted, before the first chunk of each measured pass
    "events": (object,),  # list[StageEvent], one batch per ~50 ms
    "telemetry": (object,),  # list[TelemetrySample]
    "status": (str,),
    "finished": (object,),  # RunReport of the last repeat
    "measured": (object,),  # RepeatDone, after each measured repeat (before finished)
    "warmup": (int, int),  # chunks of the warm-up pass done, of total
    "cancelled": (str,),
    "failed": (str, str, str),  # title, message, details
    "saved": (object,),  # SaveResult: the run went into the history (or why not)
    "done": (),
}

# any object with one method per name of RUN_SIGNALS (job_runner.SignalOutlet in the app)
RunOutlet = Any
