"""Compare through the window: two real demo runs (pipeline_depth 0 and 1 on 2 CPU stages), saved to
the history when they finish, picked in the History tab, shown on one time axis with their
ratios, both busy histograms and a config diff that names pipeline_depth and nothing else."""
from __future__ import annotations

import pytest
from gui_support import qsettings, qt_settings_sandbox, themed_app, window  # noqa: F401
from history_support import FORM, run_once
from PySide6.QtCore import Qt

from strata_gui.history.compare_model import format_ratio


def test_depth_0_vs_1_compare_on_one_axis_with_ratio_and_config_diff(window, qtbot, qsettings, demo_path):
    from strata_gui.views.main_window_view import MainWindow

    win = window
    join = run_once(qtbot, win, pipeline_depth=0, **FORM)
    overlap = run_once(qtbot, win, pipeline_depth=1, **FORM)
    assert win.controller.sessions.builds == 2  # a different depth is a different session

    panel = win.history_panel
    win.tabs.setCurrentWidget(panel)
    panel.select_ids([join, overlap])
    assert panel.compare_button.isEnabled()
    qtbot.mouseClick(panel.compare_button, Qt.MouseButton.LeftButton)
    cv = win.compare_view
    assert win.tabs.currentWidget() is win.compare_tab
    c = cv.comparison
    assert c is not None and cv.ids == (join, overlap)  # the older run is "before"
    assert (c.before.config["pipeline_depth"], c.after.config["pipeline_depth"]) == (0, 1)

    # config diff: exactly pipeline_depth
    assert [(d.setting, d.before, d.after) for d in c.diff] == [("pipeline_depth", "0", "1")]
    assert cv.diff.rowCount() == 1
    assert [cv.diff.item(0, j).text() for j in range(3)] == ["pipeline_depth", "0", "1"]
    assert "pipeline_depth" in cv.headline.text()

    # both Gantts on ONE time axis, each run from its own start, the longer run whole
    assert cv.gantt_after.vb.linkedView(0) is cv.gantt_before.vb
    (b0, b1), (a0, a1) = cv.shared_x_range()
    assert (b0, b1) == pytest.approx((a0, a1))
    durations = [(g.store.span_ns()[1] - g.store.origin_ns) / 1e9 for g in (cv.gantt_before, cv.gantt_after)]
    assert b0 == pytest.approx(0.0) and b1 >= max(durations)
    for g, rec in ((cv.gantt_before, c.before), (cv.gantt_after, c.after)):
        ok, what = g.store.one_compute_per_stage_chunk(2, 8)
        assert ok, what
        assert g.store.count() == len(rec.events)
        assert g.drawn_counts()["compute"] > 0

    # figures side by side, with after / before
    pre = c.metric("prefill tok/s")
    assert pre.ratio == pytest.approx(c.after.report.prefill_tok_s / c.before.report.prefill_tok_s)
    row = next(i for i in range(cv.metrics.rowCount()) if cv.metrics.item(i, 0).text().startswith("prefill tok/s"))
    assert cv.metrics.item(row, 3).text() == format_ratio(pre.ratio)
    waits = [cv.metrics.item(i, 0).text() for i in range(cv.metrics.rowCount())]
    assert "stage 0 wait (ms)" in waits and "stage 1 wait (ms)" in waits
    assert format_ratio(pre.ratio) in cv.headline.text()
    assert c.same_output is True and "byte-identical" in cv.headline.text()  # depth never changes arithmetic

    # both busy histograms, grouped bars
    hb, ha = cv.bar_heights()
    assert hb == pytest.approx([x * 100 for x in c.before.report.busy_histogram])
    assert ha == pytest.approx([x * 100 for x in c.after.report.busy_histogram])
    assert len(hb) == len(ha) == 3 and len(cv.bar_labels) == 6

    # swap, pick in the combo boxes, a run against itself
    cv.swap()
    assert cv.ids == (overlap, join) and cv.comparison.before.config["pipeline_depth"] == 1
    cv.before_box.setCurrentIndex(cv.before_box.findData(join))
    cv.after_box.setCurrentIndex(cv.after_box.findData(join))
    cv.after_box.activated.emit(cv.after_box.currentIndex())
    assert cv.ids == (join, join)
    assert cv.comparison.diff == [] and cv.diff.item(0, 0).text() == "no setting differs"
    assert cv.comparison.metric("prefill tok/s").ratio == pytest.approx(1.0)

    # the history survives closing the app and opening it again
    path = win.history.path
    win.close()
    again = MainWindow(qsettings, demo_path, history_path=path)
    qtbot.addWidget(again)
    try:
        assert {r.id for r in again.history_panel.rows} == {join, overlap}
        assert again.compare_runs(join, overlap)
        assert [d.setting for d in again.compare_view.comparison.diff] == ["pipeline_depth"]
    finally:
        again.close()



