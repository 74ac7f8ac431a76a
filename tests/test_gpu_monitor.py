"""Issue 37: the GPU panel's monitor between runs (nvitop's view of our devices): every GPU's
samples from now on, the processes holding GPU memory, paused while a run owns the panel.
NVML and torch.cuda are the fakes of tests/test_topology.py."""
from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
from gui_support import qsettings, qt_settings_sandbox, set_form, themed_app  # noqa: F401
from test_topology import GIB, FakeCuda, FakeNvml, FakeNvmlDevice, cuda_props

from engine.hw import topology
from strata_gui.run.telemetry_model import TelemetryMonitor, processes_text


class ProcessNvml(FakeNvml):
    """Our own process holds 3 GiB on the GPU named Fast (listed twice by NVML: counted once)."""

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        self._live()
        return [SimpleNamespace(pid=os.getpid(), usedGpuMemory=3 * GIB)] if h.name == "Fast" else []

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        self._live()
        return [SimpleNamespace(pid=os.getpid(), usedGpuMemory=3 * GIB)] if h.name == "Fast" else []


@pytest.fixture
def two_gpus(monkeypatch):
    nvml = ProcessNvml([FakeNvmlDevice(0, 7, 0, name="Fast", util=77), FakeNvmlDevice(0, 6, 0, name="Slow")])
    nvml.install(monkeypatch)
    FakeCuda([cuda_props("Slow", 0, 6, 0), cuda_props("Fast", 0, 7, 0)]).install(monkeypatch)
    topology.clear_probe_cache()
    yield nvml
    topology.clear_probe_cache()


def test_the_monitor_samples_every_gpu_and_lists_their_processes(two_gpus):
    before = set(threading.enumerate())
    mon = TelemetryMonitor(topology.discover(), interval_s=0.01, processes_every=1)
    assert mon.start() and mon.running
    got: list = []
    procs = None
    deadline = 200
    while (len({s.gpu for s in got}) < 2 or procs is None) and deadline:
        s, p = mon.poll()
        got += s
        procs = procs if p is None else p
        threading.Event().wait(0.02)
        deadline -= 1
    mon.stop()
    assert {s.gpu for s in got} == {0, 1} and all(s.mem_used is not None and s.temp_c is not None for s in got)
    assert [s.t_ns for s in got] == sorted(s.t_ns for s in got)  # each poll gives only what is new
    assert len(procs) == 1 and procs[0].gpu == 1 and procs[0].pid == os.getpid() and procs[0].used_bytes == 3 * GIB
    text = processes_text(procs)
    assert text.startswith("cuda:1 · ") and f"(pid {os.getpid()}) 3.00 GiB" in text
    assert set(threading.enumerate()) == before and two_gpus.refcount == 0


def test_without_gpus_the_monitor_says_why():
    mon = TelemetryMonitor(topology.Topology(reason="no CUDA devices"))
    assert not mon.start() and "no CUDA devices" in mon.reason and mon.poll() == ([], None)


def test_the_window_monitors_between_runs_and_pauses_for_a_run(two_gpus, themed_app, qtbot, qsettings, demo_path,
                                                               tmp_path):
    from strata_gui.views.main_window_view import MainWindow

    win = MainWindow(qsettings, demo_path, history_path=tmp_path / "h.sqlite3")
    qtbot.addWidget(win)
    win.show()
    qtbot.waitUntil(lambda: not win.jobs.busy and win.controller.topology is not None, timeout=20_000)
    try:
        win.telemetry.monitor_box.setChecked(True)
        qtbot.waitUntil(lambda: f"pid {os.getpid()}" in win.telemetry.processes.text(), timeout=10_000)
        qtbot.waitUntil(lambda: len(win.telemetry.store) >= 2, timeout=10_000)
        assert win.telemetry.showing_plots and win.telemetry.processes.isVisible() and win.monitor.running
        set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="64", prompt_tokens=128, decode_tokens=0,
                 warmup=False)
        qtbot.waitUntil(lambda: not win.model_pending, timeout=20_000)
        assert win.start_run()
        qtbot.waitUntil(lambda: win.controller.is_running, timeout=5_000)
        assert not win.monitor.running  # the run owns the panel
        qtbot.waitUntil(lambda: win.last_outcome == "finished" and not win.controller.is_running, timeout=60_000)
        qtbot.waitUntil(lambda: win.monitor.running, timeout=5_000)  # and it resumes after
        win.telemetry.monitor_box.setChecked(False)
        assert not win.monitor.running and not win.telemetry.processes.isVisible()
    finally:
        win.close()
    assert two_gpus.refcount == 0
