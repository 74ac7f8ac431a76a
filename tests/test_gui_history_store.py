"""The run history's SQLite store, without the GUI: round trips, filter and delete, restarts,
schema versions (older files upgraded, newer ones refused untouched) and a writer killed in the
middle of a write."""
from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from history_support import demo_runs  # noqa: F401

from strata_gui.history.history_model import (
    ENV_DIR,
    SCHEMA_VERSION,
    HistoryError,
    RunHistory,
    SweepMember,
    default_path,
)
from strata_gui.run.record_model import RunRecord

ROOT = Path(__file__).resolve().parents[1]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_run_comes_back_exactly_and_the_file_is_wal(tmp_path, demo_runs):
    rec = demo_runs.overlap
    with RunHistory(tmp_path / "h.sqlite3") as h:
        run = h.add(rec)
        back = h.get(run)
        assert h.schema_version == SCHEMA_VERSION
        mode = h._conn.execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    assert back.events == rec.events and len(back.events) > 0
    assert back.report == rec.report  # every field, telemetry included
    assert back.config == rec.config and back.config["pipeline_depth"] == 1
    assert (back.source, back.status) == ("run", "finished")


def test_list_filter_relabel_and_delete(tmp_path, demo_runs):
    with RunHistory(tmp_path / "h.sqlite3") as h:
        a = h.add(demo_runs.join)
        b = h.add(demo_runs.overlap)
        i = h.add(RunRecord(demo_runs.overlap.report, demo_runs.overlap.events, demo_runs.overlap.config,
                            source="import", label="imported from a colleague"))
        assert [r.id for r in h.list_runs()] == [i, b, a]  # newest first
        assert [r.id for r in h.list_runs(source="import")] == [i]
        assert [r.id for r in h.list_runs("colleague")] == [i]
        assert [r.id for r in h.list_runs("pipeline_depth=0")] == [a]  # a recorded setting
        assert [r.id for r in h.list_runs("pipeline_depth=1 colleague")] == [i]  # every word must match
        assert len(h.list_runs("devices=cpu,cpu")) == 3
        assert [r.id for r in h.list_runs(f"#{a}")] == [a]
        # the table's column names work as filter keys; keys that name no setting are reported
        from history_support import CHUNK

        from strata_gui.history.history_model import unknown_filter_keys

        assert len(h.list_runs(f"chunk={CHUNK}")) == 3 and [r.id for r in h.list_runs("depth=0")] == [a]
        assert unknown_filter_keys(f"chunk={CHUNK} depth=0 devices=cpu") == []
        assert unknown_filter_keys("chunks=2048 colleague") == ["chunks"]
        assert h.list_runs("no-such-word") == []
        h.set_label(a, "join baseline")
        assert h.row(a).label == "join baseline" and [r.id for r in h.list_runs("baseline")] == [a]
        assert h.delete([a, i]) == 2
        assert [r.id for r in h.list_runs()] == [b]
        # the deleted runs' events went with them
        assert h._conn.execute("SELECT count(*) FROM events WHERE run IN (?, ?)", (a, i)).fetchone()[0] == 0
        with pytest.raises(KeyError):
            h.get(a)


def test_the_history_survives_closing_and_reopening(tmp_path, demo_runs):
    path = tmp_path / "h.sqlite3"
    with RunHistory(path) as h:
        ids = [h.add(demo_runs.join), h.add(demo_runs.overlap)]
    with RunHistory(path) as h:
        assert sorted(r.id for r in h.list_runs()) == ids
        assert h.get(ids[0]).events == demo_runs.join.events
        assert h.integrity() == "ok"


def test_sweeps_and_their_runs(tmp_path, demo_runs):
    with RunHistory(tmp_path / "h.sqlite3") as h:
        sid = h.add_sweep("join vs overlap", {"sizes": [128], "arms": [{"name": "join"}, {"name": "overlap"}]})
        r0 = h.add(demo_runs.join, (sid, SweepMember(0, 0, 128, 0)))
        r1 = h.add(demo_runs.overlap, (sid, SweepMember(0, 1, 128, 0)))
        h.set_sweep_status(sid, "finished")
        plan, members = h.sweep(sid)
        assert plan["sizes"] == [128]
        assert [(m.run, m.arm) for m in members] == [(r0, 0), (r1, 1)]
        assert h.list_sweeps()[0].n_runs == 2 and h.list_sweeps()[0].status == "finished"
        h.delete([r0])  # a deleted run leaves its sweep
        assert [m.run for m in h.sweep(sid)[1]] == [r1]


