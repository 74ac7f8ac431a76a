"""What a controller owning one background QThread job shares: stop it, wait for it.

Subclasses set `_thread` (the QThread, None when idle) and `_cancel` (the threading.Event the
engine checks at chunk boundaries)."""
from __future__ import annotations

import logging
import threading

from PySide6.QtCore import QObject, Qt, QThread, Slot

log = logging.getLogger(__name__)


class JobThreadOwner:
    _thread: QThread | None = None
    _worker: QObject | None = None
    _cancel: threading.Event | None = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None

    def _launch(self, worker: QObject, name: str, relayed: tuple[str, ...]) -> None:
        """Run `worker.run` in a new QThread named `name`; the worker's `done` ends the thread.
        Each signal named in `relayed` is re-emitted by this controller's own signal of that
        name, in the GUI thread (a signal-to-signal connection is queued to its receiver)."""
        for name_ in relayed:
            getattr(worker, name_).connect(getattr(self, name_))
        thread = QThread()
        thread.setObjectName(name)
        worker.moveToThread(thread)
        thread.started.connect(worker.run)
        # direct: quit from the worker thread itself, so shutdown() can block in wait()
        worker.done.connect(thread.quit, Qt.ConnectionType.DirectConnection)
        thread.finished.connect(self._on_thread_finished)
        self._thread, self._worker = thread, worker
        self.busy_changed.emit(True)
        thread.start()

    def stop(self) -> None:
        """Ask the engine to stop at the next chunk boundary."""
        if self._cancel is not None:
            self._cancel.set()

    def wait(self, timeout_ms: int = -1) -> bool:
        """Block until the job's thread has ended; True when it has (or none was running)."""
        thread = self._thread
        if thread is None:
            return True
        return thread.wait() if timeout_ms < 0 else thread.wait(timeout_ms)

    def _wait_out(self, what: str) -> None:
        """Window closing during a job: stop it and wait for its thread."""
        if self._thread is not None:
            log.info("closing during a %s: stopping it and waiting for its thread", what)
            self.stop()
            self._thread.wait()
            self._on_thread_finished()

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
