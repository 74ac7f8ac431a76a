"""The one relay for a job's outlet (run/job_runner.py): the controller's signals come from the
job's table, every call of the job's outlet arrives in the GUI thread in order, and
busy_changed(False) comes once the thread has ended, after the job's last signal; a second
start while one runs is refused; a stop reaches the job as its cancel event."""
from __future__ import annotations

import threading

from gui_support import qt_settings_sandbox  # noqa: F401
from PySide6.QtCore import QObject, QThread
from PySide6.QtWidgets import QApplication

from strata_gui.run.job_runner import JobRunner, signals_class
from strata_gui.run.run_controller import RunController
from strata_gui.run.run_job import RUN_SIGNALS
from strata_gui.sweep.sweep_controller import SweepController
from strata_gui.sweep.sweep_job import SWEEP_SIGNALS

TABLE = {"step": (int,), "note": (str, str), "done": ()}
Signals = signals_class("Signals", TABLE)


class Runner(JobRunner, Signals):
    signals = Signals

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []
        gui = QApplication.instance().thread()
        for name in TABLE:
            getattr(self, name).connect(
                lambda *a, n=name: self.seen.append((n, a, QThread.currentThread() is gui)))
        self.busy_changed.connect(lambda b: self.seen.append(("busy", (b,), True)))


def test_the_controllers_signals_are_their_jobs_tables():
    for cls, table in ((RunController, RUN_SIGNALS), (SweepController, SWEEP_SIGNALS)):
        assert cls.signal_names == tuple(table)
        for name in (*table, "busy_changed"):
            assert hasattr(cls, name), (cls.__name__, name)


def test_every_call_arrives_in_the_gui_thread_in_order_then_busy_ends(qtbot):
    r = Runner()
    release = threading.Event()

    def make(cancel: threading.Event, out) -> object:
        def body() -> None:
            assert QThread.currentThread() is not QApplication.instance().thread()
            release.wait(10)
            for i in range(500):
                out.step(i)
            out.note("stopped" if cancel.is_set() else "ran", "x")
            out.done()
        return body

    assert r.launch("test", make) and r.is_running
    assert not r.launch("test", make)  # one job at a time
    r.stop()
    release.set()
    qtbot.waitUntil(lambda: not r.is_running, timeout=10_000)
    names = [n for n, _, _ in r.seen]
    assert names == ["busy"] + ["step"] * 500 + ["note", "done", "busy"]
    assert [a[0] for n, a, _ in r.seen if n == "step"] == list(range(500))
    assert r.seen[0][1] == (True,) and r.seen[-1][1] == (False,)
    assert ("note", ("stopped", "x"), True) in r.seen  # the stop reached the job's cancel event
    assert all(in_gui for _, _, in_gui in r.seen)
    assert r.wait(0)


def test_a_job_that_raises_still_ends_busy(qtbot):
    r = Runner()

    def make(cancel, out):
        def body() -> None:
            out.step(1)
            raise RuntimeError("boom")
        return body

    assert r.launch("test", make)
    qtbot.waitUntil(lambda: not r.is_running, timeout=10_000)
    assert [n for n, _, _ in r.seen] == ["busy", "step", "busy"]
    assert isinstance(r, QObject)
