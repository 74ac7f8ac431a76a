"""The GPU panel's monitor between runs (GUI thread): a TelemetryMonitor polled every 500 ms
into the telemetry view while its checkbox is on and no run or sweep is in flight; a run takes
the panel over and the monitor resumes after it."""
from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, QTimer

from engine.hw.topology import Topology

from .telemetry_model import TelemetryMonitor, processes_text


class MonitorController(QObject):
    def __init__(self, view, busy: Callable[[], bool], topology: Callable[[], Topology | None],
                 parent: QObject | None = None) -> None:
        """`view`: the TelemetryView; `busy()`: a run or sweep is in flight; `topology()`: the
        devices discovered so far."""
        super().__init__(parent)
        self.view = view
        self.busy = busy
        self.topology = topology
        self.monitor = TelemetryMonitor(None)
        self.timer = QTimer(self)
        self.timer.setInterval(500)
        self.timer.timeout.connect(self.poll)
        view.monitor_toggled.connect(self.set_on)

    def set_on(self, on: bool) -> None:
        """The checkbox: on while no run or sweep is in flight."""
        if self.view.monitor_box.isChecked() != on:
            self.view.monitor_box.setChecked(on)  # emits monitor_toggled: comes back here
            return
        busy = self.busy()
        if on and not busy:
            self.monitor.topology = self.topology()
            if self.monitor.start():
                self.view.start_monitor(self.monitor.origin_ns, self.monitor.reason)
                self.timer.start()
                self.poll()
            else:
                self.view.set_unavailable(f"monitor unavailable: {self.monitor.reason}")
        else:
            self.timer.stop()
            was = self.monitor.running
            self.monitor.stop()
            if was and not busy:
                self.view.stop_monitor("GPU telemetry is sampled during a run.")

    def poll(self) -> None:
        samples, procs = self.monitor.poll()
        if samples:
            self.view.add_samples(samples)
        if procs is not None:
            self.view.set_processes(processes_text(procs))

    def busy_changed(self) -> None:
        """A run or a sweep started or ended: it takes the panel over; the monitor resumes after it."""
        if not self.view.monitor_box.isChecked():
            return
        busy = self.busy()
        if busy and self.monitor.running:
            self.timer.stop()
            self.monitor.stop()
            self.view.stop_monitor()
        elif not busy and not self.monitor.running:
            self.set_on(True)

    def shutdown(self) -> None:
        self.timer.stop()
        self.monitor.stop()  # its sampler thread
