"""The Plan tab through the window: two real demo runs (pipeline_depth 0 and 1 on 2 CPU stages) in the
history; the tab starts from one, draws the predicted Gantt above the measured one on one time
axis, answers a changed setting, shows its error on the runs that exist, and Recommend fills the
Run tab."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from gui_support import qsettings, qt_settings_sandbox, themed_app, window  # noqa: F401
from history_support import demo_runs  # noqa: F401

from strata_gui.plan.plan_model import GpuRow, PlanModel


def test_plan_model_predicts_a_saved_run_and_its_errors(demo_runs):  # noqa: F811
    m = PlanModel()
    m.set_source(demo_runs.overlap, "overlap", [("join", demo_runs.join)])
    res = m.predict()
    assert all(e.predicted for e in res.predicted.events)
    assert res.predicted.report.prefill_tok_s == pytest.approx(res.prediction.prefill_tok_s)
    assert [line.what for line in res.errors] == ["own", "cross", "cross"]
    own = res.errors[0].row
    assert own.measured_tok_s == pytest.approx(demo_runs.overlap.report.prefill_tok_s)
    m.inputs.pipeline_depth = 0
    join = m.predict()
    assert join.prediction.prefill_s > res.prediction.prefill_s  # join inherits the chain's latency
    m.inputs.gpus = [GpuRow("cpu")]
    m.inputs.chunk_tokens = "64"
    one = m.predict()
    assert one.prediction.chunk == 64 and {s.device for s in one.prediction.stages} == {"cpu"}


def test_plan_tab_draws_prediction_above_measurement_and_recommends(window, qtbot, demo_runs):  # noqa: F811
    win = window
    join_id = win.history.add(demo_runs.join)
    over_id = win.history.add(demo_runs.overlap)
    win.tabs.setCurrentWidget(win.plan_tab)
    view = win.plan_tab.view
    assert view.source_box.count() == 2
    assert win.plan_tab.plan_from(over_id)
    res = view.result
    assert res is not None
    # the predicted Gantt above the measured one, one shared time axis
    assert view.gantt_meas.vb.linkedView(0) is view.gantt_pred.vb
    assert view.gantt_pred.store.count() == len(res.predicted.events) > 0
    assert view.gantt_meas.store.count() == len(demo_runs.overlap.events)
    assert view.gantt_pred.drawn_counts()["compute"] > 0
    assert "Predicted" in view.headline.text() and "measured run" in view.headline.text()
    # its error on the runs that exist: its own run, and the other run both ways
    assert view.errors.rowCount() == 3
    assert "(own)" in view.errors.item(0, 1).text()
    assert view.errors.item(0, 4).text().endswith("%")

    # change a setting: depth 0 is predicted slower
    before = res.prediction.prefill_s
    view.depth.setCurrentIndex(view.depth.findData(0))
    assert view.result.prediction.settings.pipeline_depth == 0
    assert view.result.prediction.prefill_s > before
    # more GPUs on a slower link: the table follows the count, the prediction has that many stages
    view.gpu_count.setValue(3)
    assert view.gpus.rowCount() == 3
    view.link_preset.setCurrentIndex(view.link_preset.findText("gen4x4"))
    view._on_link_preset(view.link_preset.findText("gen4x4"))
    assert view.gpus.item(2, 2).text() == "gen4x4"
    assert len(view.result.prediction.stages) == 3
    # a wrong value is refused with a message, not an exception
    view.gpus.item(1, 1).setText("lots")
    assert view.result is None and "numbers" in view.headline.text()
    view.gpus.item(1, 1).setText("24")
    assert view.result is not None

    shot = os.environ.get("STRATA_PLAN_SHOT")
    if shot:
        view.depth.setCurrentIndex(view.depth.findData(1))
        view.gpu_count.setValue(2)
        view.gpus.item(1, 0).setText("cpu")
        view.gpus.item(0, 0).setText("cpu")
        win.plan_tab.plan_from(over_id)
        qtbot.wait(200)
        Path(shot).parent.mkdir(parents=True, exist_ok=True)
        win.grab().save(shot)

    # Recommend fills the Run tab with the best predicted settings for this machine
    before = win.current_settings()
    settings = win.plan_tab.recommend()
    assert settings is not None
    assert win.tabs.currentWidget() is win.run_tab
    current = win.current_settings()
    # it says what it changed (issue 37), in the status bar and under the plan
    said = win.plan_tab.last_change_text
    assert said == win.status_label.text() and said in win.plan_tab.view.bottleneck.text()
    if before.chunk_tokens != current.chunk_tokens:
        assert f"chunk tokens {before.chunk_tokens} → {current.chunk_tokens}" in said, said
    assert said.startswith("Recommend changed the Run tab: " if before != current else "Recommend kept")
    assert current.pipeline_depth == settings.pipeline_depth and current.chunk_mode == "fixed"
    assert current.chunk_tokens == settings.chunk_tokens
    # no GPU here: the Run tab's two CPU stages stay a choice, and overlap on both wins the sweep
    assert settings.devices == current.devices == "cpu,cpu" and settings.pipeline_depth == 1
    assert join_id != over_id
