"""Owns the sweep thread: starts a SweepWorker in a QThread, stops it, waits for it (GUI thread).

One sweep at a time.  `stop()` sets the cancel event (the engine stops at the next chunk boundary,
the finished points stay); `shutdown()` (window closing) stops and waits.  `busy_changed(False)`
comes once the thread has really ended, after the sweep's last signal.
"""
from __future__ import annotations

import logging
import threading

from PySide6.QtCore import QObject, QThread, Signal, Slot

from engine.pipeline import PipelineHooks

from .job_thread import JobThreadOwner

from .sweep_worker import SweepRecorder, SweepRequest, SweepWorker

log = logging.getLogger(__name__)


class SweepController(JobThreadOwner, QObject):
    progress = Signal(object)
    point_done = Signal(object)
    status = Signal(str)
    finished = Signal(bool, str)
    failed = Signal(str, str, str)
    busy_changed = Signal(bool)

    def __init__(self, hooks: PipelineHooks | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.hooks = hooks  # test and fault-injection seam, handed to every sweep
        self.recorder: SweepRecorder | None = None
        self._thread: QThread | None = None
        self._worker: SweepWorker | None = None
        self._cancel: threading.Event | None = None

    def start(self, request: SweepRequest) -> bool:
        if self._thread is not None:
            log.warning("a sweep is already in flight; start ignored")
            return False
        self._cancel = threading.Event()
        worker = SweepWorker(request, self._cancel, self.recorder, self.hooks)
        worker.progress.connect(self._on_progress)
        worker.point_done.connect(self._on_point)
        worker.status.connect(self._on_status)
        worker.finished.connect(self._on_finished)
        worker.failed.connect(self._on_failed)
        self._launch(worker, "strata-sweep")
        return True

    def shutdown(self) -> None:
        if self._thread is not None:
            log.info("closing during a sweep: stopping it and waiting for the sweep thread")
            self.stop()
            self._thread.wait()
            self._on_thread_finished()

    # -------------------------------------------------- worker -> GUI thread
    @Slot(object)
    def _on_progress(self, p: object) -> None:
        self.progress.emit(p)

    @Slot(object)
    def _on_point(self, sample: object) -> None:
        self.point_done.emit(sample)

    @Slot(str)
    def _on_status(self, text: str) -> None:
        self.status.emit(text)

    @Slot(bool, str)
    def _on_finished(self, stopped: bool, message: str) -> None:
        self.finished.emit(stopped, message)

    @Slot(str, str, str)
    def _on_failed(self, title: str, message: str, details: str) -> None:
        self.failed.emit(title, message, details)

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
