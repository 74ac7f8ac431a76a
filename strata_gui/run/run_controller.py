"""Runs the Run tab's runs (GUI thread): one RunJob at a time in the background, its outlet
relayed as this controller's signals (RUN_SIGNALS, through job_runner), and what this press of
Run has done so far in `state` (run_state.RunState), updated before the window's slots see a
signal.

`stop()` sets the cancel event the engine checks at each chunk boundary; the engine then drains
the split and raises Cancelled.  `shutdown()` (window closing) cancels, waits for the thread and
closes the cached Session.  `busy_changed(False)` is emitted only once the thread has really
finished, after the run's last signal.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject

from engine.hw.topology import Topology

from .event_batcher import DEFAULT_INTERVAL_S
from .job_runner import JobRunner, signals_class
from .run_messages import RUN_SIGNALS, RunRecorder, RunRequest
from .run_state import RunState
from .session_cache import SessionCache

if TYPE_CHECKING:
    from engine.pipeline.session import PipelineHooks

log = logging.getLogger(__name__)

RunSignals = signals_class("RunSignals", RUN_SIGNALS)


class RunController(JobRunner, RunSignals):
    signals = RunSignals

    def __init__(self, hooks: PipelineHooks | None = None, batch_interval_s: float = DEFAULT_INTERVAL_S,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.hooks = hooks  # test and fault-injection seam, handed to every run
        self.batch_interval_s = batch_interval_s
        self.sessions = SessionCache()
        self.topology: Topology | None = None
        self.recorder: RunRecorder | None = None  # the history's add(), when there is a history
        self.runs_started = 0
        self.state = RunState()
        st = self.state  # connected first: the state is current when the window's slot runs
        self.run_started.connect(st.started)
        self.warmup.connect(st.warmup)
        self.events.connect(st.events)
        self.measured.connect(st.measured)
        self.saved.connect(st.saved)
        self.finished.connect(st.finished)
        self.cancelled.connect(lambda _m: st.ended("cancelled"))
        self.failed.connect(lambda *_a: st.ended("failed"))

    def start(self, request: RunRequest) -> bool:
        if self.is_running:
            log.warning("a run is already in flight; start ignored")
            return False
        self.state.begin(request.repeats)
        self.runs_started += 1
        from .run_job import RunJob  # the engine's Session and torch: imported by the first run

        return self.launch("run", lambda cancel, outlet: RunJob(
            request, self.sessions, cancel, outlet, self.hooks, self.topology, self.batch_interval_s,
            self.recorder).execute)

    def shutdown(self) -> None:
        """Cancel, wait for the thread, free the Session: the window is closing."""
        self._wait_out("run")
        self.sessions.close()
