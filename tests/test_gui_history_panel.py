"""The History tab with real runs: runs saved as they finish (a stopped one too, with its partial
report), filter and delete, export (trace, CSV, PNG) and import back (compare works on the
imported run; a bad trace file changes nothing), and a history from a newer version."""
from __future__ import annotations

import csv
import hashlib
import sqlite3
import time

from gui_support import qsettings, qt_settings_sandbox, set_form, themed_app, window  # noqa: F401
from history_support import FORM, RUN_TIMEOUT_MS, run_once
from PySide6.QtCore import Qt
from PySide6.QtGui import QImage

from engine.pipeline.session import PipelineHooks


def _wait_panel(qtbot, panel) -> None:
    qtbot.waitUntil(lambda: not panel.busy, timeout=20_000)


def test_export_import_round_trip_compare_the_imported_run_and_bad_files(window, qtbot, tmp_path):
    win = window
    panel = win.history_panel
    run = run_once(qtbot, win, pipeline_depth=1, **FORM)
    original = win.history.get(run)
    assert original.config["prompt"] == "synthetic, nonce 0" and original.config["prompt_tokens"] == 256
    assert original.events and len(original.events) == len(win.controller.sessions.session.events)

    trace_path, csv_path, png_path = tmp_path / "run.json", tmp_path / "run.csv", tmp_path / "run.png"
    panel.export_run(run, "trace", trace_path)
    _wait_panel(qtbot, panel)
    panel.export_run(run, "csv", csv_path)
    _wait_panel(qtbot, panel)
    panel.export_run(run, "png", png_path)
    assert "written to" in panel.message.text()
    assert len(list(csv.DictReader(csv_path.open()))) == len(original.events)
    img = QImage(str(png_path))
    assert not img.isNull() and img.width() >= 1200 and img.height() >= 200
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".json", ".csv", ".png", ".part")) == \
        ["run.csv", "run.json", "run.png"]

    panel.import_file(trace_path)
    _wait_panel(qtbot, panel)
    assert "imported run.json as run #" in panel.message.text()
    imported_row = panel.rows[0]
    assert imported_row.source == "import" and panel.selected_ids() == [imported_row.id]
    imported = win.history.get(imported_row.id)
    assert imported.events == original.events  # exactly
    assert imported.report == original.report and imported.config == original.config

    assert win.compare_runs(run, imported_row.id)
    c = win.compare_view.comparison
    assert c.diff == [] and c.same_output is True
    assert c.metric("prefill tok/s").ratio == 1.0

    # a bad file: a message, and the history is unchanged
    truncated = tmp_path / "truncated.json"
    truncated.write_bytes(trace_path.read_bytes()[: trace_path.stat().st_size // 3])
    panel.import_file(truncated)
    _wait_panel(qtbot, panel)
    assert "nothing imported" in panel.message.text() and "truncated or corrupt" in panel.message.text()
    box = win.error_box
    assert box is not None and box.windowTitle() == "Import failed" and "unchanged" in box.text()
    box.accept()
    qtbot.waitUntil(lambda: win.error_box is None, timeout=5_000)
    panel.import_file(trace_path, max_bytes=2048)  # "huge": above the limit given
    _wait_panel(qtbot, panel)
    assert "an import may read" in panel.message.text()
    assert {r.id for r in panel.rows} == {run, imported_row.id} and win.history.count() == 2


def test_filter_delete_and_show_a_saved_run(window, qtbot, monkeypatch):
    win = window
    panel = win.history_panel
    a = run_once(qtbot, win, pipeline_depth=0, **FORM)
    b = run_once(qtbot, win, pipeline_depth=1, **{**FORM, "prompt_tokens": 128})
    panel.filter.setText("pipeline_depth=0")
    assert [r.id for r in panel.rows] == [a] and panel.table.rowCount() == 1
    panel.filter.setText("")
    panel.source.setCurrentIndex(panel.source.findData("import"))
    assert panel.rows == []
    panel.source.setCurrentIndex(0)
    assert {r.id for r in panel.rows} == {a, b}

    assert win.show_history_run(a)
    assert win.tabs.currentWidget() is win.run_tab
    assert win.gantt.store.count() == len(win.history.get(a).events)
    assert win.summary.report.run_id == win.history.get(a).report.run_id
    assert f"run #{a}" in win.progress_label.text()

    panel.select_ids([a])
    from PySide6.QtWidgets import QMessageBox

    monkeypatch.setattr(QMessageBox, "question", lambda *args, **kw: QMessageBox.StandardButton.Yes)
    qtbot.mouseClick(panel.delete_button, Qt.MouseButton.LeftButton)
    assert [r.id for r in panel.rows] == [b] and win.history.count() == 1
    assert win.compare_view.before_box.findData(a) < 0  # gone from compare's choices too


def test_a_stopped_run_is_saved_with_its_partial_report(window, qtbot):
    win = window
    win.controller.hooks = PipelineHooks(after_layer=lambda s, layer, c: time.sleep(0.01))
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="32", prompt_tokens=1024, decode_tokens=0)
    qtbot.mouseClick(win.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: win.progress_model is not None and win.progress_model.snapshot().chunks_done >= 2,
                    timeout=RUN_TIMEOUT_MS)
    qtbot.mouseClick(win.stop_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: win.last_outcome == "cancelled" and not win.controller.is_running, timeout=RUN_TIMEOUT_MS)
    qtbot.waitUntil(lambda: len(win.history_panel.rows) == 1, timeout=5_000)
    row = win.history_panel.rows[0]
    assert row.status == "cancelled"
    rec = win.history.get(row.id)
    assert rec.report.cancelled and rec.events
    chunks = {e.chunk for e in rec.events if e.kind == "compute" and e.stage == 1}
    assert 2 <= len(chunks) < 32
    assert "saved (cancelled)" in win.history_panel.message.text()


def test_a_history_from_a_newer_version_is_left_alone_and_runs_still_work(themed_app, qtbot, qsettings,
                                                                           demo_path, tmp_path):
    from strata_gui.history.history_model import RunHistory
    from strata_gui.views.main_window_view import MainWindow

    path = tmp_path / "history.sqlite3"
    RunHistory(path).close()
    con = sqlite3.connect(path)
    con.execute("PRAGMA user_version = 42")
    con.close()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    win = MainWindow(qsettings, demo_path, history_path=path)
    qtbot.addWidget(win)
    win.show()
    try:
        qtbot.waitUntil(lambda: not win.jobs.busy, timeout=20_000)
        assert win.history is None
        assert "newer Strata GUI" in win.history_panel.unavailable.text()
        assert not win.history_panel.unavailable.isHidden()
        assert win.error_box is not None and win.error_box.windowTitle() == "Run history unavailable"
        win.error_box.accept()
        set_form(win, pipeline_depth=1, **FORM)
        qtbot.mouseClick(win.run_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: win.last_outcome != "" and not win.controller.is_running, timeout=RUN_TIMEOUT_MS)
        assert win.last_outcome == "finished"
    finally:
        win.close()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
