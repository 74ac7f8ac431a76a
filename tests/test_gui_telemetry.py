"""The GPU panel (issue 37): memory, clock, power and temperature beside utilisation and PCIe on
the run's time axis, and a Live monitor between runs with the processes on each GPU.  Drawn from
recorded samples (this machine has no NVIDIA driver); the sampler's NVML side is the GPU gate's."""
from __future__ import annotations

import os

import numpy as np
import pytest
from gui_support import qsettings, qt_settings_sandbox, themed_app, window  # noqa: F401

from engine.topology import GpuProcess, TelemetrySample, Topology
from strata_gui.run.gpu_monitor_model import GpuMonitor, LiveView
from strata_gui.views.telemetry_view import EXTRA, TelemetryView

GIB = 1 << 30


def _samples(origin: int, n: int = 20, gpus: int = 2) -> list[TelemetrySample]:
    return [TelemetrySample(t_ns=origin + int(i * 0.1e9), gpu=g, util_pct=10 * g + i, mem_used=(g + 1) * GIB + i,
                            pcie_tx_gbs=1.0, pcie_rx_gbs=2.0, sm_clock_mhz=1500 + i, power_w=200.0 + g,
                            temp_c=40 + g, mem_total=80 * GIB)
            for i in range(n) for g in range(gpus)]


def test_the_run_view_plots_each_chosen_quantity_in_its_unit(themed_app, qtbot):
    v = TelemetryView()
    qtbot.addWidget(v)
    v.start(1_000, True, "")
    v.add_samples(_samples(1_000))
    assert v.showing_plots and v.mode == "run"
    assert v.extra_choice.currentText() == "memory used"
    np.testing.assert_array_equal(v.values(1, "extra"), [2 * GIB + i for i in range(20)])
    for label, (series, _axis, _units, scale) in EXTRA.items():
        v.extra_choice.setCurrentText(label)
        got = v.values(0, "extra")
        want = np.array([getattr(s, series) for s in _samples(1_000) if s.gpu == 0], dtype=float) * scale
        np.testing.assert_allclose(got, want, err_msg=label)
        assert v.extra.getAxis("left").labelText == EXTRA[label][1]
    np.testing.assert_array_equal(v.values(1, "util"), [10 + i for i in range(20)])


def test_the_live_view_shows_the_window_as_seconds_ago_and_the_processes(themed_app, qtbot):
    v = TelemetryView()
    qtbot.addWidget(v)
    v.set_mode("live")
    now = 10 * 10**9
    procs = [GpuProcess(0, os.getpid(), "python3", 3 * GIB), GpuProcess(1, 4242, "llama-server", None)]
    v.show_live(LiveView(_samples(now - 2 * 10**9), procs, now))
    assert v.showing_plots and v.processes.isVisibleTo(v)
    curve = v._curves[(0, "util")]
    assert curve.xData.min() >= 0 and curve.xData.max() <= 2.0 + 1e-9  # seconds before "now"
    rows = [[v.processes.item(r, c).text() for c in range(4)] for r in range(v.processes.rowCount())]
    assert rows[0] == ["cuda:0", str(os.getpid()), "python3 (this app)", "3.00 GiB"]
    assert rows[1] == ["cuda:1", "4242", "llama-server", "n/a"]
    v.set_mode("run")  # back to the run: the timeline's axis again, no process table
    assert not v.processes.isVisibleTo(v)


def test_without_a_gpu_the_monitor_says_why_and_the_app_stays_usable(window, qtbot):
    mon = GpuMonitor()
    assert not mon.start(Topology(reason="no NVIDIA driver")) and "no NVIDIA driver" in mon.reason
    assert mon.poll().samples == [] and not mon.running
    win = window
    if win.controller.topology is not None and win.controller.topology.devices:
        pytest.skip("this machine has GPUs: the live panel shows readings")
    win.telemetry.live_button.click()
    assert win.telemetry.mode == "live" and not win.telemetry.showing_plots
    assert "no GPU to monitor" in win.telemetry.message.text()
    win.telemetry.run_button.click()
    assert win.telemetry.mode == "run"
