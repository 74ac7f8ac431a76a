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
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

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

    def to_host_ns(self, device: torch.device, ev: "torch.cuda.Event") -> int:
        a, host = self.anchors[device]
        return host + int(a.elapsed_time(ev) * 1e6)


def timing_event(device: torch.device, stream: "torch.cuda.Stream | None" = None) -> "torch.cuda.Event":
    """A timing event recorded now on `stream` (the device's current stream when None)."""
    ev = torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(device):
        ev.record(stream)
    return ev


@dataclass
class GpuInterval:
    """One interval of GPU work: start and end events, each on its own device's clock."""

    start_device: torch.device
    start: "torch.cuda.Event"
    end_device: torch.device
    end: "torch.cuda.Event"
    deliver: Callable[[int, int], None]  # (start_ns, end_ns) on the host clock
    min_ns: int = 0  # when set, shorter intervals are dropped (idle gaps of a few microseconds)


class DeferredTimer:
    """Resolves `GpuInterval`s in submission order on a helper thread (`submit` never blocks).

    `flush()` returns once every interval submitted so far has been delivered."""

    def __init__(self, clock: DeviceClock, start_worker: Callable[[], "object"]) -> None:
        self.clock = clock
        self._start_worker = start_worker  # makes the thread lazily: CPU-only sessions never need it
        self._worker = None
        self._last: Future | None = None

    def submit(self, iv: GpuInterval) -> None:
        if self._worker is None:
            self._worker = self._start_worker()
        self._last = self._worker.submit(_resolve, self.clock, iv)

    def flush(self) -> None:
        last, self._last = self._last, None
        if last is not None:
            last.result()

    def stop(self) -> None:
        self.flush()
        if self._worker is not None:
            self._worker.stop()
            self._worker = None


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
