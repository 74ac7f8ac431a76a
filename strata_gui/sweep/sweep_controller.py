"""Runs the Sweep tab's sweeps (GUI thread): one SweepJob at a time in the background, its
outlet relayed as this controller's signals (SWEEP_SIGNALS, through run/job_runner.py), and the
sweep's record in the history (sweep_book.SweepBook): `prepare` frees the Run tab's loaded
model and records the sweep, its end is recorded before the window's slots see it.

`stop()` sets the cancel event (the engine stops at the next chunk boundary, the finished points
stay); `shutdown()` (window closing) stops and waits.  `busy_changed(False)` comes once the
thread has really ended, after the sweep's last signal.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject

from ..run.job_runner import JobRunner, signals_class
from ..run.model_cache import ModelCache
from .sweep_book import SweepBook
from .sweep_messages import SWEEP_SIGNALS, SweepRecorder, SweepRequest
from .sweep_model import SweepPlan

if TYPE_CHECKING:
    from engine.pipeline.session import PipelineHooks

log = logging.getLogger(__name__)

SweepSignals = signals_class("SweepSignals", SWEEP_SIGNALS)


class SweepController(JobRunner, SweepSignals):
    signals = SweepSignals

    def __init__(self, hooks: PipelineHooks | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.hooks = hooks  # test and fault-injection seam, handed to every sweep
        self.recorder: SweepRecorder | None = None
        self.models: ModelCache | None = None  # the window's parsed files: a sweep does not parse its model again
        self.book = SweepBook()
        self.free_memory: Callable[[], None] | None = None  # closes the Run tab's loaded Session
        self.sweep_id: int | None = None  # the sweep in flight (or the last one), in the history
        # connected first: the history has the sweep's end when the window's slot runs
        self.finished.connect(lambda stopped, _msg: self.book.end(self.sweep_id, "stopped" if stopped else "finished"))
        self.failed.connect(lambda *_a: self.book.end(self.sweep_id, "stopped"))

    def prepare(self, plan: SweepPlan) -> tuple[int | None, str]:
        """Before `start`: the Run tab's model leaves memory, the sweep goes into the history.
        Returns (its id there or None, why it is not saved or "")."""
        if self.free_memory is not None:
            self.free_memory()
        self.sweep_id, note = self.book.add(plan)
        return self.sweep_id, note

    def start(self, request: SweepRequest) -> bool:
        if self.is_running:
            log.warning("a sweep is already in flight; start ignored")
            return False
        from .sweep_job import SweepJob  # the engine's Session and torch: imported by the first sweep

        return self.launch("sweep", lambda cancel, outlet: SweepJob(
            request, cancel, outlet, self.recorder, self.hooks, self.models).execute)

    def shutdown(self) -> None:
        self._wait_out("sweep")
