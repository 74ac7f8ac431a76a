"""GPU telemetry: utilisation, PCIe throughput and one more quantity (memory used, SM clock,
power or temperature, picked in the header) per GPU.

Two modes, switched in the header: **Run** draws the last run's samples on the Gantt's time axis
(the X axes are linked); **Live** is a monitor between runs — the last two minutes of every GPU
and the processes holding memory on each, as nvitop shows them.  A run switches to Run.  When
there is nothing to sample (no NVIDIA driver, a CPU-only run) the panel says so, with the
reason, instead of showing empty plots.
"""
from __future__ import annotations

import logging

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QButtonGroup,
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QStackedWidget,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.sizes import size_text
from engine.topology import TelemetrySample

from ..run.gpu_monitor_model import WINDOW_S, LiveView
from ..run.telemetry_model import TelemetryStore
from .theme import GPU_COLORS, MUTED_COLOR

log = logging.getLogger(__name__)

# the third plot's choices: label -> (series, axis label, units, scale of the stored value)
EXTRA = {
    "memory used": ("mem_used", "memory used", "B", 1.0),
    "SM clock": ("sm_clock_mhz", "SM clock", "Hz", 1e6),
    "power": ("power_w", "power", "W", 1.0),
    "temperature": ("temp_c", "temperature", "°C", 1.0),
}


