"""GPU telemetry on the Gantt's time axis, per GPU: utilisation and PCIe throughput, memory used
and SM clock, or power and temperature (the sampler reads all of them; a picker chooses the pair
the two plots show, as nvtop/nvitop users expect to see them).

The plots share the Gantt's X axis (linked).  When the sampler is unavailable (no NVIDIA driver,
a CPU-only run) the panel says so, with the reason, instead of showing empty plots.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QCheckBox, QComboBox, QHBoxLayout, QLabel, QStackedWidget, QVBoxLayout, QWidget

from engine.hw.topology import TelemetrySample

from ..run.telemetry_model import TelemetryStore
from .theme import GPU_COLORS, MUTED_COLOR

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Quantity:
    """One plot's quantity: the store's series (with a legend suffix each), axis label and unit,
    the factor to the unit, and a fixed top of the axis (None: auto)."""

    series: tuple[tuple[str, str], ...]
    label: str
    units: str
    scale: float = 1.0
    y_max: float | None = None


VIEWS: dict[str, tuple[Quantity, Quantity]] = {
    "utilisation · PCIe": (Quantity((("util_pct", ""),), "utilisation", "%", y_max=100.0),
                           Quantity((("pcie_tx_gbs", " TX"), ("pcie_rx_gbs", " RX")), "PCIe", "B/s", 1e9)),
    "memory · SM clock": (Quantity((("mem_used", ""),), "memory used", "B"),
                          Quantity((("sm_clock_mhz", ""),), "SM clock", "Hz", 1e6)),
    "power · temperature": (Quantity((("power_w", ""),), "power", "W"),
                            Quantity((("temp_c", ""),), "temperature", "°C")),
}


class TelemetryView(QWidget):
    monitor_toggled = Signal(bool)  # the user turned the between-runs monitor on or off

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._linked: object = None  # the Gantt's plot the X axis follows during runs
        self.store = TelemetryStore()
        title = QLabel("GPU telemetry (same time axis as the timeline)")
        title.setProperty("role", "panel-title")
        title.setWordWrap(True)  # a narrow window wraps it rather than growing
        self.view_box = QComboBox()
        for name in VIEWS:
            self.view_box.addItem(name)
        self.view_box.setToolTip("Which of the sampled quantities the two plots show (every one is sampled "
                                 "and kept with the run).")
        self.view_box.currentIndexChanged.connect(lambda _i: self._configure())
        self.monitor_box = QCheckBox("Monitor between runs")
        self.monitor_box.setToolTip("Between runs, sample every GPU of this machine (memory, clocks, power, "
                                    "temperature, utilisation) and list the processes holding GPU memory, as "
                                    "nvitop does; a run takes the panel over and the monitor resumes after it.")
        self.monitor_box.toggled.connect(self.monitor_toggled.emit)
        head = QHBoxLayout()
        head.addWidget(title, 1)
        head.addWidget(self.monitor_box)
        head.addWidget(QLabel("show"))
        head.addWidget(self.view_box)
        self.processes = QLabel()
        self.processes.setProperty("role", "hint")
        self.processes.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.processes.setVisible(False)
        self.message = QLabel()
        self.message.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.message.setWordWrap(True)
        self.message.setStyleSheet(f"color: {MUTED_COLOR}; font-size: 11pt; padding: 12px;")
        self.plots = pg.GraphicsLayoutWidget()
        self.util = self.plots.addPlot(row=0, col=0)
        self.pcie = self.plots.addPlot(row=1, col=0)
        for plot in (self.util, self.pcie):
            plot.setMenuEnabled(False)
            plot.hideButtons()
            plot.getAxis("left").setWidth(118)
            plot.setMouseEnabled(x=True, y=False)
            plot.addLegend(offset=(-10, 5), labelTextSize="8pt")
        self.util.getAxis("bottom").setStyle(showValues=False)
        self.pcie.setLabel("bottom", "time since the run started", units="s")
        self._curves: dict[tuple[int, str], pg.PlotDataItem] = {}
        self.stack = QStackedWidget()
        self.stack.addWidget(self.message)
        self.stack.addWidget(self.plots)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(head)
        lay.addWidget(self.stack, 1)
        lay.addWidget(self.processes)
        self._configure()
        self.set_unavailable("GPU telemetry is sampled during a run.")

    @property
    def view(self) -> str:
        return self.view_box.currentText()

    def set_view(self, name: str) -> None:
        self.view_box.setCurrentText(name)

    def _configure(self) -> None:
        """The two plots' axes for the chosen pair of quantities, then their curves again."""
        for plot in (self.util, self.pcie):
            plot.clear()  # its curves, and their legend entries
        self._curves = {}
        for plot, q in zip((self.util, self.pcie), VIEWS[self.view]):
            plot.setLabel("left", q.label, units=q.units)
            if q.y_max is not None:
                plot.setYRange(0, q.y_max, padding=0.02)
            else:
                plot.enableAutoRange(axis="y")
        self._redraw()

    def link_x(self, plot: pg.PlotItem | pg.PlotWidget | None) -> None:
        """Share the X axis with the Gantt (None: an axis of its own, the monitor's)."""
        if plot is not None:
            self._linked = plot
        self.util.setXLink(plot)
        self.pcie.setXLink(plot)

    def start_monitor(self, origin_ns: int, reason: str = "") -> None:
        """Between runs: the machine's GPUs on a time axis of their own, from now."""
        self.link_x(None)
        self.start(origin_ns, True, reason)
        for plot in (self.util, self.pcie):
            plot.setLabel("bottom", "seconds of monitoring" if plot is self.pcie else "")
            plot.enableAutoRange(axis="x")
        self.processes.setVisible(True)

    def stop_monitor(self, why: str = "") -> None:
        """A run takes the panel over (or the user turned the monitor off)."""
        self.processes.setVisible(False)
        self.pcie.setLabel("bottom", "time since the run started", units="s")
        if self._linked is not None:
            self.link_x(self._linked)
        if why:
            self.set_unavailable(why)

    def set_processes(self, text: str) -> None:
        self.processes.setText(text)

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
        if self.store.add(samples):
            self._redraw()

    def _redraw(self) -> None:
        for gpu in self.store.gpus:
            color = QColor(GPU_COLORS[gpu % len(GPU_COLORS)])
            for plot, q in zip((self.util, self.pcie), VIEWS[self.view]):
                for k, (series, suffix) in enumerate(q.series):
                    t, v = self.store.series(gpu, series)
                    pen = pg.mkPen(color, width=2, style=Qt.PenStyle.DashLine if k else Qt.PenStyle.SolidLine)
                    self._curve(gpu, series, plot, f"cuda:{gpu}{suffix}", pen).setData(t, v * q.scale,
                                                                                      connect="finite")

    def _curve(self, gpu: int, what: str, plot: pg.PlotItem, name: str, pen: object) -> pg.PlotDataItem:
        curve = self._curves.get((gpu, what))
        if curve is None:
            curve = self._curves[(gpu, what)] = plot.plot([], [], pen=pen, name=name)
        return curve
