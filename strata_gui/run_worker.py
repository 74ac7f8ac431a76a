"""The run worker: one engine run in a QThread (worker-object pattern).

`RunWorker.run` builds (or reuses) the Session, starts the GPU telemetry sampler, and calls
`Session.run` with a `threading.Event` as `cancel`.  The engine's events go through an
`EventBatcher` and leave as ONE `events` signal per ~50 ms carrying a list; telemetry samples
leave on the same tick.  Every outcome ends in exactly one of finished / cancelled / failed,
followed by `done`, after the sampler and the batcher have stopped (so no event of this run
arrives after `done`).
"""
from __future__ import annotations

import logging
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QObject, Signal, Slot

from engine import prompt as prompts
from engine.config import EngineConfig
from engine.events import RunPlan
from engine.pipeline import Cancelled, PipelineHooks
from engine.topology import TelemetrySampler, Topology, cuda_index

from .event_batcher import DEFAULT_INTERVAL_S, EventBatcher
from .session_cache import SessionCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunRequest:
    model_path: Path
    config: EngineConfig
    prompt_tokens: int = 512  # a synthetic prompt of this size when prompt_text is None
    prompt_text: str | None = None
    decode_tokens: int = 0
    nonce: int = 0


@dataclass(frozen=True)
class RunStarted:
    """What the GUI learns before the first chunk."""

    plan: RunPlan
    origin_ns: int  # perf_counter_ns() when the plan was made: the Gantt's time zero
    model: str
    session_reused: bool
    telemetry_available: bool
    telemetry_reason: str


def make_sampler(config: EngineConfig, topo: Topology | None,
                 interval_s: float = 0.1) -> tuple[TelemetrySampler | None, str]:
    """The sampler for the run's GPUs, or None and why there is nothing to sample."""
    gpus = sorted({i for i in (cuda_index(d) for d in config.devices) if i is not None})
    try:
        if gpus:
            sampler = TelemetrySampler(gpus, interval_s=interval_s)
        elif topo is None or not topo.devices:
            sampler = TelemetrySampler(topo or Topology(reason="GPU discovery has not run"), interval_s=interval_s)
        else:
            return None, f"this run uses no GPU (devices {','.join(config.devices)})"
    except Exception as exc:  # telemetry must never stop a run
        log.warning("telemetry sampler failed to start: %s", exc)
        return None, f"sampler failed: {exc}"
    if not sampler.available:
        return None, sampler.reason.removeprefix("unavailable: ")
    return sampler, sampler.reason


class RunWorker(QObject):
    run_started = Signal(object)  # RunStarted
    events = Signal(object)  # list[StageEvent]
    telemetry = Signal(object)  # list[TelemetrySample]
    status = Signal(str)
    finished = Signal(object)  # RunReport
    cancelled = Signal(str)
    failed = Signal(str, str, str)  # title, message, details
    done = Signal()

    def __init__(self, request: RunRequest, sessions: SessionCache, cancel: threading.Event,
                 hooks: PipelineHooks | None = None, topology: Topology | None = None,
                 batch_interval_s: float = DEFAULT_INTERVAL_S) -> None:
        super().__init__()
        self.request = request
        self.sessions = sessions
        self.cancel = cancel
        self.hooks = hooks
        self.topology = topology
        self.batch_interval_s = batch_interval_s
        self._sampler: TelemetrySampler | None = None
        self._telemetry_reason = ""
        self._telemetry_since: int | None = None
        self._model = ""
        self._reused = False
        self._last_status = 0.0

    # ------------------------------------------------------------ the thread body
    @Slot()
    def run(self) -> None:
        batcher = EventBatcher(self.events.emit, self.batch_interval_s, on_tick=self._flush_telemetry)
        session = None
        try:
            req = self.request
            self.status.emit(f"opening {req.model_path.name} …")
            session, self._reused = self.sessions.acquire(req.model_path, req.config, progress=self._load_progress)
            self._model = session.source.describe() if hasattr(session.source, "describe") else str(req.model_path)
            if req.prompt_text is not None:
                self.status.emit("tokenising the prompt with the model's vocabulary …")
                ids = prompts.tokenize(session.source, req.prompt_text)
            else:
                ids = prompts.synthetic(req.prompt_tokens, session.spec.vocab, nonce=req.nonce)
            session.sink = batcher
            session.hooks = self.hooks or PipelineHooks()
            self._sampler, self._telemetry_reason = make_sampler(req.config, self.topology)
            if self._sampler is not None:
                self._sampler.start()
            batcher.start()
            self.status.emit(f"planning {len(ids)} prompt tokens on {', '.join(session.device_order)} …")
            try:
                result = session.run(ids, req.decode_tokens, cancel=self.cancel, on_plan=self._on_plan)
            finally:
                self._stop_sources(batcher)
            self.finished.emit(result.report)
        except Cancelled as exc:
            self._stop_sources(batcher)
            self.cancelled.emit(str(exc))
        except Exception as exc:
            self._stop_sources(batcher)
            log.exception("run failed")
            self.sessions.discard()
            session = None
            self.failed.emit(f"Run failed: {type(exc).__name__}", str(exc), traceback.format_exc())
        finally:
            if session is not None:
                session.sink = None
            self.done.emit()

    def _stop_sources(self, batcher: EventBatcher) -> None:
        if self._sampler is not None:
            self._sampler.stop()
        batcher.stop()  # delivers the tail (events and the last telemetry)
        self._sampler = None

    # --------------------------------------------------------------- callbacks
    def _on_plan(self, plan: RunPlan) -> None:
        origin = time.perf_counter_ns()
        self._telemetry_since = None
        self.run_started.emit(RunStarted(plan, origin, self._model, self._reused,
                                         self._sampler is not None, self._telemetry_reason))
        self.status.emit(f"running {plan.prompt_tokens} tokens as {plan.n_chunks} chunk(s) of {plan.chunk} "
                         f"on {len(plan.stages)} stage(s), depth {plan.pf_depth}")

    def _load_progress(self, what: str, frac: float) -> None:
        now = time.perf_counter()
        if now - self._last_status >= 0.1 or frac >= 1.0:
            self._last_status = now
            self.status.emit(f"{what} ({frac * 100:.0f}%)")

    def _flush_telemetry(self) -> None:
        sampler = self._sampler
        if sampler is None:
            return
        samples = sampler.samples(since_ns=self._telemetry_since)
        if samples:
            self._telemetry_since = samples[-1].t_ns
            self.telemetry.emit(samples)
