"""What a controller owning one background QThread job shares: stop it, wait for it.

Subclasses set `_thread` (the QThread, None when idle) and `_cancel` (the threading.Event the
engine checks at chunk boundaries)."""
from __future__ import annotations

import threading

from PySide6.QtCore import QThread


class JobThreadOwner:
    _thread: QThread | None = None
    _cancel: threading.Event | None = None

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
