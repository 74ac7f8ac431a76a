"""A sweep, without Qt: every run of it, one after another (the body of the sweep's thread).

It loads the model once and builds one engine Session per arm (as `strata-bench run` does),
warms each arm up, then runs the plan's steps in order: for each size and repeat, every arm on
the same prompt (`engine.io.prompt.sweep_nonce`).  Each finished run is saved to the history (with
its events, off the GUI thread) and leaves as one `point_done` signal.  Stop sets the cancel
event the engine checks at each chunk boundary: the run in flight is dropped, every finished
point stays.  Every outcome ends in exactly one of finished / failed, then `done`.

What leaves the job goes through an outlet, one call per name of `SWEEP_SIGNALS` (in the app
job_runner.SignalOutlet turns each into the sweep controller's signal of that name).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from engine import failure
from engine.events import StageEvent
from engine.io import prompt as prompts
from engine.io.gguf_model import load
from engine.pipeline.session import Cancelled, PipelineHooks, Session

from ..history.history_model import SweepMember
from ..run.model_cache import ModelCache
from ..run.record_model import RunRecord, record_config
from .sweep_messages import SWEEP_SIGNALS, SweepProgress, SweepRecorder, SweepRequest  # noqa: F401  (re-exported)
from .sweep_model import SweepPlan, SweepSample, SweepStep, format_tokens

log = logging.getLogger(__name__)

class _ChunkCounter:
    """The Session's sink during a sweep: counts chunks the last stage finished (cheap, any thread)
    and reports at most every `interval_s`."""

    def __init__(self, report: Callable[[int], None], interval_s: float = 0.25) -> None:
        self.report = report
        self.interval_s = interval_s
        self.finisher = -1  # nothing counted before the first measured run
        self.chunks = 0
        self._last = 0.0
        self._seen: set[tuple[str, int]] = set()
        self._lock = threading.Lock()

    def reset(self, finisher: int) -> None:
        """A measured run starts: count its chunks from 0 (on the stage that finishes them)."""
        with self._lock:
            self.finisher, self.chunks, self._last, self._seen = finisher, 0, 0.0, set()

    def pause(self) -> None:
        """Count nothing until the next reset: warm-up runs share the sink, and their chunks were
        counted into the previous run's figure ("chunk 9/4", issue 37)."""
        with self._lock:
            self.finisher = -1

    def __call__(self, ev: StageEvent) -> None:
        if ev.kind != "compute" or ev.stage != self.finisher or ev.chunk < 0:
            return
        with self._lock:
            if ev.stage != self.finisher or (ev.run_id, ev.chunk) in self._seen:
                return
            self._seen.add((ev.run_id, ev.chunk))
            self.chunks += 1
            now = time.monotonic()
            if now - self._last < self.interval_s:
                return
            self._last = now
            n = self.chunks
        self.report(n)


