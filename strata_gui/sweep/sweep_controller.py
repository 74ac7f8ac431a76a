"""Owns the sweep thread: starts a SweepWorker in a QThread, stops it, waits for it (GUI thread).

One sweep at a time.  `stop()` sets the cancel event (the engine stops at the next chunk boundary,
the finished points stay); `shutdown()` (window closing) stops and waits.  `busy_changed(False)`
comes once the thread has really ended, after the sweep's last signal.
"""
from __future__ import annotations

import logging
import threading

from PySide6.QtCore import QObject, QThread, Signal

from engine.pipeline import PipelineHooks

from ..run.job_thread import JobThreadOwner
from ..run.model_cache import ModelCache
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
        self.models: ModelCache | None = None  # the window's parsed files: a sweep does not parse its model again
        self._thread: QThread | None = None
        self._worker: SweepWorker | None = None
        self._cancel: threading.Event | None = None

    def start(self, request: SweepRequest) -> bool:
        if self._thread is not None:
            log.warning("a sweep is already in flight; start ignored")
            return False
        self._cancel = threading.Event()
        worker = SweepWorker(request, self._cancel, self.recorder, self.hooks, self.models)
        self._launch(worker, "strata-sweep", ("progress", "point_done", "status", "finished", "failed"))
        return True

    def shutdown(self) -> None:
        self._wait_out("sweep")
