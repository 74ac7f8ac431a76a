"""One engine run for the app, without Qt: the body of the run's background thread.

`RunJob.execute` builds (or reuses) the Session, starts the GPU telemetry sampler, and calls
`Session.run` with a `threading.Event` as `cancel`.  The engine's events go through an
`EventBatcher` and leave as ONE `events` call per ~50 ms carrying a list; telemetry samples
leave on the same tick.  Every outcome ends in exactly one of finished / cancelled / failed,
followed by `done`, after the sampler and the batcher have stopped (so no event of this run
arrives after `done`).  A finished run, and a cancelled one whose partial report the engine
attached to `Cancelled.report`, is handed to the `recorder` (the history) here, before that
outcome; `saved` says how it went.

Measured like a benchmark: before the first measured run of a new shape (prompt length and
decode, on this Session) an unmeasured warm-up pass runs the same chunk shapes with a different
prompt (`prompts.warmup_ids`), so one-off costs (kernel set-up, allocator growth, CUDA graph
capture) stay out of the figures.  The warm-up is NOT drawn in the Gantt (its events go to no
sink) and not saved; the status line says while it runs.  Then `repeats` measured runs of the
same prompt follow; each is saved to the history as its own run (with `repeat`, `repeats` and a
shared `repeat_group` in its settings) and announced by `measured`.  A run without warm-up on a
shape the session had not run is recorded as `cold`.

What leaves the job goes through an outlet, one call per name of `RUN_SIGNALS` — in the app
`job_runner.SignalOutlet` turns each call into the signal of that name; benchmarks/gpu_check.sh
drives the same job on a GPU machine without Qt.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable

from engine import failure
from engine.config import EngineConfig
from engine.events import RunPlan, RunReport, StageEvent
from engine.hw.topology import TelemetrySampler, Topology, cuda_index
from engine.io import prompt as prompts
from engine.pipeline.session import Cancelled, PipelineHooks, Session
from engine.plan import memory_check, split_choice

from .event_batcher import DEFAULT_INTERVAL_S, EventBatcher
from .record_model import RunRecord, record_config
from .run_messages import (  # noqa: F401  (re-exported: the job's messages, by their old names)
    RUN_SIGNALS,
    RepeatDone,
    RunOutlet,
    RunRecorder,
    RunRequest,
    RunStarted,
    SaveResult,
    describe_prompt,
)
from .session_cache import SessionCache

log = logging.getLogger(__name__)


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


class WarmupCount:
    """Chunks of the warm-up pass done, told to `report(done, total)` at most every `interval_s`
    (and at the first and last chunk): the warm-up draws nothing, yet a long prompt's pass takes
    tens of seconds.  Its `event` is the pass's sink, called on the stage threads."""

    def __init__(self, report: Callable[[int, int], None], interval_s: float = 0.1) -> None:
        self.report = report
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._finisher = -1
        self._total = 0
        self._done: set[int] = set()
        self._last = 0.0

    def plan(self, plan: RunPlan) -> None:
        with self._lock:
            self._finisher = 0 if plan.prefill_main else len(plan.stages) - 1
            self._total = plan.n_chunks
        self.report(0, plan.n_chunks)

    def event(self, ev: StageEvent) -> None:
        if ev.kind != "compute" or ev.chunk < 0:
            return
        with self._lock:
            if ev.stage != self._finisher or ev.chunk in self._done:
                return
            self._done.add(ev.chunk)
            done, now = len(self._done), time.perf_counter()
            if now - self._last < self.interval_s and done < self._total:
                return
            self._last = now
        self.report(done, self._total)


