"""DeferredTimer: GPU intervals are resolved on a helper thread, in order, never blocking the
submitter; flush() waits for all of them. The CUDA events are stood in for by objects with the
same two methods the timer uses (the real events are exercised by tests/test_cuda.py on GPUs)."""
from __future__ import annotations

import threading

import torch

from engine.hw.gpu_timing import DeferredTimer, GpuInterval
from engine.pipeline.stage import _Worker


class Event:
    """Completes when released; its time on its device's clock is `t`."""

    def __init__(self, t: int, fail: bool = False) -> None:
        self.t, self.fail = t, fail
        self.done = threading.Event()

    def synchronize(self) -> None:
        assert self.done.wait(5)
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


class Clock:
    offsets = {"cuda:0": 1_000, "cuda:1": 5_000}  # each device's anchor on the host clock

    def to_host_ns(self, device, ev: Event) -> int:
        return self.offsets[str(device)] + ev.t


def _timer() -> DeferredTimer:
    return DeferredTimer(Clock(), lambda: _Worker("strata-timing-test"))


def test_submit_never_waits_for_the_gpu_and_flush_delivers_in_order():
    timer = _timer()
    got: list[tuple[str, int, int]] = []
    d0 = torch.device("cuda:0")
    evs = [(Event(10 * i), Event(10 * i + 5)) for i in range(5)]
    for i, (a, b) in enumerate(evs):
        timer.submit(GpuInterval(d0, a, d0, b, lambda s, e, i=i: got.append((f"C{i}", s, e))))
    assert got == []  # nothing has finished on the "GPU": the submitter went on regardless
    for a, b in evs:
        a.done.set()
        b.done.set()
    timer.flush()
    assert got == [(f"C{i}", 1_000 + 10 * i, 1_000 + 10 * i + 5) for i in range(5)]
    timer.stop()


def test_short_idle_gaps_are_dropped_and_cross_device_skew_is_clamped():
    timer = _timer()
    got = []
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    a, b = Event(0), Event(10)
    c, d = Event(4_100), Event(0)  # a copy that ends on another device's clock, "before" it started
    for e in (a, b, c, d):
        e.done.set()
    timer.submit(GpuInterval(d0, a, d0, b, lambda s, e: got.append(("gap", s, e)), min_ns=20_000))
    timer.submit(GpuInterval(d0, c, d1, d, lambda s, e: got.append(("copy", s, e))))
    timer.flush()
    assert got == [("copy", 5_100, 5_100)]
    timer.stop()


def test_an_interval_that_cannot_be_read_is_skipped_and_later_ones_still_arrive(caplog):
    timer = _timer()
    got = []
    d0 = torch.device("cuda:0")
    bad, good = Event(5, fail=True), Event(7)
    for e in (bad, good):
        e.done.set()
    timer.submit(GpuInterval(d0, Event(0), d0, bad, lambda s, e: got.append("bad")))
    timer.submit(GpuInterval(d0, Event(0), d0, good, lambda s, e: got.append("good")))
    timer.flush()
    assert got == ["good"]
    assert "GPU timing could not be resolved" in caplog.text and "illegal memory access" in caplog.text
    timer.stop()
    assert timer._worker is None


def test_a_cpu_only_timer_starts_no_thread():
    started = []
    timer = DeferredTimer(Clock(), lambda: started.append(1))
    timer.flush()
    timer.stop()
    assert started == []


def test_flush_waits_for_intervals_submitted_from_every_stage_thread():
    """Stage threads submit concurrently; a flush (before the run report is built) must cover
    all of them, not just the last one to return from submit."""
    timer = _timer()
    got = []
    lock = threading.Lock()
    d0 = torch.device("cuda:0")
    gate = Event(0)  # every interval waits on this "GPU" event

    def record(key: tuple[str, int]):
        def deliver(start: int, end: int) -> None:
            with lock:
                got.append(key)
        return deliver

    def stage(name: str) -> None:
        for i in range(50):
            timer.submit(GpuInterval(d0, Event(0), d0, gate, record((name, i))))

    threads = [threading.Thread(target=stage, args=(f"stage{k}",)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == []
    gate.done.set()
    timer.flush()
    assert len(got) == 150
    assert [i for name, i in got if name == "stage1"] == list(range(50))  # each thread's in its order
    timer.stop()
