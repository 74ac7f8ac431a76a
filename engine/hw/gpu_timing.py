"""GPU work timed with CUDA events, mapped onto the host clock, resolved off the critical path.

A stage records a pair of CUDA events around its work and moves on; it never waits for the GPU
to learn when that work ran.  `DeferredTimer` hands each pair to one helper thread, which waits
for the end event, maps both events onto host `perf_counter_ns` through `DeviceClock`'s anchor
for their device and delivers the interval.  The stage threads therefore launch chunk after
chunk while the GPU works, and hand-offs between GPUs are ordered on the GPUs themselves (see
`pipeline.Stage.hand_off`) instead of by host synchronisations.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


class DeviceClock:
    """Maps CUDA event times onto host perf_counter_ns through an anchor per device."""

    def __init__(self) -> None:
        self.anchors: dict[torch.device, tuple[torch.cuda.Event, int]] = {}

    def anchor(self, device: torch.device) -> None:
        if device.type != "cuda":
            return
        torch.cuda.synchronize(device)
        with torch.cuda.device(device):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        ev.synchronize()
        self.anchors[device] = (ev, time.perf_counter_ns())

    def to_host_ns(self, device: torch.device, ev: torch.cuda.Event) -> int:
        a, host = self.anchors[device]
        return host + int(a.elapsed_time(ev) * 1e6)


def timing_event(device: torch.device, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
    """A timing event recorded now on `stream` (the device's current stream when None)."""
    ev = torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(device):
        ev.record(stream)
    return ev


@dataclass
class GpuInterval:
    """One interval of GPU work: start and end events, each on its own device's clock."""

    start_device: torch.device
    start: torch.cuda.Event
    end_device: torch.device
    end: torch.cuda.Event
    deliver: Callable[[int, int], None]  # (start_ns, end_ns) on the host clock
    min_ns: int = 0  # when set, shorter intervals are dropped (idle gaps of a few microseconds)


class DeferredTimer:
    """Resolves `GpuInterval`s in submission order on one helper thread; `submit` never waits
    for the GPU and may be called from every stage thread.

    `flush()` returns once every interval submitted before it was delivered (it queues a marker
    behind them on the helper's FIFO and waits for it)."""

    def __init__(self, clock: DeviceClock, start_worker: Callable[[], object]) -> None:
        self.clock = clock
        self._start_worker = start_worker  # makes the thread lazily: CPU-only sessions never need it
        self._worker = None
        self._lock = threading.Lock()

    def submit(self, iv: GpuInterval) -> None:
        with self._lock:
            if self._worker is None:
                self._worker = self._start_worker()
            self._worker.submit(_resolve, self.clock, iv)

    def flush(self) -> None:
        with self._lock:
            if self._worker is None:
                return
            marker = self._worker.submit(_marker)
        marker.result()

    def stop(self) -> None:
        self.flush()
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()


def _marker() -> None:
    """Queued by `flush`: once it ran, everything queued before it has."""


def _resolve(clock: DeviceClock, iv: GpuInterval) -> None:
    try:
        iv.end.synchronize()
        start = clock.to_host_ns(iv.start_device, iv.start)
        end = clock.to_host_ns(iv.end_device, iv.end)
    except Exception as exc:  # a timing that cannot be read must not fail the run (the stage reports GPU errors)
        log.warning("GPU timing could not be resolved: %s", exc)
        return
    if iv.min_ns and end - start < iv.min_ns:
        return
    # two devices' anchors differ by microseconds: a short cross-device copy may map end < start
    iv.deliver(start, max(end, start))