class RunJob:
    def __init__(self, request: RunRequest, sessions: SessionCache, cancel: threading.Event, outlet: RunOutlet,
                 hooks: PipelineHooks | None = None, topology: Topology | None = None,
                 batch_interval_s: float = DEFAULT_INTERVAL_S, recorder: RunRecorder | None = None) -> None:
        self.request = request
        self.out = outlet
        self.recorder = recorder
        self._n_prompt = 0
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
        self._measure: dict = {}

    # ------------------------------------------------------------ the thread body
    def execute(self) -> None:
        out = self.out
        batcher = EventBatcher(out.events, self.batch_interval_s, on_tick=self._flush_telemetry)
        session = None
        try:
            req = self.request
            self.out.status(f"opening {req.model_path.name} …")
            session, self._reused = self.sessions.acquire_for_run(req.model_path, req.config,
                                                                  progress=self._load_progress)
            self._model = session.source.describe() if hasattr(session.source, "describe") else str(req.model_path)
            if req.prompt_text is not None:
                self.out.status("tokenising the prompt with the model's vocabulary …")
                ids = prompts.tokenize(session.source, req.prompt_text)
            else:
                ids = prompts.synthetic(req.prompt_tokens, session.spec.vocab, nonce=req.nonce)
            # the weights are loaded; what grows with the tokens must fit before any of it is taken
            memory_check.check_run(session.source, session.config, len(ids), req.decode_tokens, False,
                                   prompt_setting="prompt_tokens", loaded=True, decode_setting="decode_tokens")
            if split_choice.applies(req.config):  # contiguous or interleave:V, whichever models faster
                self.out.status(f"choosing the layer split for {len(ids):,} prompt tokens …")
                session, reused = self.sessions.fit_split(req.model_path, req.config, len(ids), self._load_progress)
                self._reused = self._reused and reused
            self._n_prompt = len(ids)
            shape = (len(ids), req.decode_tokens > 0)
            warmed = self.sessions.warm_shapes
            warmed_up = False
            if req.warmup and shape not in warmed:
                self._warm_up(session, len(ids), req.decode_tokens)
                warmed.add(shape)
                warmed_up = True
            cold = shape not in warmed
            group = uuid.uuid4().hex[:12]
            repeats = max(int(req.repeats), 1)
            self._sampler, self._telemetry_reason = make_sampler(req.config, self.topology)
            if self._sampler is not None:
                self._sampler.start()
            batcher.start()
            result = None
            for k in range(repeats):
                self._measure = {"warmup": bool(req.warmup), "cold": cold and k == 0, "repeat": k + 1,
                                 "repeats": repeats, "repeat_group": group}
                self.out.status(f"planning {len(ids)} prompt tokens on {', '.join(session.device_order)}"
                                + (f" (repeat {k + 1} of {repeats})" if repeats > 1 else "") + " …")
                try:  # one sampler: the live plot's samples are the history's
                    result = session.run(ids, req.decode_tokens, sink=batcher, cancel=self.cancel,
                                         hooks=self.hooks or PipelineHooks(), on_plan=self._on_plan,
                                         sampler=self._sampler)
                finally:
                    batcher.flush()
                warmed.add(shape)
                self._record(result.report, result.events, "finished")
                self.out.measured(RepeatDone(k, repeats, result.report, warmed_up, cold and k == 0))
            self._stop_sources(batcher)
            self.out.finished(result.report)
        except Cancelled as exc:
            self._stop_sources(batcher)
            if session is not None and exc.report is not None and self._measure:
                self._record(exc.report, exc.events, "cancelled")
            self.out.cancelled(str(exc))
        except Exception as exc:
            self._stop_sources(batcher)
            self.sessions.discard()
            session = None
            self.out.failed(*failure.dialog_text(exc, "the run", "Run failed"))
        finally:
            self.out.done()

    def _warm_up(self, session: Session, n_tokens: int, decode_tokens: int) -> None:
        """One unmeasured pass of the same shapes (not drawn, not saved); Cancelled propagates."""
        self.out.status(f"warm-up pass: {n_tokens:,} tokens, not measured and not drawn (the first run of a "
                        "shape pays one-off set-up) …")
        t0 = time.perf_counter()
        count = WarmupCount(self.out.warmup)
        session.run(prompts.warmup_ids(n_tokens, session.spec.vocab), min(decode_tokens, 2), cancel=self.cancel,
                    hooks=self.hooks or PipelineHooks(), sink=count.event, on_plan=count.plan)
        log.info("warm-up pass of %d tokens took %.3f s", n_tokens, time.perf_counter() - t0)

    def _record(self, report: RunReport, events: Iterable, status: str) -> None:
        """Save the run to the history; a storage error is reported, never raised."""
        if self.recorder is None:
            return
        req = self.request
        config = record_config(req.config, req.model_label or req.model_path.name, describe_prompt(req),
                               self._n_prompt, req.decode_tokens, self._measure)
        record = RunRecord(report, list(events), config, source="run", status=status)
        try:
            self.out.saved(SaveResult(self.recorder(record), status))
        except Exception as exc:
            log.exception("saving the run to the history failed")
            self.out.saved(SaveResult(None, status, f"{type(exc).__name__}: {exc}"))

    def _stop_sources(self, batcher: EventBatcher) -> None:
        if self._sampler is not None:
            self._sampler.stop()
        batcher.stop()  # delivers the tail (events and the last telemetry)
        self._sampler = None

    # --------------------------------------------------------------- callbacks
    def _on_plan(self, plan: RunPlan) -> None:
        origin = time.perf_counter_ns()
        self._telemetry_since = None
        self.out.run_started(RunStarted(plan, origin, self._model, self._reused,
                                         self._sampler is not None, self._telemetry_reason))
        self.out.status(f"running {plan.prompt_tokens} tokens as {plan.n_chunks} chunk(s) of {plan.chunk} "
                         f"on {len(plan.stages)} stage(s), depth {plan.pf_depth}")

    def _load_progress(self, what: str, frac: float) -> None:
        now = time.perf_counter()
        if now - self._last_status >= 0.1 or frac >= 1.0:
            self._last_status = now
            self.out.status(f"{what} ({frac * 100:.0f}%)")

    def _flush_telemetry(self) -> None:
        sampler = self._sampler
        if sampler is None:
            return
        samples = sampler.samples(since_ns=self._telemetry_since)
        if samples:
            self._telemetry_since = samples[-1].t_ns
            self.out.telemetry(samples)
