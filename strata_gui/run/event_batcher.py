"""The engine's event sink for the GUI: thread-safe collection, one hand-off every ~50 ms.

Stage threads call the batcher (it is the `EventSink`); appending under a lock is all they pay.
A ticker thread delivers what has accumulated as ONE list per interval.  The ticker is a plain
thread rather than a QTimer because the run worker's QThread is inside `Session.run` for the
whole run, so no timer could fire in its event loop.  `deliver` is called with the flush lock
held, so batches reach the receiver in the order they were collected, and `stop()` delivers the
tail before returning: whatever is posted after `stop()` (a "finished" signal) comes after the
last batch.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from engine.events import StageEvent

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.05


class EventBatcher:
    def __init__(self, deliver: Callable[[list[StageEvent]], None], interval_s: float = DEFAULT_INTERVAL_S,
                 on_tick: Callable[[], None] | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"batch interval must be > 0 s, got {interval_s!r}")
        self._deliver = deliver
        self._on_tick = on_tick
        self.interval_s = interval_s
        self._buf: list[StageEvent] = []
        self._lock = threading.Lock()  # guards _buf (held by stage threads for one append)
        self._flush_lock = threading.Lock()  # orders deliveries
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.delivered = 0
        self.batches = 0

    # ----------------------------------------------------------------- the sink
    def __call__(self, ev: StageEvent) -> None:
        with self._lock:
            self._buf.append(ev)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="strata-gui-batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the ticker, then deliver what is left.  Safe to call more than once."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()
        self.flush()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def flush(self) -> int:
        """Deliver the collected events now (as one list); returns how many."""
        with self._flush_lock:
            with self._lock:
                batch, self._buf = self._buf, []
            if batch:
                self._deliver(batch)
                self.delivered += len(batch)
                self.batches += 1
            if self._on_tick is not None:
                self._on_tick()
            return len(batch)

    def _run(self) -> None:
        next_t = time.perf_counter() + self.interval_s
        while not self._stop.wait(max(next_t - time.perf_counter(), 0.0)):
            try:
                self.flush()
            except Exception:  # a receiver bug must not kill the ticker silently
                log.exception("event batch delivery failed")
            next_t = max(next_t + self.interval_s, time.perf_counter())
