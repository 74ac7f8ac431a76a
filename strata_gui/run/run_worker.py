"""The run worker: one engine run (strata_gui.run_job) in a QThread, worker-object pattern.

Each call the job makes of its outlet leaves as the signal of the same name, so the GUI thread
only draws.  The Qt-free job holds everything a run does; see run_job.py.
"""
from __future__ import annotations

import threading

from PySide6.QtCore import QObject, Signal, Slot

from engine.pipeline import PipelineHooks
from engine.topology import Topology

from .event_batcher import DEFAULT_INTERVAL_S
from .run_job import RepeatDone, RunJob, RunRecorder, RunRequest, RunStarted, SaveResult
from .session_cache import SessionCache


class RunWorker(QObject):
    run_started = Signal(object)  # RunStarted
    events = Signal(object)  # list[StageEvent]
    telemetry = Signal(object)  # list[TelemetrySample]
    status = Signal(str)
    finished = Signal(object)  # RunReport of the last repeat
    measured = Signal(object)  # RepeatDone, after each measured repeat (before finished)
    warmup = Signal(int, int)  # chunks of the warm-up pass done, of total
    cancelled = Signal(str)
    failed = Signal(str, str, str)  # title, message, details
    saved = Signal(object)  # SaveResult
    done = Signal()

    def __init__(self, request: RunRequest, sessions: SessionCache, cancel: threading.Event,
                 hooks: PipelineHooks | None = None, topology: Topology | None = None,
                 batch_interval_s: float = DEFAULT_INTERVAL_S, recorder: RunRecorder | None = None) -> None:
        super().__init__()
        self.request = request
        self.job = RunJob(request, sessions, cancel, _SignalOutlet(self), hooks, topology, batch_interval_s, recorder)

    @Slot()
    def run(self) -> None:
        self.job.execute()


class _SignalOutlet:
    """A RunOutlet whose every call emits the worker's signal of that name."""

    def __init__(self, worker: RunWorker) -> None:
        self.w = worker

    def run_started(self, started: RunStarted) -> None:
        self.w.run_started.emit(started)

    def events(self, batch: list) -> None:
        self.w.events.emit(batch)

    def telemetry(self, samples: list) -> None:
        self.w.telemetry.emit(samples)

    def status(self, text: str) -> None:
        self.w.status.emit(text)

    def finished(self, report) -> None:
        self.w.finished.emit(report)

    def warmup(self, done: int, total: int) -> None:
        self.w.warmup.emit(done, total)

    def measured(self, done: RepeatDone) -> None:
        self.w.measured.emit(done)

    def cancelled(self, message: str) -> None:
        self.w.cancelled.emit(message)

    def failed(self, title: str, message: str, details: str) -> None:
        self.w.failed.emit(title, message, details)

    def saved(self, result: SaveResult) -> None:
        self.w.saved.emit(result)

    def done(self) -> None:
        self.w.done.emit()