class SweepJob:
    def __init__(self, request: SweepRequest, cancel: threading.Event, outlet: Any,
                 recorder: SweepRecorder | None = None, hooks: PipelineHooks | None = None,
                 models: ModelCache | None = None) -> None:
        """`outlet`: any object with one method per name of SWEEP_SIGNALS.  `models`: where the
        form already parsed the file (the window's cache); else it is parsed here."""
        self.models = models
        self.request = request
        self.cancel = cancel
        self.out = outlet
        self.recorder = recorder
        self.hooks = hooks
        self._done = 0
        self._step: SweepStep | None = None
        self._n_chunks = 0
        self.save_errors: list[str] = []

    def execute(self) -> None:
        sessions: list[Session] = []
        req, plan = self.request, self.request.plan
        try:
            self.out.status(f"opening {req.model_path.name} …")
            model = self.models.get(req.model_path) if self.models is not None else load(req.model_path)
            counter = _ChunkCounter(self._on_chunks)
            for i, cfg in enumerate(req.configs):
                if self.cancel.is_set():
                    break
                self.out.status(f"loading arm {plan.arms[i].name} onto {', '.join(cfg.devices)} …")
                sess = Session(model, cfg, sink=counter, hooks=self.hooks or PipelineHooks())
                sessions.append(sess)
            stopped = self.cancel.is_set()
            if not stopped:
                stopped = not self._run_steps(sessions, plan, model.spec.vocab, counter)
            msg = (f"stopped after {self._done} of {plan.total} runs; the finished points are kept" if stopped
                   else f"finished all {plan.total} runs")
            if self.save_errors:
                msg += f"; {len(self.save_errors)} run(s) not saved to the history: {self.save_errors[0]}"
            self.out.finished(stopped, msg)
        except Exception as exc:
            self.out.failed(*failure.dialog_text(exc, "the sweep", "Sweep failed"))
        finally:
            for sess in sessions:
                try:
                    sess.close()
                except Exception:
                    log.exception("closing a sweep session failed")
            self.out.done()

    def _warm_up(self, sessions: list[Session], plan: SweepPlan, prompt_tokens: int, vocab: int) -> bool:
        """Unmeasured runs at one prompt size: the first sight of its chunk shapes plans kernels and
        captures CUDA graphs, which a measured run must not pay for."""
        ids = prompts.warmup_ids(prompt_tokens, vocab)
        for k in range(plan.warmup):
            for i, sess in enumerate(sessions):
                self.out.status(f"warming up arm {plan.arms[i].name} at {format_tokens(prompt_tokens)} tokens "
                                 f"({k + 1}/{plan.warmup}, not measured) …")
                try:
                    sess.run(ids, 0, cancel=self.cancel)
                except Cancelled:
                    return False
        return not self.cancel.is_set()

    def _run_steps(self, sessions: list[Session], plan: SweepPlan, vocab: int, counter: _ChunkCounter) -> bool:
        req = self.request
        ids_for: dict[tuple[int, int], list[int]] = {}
        total = plan.total
        for step in plan.steps():  # engine.sweep's order, as strata-bench walks it
            if self.cancel.is_set():
                return False
            if plan.warmup and step.first_of_size:
                self._step = None  # the warm-up's chunks are no measured run's
                counter.pause()
                if not self._warm_up(sessions, plan, step.prompt_tokens, vocab):
                    return False
            key = (step.prompt_tokens, step.repeat)
            ids = ids_for.get(key)
            if ids is None:
                ids_for.clear()  # one prompt in memory at a time: every arm of this (size, repeat) shares it
                ids = ids_for[key] = prompts.synthetic(step.prompt_tokens, vocab, step.nonce)
            sess = sessions[step.arm]
            self._step, self._n_chunks = step, 0
            counter.reset(0 if req.configs[step.arm].prefill_main else len(sess.stages) - 1)
            self.out.progress(SweepProgress(self._done, total, step))

            def on_plan(p, step=step) -> None:
                self._n_chunks = p.n_chunks
                self.out.progress(SweepProgress(self._done, total, step, 0, p.n_chunks))

            try:
                result = sess.run(ids, plan.decode_tokens, cancel=self.cancel, on_plan=on_plan)
            except Cancelled:
                return False
            report = result.report
            run_id = self._save(step, report, list(sess.events))
            self._done += 1
            self.out.point_done(SweepSample.from_report(step, report, run_id))
            self.out.progress(SweepProgress(self._done, total, None))
        self._step = None
        return True

    def _save(self, step: SweepStep, report, events: list[StageEvent]) -> int | None:
        if self.recorder is None:
            return None
        req, plan = self.request, self.request.plan
        arm = plan.arms[step.arm]
        config = record_config(req.configs[step.arm], req.model_label, f"synthetic, nonce {step.nonce}",
                               step.prompt_tokens, plan.decode_tokens)
        label = f"sweep #{req.sweep_id} · {arm.name} · {format_tokens(step.prompt_tokens)} · repeat {step.repeat + 1}" \
            if req.sweep_id is not None else f"sweep · {arm.name} · {format_tokens(step.prompt_tokens)}"
        record = RunRecord(report, events, config, source="sweep", status="finished", label=label)
        member = (req.sweep_id, SweepMember(0, step.arm, step.prompt_tokens, step.repeat)) \
            if req.sweep_id is not None else None
        try:
            return self.recorder(record, member)
        except Exception as exc:  # a full disk must not end the sweep
            log.exception("saving a sweep run failed")
            self.save_errors.append(str(exc))
            return None

    def _on_chunks(self, chunks: int) -> None:
        step = self._step
        if step is not None:
            self.out.progress(SweepProgress(self._done, self.request.plan.total, step, chunks, self._n_chunks))
