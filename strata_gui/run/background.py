"""Short background jobs off the GUI thread (device discovery, bandwidth probe), worker-object style.

Each job runs a plain callable in its own QThread and hands (result, error) back to a callback in
the GUI thread.  `wait_all()` joins whatever is still running (the window is closing).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot

log = logging.getLogger(__name__)


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

    def __init__(self, callback: Callable[[Any, str | None], None],
                 on_thread_finished: Callable[[], None]) -> None:
        super().__init__()
        self.callback = callback
        self.on_thread_finished = on_thread_finished

    @Slot(object, object)
    def deliver(self, result: object, error: object) -> None:
        self.callback(result, error if error is None else str(error))

    @Slot()
    def thread_finished(self) -> None:
        self.on_thread_finished()


class BackgroundJobs(QObject):
    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._running: dict[QThread, tuple[_Job, _Delivery]] = {}

    def submit(self, name: str, fn: Callable[[], Any], callback: Callable[[Any, str | None], None]) -> None:
        thread = QThread()
        job, delivery = _Job(fn), _Delivery(callback, lambda: self._finished(thread))
        thread.setObjectName(f"strata-{name}")
        job.moveToThread(thread)
        thread.started.connect(job.run)
        job.done.connect(delivery.deliver)
        job.done.connect(thread.quit, Qt.ConnectionType.DirectConnection)  # GUI may be blocked in wait()
        thread.finished.connect(delivery.thread_finished)
        self._running[thread] = (job, delivery)
        thread.start()

    @property
    def busy(self) -> bool:
        return bool(self._running)

    def _finished(self, thread: QThread) -> None:
        pair = self._running.pop(thread, None)
        if pair is None:
            return
        pair[0].deleteLater()
        pair[1].deleteLater()
        thread.deleteLater()

    def wait_all(self) -> None:
        for thread in list(self._running):
            thread.wait()
            self._finished(thread)
