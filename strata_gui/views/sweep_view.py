"""The Sweep tab: a plan (prompt sizes, arms, repeats) on the left; prefill tok/s against prompt
tokens per arm, and the table beside it (median, ± sd, ratio to the first arm), filled in as
each run finishes.  Start and Stop go to the sweep presenter (sweep/sweep_presenter.py); the table
exports as CSV and markdown (`sweep.SweepResults`)."""
from __future__ import annotations

import html
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.config import ConfigError

from ..run import run_files
from ..sweep.sweep_messages import SweepProgress
from ..sweep.sweep_model import (
    MAX_REPEATS,
    SweepArm,
    SweepPlan,
    SweepResults,
    SweepSample,
    format_tokens,
    parse_sizes,
    ratio_noise,
)
from .theme import ERROR_COLOR, GPU_COLORS, MUTED_COLOR

log = logging.getLogger(__name__)

DEFAULT_ARMS = (("join", "pipeline_depth=0"), ("overlap", "pipeline_depth=1"))
DEFAULT_SIZES = "8K, 16K, 32K, 64K"
TABLE_COLUMNS = ("arm", "prompt", "n", "prefill tok/s\n(median)", "± sd\n(tok/s)", "ratio to\nfirst arm",
                 "decode\ntok/s", "same\noutput")  # the last: the digest equals the first arm's
TIPS = {
    "sizes": "Prompt sizes in tokens, comma-separated; K = 1024 (8K = 8192).  Each size is one point per arm.",
    "arms": "Each arm is a name and settings over the Run tab's, written as for strata-bench --arm: "
            "setting=value pairs such as 'pipeline_depth=0' or 'prefill=2048 prefill_main=1'.  The first arm is the "
            "baseline of the ratio column.",
    "repeats": "Runs per (arm, size); the table shows the median and ± sd (the repeats' sample standard "
               "deviation, as strata-bench's ± sd).  Repeats get different prompts (a new nonce), arms identical ones.",
    "warmup": "Unmeasured warm-up runs per arm before each prompt size (the first run of a chunk shape pays "
              "for kernel set-up and CUDA graph capture), as strata-bench --warmup.",
    "decode": "Tokens to generate after each prompt (0: prefill only).",
}


def _arm_color(i: int) -> str:
    return GPU_COLORS[i % len(GPU_COLORS)]