def test_an_older_database_is_upgraded_in_place_and_keeps_its_runs(tmp_path, demo_runs):
    path = tmp_path / "v1.sqlite3"
    with RunHistory(path) as h:
        run = h.add(demo_runs.join)
    # make it exactly what schema version 1 wrote: runs and events, no sweep tables
    con = sqlite3.connect(path)
    con.executescript("DROP TABLE sweep_runs; DROP TABLE sweeps; PRAGMA user_version = 1;")
    con.close()
    with RunHistory(path) as h:
        assert h.schema_version == SCHEMA_VERSION == 2
        assert h.get(run).events == demo_runs.join.events
        sid = h.add_sweep("after the upgrade", {"sizes": [1]})
        assert h.list_sweeps()[0].id == sid


@pytest.mark.parametrize("what", ["newer", "garbage", "foreign"])
def test_a_file_this_version_cannot_use_is_refused_and_left_untouched(tmp_path, demo_runs, what):
    path = tmp_path / "h.sqlite3"
    if what == "newer":
        with RunHistory(path) as h:
            h.add(demo_runs.join)
        con = sqlite3.connect(path)
        con.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
        con.close()
    elif what == "garbage":
        path.write_bytes(b"this is not a database\n" * 100)
    else:  # another program's SQLite file
        con = sqlite3.connect(path)
        con.execute("CREATE TABLE notes (text TEXT)")
        con.execute("INSERT INTO notes VALUES ('keep me')")
        con.commit()
        con.close()
    before = _digest(path)
    with pytest.raises(HistoryError) as info:
        RunHistory(path)
    msg = str(info.value)
    assert str(path) in msg and "untouched" in msg
    if what == "newer":
        assert f"schema version {SCHEMA_VERSION + 5}" in msg and "newer Strata GUI" in msg
    assert _digest(path) == before
    if what == "newer":  # what was stored is all still there
        con = sqlite3.connect(path)
        assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 1
        con.close()


def test_default_path_is_the_user_data_dir_unless_overridden(monkeypatch, tmp_path):
    from platformdirs import user_data_dir

    monkeypatch.delenv(ENV_DIR, raising=False)
    assert default_path() == Path(user_data_dir("strata-gui", appauthor=False)) / "history.sqlite3"
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    assert default_path() == tmp_path / "history.sqlite3"


WRITER = textwrap.dedent("""
    import json, sys, time
    from strata_gui.history.history_model import RunHistory
    from strata_gui.run.run_files import import_trace

    record = import_trace(sys.argv[2])
    history = RunHistory(sys.argv[1])
    n = [0]

    def before_commit():
        if n[0] == int(sys.argv[3]):  # the last write: hold it open, uncommitted, until killed
            print("in-transaction", flush=True)
            time.sleep(60)

    history.before_commit = before_commit
    while True:
        record.label = f"copy {n[0]}"
        run = history.add(record)
        print(f"saved {run}", flush=True)
        n[0] += 1
""")


def test_a_writer_killed_mid_write_leaves_every_finished_run(tmp_path, demo_runs):
    """A subprocess saves real recorded runs (replayed from a trace) and is SIGKILLed in the middle
    of writing the fourth: the file stays readable, with the three finished runs, whole."""
    from strata_gui.run.run_files import export_trace

    trace = export_trace(demo_runs.overlap, tmp_path / "run.json")
    path = tmp_path / "h.sqlite3"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(trace), "3"], stdout=subprocess.PIPE,
                            text=True, env=env)
    saved = []
    try:
        for line in proc.stdout:
            if line.startswith("saved "):
                saved.append(int(line.split()[1]))
            if line.startswith("in-transaction"):
                break
        assert len(saved) == 3, saved
        proc.kill()  # SIGKILL on POSIX, TerminateProcess on Windows: no cleanup either way
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == (1 if sys.platform == "win32" else -signal.SIGKILL)
    assert Path(f"{path}-wal").exists()  # the killed writer's log is what the next open recovers from
    with RunHistory(path) as h:
        assert h.integrity() == "ok"
        rows = h.list_runs()
        assert sorted(r.id for r in rows) == saved
        for run in saved:
            assert h.get(run).events == demo_runs.overlap.events
        assert {r.label for r in rows} == {"copy 0", "copy 1", "copy 2"}
