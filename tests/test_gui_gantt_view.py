"""The Gantt widget: batched drawing (one item per kind), only the visible range handed to the
items, labels only when zoomed in, hover tooltips, following the live edge."""
from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from gui_support import qt_settings_sandbox, themed_app  # noqa: F401

from engine.events import StageEvent
from strata_gui.views.gantt_view import GanttView
from strata_gui.views.telemetry_view import TelemetryView

MS = 1_000_000
ORIGIN = 10**12


def _view(qtbot) -> GanttView:
    view = GanttView()
    qtbot.addWidget(view)
    view.resize(1200, 420)
    view.show()
    qtbot.waitExposed(view)
    return view


def _fill(view: GanttView, n_stages: int, n_chunks: int) -> None:
    view.reset("", ORIGIN, [(s, "cpu", 2 * s, 2 * s + 2) for s in range(n_stages)])
    c = np.arange(n_chunks)
    for s in range(n_stages):
        start = ORIGIN + (c + s) * (MS + 50_000)
        view.store.add_columns("compute", np.full(n_chunks, s), c, start, start + MS, tokens=np.full(n_chunks, 256))
        if s < n_stages - 1:
            view.store.add_columns("copy", np.full(n_chunks, s), c, start + MS, start + MS + 20_000,
                                   nbytes=np.full(n_chunks, 1 << 20), note="host")


def test_100k_blocks_one_item_per_kind_and_only_the_visible_range(themed_app, qtbot):
    view = _view(qtbot)
    _fill(view, 4, 25_000)
    assert view.store.count("compute") == 100_000
    plot_items = view.plot.getPlotItem().items
    assert sum(isinstance(i, pg.BarGraphItem) for i in plot_items) == 5  # compute, wait, copy, stream, decode
    view.fit()
    zoomed_out = view.drawn_counts()
    width_px = view.vb.boundingRect().width()
    assert zoomed_out["compute"] <= 4 * width_px  # merged at pixel resolution, not 100,000 rectangles
    assert view.labels.count == 0  # no labels when zoomed out
    # zoom in on ~20 chunks: exactly the visible blocks are drawn, and labelled
    x0 = 1_000 * (MS + 50_000) / 1e9
    view.vb.setXRange(x0, x0 + 20 * (MS + 50_000) / 1e9, padding=0)
    (a, b), _ = view.vb.viewRange()
    visible = view.store.visible("compute", ORIGIN + int(a * 1e9), ORIGIN + int(b * 1e9))
    assert 4 * 19 <= len(visible) <= 4 * 22
    assert view.drawn_counts()["compute"] == len(visible)
    assert view.labels.count == len(visible)
    assert view.drawn_counts()["copy"] <= 3 * 22
    # pan: the items follow the view range
    view.vb.setXRange(x0 * 10, x0 * 10 + 20 * (MS + 50_000) / 1e9, padding=0)
    (a, b), _ = view.vb.viewRange()
    item_x = view.items["compute"].opts["x0"]
    assert item_x.min() >= a - 0.002 and item_x.max() <= b


def test_hover_tooltip_names_chunk_stage_times_and_tokens(themed_app, qtbot):
    view = _view(qtbot)
    _fill(view, 2, 50)
    view.fit()
    slot = (MS + 50_000) / 1e9
    # stage 1 computes chunk 7 in slot 8
    text = view.tooltip_at(8 * slot + 0.0005, 1.0)
    assert text.splitlines()[0] == "C7 · compute · stage 1 (cpu), layers 2–3"
    assert "256 tokens" in text and "tok/s" in text and "ms" in text
    # the hand-off after stage 0's chunk 3
    copy = view.tooltip_at(3 * slot + 0.001 + 10e-6, 0.0)
    assert copy.startswith("C3 hand-off · stage 0") and "→ stage 1" in copy and "GB/s" in copy and "host" in copy
    assert view.tooltip_at(8 * slot, 3.0) is None  # no such stage


def test_live_batches_follow_the_edge_and_manual_zoom_stops_following(themed_app, qtbot):
    view = _view(qtbot)
    view.reset("run", ORIGIN, [(0, "cpu", 0, 2), (1, "cpu", 2, 4)])
    t = ORIGIN
    for batch in range(5):
        events = []
        for c in range(batch * 10, batch * 10 + 10):
            for s in (0, 1):
                st = ORIGIN + (c + s) * 5 * MS
                events.append(StageEvent("run", s, "cpu", c, "compute", st, st + 4 * MS, tokens=64))
                t = max(t, st + 4 * MS)
        view.add_events(events)
        (a, b), _ = view.vb.viewRange()
        assert b >= (t - ORIGIN) / 1e9  # the newest block is in view
    assert view.follow.isChecked()
    view.vb.sigRangeChangedManually.emit([True, False])  # what a wheel or drag emits
    assert not view.follow.isChecked()
    before = view.vb.viewRange()[0]
    view.add_events([StageEvent("run", 0, "cpu", 99, "compute", t + 50 * MS, t + 60 * MS)])
    assert view.vb.viewRange()[0] == before


def test_telemetry_says_why_it_is_unavailable_and_plots_when_it_is(themed_app, qtbot):
    from engine.hw.topology import TelemetrySample

    tv = TelemetryView()
    qtbot.addWidget(tv)
    tv.start(ORIGIN, False, "NVML not found (no NVIDIA driver)")
    assert not tv.showing_plots
    assert tv.message.text() == "telemetry unavailable: NVML not found (no NVIDIA driver)"
    tv.start(ORIGIN, True, "")
    tv.add_samples([TelemetrySample(ORIGIN + i * 100 * MS, g, util_pct=10 * i, pcie_tx_gbs=1.0, pcie_rx_gbs=2.0)
                    for i in range(5) for g in (0, 1)])
    assert tv.showing_plots
    x, y = tv._curves[(1, "util_pct")].getData()  # curves are keyed by (GPU, series)
    assert list(y) == [0, 10, 20, 30, 40] and abs(x[1] - 0.1) < 1e-9
    assert tv._curves[(0, "pcie_rx_gbs")].getData()[1][0] == 2e9
