"""Gantt benchmark: frame time when panning and zooming 100,000 blocks, and event-to-screen
latency at 1,000 events/s through the GUI's real path (EventBatcher -> Qt signal -> GanttView).

    QT_QPA_PLATFORM=offscreen python -m strata_gui.tools.bench_gantt [--blocks 100000] [--rate 1000]

The timeline is a synthetic filled pipeline (compute per stage and chunk, the hand-off copies and
the reap waits of stage 0); no engine runs, so the figures are about drawing only.  A frame is:
set the X range (which hands the visible, pixel-merged blocks to the items), then repaint the
whole plot synchronously.  Latency is from an event's end (its emission, as the engine emits at the end
of an interval) to the end of the first paint that shows it.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MS = 1_000_000


@dataclass
class Row:
    what: str
    frames: int
    median_ms: float
    p95_ms: float
    max_ms: float
    target: str
    drawn: str = ""

    @property
    def ok(self) -> str:
        limit = float(self.target.split()[1])
        return "yes" if self.median_ms <= limit else "NO"


def fill(view, n_blocks: int, n_stages: int = 4) -> int:
    """About n_blocks blocks: compute for every (stage, chunk), copies of stages 0..N-2, reap waits
    of stage 0.  Returns the number of chunks."""
    per_chunk = n_stages + (n_stages - 1) + 1
    n_chunks = n_blocks // per_chunk
    origin = 10**12
    view.reset("", origin, [(s, f"cuda:{s}", 12 * s, 12 * s + 12) for s in range(n_stages)])
    slot = 2 * MS
    c = np.arange(n_chunks)
    rng = np.random.default_rng(0)
    for s in range(n_stages):
        start = origin + (c + s) * slot + rng.integers(0, 50_000, n_chunks)
        dur = (slot * 0.8 + rng.integers(-100_000, 100_000, n_chunks)).astype(np.int64)
        view.store.add_columns("compute", np.full(n_chunks, s), c, start, start + dur, tokens=np.full(n_chunks, 2048))
        if s < n_stages - 1:
            view.store.add_columns("copy", np.full(n_chunks, s), c, start + dur, start + dur + 60_000,
                                   tokens=np.full(n_chunks, 2048), nbytes=np.full(n_chunks, 2048 * 4096 * 2),
                                   note="host")
        if s == 0:
            view.store.add_columns("wait", np.zeros(n_chunks), c, start + dur + 60_000, start + slot - 10_000,
                                   note="reap")
    return n_chunks


def _frame(app, view, x0: float, x1: float) -> float:
    """One complete frame: the range change hands the visible, pixel-merged blocks to the items,
    then the whole plot (blocks, labels, grid, axes) is painted synchronously."""
    app.processEvents()  # settle what the previous frame left pending (untimed)
    t0 = time.perf_counter()
    view.vb.setXRange(x0, x1, padding=0)
    view.plot.viewport().repaint()
    return (time.perf_counter() - t0) * 1e3


def _row(what: str, times: list[float], target_ms: float, drawn: str) -> Row:
    times = times[2:] if len(times) > 6 else times  # the first frames warm caches
    return Row(what, len(times), statistics.median(times), float(np.percentile(times, 95)), max(times),
               f"≤ {target_ms:g} ms", drawn)


def bench_frames(app, view, frames: int, target_ms: float) -> list[Row]:
    a, b = view.store.span_ns()
    full = (b - a) / 1e9
    rows = []

    def drawn() -> str:
        d = view.drawn_counts()
        return f"{sum(d.values()):,} rects, {view.labels.count} labels"

    for name, width in (("pan, whole run in view", full), ("pan, 1/20 of the run in view", full / 20),
                        ("pan, ~25 chunks in view (labels)", 25 * 2 * MS / 1e9)):
        times = []
        lo, hi = -0.25 * width, full - 0.75 * width  # every frame moves by 5% of the width
        start = lo
        step = width * 0.05
        for _ in range(frames):
            if start > hi:
                start = lo + (start - hi) % step + step / 2
            times.append(_frame(app, view, start, start + width))
            start += step
        rows.append(_row(name, times, target_ms, drawn()))
    # zoom: from the whole run to ~25 chunks and back, x1.25 per frame
    times = []
    w = full
    centre = full / 2
    shrinking = True
    for _ in range(frames):
        w = w / 1.25 if shrinking else w * 1.25
        if w < 25 * 2 * MS / 1e9:
            shrinking = False
        if w > full:
            w, shrinking = full, True
        times.append(_frame(app, view, centre - w / 2, centre + w / 2))
    rows.append(_row("zoom in and out (x1.25 per frame)", times, target_ms, "varies"))
    return rows


def bench_latency(app, view, rate: float, seconds: float, target_ms: float) -> Row:
    from PySide6.QtCore import QObject, Signal, Slot

    from engine.events import StageEvent

    from ..run.event_batcher import EventBatcher

    class Bridge(QObject):
        batch = Signal(object)

    class Sink(QObject):
        def __init__(self) -> None:
            super().__init__()
            self.pending: list[int] = []  # end_ns of events added since the last paint
            self.latencies: list[float] = []
            self.received = 0

        @Slot(object)
        def on_batch(self, batch: list) -> None:
            view.add_events(batch)
            self.received += len(batch)
            self.pending.extend(ev.end_ns for ev in batch)

        @Slot()
        def on_painted(self) -> None:
            now = time.perf_counter_ns()
            self.latencies.extend((now - t) / 1e6 for t in self.pending)
            self.pending = []

    bridge, sink = Bridge(), Sink()
    bridge.batch.connect(sink.on_batch)
    view.plot.painted.connect(sink.on_painted)
    t_start = time.perf_counter_ns()
    view.reset("live", t_start, [(s, f"cuda:{s}", 12 * s, 12 * s + 12) for s in range(4)])
    view.follow.setChecked(True)
    batcher = EventBatcher(bridge.batch.emit)
    n_events = int(rate * seconds)
    stop = threading.Event()

    def produce() -> None:
        period = 1.0 / rate
        nxt = time.perf_counter()
        prev = time.perf_counter_ns()
        for i in range(n_events):
            if stop.is_set():
                return
            nxt += period
            delay = nxt - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            now = time.perf_counter_ns()
            batcher(StageEvent("live", i % 4, f"cuda:{i % 4}", i // 4, "compute", prev, now, tokens=2048))
            prev = now

    batcher.start()
    producer = threading.Thread(target=produce, name="bench-producer")
    producer.start()
    deadline = time.monotonic() + seconds * 3 + 5
    while (producer.is_alive() or sink.received < n_events) and time.monotonic() < deadline:
        app.processEvents()
        time.sleep(0.001)
    stop.set()
    producer.join()
    batcher.stop()
    end = time.monotonic() + 1.0
    while sink.pending and time.monotonic() < end:
        app.processEvents()
        time.sleep(0.001)
    lat = sink.latencies
    return Row(f"event-to-screen at {rate:,.0f} events/s ({batcher.batches} batches)", len(lat),
               statistics.median(lat), float(np.percentile(lat, 95)), max(lat), f"≤ {target_ms:g} ms",
               f"{len(lat):,} events shown")


def render(rows: Sequence[Row], n_blocks: int, size: tuple[int, int]) -> str:
    import pyqtgraph
    from PySide6 import __version__ as pyside
    from PySide6.QtGui import QGuiApplication

    head = (f"Gantt benchmark: {n_blocks:,} blocks, plot {size[0]}x{size[1]} px, "
            f"Qt platform {QGuiApplication.platformName()}, PySide6 {pyside}, pyqtgraph {pyqtgraph.__version__}, "
            f"Python {platform.python_version()}, {os.cpu_count()} CPU(s) "
            f"({platform.processor() or platform.machine()})")
    lines = [head, "", "| measurement | samples | median ms | p95 ms | max ms | target (median) | met | drawn |",
             "|---|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.what} | {r.frames} | {r.median_ms:.1f} | {r.p95_ms:.1f} | {r.max_ms:.1f} | {r.target} "
                     f"| {r.ok} | {r.drawn} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m strata_gui.tools.bench_gantt", description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--frames", type=int, default=60, help="frames per pan/zoom measurement")
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--height", type=int, default=600)
    ap.add_argument("--rate", type=float, default=1000.0, help="events per second for the latency measurement")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of the latency measurement")
    ns = ap.parse_args(argv)
    from ..app import make_app
    from ..views.gantt_view import GanttView

    app = make_app()
    view = GanttView()
    view.resize(ns.width, ns.height)
    view.show()
    app.processEvents()
    fill(view, ns.blocks)
    view.fit()
    app.processEvents()
    rows = bench_frames(app, view, ns.frames, 33.0)
    view.close()
    live = GanttView()
    live.resize(ns.width, ns.height)
    live.show()
    app.processEvents()
    rows.append(bench_latency(app, live, ns.rate, ns.seconds, 100.0))
    live.close()
    sys.stdout.write(render(rows, ns.blocks, (ns.width, ns.height)) + "\n")
    return 0 if all(r.ok == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
