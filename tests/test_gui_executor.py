"""The app with executor=processes: events of every stage process reach one Gantt, the summary
says which executor ran and what the hand-offs cost, and the digest is the threaded one."""
from __future__ import annotations

import re

from executor_support import process_gone
from gui_support import qsettings, qt_settings_sandbox, set_form, themed_app, window  # noqa: F401
from PySide6.QtCore import Qt

from engine.pipeline.executor import ProcessExecutor

RUN_TIMEOUT_MS = 120_000  # spawning two stage processes takes seconds on 2 cores


def _run(qtbot, win) -> None:
    assert win.run_button.isEnabled(), win.validation.errors
    qtbot.mouseClick(win.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: win.last_outcome != "" and not win.controller.is_running, timeout=RUN_TIMEOUT_MS)
    assert win.last_outcome == "finished", f"{win.last_outcome}: {win.status_label.text()}"


def test_stage_processes_draw_one_gantt_and_the_summary_names_the_executor(window, qtbot):
    win = window
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="32", prompt_mode="tokens",
             prompt_tokens=128, decode_tokens=3, pipeline_depth=1, executor="processes")
    assert win.current_settings().executor == "processes"
    _run(qtbot, win)
    session = win.controller.sessions.session
    assert isinstance(session.executor, ProcessExecutor)
    pids = session.stage_pids()
    report = win.last_report
    assert report.executor == "processes" and report.handoff == "gloo"
    ok, what = win.gantt.store.one_compute_per_stage_chunk(2, 4)
    assert ok, what
    assert win.gantt.store.count() == len(session.events)  # every rank's events, one store
    assert win.gantt.store.count("decode") == 2 * 2
    text = win.summary.figures.text()
    assert "stages as processes" in text and "GB/s" in text and "clock offset" in text
    assert report.handoff_bytes > 0 and report.handoff_s > 0 and 0 < report.handoff_share < 1
    # the same run on threads: same bytes; the stage processes were stopped with their session
    set_form(win, executor="threads")
    _run(qtbot, win)
    assert win.last_report.executor == "threads" and win.last_report.digest == report.digest
    assert pids and all(process_gone(p) for p in pids)


def test_the_form_attaches_the_app_to_stages_started_elsewhere(window, qtbot):
    """Rendezvous in the form: the app is the controller of stages started apart (as
    `strata-bench stage --rendezvous` runs on each workstation; here two processes on 127.0.0.1),
    their events draw one Gantt, and a bad address is flagged under the field before Run."""
    import subprocess

    from executor_support import ROOT, env, free_port, reap, stage_command

    win = window
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="32", prompt_mode="tokens",
             prompt_tokens=128, decode_tokens=2, executor="processes", rendezvous="ws-a:99999")
    assert not win.run_button.isEnabled()
    assert "ws-a:99999" in win.validation.errors["rendezvous"]
    assert win.settings_panel.rendezvous.isEnabled()
    port = free_port()
    panel = win.settings_panel
    set_form(win, rendezvous=f"0.0.0.0:{port}")  # every interface: said, before Run
    assert panel.attach_warning.isVisibleTo(panel) and "not the process group" in panel.attach_warning.text()
    set_form(win, rendezvous=f"127.0.0.1:{port}")
    assert not panel.attach_warning.isVisibleTo(panel)
    # the app shows the command with its own key; the stages are started with exactly that
    command = panel.attach_command.text()
    assert panel.boxes["attach"].isVisibleTo(panel)
    m = re.fullmatch(rf"STRATA_RENDEZVOUS_KEY=(\S+) strata-bench stage --rendezvous 127.0.0.1:{port} --rank 0 --world 2",
                     command)
    assert m and len(m.group(1)) >= 20 and m.group(1) != "strata-gui", command
    procs = [subprocess.Popen(stage_command(port, "--rank", str(r), "--world", "2", "--timeout", "120"), cwd=ROOT,
                              env=env(STRATA_RENDEZVOUS_KEY=m.group(1)), stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        _run(qtbot, win)
        session = win.controller.sessions.session
        assert isinstance(session.executor, ProcessExecutor)
        assert sorted(session.stage_pids()) == sorted(p.pid for p in procs)
        ok, what = win.gantt.store.one_compute_per_stage_chunk(2, 4)
        assert ok, what
        set_form(win, executor="threads")  # a new session: the attached stages are released and end
        assert not win.settings_panel.rendezvous.isEnabled() and not panel.boxes["attach"].isVisibleTo(panel)
        _run(qtbot, win)
        for p in procs:
            assert p.wait(timeout=30) == 0, p.stderr.read()
    finally:
        reap(procs)
