"""The Compare tab: a before and an after run, their Gantts stacked on ONE time axis (each aligned
at its run's start), the figures side by side with after/before ratios, both busy histograms as
grouped bars, and exactly the settings that differ.  The arithmetic is `compare.py`'s, the noise
too: a ratio is green or red only when it lies beyond the spread of the runs' repeats (or of the
history's runs with the same settings); inside it, or with no spread known, it is shown neutral
and says why."""
from __future__ import annotations

import html
import logging

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from ..history.compare_model import Comparison, MetricRow, SampleSet, compare, format_ratio, gather_samples, unchanged
from ..history.history_model import RunHistory
from ..run.record_model import RunRecord, describe
from .gantt_view import stacked_pair
from .summary_view import busy_plot
from .theme import ERROR_COLOR, MUTED_COLOR

log = logging.getLogger(__name__)

BEFORE_COLOR = "#8A9BB0"
AFTER_COLOR = "#0072B2"
GOOD_COLOR = "#1B7F3B"
CHOICE_LIMIT = 500
NO_SAMPLES = SampleSet()  # the run alone (frozen: safe as a default)


def _values_below_only(axis) -> None:
    """One time axis, read under the lower chart: the upper's unlabelled axis had shown seconds
    (pyqtgraph scales to ms only with the label shown) above the lower's ms."""
    axis.showLabel(False)
    axis.setStyle(showValues=False)


def _cap_column(t: QTableWidget, col: int, max_px: int) -> None:
    """A column as wide as its texts, up to max_px (longer texts wrap): at 1280 px and 150% scale
    the figures' longest name had widened the window past the screen (issue 37)."""
    t.resizeColumnToContents(col)
    t.setColumnWidth(col, min(t.columnWidth(col), max_px))
    t.resizeRowsToContents()


def _item(text: str, right: bool = False, color: str | None = None, bold: bool = False) -> QTableWidgetItem:
    item = QTableWidgetItem(text)
    if right:
        item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
    if color:
        item.setForeground(QColor(color))
    if bold:
        f = item.font()
        f.setBold(True)
        item.setFont(f)
    return item