class SweepView(QWidget):
    start_requested = Signal()
    stop_requested = Signal()
    open_requested = Signal(int)  # a past sweep's id in the history
    plan_changed = Signal()  # sizes, repeats, warm-up, decode or arms edited (the estimate follows)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.results: SweepResults | None = None
        self.sweep_id: int | None = None
        self.running = False
        self._build()
        self.show_results(None)

    # ------------------------------------------------------------------ layout
    def _build_past_and_export(self) -> tuple[QHBoxLayout, QHBoxLayout]:
        self.past = QComboBox()
        self.past.setToolTip("Sweeps saved in the history; Open shows one's chart and table again.")
        open_past = QPushButton("Open")
        open_past.clicked.connect(self._open_past)
        # a narrow combo box elides its text; the chosen sweep is spelled out in full under it
        self.past.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.past.setMinimumContentsLength(16)
        self.past_detail = QLabel()
        self.past_detail.setWordWrap(True)
        self.past_detail.setProperty("role", "hint")
        self.past.currentIndexChanged.connect(self._show_past_detail)
        past_row = QHBoxLayout()
        past_row.addWidget(self.past, 1)
        past_row.addWidget(open_past)
        self.open_past_button = open_past

        self.csv_button = QPushButton("Export CSV…")
        self.csv_button.clicked.connect(lambda: self._ask_export("csv"))
        self.md_button = QPushButton("Export markdown…")
        self.md_button.clicked.connect(lambda: self._ask_export("md"))
        export_row = QHBoxLayout()
        export_row.addWidget(self.csv_button)
        export_row.addWidget(self.md_button)
        export_row.addStretch(1)
        self.message = QLabel()
        self.message.setWordWrap(True)
        return past_row, export_row

    def _build(self) -> None:
        plan_box = _plan_box(self)
        self.start_button = QPushButton("Start sweep")
        self.start_button.setObjectName("runButton")
        self.start_button.clicked.connect(self.start_requested.emit)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setObjectName("stopButton")
        self.stop_button.setToolTip("Stop at the next chunk boundary; the finished points are kept.")
        self.stop_button.setEnabled(False)
        self.stop_button.clicked.connect(self.stop_requested.emit)
        run_row = QHBoxLayout()
        run_row.addWidget(self.start_button)
        run_row.addWidget(self.stop_button)
        run_row.addStretch(1)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.progress.setFormat("not started")  # "%v / %m runs" once a sweep begins (not "0 / 1 runs")
        self.progress_label = QLabel("idle")
        self.progress_label.setWordWrap(True)

        past_row, export_row = self._build_past_and_export()
        left = QWidget()
        left_lay = QVBoxLayout(left)
        left_lay.addWidget(plan_box)
        left_lay.addLayout(run_row)
        left_lay.addWidget(self.progress)
        left_lay.addWidget(self.progress_label)
        past_title = QLabel("Past sweeps")
        past_title.setStyleSheet("font-weight: 600")
        left_lay.addWidget(past_title)
        left_lay.addLayout(past_row)
        left_lay.addWidget(self.past_detail)
        left_lay.addLayout(export_row)
        left_lay.addWidget(self.message)
        left_lay.addStretch(1)
        left.setMinimumWidth(380)
        left.setMaximumWidth(470)

        self.results_view = SweepResultsView()
        rv = self.results_view  # its parts, by the names the tests use
        self.title, self.chart, self.legend, self.chart_note = rv.title, rv.chart, rv.legend, rv.chart_note
        self.table, self.command = rv.table, rv.command

        # the plan column scrolls in a short window (1280x720, 150% scale) instead of setting its height
        left_scroll = QScrollArea()
        left_scroll.setWidget(left)
        left_scroll.setWidgetResizable(True)
        left_scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        left_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        left_scroll.setMinimumWidth(400)
        left_scroll.setMaximumWidth(490)
        lay = QHBoxLayout(self)
        lay.addWidget(left_scroll)
        lay.addWidget(self.results_view, 1)

    # ------------------------------------------------------------------ the plan
    def add_arm(self, name: str, settings: str) -> None:
        r = self.arms.rowCount()
        self.arms.insertRow(r)
        self.arms.setItem(r, 0, QTableWidgetItem(name))
        self.arms.setItem(r, 1, QTableWidgetItem(settings))

    def _remove_arm(self) -> None:
        rows = sorted({i.row() for i in self.arms.selectedIndexes()}, reverse=True) or [self.arms.rowCount() - 1]
        for r in rows:
            if self.arms.rowCount() > 1 and r >= 0:
                self.arms.removeRow(r)

    def set_arms(self, arms: Sequence[tuple[str, str]]) -> None:
        self.arms.setRowCount(0)
        for name, settings in arms:
            self.add_arm(name, settings)

    def arm_list(self) -> list[SweepArm]:
        out = []
        for r in range(self.arms.rowCount()):
            name = self.arms.item(r, 0).text().strip() if self.arms.item(r, 0) else ""
            settings = self.arms.item(r, 1).text().strip() if self.arms.item(r, 1) else ""
            out.append(SweepArm(name or settings or f"arm {r + 1}", settings))
        return out

    def plan(self, model: str, base: dict) -> SweepPlan:
        """The plan in the form (raises ConfigError naming the field and the value)."""
        plan = SweepPlan(sizes=tuple(parse_sizes(self.sizes.text())), arms=tuple(self.arm_list()),
                         repeats=self.repeats.value(), warmup=self.warmup.value(), decode_tokens=self.decode.value(),
                         model=model, base=base)
        plan.validate()
        for arm in plan.arms:
            try:
                arm.overrides()
            except ConfigError as exc:
                raise ConfigError(f"arm {arm.name}", arm.settings, exc.allowed, str(exc)) from None
        return plan

    def set_base(self, text: str) -> None:
        self.base.setText(text)

    def set_estimate(self, text: str) -> None:
        self.estimate.setText(text)

    def set_errors(self, errors: list[str]) -> None:
        self.errors.setText("<br>".join(html.escape(e) for e in errors))
        self.errors.setVisible(bool(errors))

    def set_running(self, running: bool) -> None:
        self.running = running
        for w in (self.sizes, self.repeats, self.warmup, self.decode, self.arms, self.start_button, self.past,
                  self.open_past_button):
            w.setEnabled(not running)
        self.stop_button.setEnabled(running)

    def set_start_enabled(self, on: bool, why: str = "") -> None:
        self.start_button.setEnabled(on and not self.running)
        self.start_button.setToolTip(why or "Run every prompt size for every arm, the repeats, in strata-bench's "
                                            "order (each arm on the same prompt).")

    # ------------------------------------------------------------------ past sweeps
    def set_past(self, sweeps: Sequence) -> None:
        current = self.past.currentData()
        self.past.clear()
        for s in sweeps:
            text = f"#{s.id} · {s.when} · {s.label or 'sweep'} · {s.n_runs} runs · {s.status}"
            self.past.addItem(text, s.id)
            self.past.setItemData(self.past.count() - 1, text, Qt.ItemDataRole.ToolTipRole)
        if current is not None and self.past.findData(current) >= 0:
            self.past.setCurrentIndex(self.past.findData(current))
        self.open_past_button.setEnabled(self.past.count() > 0 and not self.running)
        if self.past.count():
            self.past.view().setMinimumWidth(self.past.view().sizeHintForColumn(0) + 24)  # the list: whole lines
        self._show_past_detail()

    def _show_past_detail(self, *args: object) -> None:
        self.past_detail.setText(self.past.currentText() if self.past.count() else "no sweep saved yet")

    def _open_past(self) -> None:
        sid = self.past.currentData()
        if sid is not None:
            self.open_requested.emit(int(sid))

    # ------------------------------------------------------------------ results
    def begin(self, plan: SweepPlan, sweep_id: int | None) -> None:
        self.sweep_id = sweep_id
        self.show_results(SweepResults(plan))
        self.progress.setFormat("%v / %m runs")
        self.progress.setRange(0, plan.total)
        self.progress.setValue(0)
        self.progress_label.setText("starting …")
        self.set_message("")

    def add_sample(self, sample: SweepSample) -> None:
        if self.results is None:
            return
        self.results.add(sample)
        self.progress.setValue(len(self.results))
        self._draw()

    def on_progress(self, p: SweepProgress) -> None:
        if self.results is None:
            return
        self.progress.setRange(0, p.total)
        self.progress.setValue(p.done)
        self.progress_label.setText(p.text(self.results.plan))

    def on_finished(self, stopped: bool, message: str) -> None:
        self.progress_label.setText(message)
        self._draw()

    def set_message(self, text: str, error: bool = False) -> None:
        color = ERROR_COLOR if error else MUTED_COLOR
        self.message.setText(f"<span style='color:{color}'>{html.escape(text)}</span>" if text else "")

    def show_results(self, results: SweepResults | None, sweep_id: int | None = None) -> None:
        self.results = results
        if sweep_id is not None:
            self.sweep_id = sweep_id
        if results is not None:
            self.progress.setFormat("%v / %m runs")
            self.progress.setRange(0, max(results.plan.total, 1))
            self.progress.setValue(len(results))
        self._draw()

    def _draw(self) -> None:
        res = self.results
        has = res is not None and len(res) > 0
        self.csv_button.setEnabled(has)
        self.md_button.setEnabled(has)
        self.results_view.draw(res, self.sweep_id)

    def chart_points(self) -> list[tuple[str, float, float]]:
        """(arm, prompt tokens, median tok/s) of every point drawn (tests)."""
        return self.results_view.chart_points()

    # ------------------------------------------------------------------ export
    def _ask_export(self, kind: str) -> None:
        if self.results is None:
            return
        suffix, pattern = (".csv", "CSV (*.csv)") if kind == "csv" else (".md", "Markdown (*.md)")
        name = f"strata-sweep{'-' + str(self.sweep_id) if self.sweep_id is not None else ''}{suffix}"
        path, _ = QFileDialog.getSaveFileName(self, "Export the sweep table", str(Path.home() / name), pattern)
        if path:
            self.export(kind, Path(path))

    def export(self, kind: str, path: Path) -> bool:
        if self.results is None:
            return False
        text = self.results.to_csv() if kind == "csv" else self.results.to_markdown()
        try:
            run_files.write_bytes(path, text.encode("utf-8"))
        except OSError as exc:
            self.set_message(f"cannot write {path}: {exc}", error=True)
            return False
        self.set_message(f"wrote {path}")
        return True


