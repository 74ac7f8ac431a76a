"""Issue 19, items 2 and 4: the history can never be poisoned, and a damaged file is said to be.

Every file is made here: real runs of the demo model, a trace whose report holds a string where
a number belongs, rows changed behind the app's back, and random page corruption."""
from __future__ import annotations

import hashlib
import json
import random
import sqlite3
from pathlib import Path

import pytest
from gui_support import qsettings, qt_settings_sandbox, set_form, themed_app  # noqa: F401
from history_support import FORM, RUN_TIMEOUT_MS, demo_runs  # noqa: F401
from PySide6.QtCore import Qt

from strata_gui.history.history_model import UNSAVED_DIR, HistoryError, RunHistory, UnsavedRuns, open_history
from strata_gui.run import run_files
from strata_gui.run.background import BackgroundJobs
from strata_gui.views.history_view import LABEL_COL, HistoryPanel

PAGE = 4096


def _history(path: Path, records, n: int = 3) -> Path:
    with RunHistory(path) as h:
        for i in range(n):
            h.add(records[i % len(records)])
    assert not Path(f"{path}-wal").exists() or Path(f"{path}-wal").stat().st_size == 0
    return path


def _poisoned_trace(tmp_path: Path, record) -> Path:
    p = run_files.export_trace(record, tmp_path / "poison.json")
    doc = json.loads(p.read_text())
    doc["otherData"]["report"]["plan"]["prompt_tokens"] = "many"
    p.write_text(json.dumps(doc))
    return p


def test_a_report_with_many_prompt_tokens_is_not_stored_as_is(tmp_path, demo_runs):
    """The trace that stopped every later launch: it imports with figures from its events."""
    record = run_files.import_trace(_poisoned_trace(tmp_path, demo_runs.overlap))
    assert isinstance(record.report.plan.prompt_tokens, int)
    assert any("could not be read" in n and "prompt_tokens is not an integer: 'many'" in n for n in record.report.notes)
    with RunHistory(tmp_path / "h.sqlite3") as h:
        run = h.add(record)
        assert not h.row(run).problem()
        bad = run_files.import_trace(tmp_path / "poison.json")
        bad.report.plan = type(bad.report.plan)(**{**vars(bad.report.plan), "prompt_tokens": "many"})
        with pytest.raises(ValueError, match="report.plan.prompt_tokens is not an integer: 'many'"):
            h.add(bad)  # validated on the way in: nothing stored
        assert h.count() == 1


def test_a_row_poisoned_behind_the_apps_back_shows_as_unreadable(themed_app, qtbot, qsettings, demo_path,
                                                                 tmp_path, demo_runs):
    from strata_gui.views.main_window_view import MainWindow

    path = _history(tmp_path / "history.sqlite3", [demo_runs.join, demo_runs.overlap], 2)
    con = sqlite3.connect(path)
    con.execute("UPDATE runs SET prompt_tokens = 'many', report_json = '{\"plan\": 5}' WHERE id = 1")
    con.commit()
    con.close()
    win = MainWindow(qsettings, demo_path, history_path=path)  # was: exit 1 at every launch
    qtbot.addWidget(win)
    try:
        panel = win.history_panel
        labels = {panel.table.item(i, 0).text(): panel.table.item(i, LABEL_COL).text()
                  for i in range(panel.table.rowCount())}
        assert labels["1"] == "unreadable run #1" and labels["2"] != "unreadable run #2"
        assert "prompt_tokens is 'many'" in panel.table.item(0 if panel.table.item(0, 0).text() == "1" else 1,
                                                              LABEL_COL).toolTip()
        with pytest.raises(HistoryError, match="run #1 in the history is unreadable"):
            win.history.get(1)
        assert not win.show_history_run(1)  # says so, does not crash
        win.error_box.accept()
        assert win.history.get(2).events == demo_runs.overlap.events
    finally:
        win.close()


def _corrupt(path: Path, rng: random.Random, pages: list[int]) -> None:
    data = bytearray(path.read_bytes())
    for p in pages:
        data[p * PAGE:(p + 1) * PAGE] = rng.randbytes(PAGE)
    path.write_bytes(bytes(data))


