"""Owns the run thread: starts a RunWorker in a QThread, stops it, waits for it (GUI thread).

One run at a time.  `stop()` sets the cancel event the engine checks at each chunk boundary;
the engine then drains the split and raises Cancelled.  `shutdown()` (window closing) cancels,
waits for the thread and closes the cached Session.  `busy_changed(False)` is emitted only once
the thread has really finished, after the run's last signal.
"""
from __future__ import annotations

import logging
import threading

from PySide6.QtCore import QObject, QThread, Signal, Slot

from engine.pipeline import PipelineHooks

from .job_thread import JobThreadOwner
from engine.topology import Topology

from .event_batcher import DEFAULT_INTERVAL_S
from .run_worker import RunRecorder, RunRequest, RunWorker
from .session_cache import SessionCache

log = logging.getLogger(__name__)


class RunController(JobThreadOwner, QObject):
    run_started = Signal(object)
    events = Signal(object)
    telemetry = Signal(object)
    status = Signal(str)
    finished = Signal(object)
    cancelled = Signal(str)
    failed = Signal(str, str, str)
    saved = Signal(object)  # SaveResult: the run went into the history (or why not)
    busy_changed = Signal(bool)

    def __init__(self, hooks: PipelineHooks | None = None, batch_interval_s: float = DEFAULT_INTERVAL_S,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.hooks = hooks  # test and fault-injection seam, handed to every run
        self.batch_interval_s = batch_interval_s
        self.sessions = SessionCache()
        self.topology: Topology | None = None
        self.recorder: RunRecorder | None = None  # the history's add(), when there is a history
        self._thread: QThread | None = None
        self._worker: RunWorker | None = None
        self._cancel: threading.Event | None = None
        self.runs_started = 0

    def start(self, request: RunRequest) -> bool:
        if self._thread is not None:
            log.warning("a run is already in flight; start ignored")
            return False
        self._cancel = threading.Event()
        worker = RunWorker(request, self.sessions, self._cancel, self.hooks, self.topology, self.batch_interval_s,
                           self.recorder)
        worker.run_started.connect(self._on_run_started)
        worker.events.connect(self._on_events)
        worker.telemetry.connect(self._on_telemetry)
        worker.status.connect(self._on_status)
        worker.finished.connect(self._on_finished)
        worker.cancelled.connect(self._on_cancelled)
        worker.failed.connect(self._on_failed)
        worker.saved.connect(self._on_saved)
        self.runs_started += 1
        self._launch(worker, "strata-run")
        return True

    def shutdown(self) -> None:
        """Cancel, wait for the thread, free the Session: the window is closing."""
        if self._thread is not None:
            log.info("closing during a run: cancelling and waiting for the run thread")
            self.stop()
            self._thread.wait()
            self._on_thread_finished()
        self.sessions.close()

    # -------------------------------------------------- worker -> GUI thread
    @Slot(object)
    def _on_run_started(self, info: object) -> None:
        self.run_started.emit(info)

    @Slot(object)
    def _on_events(self, batch: object) -> None:
        self.events.emit(batch)

    @Slot(object)
    def _on_telemetry(self, samples: object) -> None:
        self.telemetry.emit(samples)

    @Slot(str)
    def _on_status(self, text: str) -> None:
        self.status.emit(text)

    @Slot(object)
    def _on_finished(self, report: object) -> None:
        self.finished.emit(report)

    @Slot(str)
    def _on_cancelled(self, message: str) -> None:
        self.cancelled.emit(message)

    @Slot(str, str, str)
    def _on_failed(self, title: str, message: str, details: str) -> None:
        self.failed.emit(title, message, details)

    @Slot(object)
    def _on_saved(self, result: object) -> None:
        self.saved.emit(result)

    @Slot()
    def _on_thread_finished(self) -> None:
        thread, worker = self._thread, self._worker
        if thread is None:
            return
        self._thread, self._worker, self._cancel = None, None, None
        if worker is not None:
            worker.deleteLater()
        thread.deleteLater()
        self.busy_changed.emit(False)