def _run(qtbot, win, repeats: int = 1, **form) -> list[int]:
    """Click Run; wait until every repeat finished and is in the history; their ids, oldest first."""
    from gui_support import set_form

    set_form(win, repeats=repeats, **form)
    before = win.history.count()
    assert win.run_button.isEnabled(), win.validation.errors
    qtbot.mouseClick(win.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: win.last_outcome != "" and not win.controller.is_running, timeout=120_000)
    assert win.last_outcome == "finished", win.status_label.text()
    qtbot.waitUntil(lambda: len(win.history_panel.rows) == before + repeats, timeout=5_000)
    return sorted(r.id for r in win.history_panel.rows[:repeats])


def _prefill_row(cv) -> int:
    return next(i for i in range(cv.metrics.rowCount()) if cv.metrics.item(i, 0).text() == "prefill tok/s")


def test_two_identical_settings_runs_compare_as_within_noise(window, qtbot):
    """The issue's first complaint: two runs with the same settings must not read as a result."""
    win = window
    (first,) = _run(qtbot, win, **FORM)
    assert "after a warm-up pass" in win.summary.figures.text()
    (second,) = _run(qtbot, win, **FORM)
    assert "warm (this shape ran before" in win.summary.figures.text()
    assert win.compare_runs(first, second)
    cv = win.compare_view
    c = cv.comparison
    assert c.diff == []
    assert c.before_samples.source == c.after_samples.source == "same settings"
    pre = c.metric("prefill tok/s")
    assert pre.within_noise is True and pre.verdict == ""
    assert pre.judgement.startswith("within noise (±") and pre.judgement.endswith("; no setting differs")
    assert "noise" in cv.headline.text() and "color:#1B7F3B" not in cv.headline.text()
    row = _prefill_row(cv)
    assert cv.metrics.item(row, 3).foreground().color().name() not in ("#1b7f3b", "#c5221f")
    assert "noise" in cv.metrics.item(row, 4).text()
    # warm by default: neither run is labelled cold, and the summary said how it was measured
    assert c.cold == (False, False) and "Cold run" not in cv.headline.text()


def test_depth_change_with_repeats_colours_prefill_and_flags_decode_as_unaffected(window, qtbot):
    """Depth 0 vs 1, three repeats each, on stages slowed to a steady 20 ms per layer (a stand-in for
    slow GPUs: join takes ~2x as long as overlap, a gap that stands clear of a loaded 2-core machine's
    noise)."""
    import time

    from engine.pipeline.session import PipelineHooks

    win = window
    win.controller.hooks = PipelineHooks(after_layer=lambda s, layer, c: time.sleep(0.02) if c >= 0 else None)
    join = _run(qtbot, win, repeats=3, pipeline_depth=0, **FORM)
    assert len(win.summary.repeats) == 3 and "median of 3" in win.summary.figures.text()
    overlap = _run(qtbot, win, repeats=3, pipeline_depth=1, **FORM)
    win.controller.hooks = None
    assert win.compare_runs(join[-1], overlap[-1])
    cv = win.compare_view
    c = cv.comparison
    assert [d.setting for d in c.diff] == ["pipeline_depth"]
    assert c.before_samples.source == c.after_samples.source == "repeats"
    assert (c.before_samples.n, c.after_samples.n) == (3, 3)
    pre = c.metric("prefill tok/s")
    assert pre.within_noise is False and pre.verdict == "better", (pre.interval, pre.ratio, pre.before_spread,
                                                                    pre.after_spread)
    assert pre.judgement.startswith("beyond noise (±")
    assert cv.metrics.item(_prefill_row(cv), 3).foreground().color().name() == "#1b7f3b"
    dec = c.metric("decode tok/s")
    assert dec.verdict == "" and dec.unaffected.startswith("not affected by pipeline_depth")
    assert "not affected by pipeline_depth" in dec.judgement
    assert "not affected by pipeline_depth" in cv.headline.text()
