"""The app's one way to run work off the GUI thread: a plain callable in its own QThread.

Short jobs (device discovery, the bandwidth probe, parsing a model file, an export) hand
(result, error) back to a callback in the GUI thread.  Long jobs (a run, a sweep: see
job_runner.py) pass no callback and learn through `on_ended` that their thread has really
finished, after every signal the job emitted.  `wait_all()` joins whatever is still running
(the window is closing).  `hold()` queues new jobs instead of starting them until `release()`:
the app holds the window's first jobs (device discovery, the model's parse: they import torch)
until the window is on screen, so they do not compete with drawing it (issue 37).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot

log = logging.getLogger(__name__)

Callback = Callable[[Any, str | None], None]


class _Job(QObject):
    done = Signal(object, object)  # result, error text (None when it worked)

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__()
        self.fn = fn

    @Slot()
    def run(self) -> None:
        try:
            result = self.fn()
        except Exception as exc:
            log.exception("background job failed")
            self.done.emit(None, f"{type(exc).__name__}: {exc}")
            return
        self.done.emit(result, None)


class _Delivery(QObject):
    """Lives in the GUI thread: receives the job's result and calls the callback there."""

    def __init__(self, callback: Callback | None, on_thread_finished: Callable[[], None]) -> None:
        super().__init__()
        self.callback = callback
        self.on_thread_finished = on_thread_finished

    @Slot(object, object)
    def deliver(self, result: object, error: object) -> None:
        if self.callback is not None:
            self.callback(result, error if error is None else str(error))

    @Slot()
    def thread_finished(self) -> None:
        self.on_thread_finished()


class BackgroundJobs(QObject):
    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._running: dict[QThread, tuple[_Job, _Delivery, Callable[[], None] | None]] = {}
        self._held: list[QThread] | None = None  # submitted, not started (hold/release)

    def submit(self, name: str, fn: Callable[[], Any], callback: Callback | None = None,
               on_ended: Callable[[], None] | None = None) -> QThread:
        """Run `fn` in a new thread named strata-`name`.  `callback(result, error)` comes in the
        GUI thread when `fn` returned; `on_ended()` once the thread has finished (or was waited
        out by `wait_all`), exactly once."""
        thread = QThread()
        job, delivery = _Job(fn), _Delivery(callback, lambda: self._finished(thread))
        thread.setObjectName(f"strata-{name}")
        job.moveToThread(thread)
        thread.started.connect(job.run)
        job.done.connect(delivery.deliver)
        job.done.connect(thread.quit, Qt.ConnectionType.DirectConnection)  # GUI may be blocked in wait()
        thread.finished.connect(delivery.thread_finished)
        self._running[thread] = (job, delivery, on_ended)
        if self._held is not None:
            self._held.append(thread)
        else:
            thread.start()
        return thread

    def hold(self) -> None:
        """Queue the jobs submitted from now on (busy counts them) until `release`."""
        if self._held is None:
            self._held = []

    def release(self) -> None:
        """Start the queued jobs, in order, and stop holding."""
        held, self._held = self._held or [], None
        for thread in held:
            if thread in self._running:
                thread.start()

    @property
    def busy(self) -> bool:
        return bool(self._running)

    def _finished(self, thread: QThread) -> None:
        entry = self._running.pop(thread, None)
        if entry is None:
            return
        job, delivery, on_ended = entry
        job.deleteLater()
        delivery.deleteLater()
        thread.deleteLater()
        if on_ended is not None:
            on_ended()

    def wait(self, timeout_ms: int = -1) -> bool:
        """Block until every job's thread has ended (or `timeout_ms` passed); True when they have."""
        return all(t.wait() if timeout_ms < 0 else t.wait(timeout_ms) for t in list(self._running))

    def wait_all(self) -> None:
        self.release()  # a job queued while the window closes runs now, so it ends like the others
        for thread in list(self._running):
            thread.wait()
            self._finished(thread)
