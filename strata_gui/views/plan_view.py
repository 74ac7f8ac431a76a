"""The Plan tab: start from a saved run, change the GPUs (count, VRAM, PCIe gen x width or a
custom GB/s) and the settings, and see the predicted Gantt stacked above the measured one on one
time axis (the Compare tab's Gantt widgets), with predicted vs measured tok/s and the planner's
error on the runs that exist.  "Recommend" hands the best predicted settings for the detected
machine to the Run tab.  State and arithmetic: `plan_model.py`."""
from __future__ import annotations

import html
import logging

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.hw.topology import Topology
from engine.plan.planner import PlanError

from ..history.history_model import RunHistory
from ..plan.plan_model import PCIE_CHOICES, GpuRow, PlanModel, PlanResult, gpus_of_topology, settings_changes
from ..run.record_model import describe
from ..run.settings_model import RunSettings
from .compare_view import AFTER_COLOR, BEFORE_COLOR, _item
from .gantt_view import stacked_pair
from .theme import ERROR_COLOR, MUTED_COLOR

log = logging.getLogger(__name__)

CHOICE_LIMIT = 300
CROSS_LIMIT = 6  # other saved runs of the same model in the error table


class PlanView(QWidget):
    recommended = Signal(object)  # RunSettings for the Run tab

    def __init__(self, history: RunHistory | None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.history = history
        self.model = PlanModel()
        self.result: PlanResult | None = None
        self.topology: Topology | None = None
        self.base_settings = RunSettings()
        self.run_id: int | None = None
        self._loading = False
        self._build()
        self.refresh_choices()

    # ------------------------------------------------------------------ layout
    def _build(self) -> None:
        self.source_box = QComboBox()
        self.source_box.setMinimumWidth(460)
        self.source_box.activated.connect(self._on_source)
        self.recommend_button = QPushButton("Recommend")
        self.recommend_button.setToolTip("Fill the Run tab with the best predicted settings for this machine's "
                                         "detected devices (chunk, schedule, depth, prefill-main, device order).")
        self.recommend_button.clicked.connect(self.recommend)
        top = QHBoxLayout()
        top.addWidget(QLabel("Start from run"))
        top.addWidget(self.source_box, 1)
        top.addWidget(self.recommend_button)

        inputs = _inputs(self)
        self.headline = QLabel()
        self.headline.setTextFormat(Qt.TextFormat.RichText)
        self.headline.setWordWrap(True)
        self.headline.setStyleSheet("font-size: 11pt; padding: 2px 0 4px 0;")

        self.gantt_pred, self.gantt_meas, gantts = stacked_pair("Predicted", "Measured", self.fit)

        honesty = _honesty(self)
        body = QSplitter(Qt.Orientation.Vertical)
        body.addWidget(gantts)
        body.addWidget(honesty)
        body.setStretchFactor(0, 3)
        body.setStretchFactor(1, 1)
        body.setSizes([520, 200])

        lay = QVBoxLayout(self)
        lay.addLayout(top)
        lay.addLayout(inputs)
        lay.addWidget(self.headline)
        lay.addWidget(body, 1)
        self.show_message("Pick a saved run to start from: its measured costs drive the prediction.")

    # ------------------------------------------------------------------ choices
    def refresh_choices(self) -> None:
        self.source_box.blockSignals(True)
        try:
            self.source_box.clear()
            if self.history is None:
                return
            for row in self.history.list_runs(limit=CHOICE_LIMIT):
                if row.status == "finished":
                    self.source_box.addItem(row.title(), row.id)
            if self.run_id is not None:
                i = self.source_box.findData(self.run_id)
                if i >= 0:
                    self.source_box.setCurrentIndex(i)
        finally:
            self.source_box.blockSignals(False)

    def _on_source(self, *args: object) -> None:
        run = self.source_box.currentData()
        if run is not None:
            self.set_run(int(run))

    def set_run(self, run: int) -> bool:
        """Start from saved run #run (its own settings, its devices)."""
        if self.history is None:
            return False
        try:
            record = self.history.get(run)
            others = []
            for row in self.history.list_runs(limit=CHOICE_LIMIT):
                if row.id != run and row.status == "finished" and len(others) < CROSS_LIMIT:
                    others.append((f"#{row.id}", self.history.get(row.id)))
            self.model.set_source(record, f"#{run}", others)
        except (KeyError, PlanError, ValueError) as exc:
            self.show_message(f"Run #{run} cannot be planned from: {exc}", error=True)
            return False
        self.run_id = run
        i = self.source_box.findData(run)
        if i >= 0:
            self.source_box.setCurrentIndex(i)
        self._load_inputs()
        return self.update_prediction()

    def _load_inputs(self) -> None:
        i = self.model.inputs
        self._loading = True
        try:
            self.gpu_count.setValue(len(i.gpus))
            self._fill_gpus(i.gpus)
            self.chunk.setCurrentText(i.chunk_tokens)
            self.schedule.setCurrentText(i.schedule)
            self.depth.setCurrentIndex(max(self.depth.findData(i.pipeline_depth), 0))
            self.prefill_main.setChecked(i.prefill_main)
            self.pin.setText("" if i.pin_limit_gib is None else f"{i.pin_limit_gib:g}")
            self.prompt.setValue(i.prompt_tokens)
            self.peer.setCurrentText(i.peer)
        finally:
            self._loading = False

    def _fill_gpus(self, gpus: list[GpuRow]) -> None:
        self.gpus.blockSignals(True)
        try:
            self.gpus.setRowCount(len(gpus))
            for r, g in enumerate(gpus):
                for c, text in enumerate((g.name, f"{g.vram_gib:g}" if g.vram_gib else "", g.link, f"{g.speed:g}")):
                    self.gpus.setItem(r, c, QTableWidgetItem(text))
        finally:
            self.gpus.blockSignals(False)

    # ------------------------------------------------------------------ edits
    def read_gpus(self) -> list[GpuRow]:
        rows = []
        for r in range(self.gpus.rowCount()):
            cell = [(self.gpus.item(r, c).text().strip() if self.gpus.item(r, c) else "") for c in range(4)]
            name = cell[0] or f"cuda:{r}"
            try:
                vram = float(cell[1]) if cell[1] else 0.0
                speed = float(cell[3]) if cell[3] else 1.0
            except ValueError:
                raise PlanError(f"device {name}: VRAM and speed are numbers") from None
            rows.append(GpuRow(name, vram, cell[2], speed))
        return rows

    def _on_gpu_count(self, n: int) -> None:
        if self._loading:
            return
        rows = self.read_gpus()
        while len(rows) < n:
            last = rows[-1] if rows else GpuRow("cuda:0")
            rows.append(GpuRow(f"cuda:{len(rows)}", last.vram_gib, last.link, last.speed))
        self._fill_gpus(rows[:n])
        self._on_input()

    def _on_link_preset(self, index: int) -> None:
        if index <= 0:
            return
        text = self.link_preset.itemText(index).split(" ")[0]
        self.gpus.blockSignals(True)
        for r in range(self.gpus.rowCount()):
            self.gpus.setItem(r, 2, QTableWidgetItem(text))
        self.gpus.blockSignals(False)
        self.link_preset.setCurrentIndex(0)
        self._on_input()

    def _on_gpu_edit(self, *args: object) -> None:
        self._on_input()

    def _on_input(self, *args: object) -> None:
        if self._loading or self.model.run is None:
            return
        self.update_prediction()

    def _read_inputs(self) -> None:
        i = self.model.inputs
        i.gpus = self.read_gpus()
        i.peer = self.peer.currentText()
        i.chunk_tokens = self.chunk.currentText()
        i.schedule = self.schedule.currentText()
        i.pipeline_depth = int(self.depth.currentData())
        i.prefill_main = self.prefill_main.isChecked()
        pin = self.pin.text().strip()
        try:
            i.pin_limit_gib = float(pin) if pin else None
        except ValueError:
            raise PlanError(f"pin limit {pin!r}: GiB, or empty for all pinned") from None
        i.prompt_tokens = self.prompt.value()

    # ------------------------------------------------------------------ the prediction
    def update_prediction(self) -> bool:
        try:
            self._read_inputs()
            res = self.result = self.model.predict()
        except (PlanError, ValueError) as exc:
            self.result = None
            self.show_message(str(exc), error=True)
            return False
        pred, meas = res.predicted, res.measured
        self.gantt_pred.set_title(f"Predicted · {describe(pred)}")
        self.gantt_meas.set_title(f"Measured {self.model.run.name} · {describe(meas)}")
        self.gantt_pred.show_run(pred.report.run_id, pred.origin_ns, pred.stages, pred.events)
        self.gantt_meas.show_run(meas.report.run_id, meas.origin_ns, meas.stages, meas.events)
        self.fit()
        own = res.own
        color = MUTED_COLOR
        text = (f"<b style='color:{AFTER_COLOR}'>Predicted {pred.report.prefill_tok_s:,.0f} tok/s</b> "
                f"({html.escape(res.prediction.settings.describe())}, {len(res.prediction.stages)} stage(s)) · "
                f"<span style='color:{BEFORE_COLOR}'>measured run {meas.report.prefill_tok_s:,.0f} tok/s</span> "
                f"· predicted / measured {pred.report.prefill_tok_s / max(meas.report.prefill_tok_s, 1e-9):.2f}×"
                f"<br><span style='color:{color}'>On its own configuration this profile predicts "
                f"{own.predicted_tok_s:,.0f} vs {own.measured_tok_s:,.0f} measured ({own.error:+.1%}); "
                f"busy 0/1/…: {'/'.join(f'{x * 100:.0f}' for x in pred.report.busy_histogram)} %</span>")
        if res.caution:
            text += f"<br><span style='color:{ERROR_COLOR}'>Caution: {html.escape(res.caution)}</span>"
        self.headline.setText(text)
        self.bottleneck.setText(f"Bottleneck (predicted): {res.prediction.bottleneck}")
        self.errors.setRowCount(len(res.errors))
        for r, line in enumerate(res.errors):
            e = line.row
            bad = abs(e.error) > 0.10
            cells = [_item(e.profile_from), _item(e.predicted + (" (own)" if line.what == "own" else "")),
                     _item(f"{e.measured_tok_s:,.0f}", right=True), _item(f"{e.predicted_tok_s:,.0f}", right=True),
                     _item(f"{e.error:+.1%}", right=True, color=ERROR_COLOR if bad else None, bold=line.what == "own"),
                     _item(f"{e.hist_points:.1f} pts", right=True)]
            for c, it in enumerate(cells):
                self.errors.setItem(r, c, it)
        return True

    def fit(self) -> None:
        ends = []
        for g in (self.gantt_pred, self.gantt_meas):
            a, b = g.store.span_ns()
            ends.append((b - g.store.origin_ns) / 1e9)
        x1 = max(max(ends, default=0.0), 1e-6)
        self.gantt_pred.vb.setXRange(0.0, x1 * 1.02, padding=0)
        for g in (self.gantt_pred, self.gantt_meas):
            g.redraw()

    def show_message(self, text: str, error: bool = False) -> None:
        color = ERROR_COLOR if error else MUTED_COLOR
        self.headline.setText(f"<span style='color:{color}'>{html.escape(text)}</span>")
        if self.result is None:
            for g in (self.gantt_pred, self.gantt_meas):
                g.reset("", 0, [])
                g.set_empty_text("no prediction")
            self.errors.setRowCount(0)
            self.bottleneck.setText("")

    # ------------------------------------------------------------------ recommend
    def set_machine(self, topology: Topology | None, base: RunSettings) -> None:
        """The detected machine and the Run tab's settings (what Recommend starts from)."""
        self.topology = topology
        self.base_settings = base

    def recommend(self) -> RunSettings | None:
        if self.model.run is None:
            self.show_message("Pick a saved run first: its costs are what the recommendation is computed from.",
                              error=True)
            return None
        devices = [d.strip() for d in self.base_settings.devices.split(",") if d.strip()] or ["cpu"]
        gpus = gpus_of_topology(self.topology, devices)
        try:
            self._read_inputs()
            settings, best = self.model.recommend(gpus, self.base_settings, devices)
        except (PlanError, ValueError) as exc:
            self.show_message(f"No recommendation: {exc}", error=True)
            return None
        self.bottleneck.setText(f"Recommended for {', '.join(g.name for g in gpus)}: {best.describe()} — "
                                f"{best.prediction.prefill_tok_s:,.0f} tok/s predicted")
        self.recommended.emit(settings)
        return settings


class PlanTab(QWidget):
    """The tab's frame in the main window: builds the PlanView on first show (its two Gantts are not
    free), refreshes the run choices whenever it is shown, and hands Recommend's settings to the
    window's Run tab.  The window needs only `history`, `controller.topology`, `current_settings()`,
    `apply_settings()` and `run_tab`."""

    def __init__(self, window: QWidget) -> None:
        super().__init__()
        self.window_ = window
        self._view: PlanView | None = None
        self.last_change_text = ""  # what the last Recommend changed in the Run tab, in words
        QVBoxLayout(self).setContentsMargins(0, 0, 0, 0)

    @property
    def view(self) -> PlanView:
        if self._view is None:
            self._view = PlanView(getattr(self.window_, "history", None))
            self._view.recommended.connect(self._apply)
            # in a scroll area: its two Gantts and tables need ~690 px of height, more than a 720-px
            # screen leaves; without it the whole window grew past the screen on this tab
            scroll = QScrollArea()
            scroll.setWidgetResizable(True)
            scroll.setFrameShape(QScrollArea.Shape.NoFrame)
            scroll.setWidget(self._view)
            self.layout().addWidget(scroll)
        return self._view

    def showEvent(self, event) -> None:  # noqa: N802 - Qt's name
        self.view.refresh_choices()
        if self.view.model.run is None and self.view.source_box.count():
            self.view.set_run(int(self.view.source_box.itemData(0)))
        self._sync_machine()
        super().showEvent(event)

    def _sync_machine(self) -> None:
        w = self.window_
        controller = getattr(w, "controller", None)
        self.view.set_machine(getattr(controller, "topology", None), w.current_settings())

    def plan_from(self, run: int) -> bool:
        return self.view.set_run(run)

    def recommend(self) -> RunSettings | None:
        self._sync_machine()
        return self.view.recommend()

    def _apply(self, settings: RunSettings) -> None:
        w = self.window_
        changes = settings_changes(w.current_settings(), settings)
        w.apply_settings(settings)
        w.tabs.setCurrentWidget(w.run_tab)
        said = ("Recommend changed the Run tab: " + "; ".join(changes)) if changes else \
            "Recommend kept the Run tab as it was: its settings are already the best predicted for this machine"
        self.last_change_text = said
        self.view.bottleneck.setText(self.view.bottleneck.text() + "\n" + said)
        w.set_status(said)


def _inputs(self: PlanView) -> QHBoxLayout:
    """The machine (devices, links, peer copies) and the settings to predict, set on the view (as Qt
    Designer's setupUi does); their row."""
    self.gpus = QTableWidget(0, 4)
    self.gpus.setHorizontalHeaderLabels(["device", "VRAM GiB", "host link (genGxW or GB/s)", "speed ×"])
    self.gpus.verticalHeader().setVisible(False)
    self.gpus.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
    self.gpus.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    self.gpus.setToolTip("The machine to predict: one row per device. Link: PCIe as gen4x4 (its link class) "
                         "or a measured GB/s such as 5.3 (a Thunderbolt enclosure); empty = as in the run. "
                         "Speed: compute relative to the run's device.")
    self.gpus.itemChanged.connect(self._on_gpu_edit)
    self.gpu_count = QSpinBox()
    self.gpu_count.setRange(1, 8)
    self.gpu_count.valueChanged.connect(self._on_gpu_count)
    self.link_preset = QComboBox()
    self.link_preset.addItems(["set all links…", *PCIE_CHOICES, "5.3 (Thunderbolt)"])
    self.link_preset.activated.connect(self._on_link_preset)
    self.peer = QComboBox()
    self.peer.setEditable(True)
    self.peer.addItems(["as measured", "none", "25", "50"])
    self.peer.setToolTip("GPU-to-GPU copies: as measured in the run, none (staged through host memory, "
                         "as WDDM forces), or a GB/s figure.")
    self.peer.currentTextChanged.connect(self._on_input)

    self.chunk = QComboBox()
    self.chunk.setEditable(True)
    self.chunk.addItems(["as measured", "auto", "1024", "2048", "3072", "4096", "8192", "16384"])
    self.chunk.currentTextChanged.connect(self._on_input)
    self.schedule = QComboBox()
    self.schedule.addItems(["fixed", "balanced"])
    self.schedule.currentTextChanged.connect(self._on_input)
    self.depth = QComboBox()
    self.depth.addItem("1 (overlap)", 1)
    self.depth.addItem("0 (join)", 0)
    self.depth.currentIndexChanged.connect(self._on_input)
    self.prefill_main = QCheckBox("prefill on the main GPU")
    self.prefill_main.toggled.connect(self._on_input)
    self.pin = QLineEdit()
    self.pin.setPlaceholderText("all pinned")
    self.pin.editingFinished.connect(self._on_input)
    self.prompt = QSpinBox()
    self.prompt.setRange(0, 1 << 20)
    self.prompt.setSpecialValueText("as measured")
    self.prompt.setSingleStep(1024)
    self.prompt.valueChanged.connect(self._on_input)

    machine = QGroupBox("Machine")
    ml = QVBoxLayout(machine)
    row = QHBoxLayout()
    row.addWidget(QLabel("devices"))
    row.addWidget(self.gpu_count)
    row.addWidget(self.link_preset)
    row.addWidget(QLabel("peer"))
    row.addWidget(self.peer, 1)
    ml.addLayout(row)
    ml.addWidget(self.gpus)
    settings = QGroupBox("Settings")
    form = QFormLayout(settings)
    form.addRow("chunk", self.chunk)
    form.addRow("schedule", self.schedule)
    form.addRow("pipeline depth", self.depth)
    form.addRow("", self.prefill_main)
    form.addRow("pin limit GiB", self.pin)
    form.addRow("prompt tokens", self.prompt)
    inputs = QHBoxLayout()
    inputs.addWidget(machine, 3)
    inputs.addWidget(settings, 2)
    return inputs


def _honesty(self: PlanView) -> QWidget:
    """The planner's error on the runs that exist, and the bottleneck line, set on the view (as setupUi does)."""
    self.errors = QTableWidget(0, 6)
    self.errors.setHorizontalHeaderLabels(["profile from", "predicted run", "measured tok/s", "predicted tok/s",
                                           "error", "busy hist. gap"])
    self.errors.verticalHeader().setVisible(False)
    self.errors.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    self.errors.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    self.errors.horizontalHeader().setStretchLastSection(True)
    self.errors.setToolTip("How wrong the planner is on runs that exist: the start run's own configuration "
                           "from its own profile, and other saved runs of the same model from each other's.")
    self.bottleneck = QLabel()
    self.bottleneck.setWordWrap(True)
    self.bottleneck.setProperty("role", "hint")
    honesty = QWidget()
    hl = QVBoxLayout(honesty)
    hl.setContentsMargins(0, 0, 0, 0)
    hl.addWidget(QLabel("Error on the runs that exist"))
    hl.addWidget(self.errors, 1)
    hl.addWidget(self.bottleneck)
    return honesty