def test_corrupt_data_pages_are_found_at_open_and_nothing_is_changed(tmp_path, demo_runs):
    path = _history(tmp_path / "history.sqlite3", [demo_runs.join, demo_runs.overlap])
    n_pages = path.stat().st_size // PAGE
    _corrupt(path, random.Random(1), list(range(n_pages - 3, n_pages)))  # the last pages: events
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(HistoryError) as ei:
        RunHistory(path)
    msg = str(ei.value)
    assert "is damaged" in msg and "Nothing was deleted" in msg and "Move the file aside" in msg
    assert "start a new history" in msg and UNSAVED_DIR in msg
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


def test_a_run_that_the_file_cannot_take_is_kept_as_a_trace_beside_it(tmp_path, demo_runs):
    path = _history(tmp_path / "history.sqlite3", [demo_runs.join], 1)
    h = RunHistory(path)
    try:
        h._conn.execute("PRAGMA query_only = 1")  # a real SQLite refusal of the write (not a stand-in)
        with pytest.raises(HistoryError, match="could not be saved") as ei:
            h.add(demo_runs.overlap)
    finally:
        h.close()
    kept = list((tmp_path / UNSAVED_DIR).glob("run-*.json.gz"))
    assert len(kept) == 1 and str(kept[0]) in str(ei.value)
    back = run_files.import_trace(kept[0])
    assert back.events == demo_runs.overlap.events and back.report.digest == demo_runs.overlap.report.digest
    with pytest.raises(HistoryError, match="No run history is open: gone"):
        UnsavedRuns(path, "gone").add(demo_runs.join)
    assert len(list((tmp_path / UNSAVED_DIR).glob("run-*.json.gz"))) == 2


def test_fuzz_random_page_corruption_the_history_view_starts_and_says_what_is_wrong(themed_app, qtbot, tmp_path,
                                                                                     demo_runs):
    clean = _history(tmp_path / "clean.sqlite3", [demo_runs.join, demo_runs.overlap], 4)
    n_pages = clean.stat().st_size // PAGE
    outcomes = {"refused": 0, "opened": 0}
    for seed in range(40):
        rng = random.Random(seed)
        path = tmp_path / f"fuzz{seed}" / "history.sqlite3"
        path.parent.mkdir()
        path.write_bytes(clean.read_bytes())
        _corrupt(path, rng, rng.sample(range(1, n_pages), rng.randint(1, 3)))  # page 0 holds the header
        history, why = open_history(path)
        if history is None:
            outcomes["refused"] += 1
            assert "Move" in why and "start a new history" in why, why
        else:
            outcomes["opened"] += 1
        jobs = BackgroundJobs()
        panel = HistoryPanel(history, jobs, why)  # never raises
        qtbot.addWidget(panel)
        if history is None:
            assert panel.unavailable.text() == why
        else:
            # every row is shown, or shown as unreadable, or the panel says it cannot read the file
            assert panel.table.rowCount() == len(panel.rows) or "cannot read the history" in panel.message.text()
            history.close()
    assert outcomes["refused"] >= 20, outcomes  # quick_check finds most damage at open


def test_the_app_starts_on_a_damaged_history_and_keeps_its_runs_as_traces(themed_app, qtbot, qsettings, demo_path,
                                                                          tmp_path, demo_runs):
    from strata_gui.views.main_window_view import MainWindow

    path = _history(tmp_path / "history.sqlite3", [demo_runs.join, demo_runs.overlap])
    n_pages = path.stat().st_size // PAGE
    _corrupt(path, random.Random(2), list(range(n_pages - 3, n_pages)))
    win = MainWindow(qsettings, demo_path, history_path=path)
    qtbot.addWidget(win)
    win.show()
    try:
        qtbot.waitUntil(lambda: not win.jobs.busy, timeout=20_000)
        assert win.history is None
        assert "is damaged" in win.history_panel.unavailable.text()
        assert win.error_box is not None and "Move the file aside" in win.error_box.text()
        win.error_box.accept()
        set_form(win, pipeline_depth=1, **FORM)
        qtbot.mouseClick(win.run_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: win.last_outcome != "" and not win.controller.is_running, timeout=RUN_TIMEOUT_MS)
        assert win.last_outcome == "finished"
        qtbot.waitUntil(lambda: win.last_saved is not None, timeout=5_000)
    finally:
        win.close()
    kept = list((tmp_path / UNSAVED_DIR).glob("run-*.json.gz"))
    assert len(kept) == 1 and str(kept[0]) in win.last_saved.error
