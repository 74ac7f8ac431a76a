"""Guards around Qt signals: PySide6 6.12.0 aborts Python 3.11 after a few thousand calls of
Qt methods returning nothing (`Fatal Python error: none_dealloc`, docs/design.md), and the run worker
relies on batches emitted from a plain Python thread being queued to the GUI thread."""
from __future__ import annotations

import threading

import PySide6
from gui_support import qt_settings_sandbox  # noqa: F401
from PySide6.QtCore import QObject, QThread, Signal, Slot
from PySide6.QtWidgets import QApplication, QLabel

from engine.events import StageEvent
from strata_gui.run.event_batcher import EventBatcher

N = 20_000


class _Emitter(QObject):
    payload = Signal(object)
    bare = Signal()


class _Receiver(QObject):
    def __init__(self) -> None:
        super().__init__()
        self.items = 0
        self.calls = 0
        self.off_thread = 0

    @Slot(object)
    def on_batch(self, batch: object) -> None:
        self.calls += 1
        self.items += len(batch)  # type: ignore[arg-type]
        if QThread.currentThread() is not QApplication.instance().thread():
            self.off_thread += 1


def test_pyside_version_is_not_the_crashing_one():
    major, minor = (int(x) for x in PySide6.__version__.split(".")[:2])
    assert (major, minor) < (6, 12), f"PySide6 {PySide6.__version__}: 6.12.0 aborts Python 3.11 (none_dealloc)"


def test_thousands_of_signals_and_void_calls_do_not_abort(qapp):
    e = _Emitter()
    got: list[object] = []
    bare = [0]
    e.payload.connect(got.append)
    e.bare.connect(lambda: bare.__setitem__(0, bare[0] + 1))
    label = QLabel()
    for i in range(N):
        e.payload.emit(i)
        e.bare.emit()
        label.setText(str(i))  # a Qt method returning nothing
        label.setVisible(False)
    qapp.processEvents()
    assert len(got) == N and bare[0] == N and label.text() == str(N - 1)


def test_batches_from_python_threads_reach_the_gui_thread_queued(qapp, qtbot):
    e, r = _Emitter(), _Receiver()
    e.payload.connect(r.on_batch)
    batcher = EventBatcher(e.payload.emit, interval_s=0.01)
    batcher.start()

    def produce(stage: int) -> None:
        for i in range(2_500):
            batcher(StageEvent("r", stage, "cpu", i, "compute", i, i + 1))

    threads = [threading.Thread(target=produce, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batcher.stop()
    qtbot.waitUntil(lambda: r.items == 5_000, timeout=5_000)
    assert r.off_thread == 0
    assert r.calls == batcher.batches < 5_000