def _num(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    if unit == "tok/s":
        return f"{v:,.0f}" if v >= 100 else f"{v:,.1f}"
    return f"{v:,.1f}"


class CompareView(QWidget):
    def __init__(self, history: RunHistory | None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.history = history
        self.comparison: Comparison | None = None
        self.ids: tuple[int | None, int | None] = (None, None)
        self._build()
        self.refresh_choices()
        self.clear("Pick a before and an after run above, or select two runs in the History tab and press "
                   "Compare.")

    # ------------------------------------------------------------------ layout
    def _build(self) -> None:
        self.before_box = QComboBox()
        self.after_box = QComboBox()
        for box in (self.before_box, self.after_box):
            box.setMinimumWidth(420)
            box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            box.activated.connect(self._on_choice)
        swap = QPushButton("Swap")
        swap.setToolTip("Exchange before and after.")
        swap.clicked.connect(self.swap)
        top = QHBoxLayout()
        top.addWidget(self._swatch(BEFORE_COLOR, "Before"))
        top.addWidget(self.before_box, 1)
        top.addSpacing(12)
        top.addWidget(self._swatch(AFTER_COLOR, "After"))
        top.addWidget(self.after_box, 1)
        top.addWidget(swap)

        self.headline = QLabel()
        self.headline.setTextFormat(Qt.TextFormat.RichText)
        self.headline.setWordWrap(True)
        self.headline.setStyleSheet("font-size: 11pt; padding: 2px 0 4px 0;")

        self.gantt_before, self.gantt_after, gantts = stacked_pair("Before", "After", self.fit)
        for g in (self.gantt_before, self.gantt_after):
            g.fit_button.setToolTip("Show both runs whole, on the shared time axis.")
        _values_below_only(self.gantt_before.plot.getPlotItem().getAxis("bottom"))

        bottom = _bottom(self)
        body = QSplitter(Qt.Orientation.Vertical)
        body.addWidget(gantts)
        body.addWidget(bottom)
        body.setStretchFactor(0, 1)
        body.setStretchFactor(1, 1)
        body.setSizes([480, 420])  # proportions: a short window keeps the figures readable

        lay = QVBoxLayout(self)
        lay.addLayout(top)
        lay.addWidget(self.headline)
        lay.addWidget(body, 1)

    @staticmethod
    def _swatch(color: str, text: str) -> QLabel:
        lab = QLabel(f"<span style='color:{color}; font-size:14pt'>■</span> <b>{text}</b>")
        return lab

    @staticmethod
    def _titled(title: str, w: QWidget) -> QWidget:
        box = QWidget()
        lay = QVBoxLayout(box)
        lay.setContentsMargins(4, 4, 4, 4)
        lab = QLabel(title)
        lab.setStyleSheet("font-weight: 600")
        lay.addWidget(lab)
        lay.addWidget(w, 1)
        return box

    NOISE_MIN_PX = 130  # "within noise ±362%" on two lines at most
    FIGURE_MAX_PX = 210  # a longer figure name ("busy: 1 stage(s) computing (% of wall)") wraps to two lines

    def _fit_metrics_width(self) -> None:
        t = self.metrics
        head = t.horizontalHeader()
        width = sum(head.sectionSize(c) for c in range(t.columnCount() - 1)) + self.NOISE_MIN_PX
        t.setMinimumWidth(width + 2 * t.frameWidth() + t.verticalScrollBar().sizeHint().width() + 2)
        QTimer.singleShot(0, t.resizeRowsToContents)  # the noise column's wrap follows its width (after layout)

    @staticmethod
    def _table_setup(t: QTableWidget) -> None:
        t.verticalHeader().setVisible(False)
        t.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        t.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        t.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        t.horizontalHeader().setStretchLastSection(True)
        t.setWordWrap(False)

    # ------------------------------------------------------------------ choices
    def refresh_choices(self) -> None:
        """The runs to pick from (newest first), keeping the current pair."""
        rows = []
        if self.history is not None:
            try:
                rows = self.history.list_runs(limit=CHOICE_LIMIT)
            except Exception:
                log.exception("listing runs for compare failed")
        for box, current in ((self.before_box, self.ids[0]), (self.after_box, self.ids[1])):
            box.blockSignals(True)
            box.clear()
            box.addItem("— pick a run —", None)
            for r in rows:
                box.addItem(r.title(), r.id)
            if current is not None and box.findData(current) < 0 and self.history is not None:
                row = self.history.row(current)
                if row is not None:
                    box.addItem(row.title(), row.id)
                elif self.comparison is not None:
                    gone = current
                    self.ids = (None, None)
                    self.clear(f"Run #{gone} was deleted from the history.")
            box.setCurrentIndex(max(box.findData(current), 0) if current is not None else 0)
            box.blockSignals(False)
        if self.history is None:
            self.before_box.setEnabled(False)
            self.after_box.setEnabled(False)

    def _on_choice(self, *args: object) -> None:
        a, b = self.before_box.currentData(), self.after_box.currentData()
        if a is not None and b is not None:
            self.set_pair(int(a), int(b))
        else:
            self.ids = (a, b)

    def swap(self) -> None:
        a, b = self.ids
        if a is not None and b is not None:
            self.set_pair(b, a)

    def set_pair(self, before: int, after: int) -> bool:
        """Compare two runs of the history; False (with a message) when one cannot be read."""
        if self.history is None:
            return False
        try:
            a, b = self.history.get(before), self.history.get(after)
        except Exception as exc:
            log.exception("loading runs %s and %s failed", before, after)
            self.clear(f"Cannot load the runs: {exc}", error=True)
            return False
        self.ids = (before, after)
        for box, run in ((self.before_box, before), (self.after_box, after)):
            i = box.findData(run)
            if i < 0:
                self.refresh_choices()
                i = box.findData(run)
            box.setCurrentIndex(max(i, 0))
        self.set_records(a, b, f"#{before}", f"#{after}", gather_samples(self.history, before, a),
                         gather_samples(self.history, after, b))
        return True

    # ------------------------------------------------------------------ showing
    def clear(self, text: str, error: bool = False) -> None:
        self.comparison = None
        color = ERROR_COLOR if error else MUTED_COLOR
        self.headline.setText(f"<span style='color:{color}'>{html.escape(text)}</span>")
        for g in (self.gantt_before, self.gantt_after):
            g.reset("", 0, [])
            g.set_empty_text("no run picked")
        self.metrics.setRowCount(0)
        self.diff.setRowCount(0)
        self.same.setText("")
        self._set_hist([], [])

    def set_records(self, before: RunRecord, after: RunRecord, before_name: str = "", after_name: str = "",
                    before_samples: SampleSet = NO_SAMPLES, after_samples: SampleSet = NO_SAMPLES) -> None:
        c = self.comparison = compare(before, after, before_samples, after_samples)
        self.gantt_before.set_title(f"Before {before_name} · {describe(before)}".replace("  ", " "))
        self.gantt_after.set_title(f"After {after_name} · {describe(after)}".replace("  ", " "))
        self.gantt_before.show_run(before.report.run_id, before.origin_ns, before.stages, before.events,
                                  before.report.plan.interleave)
        self.gantt_after.show_run(after.report.run_id, after.origin_ns, after.stages, after.events,
                                 after.report.plan.interleave)
        self.fit()
        self._show_headline(c)
        self._show_metrics(c)
        self._show_diff(c)
        self._set_hist(before.report.busy_histogram, after.report.busy_histogram)

    def fit(self) -> None:
        """Both runs whole on the shared axis: 0 (each run's start) to the longer run's end."""
        ends = []
        for g in (self.gantt_before, self.gantt_after):
            a, b = g.store.span_ns()
            ends.append((b - g.store.origin_ns) / 1e9)
        x1 = max(max(ends, default=0.0), 1e-6)
        self.gantt_before.vb.setXRange(0.0, x1 * 1.02, padding=0)
        for g in (self.gantt_before, self.gantt_after):
            g.redraw()

    def shared_x_range(self) -> tuple[tuple[float, float], tuple[float, float]]:
        return (tuple(self.gantt_before.vb.viewRange()[0]), tuple(self.gantt_after.vb.viewRange()[0]))

    @staticmethod
    def _ratio_html(m: MetricRow) -> str:
        verdict = m.verdict
        color = GOOD_COLOR if verdict == "better" else ERROR_COLOR if verdict == "worse" else None
        ratio = html.escape(format_ratio(m.ratio))
        return f"<b style='color:{color}'>{ratio}</b>" if color else ratio

    @staticmethod
    def _sample_text(name: str, samples: SampleSet) -> str:
        if samples.source == "repeats":
            return f"{name}: median of {samples.n} repeats"
        if samples.source == "same settings":
            return f"{name}: noise from {samples.n} runs with the same settings"
        return f"{name}: one run"

    def _show_headline(self, c: Comparison) -> None:
        pre = c.metric("prefill tok/s")
        r = pre.ratio
        if r is None:
            head = "Prefill: no figure to compare (a stopped run has no prefill rate)."
        else:
            head = (f"Prefill {self._ratio_html(pre)} "
                    f"({_num(pre.before, 'tok/s')} → {_num(pre.after, 'tok/s')} tok/s) "
                    f"<span style='color:{MUTED_COLOR}'>{html.escape(pre.judgement)}</span>")
        dec = c.metric("decode tok/s")
        if dec.ratio is not None:
            head += f" · decode {self._ratio_html(dec)} <span style='color:{MUTED_COLOR}'>" \
                    f"{html.escape(dec.judgement)}</span>"
        same = c.same_output
        if same is True:
            head += f" · outputs byte-identical (digest {html.escape(c.after.report.digest[:12])})"
        elif same is False:
            head += f" · <b style='color:{ERROR_COLOR}'>outputs differ</b> (digests " \
                    f"{html.escape(c.before.report.digest[:12])} vs {html.escape(c.after.report.digest[:12])})"
        cold = [name for name, is_cold in zip(("before", "after"), c.cold) if is_cold]
        if cold:
            head += f"<br><b style='color:{ERROR_COLOR}'>Cold run: {' and '.join(cold)}</b> " \
                    f"(no warm-up, first run of its shape: includes one-off set-up)"
        changed = ", ".join(d.setting for d in c.diff[:6]) or "no setting differs"
        measured = "; ".join((self._sample_text("before", c.before_samples),
                              self._sample_text("after", c.after_samples)))
        head += f"<br><span style='color:{MUTED_COLOR}'>Changed: {html.escape(changed)}. {html.escape(measured)}. " \
                f"Both timelines start at their run's first event, on one time axis.</span>"
        self.headline.setText(head)

    def _show_metrics(self, c: Comparison) -> None:
        t = self.metrics
        t.setRowCount(len(c.metrics))
        for i, m in enumerate(c.metrics):
            unit = f" ({m.unit})" if m.unit and m.unit != m.name.split()[-1] else ""
            verdict = m.verdict
            color = GOOD_COLOR if verdict == "better" else ERROR_COLOR if verdict == "worse" else None
            t.setItem(i, 0, _item(m.name + unit, bold=m.name == "prefill tok/s"))
            t.setItem(i, 1, _item(_num(m.before, m.unit), right=True))
            t.setItem(i, 2, _item(_num(m.after, m.unit), right=True))
            t.setItem(i, 3, _item(format_ratio(m.ratio), right=True, color=color, bold=bool(verdict)))
            note = _item(m.short_judgement, color=MUTED_COLOR)  # the whole sentence is the tooltip
            note.setToolTip(m.judgement)
            t.setItem(i, 4, note)
        _cap_column(t, 0, self.FIGURE_MAX_PX)

    def _show_diff(self, c: Comparison) -> None:
        same = unchanged(c.before.config, c.after.config)
        self.same.setText(f"Identical in both: {', '.join(same)}." if same else "")
        t = self.diff
        rows = c.diff or []
        t.setRowCount(max(len(rows), 1))
        if not rows:
            t.setItem(0, 0, _item("no setting differs", color=MUTED_COLOR))
            t.setItem(0, 1, _item(""))
            t.setItem(0, 2, _item(""))
            return
        for i, d in enumerate(rows):
            t.setItem(i, 0, _item(d.setting, bold=True))
            for j, text in ((1, d.before), (2, d.after)):
                item = _item(text if len(text) <= 70 else text[:69] + "…")
                item.setToolTip(text)
                t.setItem(i, j, item)
        t.resizeRowsToContents()

    def _set_hist(self, before: list[float], after: list[float]) -> None:
        hp = self.hist.getPlotItem()
        for lab in self.bar_labels:
            hp.removeItem(lab)
        self.bar_labels = []
        n = max(len(before), len(after))
        xb = np.arange(len(before), dtype=float) - 0.19
        xa = np.arange(len(after), dtype=float) + 0.19
        hb = np.asarray(before, dtype=float) * 100
        ha = np.asarray(after, dtype=float) * 100
        self.bars_before.setOpts(x=xb, height=hb, width=0.36)
        self.bars_after.setOpts(x=xa, height=ha, width=0.36)
        for xs, hs in ((xb, hb), (xa, ha)):
            for x, h in zip(xs, hs):
                lab = pg.TextItem(f"{h:.0f}%", color="#202124", anchor=(0.5, 1.0))
                lab.setPos(float(x), float(h))
                hp.addItem(lab)
                self.bar_labels.append(lab)
        hp.getAxis("bottom").setTicks([[(float(k), str(k)) for k in range(n)], []])
        hp.setXRange(-0.6, max(n - 0.4, 1.4), padding=0)
        hp.setYRange(0, 115, padding=0)

    def bar_heights(self) -> tuple[list[float], list[float]]:
        """(before, after) heights in % as drawn (tests)."""
        return (list(self.bars_before.opts["height"]), list(self.bars_after.opts["height"]))


def _bottom(self: CompareView) -> QSplitter:
    """The figures table, the busy histograms and what changed, set on the view (as Qt Designer's
    setupUi does); their splitter."""
    self.metrics = QTableWidget(0, 5)
    self.metrics.setHorizontalHeaderLabels(["figure", "before", "after", "after / before", "noise"])
    self._table_setup(self.metrics)
    # the noise column takes the width left and wraps its few words there: never cut, no sideways scroll
    self.metrics.horizontalHeader().setSectionResizeMode(4, QHeaderView.ResizeMode.Stretch)
    self.metrics.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Interactive)  # _show_metrics
    self.metrics.setWordWrap(True)
    # at least its figures' columns and a readable noise column: the splitter never squeezes them
    self.metrics.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    self.metrics.horizontalHeader().sectionResized.connect(lambda *_: self._fit_metrics_width())
    self.metrics.setToolTip("Ratios are after / before; green where the after run is better, red where worse, "
                            "only beyond the noise: the spread of the runs' repeats, or of the history's runs "
                            "with the same settings. Within the noise, or with no spread known, a ratio is "
                            "neutral; a figure no changed setting can affect is flagged.")

    self.hist, hp = busy_plot("share of prefill wall time", "% of prefill wall time")  # under "Busy histograms"
    self.hist.setMinimumWidth(280)  # its bars and labels readable beside the wide figures table
    self.hist_legend = hp.addLegend(offset=(10, 5), labelTextSize="9pt")
    self.bars_before = pg.BarGraphItem(x=np.zeros(0), height=np.zeros(0), width=0.36,
                                       brush=pg.mkBrush(BEFORE_COLOR), pen=pg.mkPen(None), name="before")
    self.bars_after = pg.BarGraphItem(x=np.zeros(0), height=np.zeros(0), width=0.36,
                                      brush=pg.mkBrush(AFTER_COLOR), pen=pg.mkPen(None), name="after")
    hp.addItem(self.bars_before)
    hp.addItem(self.bars_after)
    self.bar_labels: list[pg.TextItem] = []

    self.diff = QTableWidget(0, 3)
    self.diff.setHorizontalHeaderLabels(["setting", "before", "after"])
    self._table_setup(self.diff)
    self.diff.setToolTip("Exactly the settings that differ between the two runs, then what the engine "
                         "resolved differently (chunk size, layer ranges, hand-off).")

    bottom = QSplitter(Qt.Orientation.Horizontal)
    bottom.addWidget(self._titled("Figures side by side", self.metrics))
    bottom.addWidget(self._titled("Busy histograms", self.hist))
    self.same = QLabel()
    self.same.setWordWrap(True)
    self.same.setProperty("role", "hint")
    changed = QWidget()
    changed_lay = QVBoxLayout(changed)
    changed_lay.setContentsMargins(0, 0, 0, 0)
    changed_lay.addWidget(self.diff, 1)
    changed_lay.addWidget(self.same)
    bottom.addWidget(self._titled("What changed", changed))
    bottom.setSizes([560, 420, 520])
    return bottom
