"""A long engine job (a run, a sweep) in the background, its outlet relayed as Qt signals.

A Qt-free job (run_job.RunJob, sweep_job.SweepJob) calls one method of its outlet per thing
that happens, each named in the job's signal table (`RUN_SIGNALS`, `SWEEP_SIGNALS`: name ->
argument types, written once).  From that table:

- `signals_class(table)` makes the QObject class with one Signal per name (plus busy_changed);
  a controller is one of those, so the window connects to `controller.<name>`;
- `SignalOutlet(emitter)` is the outlet handed to the job: each call emits the emitter's signal
  of that name, on the job's thread;
- `JobRunner.launch` runs the job in `BackgroundJobs` (the one thread helper) and relays each of
  the emitter's signals by the controller's own, so they arrive queued in the GUI thread.
  `busy_changed(False)` comes once the thread has really ended, after the job's last signal.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from PySide6.QtCore import QObject, Signal

from .background import BackgroundJobs

log = logging.getLogger(__name__)

SignalTable = Mapping[str, tuple[type, ...]]


def signals_class(name: str, table: SignalTable) -> type[QObject]:
    """A QObject subclass with one Signal per entry of `table`, and busy_changed(bool)."""
    attrs: dict[str, object] = {n: Signal(*types) for n, types in table.items()}
    attrs["busy_changed"] = Signal(bool)
    attrs["signal_names"] = tuple(table)
    return type(name, (QObject,), attrs)


class SignalOutlet:
    """An outlet whose every call emits `emitter`'s signal of that name (any thread)."""

    def __init__(self, emitter: QObject) -> None:
        for n in emitter.signal_names:
            setattr(self, n, getattr(emitter, n).emit)


class JobRunner:
    """Mixed into a controller made by `signals_class` (set as `signals`): one job at a time,
    stoppable."""

    signals: type[QObject]
    _cancel: threading.Event | None = None
    _jobs: BackgroundJobs | None = None
    _emitter: QObject | None = None

    @property
    def is_running(self) -> bool:
        return self._emitter is not None

    def launch(self, name: str, make_job: Callable[[threading.Event, SignalOutlet], Callable[[], None]]) -> bool:
        """Start `make_job(cancel, outlet)()` in a thread named strata-`name`; False when a job
        of this controller is in flight already."""
        if self._emitter is not None:
            log.warning("a %s is already in flight; start ignored", name)
            return False
        if self._jobs is None:
            self._jobs = BackgroundJobs(self)
        self._cancel = threading.Event()
        emitter = self.signals()  # the same signal set, emitted on the job's thread
        for n in self.signal_names:
            getattr(emitter, n).connect(getattr(self, n))
        body = make_job(self._cancel, SignalOutlet(emitter))
        self._emitter = emitter
        self.busy_changed.emit(True)
        self._jobs.submit(name, body, on_ended=self._on_ended)
        return True

    def stop(self) -> None:
        """Ask the engine to stop at the next chunk boundary."""
        if self._cancel is not None:
            self._cancel.set()

    def wait(self, timeout_ms: int = -1) -> bool:
        """Block until the job's thread has ended; True when it has (or none was running)."""
        return self._jobs is None or self._jobs.wait(timeout_ms)

    def _wait_out(self, what: str) -> None:
        """Window closing during a job: stop it and wait for its thread."""
        if self._emitter is not None and self._jobs is not None:
            log.info("closing during a %s: stopping it and waiting for its thread", what)
            self.stop()
            self._jobs.wait_all()

    def _on_ended(self) -> None:
        emitter = self._emitter
        self._emitter, self._cancel = None, None
        if emitter is not None:
            emitter.deleteLater()
        self.busy_changed.emit(False)
