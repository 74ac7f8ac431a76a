"""GPU telemetry on the Gantt's time axis: utilisation and PCIe throughput per GPU.

The plots share the Gantt's X axis (linked).  When the sampler is unavailable (no NVIDIA driver,
a CPU-only run) the panel says so, with the reason, instead of showing empty plots.
"""
from __future__ import annotations

import logging

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QLabel, QStackedWidget, QVBoxLayout, QWidget

from engine.topology import TelemetrySample

from ..run.telemetry_model import TelemetryStore
from .theme import GPU_COLORS, MUTED_COLOR

log = logging.getLogger(__name__)


class TelemetryView(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store = TelemetryStore()
        title = QLabel("GPU telemetry: utilisation and PCIe throughput (same time axis as the timeline)")
        title.setProperty("role", "panel-title")
        title.setWordWrap(True)  # a narrow window wraps it rather than growing
        self.message = QLabel()
        self.message.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.message.setWordWrap(True)
        self.message.setStyleSheet(f"color: {MUTED_COLOR}; font-size: 11pt; padding: 12px;")
        self.plots = pg.GraphicsLayoutWidget()
        self.util = self.plots.addPlot(row=0, col=0)
        self.pcie = self.plots.addPlot(row=1, col=0)
        for plot, label, units in ((self.util, "utilisation", "%"), (self.pcie, "PCIe", "B/s")):
            plot.setMenuEnabled(False)
            plot.hideButtons()
            plot.setLabel("left", label, units=units)
            plot.getAxis("left").setWidth(118)
            plot.setMouseEnabled(x=True, y=False)
            plot.addLegend(offset=(-10, 5), labelTextSize="8pt")
        self.util.setYRange(0, 100, padding=0.02)
        self.util.getAxis("bottom").setStyle(showValues=False)
        self.pcie.setLabel("bottom", "time since the run started", units="s")
        self._curves: dict[tuple[int, str], pg.PlotDataItem] = {}
        self.stack = QStackedWidget()
        self.stack.addWidget(self.message)
        self.stack.addWidget(self.plots)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(title)
        lay.addWidget(self.stack, 1)
        self.set_unavailable("GPU telemetry is sampled during a run.")

    def link_x(self, plot: pg.PlotItem | pg.PlotWidget) -> None:
        """Share the X axis with the Gantt."""
        self.util.setXLink(plot)
        self.pcie.setXLink(plot)

    # ------------------------------------------------------------------- state
    def set_unavailable(self, text: str) -> None:
        self.message.setText(text)
        self.stack.setCurrentWidget(self.message)

    @property
    def showing_plots(self) -> bool:
        return self.stack.currentWidget() is self.plots

    def start(self, origin_ns: int, available: bool, reason: str) -> None:
        """A run started: clear the plots, or say why there is nothing to plot."""
        self.store.reset(origin_ns, available, reason)
        for curve in self._curves.values():
            curve.setData([], [])
        if available:
            self.stack.setCurrentWidget(self.plots)
            if reason:  # e.g. "partial: no NVML device matches cuda:1 by PCI id"
                log.info("telemetry %s", reason)
        else:
            self.set_unavailable(f"telemetry unavailable: {reason}")

    def add_samples(self, samples: list[TelemetrySample]) -> None:
        if not self.store.add(samples):
            return
        for gpu in self.store.gpus:
            color = QColor(GPU_COLORS[gpu % len(GPU_COLORS)])
            t, util = self.store.series(gpu, "util_pct")
            curve = self._curve(gpu, "util", self.util, f"cuda:{gpu}", pg.mkPen(color, width=2))
            curve.setData(t, util, connect="finite")
            _, tx = self.store.series(gpu, "pcie_tx_gbs")
            _, rx = self.store.series(gpu, "pcie_rx_gbs")
            self._curve(gpu, "tx", self.pcie, f"cuda:{gpu} TX", pg.mkPen(color, width=2)).setData(
                t, tx * 1e9, connect="finite")
            self._curve(gpu, "rx", self.pcie, f"cuda:{gpu} RX",
                        pg.mkPen(color, width=2, style=Qt.PenStyle.DashLine)).setData(t, rx * 1e9, connect="finite")

    def _curve(self, gpu: int, what: str, plot: pg.PlotItem, name: str, pen: object) -> pg.PlotDataItem:
        curve = self._curves.get((gpu, what))
        if curve is None:
            curve = self._curves[(gpu, what)] = plot.plot([], [], pen=pen, name=name)
        return curve