class SweepResultsView(QWidget):
    """The sweep's results: the chart (prefill tok/s against prompt tokens, per arm), the table
    beside it (median, ± sd, ratio to the first arm) and the same sweep's command line."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.title = QLabel()
        self.title.setProperty("role", "panel-title")
        self.title.setWordWrap(True)
        self.chart = pg.PlotWidget()
        cp = self.chart.getPlotItem()
        cp.setMenuEnabled(False)
        cp.hideButtons()
        cp.setLabel("bottom", "prompt tokens (log scale)")
        cp.setLabel("left", "prefill tok/s")
        cp.showGrid(x=True, y=True, alpha=0.25)
        cp.getAxis("left").setWidth(64)
        self.legend = cp.addLegend(offset=(10, 10), labelTextSize="9pt")
        self._curves: list[pg.GraphicsObject] = []
        self.chart_note = QLabel("Lines join the medians; bars span the lowest and highest repeat; dots are the "
                                 "single runs. Each repeat prefills a different synthetic prompt (a nonce in its "
                                 "first tokens), so digests differ between repeats by design; the arms of one "
                                 "repeat share it, so their digests must match.")
        self.chart_note.setProperty("role", "hint")
        self.chart_note.setWordWrap(True)
        chart_box = QWidget()
        chart_lay = QVBoxLayout(chart_box)
        chart_lay.setContentsMargins(0, 0, 0, 0)
        chart_lay.addWidget(self.chart, 1)
        chart_lay.addWidget(self.chart_note)

        self.table = QTableWidget(0, len(TABLE_COLUMNS))
        self.table.setHorizontalHeaderLabels(TABLE_COLUMNS)
        self.table.horizontalHeaderItem(len(TABLE_COLUMNS) - 1).setToolTip(
            "yes: the same output bytes (digest) as the first arm on the same prompt; NO: they differ")
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(False)
        # as wide as its columns, so the splitter beside the chart never cuts one (issue 37)
        self.table.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.table.horizontalHeader().sectionResized.connect(lambda *_: self._fit_table_width())
        self.table.setToolTip("Per arm and prompt size: the median prefill tok/s of the repeats, ± sd (their sample "
                              "standard deviation in tok/s, as strata-bench's ± sd), and the ratio of the medians to "
                              "the first arm's: green or red only beyond the repeats' noise (hover a ratio).")

        self.command = QLabel()
        self.command.setWordWrap(True)
        self.command.setTextFormat(Qt.TextFormat.RichText)
        self.command.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.command.setToolTip("The same sweep from the command line (docs/benchmarks.md keeps each figure with "
                                "the command that produced it).")
        table_box = QWidget()
        table_lay = QVBoxLayout(table_box)
        table_lay.setContentsMargins(0, 0, 0, 0)
        table_lay.addWidget(self.table, 1)
        table_lay.addWidget(self.command)
        results = QSplitter(Qt.Orientation.Horizontal)
        results.addWidget(chart_box)
        results.addWidget(table_box)
        results.setSizes([620, 520])
        right_lay = QVBoxLayout(self)
        right_lay.addWidget(self.title)
        right_lay.addWidget(results, 1)

    def _fit_table_width(self) -> None:
        t = self.table
        width = sum(t.horizontalHeader().sectionSize(c) for c in range(t.columnCount()))
        t.setMinimumWidth(width + 2 * t.frameWidth() + t.verticalScrollBar().sizeHint().width() + 2)

    def draw(self, res: SweepResults | None, sweep_id: int | None) -> None:
        cp = self.chart.getPlotItem()
        for c in self._curves:
            cp.removeItem(c)
        self._curves = []
        self.legend.clear()
        if res is None:
            self.title.setText("Prefill tok/s against prompt tokens, per arm")
            self.table.setRowCount(0)
            self.command.setText("")
            return
        plan = res.plan
        model = plan.model if plan.model and not plan.model.startswith("built-in demo") else "demo"
        self.command.setText(f"<span style='color:{MUTED_COLOR}'>From the command line:</span><br>"
                             f"<code>{html.escape(plan.bench_command(model))}</code>")
        sid = f"Sweep #{sweep_id}: " if sweep_id is not None else ""
        self.title.setText(f"{sid}prefill tok/s against prompt tokens · {len(plan.arms)} arm(s) × "
                           f"{len(plan.sizes)} size(s) × {plan.repeats} repeat(s) · {len(res)} of {plan.total} runs")
        for a, arm in enumerate(plan.arms):
            color = QColor(_arm_color(a))
            sizes, med, lo, hi = res.series(a)
            if not sizes:
                continue
            x = np.log2(np.asarray(sizes, dtype=float))
            y = np.asarray(med, dtype=float)
            label = f"{arm.name} ({arm.settings})" if arm.settings else arm.name
            line = pg.PlotDataItem(x, y, pen=pg.mkPen(color, width=2), symbol="o", symbolSize=9,
                                   symbolBrush=pg.mkBrush(color), symbolPen=pg.mkPen("#FFFFFF"), name=label)
            cp.addItem(line)
            err = pg.ErrorBarItem(x=x, y=y, top=np.asarray(hi) - y, bottom=y - np.asarray(lo), beam=0.06,
                                  pen=pg.mkPen(color, width=1.5))
            cp.addItem(err)
            samples = [s for s in res.samples if s.arm == a]
            dots = pg.ScatterPlotItem(x=np.log2([s.prompt_tokens for s in samples]),
                                      y=[s.prefill_tok_s for s in samples], size=6,
                                      brush=pg.mkBrush(color.red(), color.green(), color.blue(), 150),
                                      pen=pg.mkPen(None), symbol="d")
            cp.addItem(dots)
            self._curves += [line, err, dots]
        ticks = [(math.log2(n), format_tokens(n)) for n in plan.sizes]
        cp.getAxis("bottom").setTicks([ticks, []])
        lo_x, hi_x = math.log2(plan.sizes[0]), math.log2(plan.sizes[-1])
        pad = max((hi_x - lo_x) * 0.08, 0.3)
        cp.setXRange(lo_x - pad, hi_x + pad, padding=0)
        ys = [s.prefill_tok_s for s in res.samples]
        cp.setYRange(0, max(ys) * 1.15 if ys else 1.0, padding=0)
        self._fill_table(res)

    def _fill_table(self, res: SweepResults) -> None:
        rows = res.rows()
        base = {r.prompt_tokens: r for r in rows if r.arm == 0}
        t = self.table
        t.setRowCount(len(rows))
        for i, r in enumerate(rows):
            same = {True: "yes", False: "NO", None: "—"}[r.same_output]
            cells = (r.arm_name, format_tokens(r.prompt_tokens), str(r.n), f"{r.median:,.0f}",
                     f"{r.sd:,.0f}" if r.n > 1 else "—", "—" if r.ratio is None else f"{r.ratio:.3f}×",
                     f"{r.decode_median:,.1f}" if r.decode_median else "—", same)
            for j, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if j >= 1:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                if j == 0:
                    item.setForeground(QColor(_arm_color(r.arm)))
                    item.setToolTip(r.settings or "(base settings)")
                if j == 5 and r.ratio is not None and r.arm > 0:
                    within, noise = ratio_noise(r, base.get(r.prompt_tokens))
                    if within is False and abs(r.ratio - 1.0) >= 0.01:  # coloured only beyond the repeats' noise
                        item.setForeground(QColor("#1B7F3B" if r.ratio >= 1.0 else ERROR_COLOR))
                    item.setToolTip("noise unknown: one repeat" if within is None else
                                    f"{'within' if within else 'beyond'} noise (±{noise * 100:.1f}%): the ratios "
                                    "the repeats allow " + ("hold" if within else "exclude") + " 1")
                if j == 7 and r.same_output is False:
                    item.setForeground(QColor(ERROR_COLOR))
                t.setItem(i, j, item)
        t.resizeRowsToContents()
        t.resizeColumnsToContents()
        self._fit_table_width()

    def chart_points(self) -> list[tuple[str, float, float]]:
        """(arm, prompt tokens, median tok/s) of every point drawn (tests)."""
        out = []
        for c in self._curves:
            if isinstance(c, pg.PlotDataItem):
                xs, ys = c.getData()
                out += [(c.name(), float(2 ** x), float(y)) for x, y in zip(xs, ys)]
        return out


def _plan_box(self: SweepView) -> QGroupBox:
    """The plan form's widgets, set on the view (as Qt Designer's setupUi does): sizes, repeats,
    warm-up, decode, the arms table, the base and estimate lines, the errors."""
    plan_box = QGroupBox("Sweep plan")
    form = QFormLayout(plan_box)
    self.sizes = QLineEdit(DEFAULT_SIZES)
    self.sizes.setToolTip(TIPS["sizes"])
    self.repeats = QSpinBox()
    self.repeats.setRange(1, MAX_REPEATS)
    self.repeats.setValue(3)
    self.repeats.setToolTip(TIPS["repeats"])
    self.warmup = QSpinBox()
    self.warmup.setRange(0, 10)
    self.warmup.setValue(1)
    self.warmup.setToolTip(TIPS["warmup"])
    self.decode = QSpinBox()
    self.decode.setRange(0, 4096)
    self.decode.setValue(0)
    self.decode.setToolTip(TIPS["decode"])
    form.addRow("Prompt sizes", self.sizes)
    form.addRow("Repeats", self.repeats)
    form.addRow("Warm-up runs", self.warmup)
    form.addRow("Decode tokens", self.decode)

    self.arms = QTableWidget(0, 2)
    self.arms.setHorizontalHeaderLabels(["arm", "settings over the Run tab's"])
    self.arms.verticalHeader().setVisible(False)
    self.arms.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)
    self.arms.horizontalHeader().setStretchLastSection(True)
    self.arms.setToolTip(TIPS["arms"])
    self.arms.setMinimumHeight(120)
    for name, settings in DEFAULT_ARMS:
        self.add_arm(name, settings)
    add = QPushButton("Add arm")
    add.clicked.connect(lambda: self.add_arm(f"arm {self.arms.rowCount() + 1}", ""))
    remove = QPushButton("Remove arm")
    remove.clicked.connect(self._remove_arm)
    arm_buttons = QHBoxLayout()
    arm_buttons.addWidget(add)
    arm_buttons.addWidget(remove)
    arm_buttons.addStretch(1)
    form.addRow(QLabel("Arms (the first is the baseline)"))
    form.addRow(self.arms)
    form.addRow(arm_buttons)
    self.base = QLabel()
    self.base.setWordWrap(True)
    self.base.setProperty("role", "hint")
    self.base.setTextFormat(Qt.TextFormat.RichText)
    form.addRow(self.base)
    self.estimate = QLabel()
    self.estimate.setWordWrap(True)
    self.estimate.setProperty("role", "hint")
    form.addRow(self.estimate)
    for edit in (self.sizes.textChanged, self.repeats.valueChanged, self.warmup.valueChanged,
                 self.decode.valueChanged, self.arms.cellChanged, self.arms.model().rowsInserted,
                 self.arms.model().rowsRemoved):
        edit.connect(lambda *_: self.plan_changed.emit())
    self.errors = QLabel()
    self.errors.setWordWrap(True)
    self.errors.setProperty("role", "error")
    self.errors.setVisible(False)
    form.addRow(self.errors)
    return plan_box
