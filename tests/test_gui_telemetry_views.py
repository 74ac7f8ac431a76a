"""Issue 37: the GPU panel plots memory used, SM clock, power and temperature too (the sampler
reads them), on the run's time axis; a picker chooses the pair."""
from __future__ import annotations

import numpy as np
from gui_support import themed_app  # noqa: F401

from engine.hw.topology import TelemetrySample


def _samples(origin: int) -> list[TelemetrySample]:
    return [TelemetrySample(origin + k * 100_000_000, gpu, util_pct=10 * k, mem_used=(k + 1) * 2**30,
                            pcie_tx_gbs=1.0 * k, pcie_rx_gbs=0.5 * k, sm_clock_mhz=1500 + k, power_w=300.0 + k,
                            temp_c=40 + k) for k in range(5) for gpu in (0, 1)]


def test_every_sampled_quantity_is_plotted_on_the_runs_time_axis(themed_app, qtbot):
    from strata_gui.views.telemetry_view import VIEWS, TelemetryView

    v = TelemetryView()
    qtbot.addWidget(v)
    v.start(1_000, True, "")
    v.add_samples(_samples(1_000))
    want = {"utilisation · PCIe": {"util_pct": 40.0, "pcie_tx_gbs": 4e9, "pcie_rx_gbs": 2e9},
            "memory · SM clock": {"mem_used": 5 * 2**30, "sm_clock_mhz": 1504e6},
            "power · temperature": {"power_w": 304.0, "temp_c": 44.0}}
    assert set(VIEWS) == set(want)
    for view, last in want.items():
        v.set_view(view)
        assert v.view == view
        assert {s for (_, s) in v._curves} == set(last)
        for (_gpu, series), curve in v._curves.items():
            x, y = curve.xData, curve.yData  # as given (getData clips to the view)
            assert np.allclose(x, [0.0, 0.1, 0.2, 0.3, 0.4]), x  # seconds since the run started
            assert y[-1] == last[series], (view, series, y)
        labels = [p.getAxis("left").labelText for p in (v.util, v.pcie)]
        assert labels == [q.label for q in VIEWS[view]]
    # a new run clears the curves whatever the pair shown
    v.start(5_000, True, "")
    assert all(c.xData is None or len(c.xData) == 0 for c in v._curves.values())