class TelemetryView(QWidget):
    mode_changed = Signal(str)  # "run" or "live"

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store = TelemetryStore()  # the run's samples (Run mode)
        self.live = TelemetryStore()  # the monitor's window (Live mode)
        self.mode = "run"
        self._linked: pg.PlotItem | pg.PlotWidget | None = None
        self._run_state: tuple[bool, str] = (False, "GPU telemetry is sampled during a run.")
        title = QLabel("GPU telemetry")
        title.setProperty("role", "panel-title")
        self.extra_choice = QComboBox()
        self.extra_choice.addItems(list(EXTRA))
        self.extra_choice.setToolTip("The quantity of the third plot")
        self.extra_choice.currentIndexChanged.connect(self._redraw)
        self.run_button = QPushButton("Run")
        self.run_button.setToolTip("The last run's samples on the timeline's time axis")
        self.live_button = QPushButton("Live")
        self.live_button.setToolTip("A monitor between runs: the last two minutes and the processes on each GPU")
        group = QButtonGroup(self)
        for b in (self.run_button, self.live_button):
            b.setCheckable(True)
            b.setAutoDefault(False)
            group.addButton(b)
        self.run_button.setChecked(True)
        self.run_button.clicked.connect(lambda: self.set_mode("run"))
        self.live_button.clicked.connect(lambda: self.set_mode("live"))
        head = QHBoxLayout()
        head.setContentsMargins(0, 0, 0, 0)
        head.addWidget(title)
        head.addStretch(1)
        head.addWidget(QLabel("third plot:"))
        head.addWidget(self.extra_choice)
        head.addWidget(self.run_button)
        head.addWidget(self.live_button)
        self.message = QLabel()
        self.message.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.message.setWordWrap(True)
        self.message.setStyleSheet(f"color: {MUTED_COLOR}; font-size: 11pt; padding: 12px;")
        self.plots = pg.GraphicsLayoutWidget()
        self.util = self.plots.addPlot(row=0, col=0)
        self.pcie = self.plots.addPlot(row=1, col=0)
        self.extra = self.plots.addPlot(row=2, col=0)
        for plot, label, units in ((self.util, "utilisation", "%"), (self.pcie, "PCIe", "B/s"),
                                   (self.extra, "memory used", "B")):
            plot.setMenuEnabled(False)
            plot.hideButtons()
            plot.setLabel("left", label, units=units)
            plot.getAxis("left").setWidth(118)
            plot.setMouseEnabled(x=True, y=False)
            plot.addLegend(offset=(-10, 5), labelTextSize="8pt")
        self.util.setYRange(0, 100, padding=0.02)
        for plot in (self.util, self.pcie):
            plot.getAxis("bottom").setStyle(showValues=False)
        self.extra.setLabel("bottom", "time since the run started", units="s")
        self._curves: dict[tuple[int, str], pg.PlotDataItem] = {}
        self.processes = QTableWidget(0, 4)
        self.processes.setHorizontalHeaderLabels(["GPU", "pid", "process", "VRAM"])
        self.processes.verticalHeader().setVisible(False)
        self.processes.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.processes.horizontalHeader().setStretchLastSection(True)
        self.processes.setMaximumHeight(120)
        self.processes.setVisible(False)
        body = QWidget()
        body_lay = QVBoxLayout(body)
        body_lay.setContentsMargins(0, 0, 0, 0)
        body_lay.addWidget(self.plots, 1)
        body_lay.addWidget(self.processes)
        self.stack = QStackedWidget()
        self.stack.addWidget(self.message)
        self.stack.addWidget(body)
        self._body = body
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(head)
        lay.addWidget(self.stack, 1)
        self.set_unavailable("GPU telemetry is sampled during a run.")

    def link_x(self, plot: pg.PlotItem | pg.PlotWidget) -> None:
        """Share the X axis with the Gantt (in Run mode)."""
        self._linked = plot
        for p in (self.util, self.pcie, self.extra):
            p.setXLink(plot)

    def _unlink_x(self) -> None:
        for p in (self.util, self.pcie, self.extra):
            p.setXLink(None)

    # ------------------------------------------------------------------- state
    def set_unavailable(self, text: str) -> None:
        self._run_state = (False, text)
        if self.mode == "run":
            self._show_message(text)

    def _show_message(self, text: str) -> None:
        self.message.setText(text)
        self.stack.setCurrentWidget(self.message)

    @property
    def showing_plots(self) -> bool:
        return self.stack.currentWidget() is self._body

    def set_mode(self, mode: str) -> None:
        """"run": the last run on the timeline's axis; "live": the monitor's window."""
        if mode not in ("run", "live"):
            raise ValueError(f"telemetry mode {mode!r}: allowed 'run' or 'live'")
        changed = mode != self.mode
        self.mode = mode
        (self.run_button if mode == "run" else self.live_button).setChecked(True)
        self.processes.setVisible(mode == "live")
        self.extra.setLabel("bottom", "time since the run started" if mode == "run" else "seconds ago", units="s")
        if mode == "run":
            if self._linked is not None:
                self.link_x(self._linked)
            available, text = self._run_state
            if available:
                self.stack.setCurrentWidget(self._body)
            else:
                self._show_message(text)
        else:
            self._unlink_x()
            self._show_message("waiting for the first readings …")
        self._redraw()
        if changed:
            self.mode_changed.emit(mode)

    def start(self, origin_ns: int, available: bool, reason: str) -> None:
        """A run started: Run mode, the plots cleared, or why there is nothing to plot."""
        self.store.reset(origin_ns, available, reason)
        self._run_state = (available, f"telemetry unavailable: {reason}")
        if available and reason:  # e.g. "partial: no NVML device matches cuda:1 by PCI id"
            log.info("telemetry %s", reason)
        self.set_mode("run")

    def add_samples(self, samples: list[TelemetrySample]) -> None:
        if self.store.add(samples) and self.mode == "run":
            self._redraw()

    def show_live(self, view: LiveView, unavailable: str = "") -> None:
        """The monitor's window (Live mode only); `unavailable` says why there is none."""
        if self.mode != "live":
            return
        if unavailable and not view.samples:
            self._show_message(unavailable)
            return
        self.live.reset(view.now_ns, True, "")
        self.live.add(view.samples)
        if view.samples:
            self.stack.setCurrentWidget(self._body)
        self._redraw()
        self._fill_processes(view)

    def _fill_processes(self, view: LiveView) -> None:
        t = self.processes
        t.setRowCount(len(view.processes))
        for r, p in enumerate(view.processes):
            name = p.name or "?"
            if p.pid == view.own_pid:
                name += " (this app)"
            cells = (f"cuda:{p.gpu}", str(p.pid), name, size_text(p.used_bytes) if p.used_bytes is not None else "n/a")
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if c in (1, 3):
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                t.setItem(r, c, item)

    # ------------------------------------------------------------------- drawing
    def _redraw(self) -> None:
        store = self.store if self.mode == "run" else self.live
        series, label, units, scale = EXTRA[self.extra_choice.currentText()]
        self.extra.setLabel("left", label, units=units)
        for curve in self._curves.values():
            curve.setData([], [])
        for gpu in store.gpus:
            color = QColor(GPU_COLORS[gpu % len(GPU_COLORS)])
            pen = pg.mkPen(color, width=2)
            t, util = store.series(gpu, "util_pct")
            if self.mode == "live":
                t = -t  # the window ends now: x is seconds ago (reset put "now" at the origin)
            self._curve(gpu, "util", self.util, f"cuda:{gpu}", pen).setData(t, util, connect="finite")
            _, tx = store.series(gpu, "pcie_tx_gbs")
            _, rx = store.series(gpu, "pcie_rx_gbs")
            self._curve(gpu, "tx", self.pcie, f"cuda:{gpu} TX", pen).setData(t, tx * 1e9, connect="finite")
            self._curve(gpu, "rx", self.pcie, f"cuda:{gpu} RX",
                        pg.mkPen(color, width=2, style=Qt.PenStyle.DashLine)).setData(t, rx * 1e9, connect="finite")
            _, v = store.series(gpu, series)
            self._curve(gpu, "extra", self.extra, f"cuda:{gpu}", pen).setData(t, v * scale, connect="finite")
        if self.mode == "live":
            for p in (self.util, self.pcie, self.extra):
                p.setXRange(0, WINDOW_S, padding=0.01)
                p.getViewBox().invertX(True)
        else:
            for p in (self.util, self.pcie, self.extra):
                p.getViewBox().invertX(False)

    def _curve(self, gpu: int, what: str, plot: pg.PlotItem, name: str, pen: object) -> pg.PlotDataItem:
        curve = self._curves.get((gpu, what))
        if curve is None:
            curve = self._curves[(gpu, what)] = plot.plot([], [], pen=pen, name=name)
        return curve

    def values(self, gpu: int, what: str) -> np.ndarray:
        """The y values drawn for one GPU's curve ('util', 'tx', 'rx', 'extra'): for tests and
        for a look at what the panel shows."""
        curve = self._curves.get((gpu, what))
        return np.zeros(0) if curve is None or curve.yData is None else np.asarray(curve.yData)
