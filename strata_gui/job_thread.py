"""What a controller owning one background QThread job shares: stop it, wait for it.

Subclasses set `_thread` (the QThread, None when idle) and `_cancel` (the threading.Event the
engine checks at chunk boundaries)."""
from __future__ import annotations

import threading

from PySide6.QtCore import QObject, Qt, QThread


class JobThreadOwner:
    _thread: QThread | None = None
    _cancel: threading.Event | None = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None

    def _launch(self, worker: QObject, name: str) -> None:
        """Run `worker.run` in a new QThread named `name`; the worker's `done` ends the thread.
        The subclass connects the worker's own signals first and has `_on_thread_finished`."""
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
