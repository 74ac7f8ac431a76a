"""Owns the run thread: starts a RunWorker in a QThread, stops it, waits for it (GUI thread).

One run at a time.  `stop()` sets the cancel event the engine checks at each chunk boundary;
the engine then drains the split and raises Cancelled.  `shutdown()` (window closing) cancels,
waits for the thread and closes the cached Session.  `busy_changed(False)` is emitted only once
the thread has really finished, after the run's last signal.
"""
from __future__ import annotations

import logging
import threading

from PySide6.QtCore import QObject, QThread, Signal

from engine.pipeline import PipelineHooks
from engine.topology import Topology

from .event_batcher import DEFAULT_INTERVAL_S
from .job_thread import JobThreadOwner
from .run_job import RunRecorder, RunRequest
from .run_worker import RunWorker
from .session_cache import SessionCache

log = logging.getLogger(__name__)


class RunController(JobThreadOwner, QObject):
    run_started = Signal(object)
    events = Signal(object)
    telemetry = Signal(object)
    status = Signal(str)
    finished = Signal(object)
    measured = Signal(object)  # RepeatDone after each measured repeat
    warmup = Signal(int, int)  # chunks of the warm-up pass done, of total
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
        self.runs_started += 1
        self._launch(worker, "strata-run", ("run_started", "events", "telemetry", "status", "finished",
                                            "measured", "warmup", "cancelled", "failed", "saved"))
        return True

    def shutdown(self) -> None:
        """Cancel, wait for the thread, free the Session: the window is closing."""
        self._wait_out("run")
        self.sessions.close()
