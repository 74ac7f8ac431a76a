"""The run summary: the engine's RunReport, as figures, a per-stage table and the busy histogram."""
from __future__ import annotations

import html
import logging
from collections.abc import Sequence

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QGridLayout,
    QHeaderView,
    QLabel,
    QSizePolicy,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.events import RunReport

from ..run.spread_model import Spread, format_spread
from .table_height import fit_height
from .theme import KIND_STYLES, MUTED_COLOR, WARNING_COLOR

log = logging.getLogger(__name__)

FIGURES_MIN_PX = 260
STAGE_COLUMNS = ("stage", "device", "layers", "chunks", "wall\nms", "compute\nms", "wait\nms", "copy\nms", "busy\n%")


def busy_plot(title: str, left_label: str) -> tuple[pg.PlotWidget, pg.PlotItem]:
    """A fixed (no zoom, no menu) plot for a busy histogram: x = stages computing at once."""
    widget = pg.PlotWidget()
    hp = widget.getPlotItem()
    hp.setMenuEnabled(False)
    hp.hideButtons()
    hp.setMouseEnabled(x=False, y=False)
    hp.setTitle(title, size="10pt")
    hp.setLabel("bottom", "stages computing at once")
    hp.setLabel("left", left_label)
    hp.showGrid(y=True, alpha=0.25)
    return widget, hp


def _rate_rows(r: RunReport, repeats: list[RunReport], measure: str) -> list[tuple[str, str]]:
    """Prefill and decode (the repeats' median and spread when there are two or more), how measured."""
    plan = r.plan
    rows = []
    many = len(repeats) >= 2
    if r.cancelled:
        rows.append(("Prefill", f"<b>—</b> (stopped: no prefill rate) · {plan.prompt_tokens:,} tokens planned"))
    elif many:
        pre = Spread.of(x.prefill_tok_s for x in repeats)
        ms = Spread.of(x.prefill_s * 1e3 for x in repeats)
        took = html.escape(format_spread(ms, '{:,.1f}', 'ms'))
        rows.append(("Prefill", f"<b>{html.escape(format_spread(pre, unit='tok/s'))}</b><br>"
                                f"{plan.prompt_tokens:,} tokens in {took}"))
    else:
        rows.append(("Prefill", f"<b>{r.prefill_tok_s:,.0f} tok/s</b> · {plan.prompt_tokens:,} tokens in "
                                f"{r.prefill_s * 1e3:,.1f} ms"))
    steps = max(len(r.generated) - 1, 0)
    if steps and many:
        dec = Spread.of(x.decode_tok_s for x in repeats if x.decode_tok_s)
        rows.append(("Decode", f"<b>{html.escape(format_spread(dec, '{:,.1f}', 'tok/s'))}</b> · {steps} steps"))
    elif steps:
        rows.append(("Decode", f"<b>{r.decode_tok_s:,.1f} tok/s</b> · {steps} steps in {r.decode_s * 1e3:,.1f} ms"))
    else:
        rows.append(("Decode", "no decode steps in this run"))
    if measure:
        rows.append(("Measured", html.escape(measure)))
    return rows


def _run_rows(r: RunReport) -> list[tuple[str, str]]:
    """Chunks, the model's prediction, pipeline, hand-off, executor, kernels, order, digest, notes."""
    plan = r.plan
    rows = []
    if plan.schedule == "balanced" and plan.bounds:
        sizes = [n for _, n in plan.bounds]
        what = f"{plan.n_chunks} balanced chunks, {sizes[0]:,} … {sizes[-1]:,} tokens"
    else:
        what = f"{plan.n_chunks} × {plan.chunk} tokens"
    rows.append(("Chunks", f"{what} ({html.escape(_short(plan.chunk_reason))})"))
    if plan.modelled_s > 0 and not r.cancelled and r.prefill_s > 0:
        rows.append(("Model", f"predicted {plan.modelled_s * 1e3:,.1f} ms, measured {r.prefill_s * 1e3:,.1f} ms "
                              f"({(r.prefill_s / plan.modelled_s - 1) * 100:+.1f}%)"))
    depth = "1 (overlap)" if plan.pipeline_depth == 1 else "0 (join)"
    rows.append(("Pipeline", f"depth {depth}" + (" · prefill on the main device" if plan.prefill_main else "")))
    hops = len(plan.stages) - 1 if not plan.prefill_main else 0
    moved = f" · {hops} hop(s) per chunk, {r.handoff_bytes / 2**20:,.1f} MiB handed off" if hops else ""
    state = getattr(r, "state_handoff_bytes", 0)  # reports saved before the field read as 0
    if plan.prefill_main and state:
        moved += f" · {state / 2**20:,.1f} MiB of KV and recurrent state handed to the stages after prefill"
    groups = f" · interleave:{plan.interleave} ({len(plan.stages)} layer groups)" if plan.interleave > 1 else ""
    cost = (f" · {r.handoff_s * 1e3:,.1f} ms, {r.handoff_gbps:,.2f} GB/s, "
            f"{r.handoff_share * 100:.1f}% of the wall per hop") if hops and r.handoff_s > 0 else ""
    rows.append(("Hand-off", html.escape(handoff_text(r.handoff)) + moved + cost + groups))
    executor = getattr(r, "executor", "threads")
    rows.append(("Executor", "stages as processes (torch.distributed)" if executor == "processes"
                 else "stages as threads of one process"))
    if r.attention:
        rows.append(("Attention", html.escape(r.attention)))
    if getattr(r, "kernels", ""):
        rows.append(("Kernels", html.escape(r.kernels)))
    rows.append(("Order used", f"{html.escape(', '.join(r.device_order))}<br>"
                               f"<span style='color:{MUTED_COLOR}'>{html.escape(r.order_reason)}</span>"))
    rows.append(("Digest", f"<code>{html.escape(r.digest)}</code>"))
    if r.generated:
        gen = ", ".join(str(t) for t in r.generated[:12]) + (" …" if len(r.generated) > 12 else "")
        rows.append(("Generated ids", html.escape(gen)))
    for note in r.notes:
        if note.startswith("fast kernel missing"):  # a slow run the user can fix: not a grey note
            rows.append(("Warning", f"<span style='color:{WARNING_COLOR}'>{html.escape(note)}</span>"))
        else:
            rows.append(("Note", html.escape(note)))
    return rows


class SummaryView(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.report: RunReport | None = None
        title = QLabel("Run summary")
        title.setProperty("role", "panel-title")
        self.figures = QLabel()
        self.figures.setTextFormat(Qt.TextFormat.RichText)
        self.figures.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.figures.setWordWrap(True)
        self.figures.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.figures.setMinimumWidth(FIGURES_MIN_PX)

        self.table = QTableWidget(0, len(STAGE_COLUMNS))
        self.table.setHorizontalHeaderLabels(STAGE_COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(False)
        self.table.horizontalHeader().sectionResized.connect(lambda *_: self._fit_table_width())
        # never a sideways scroll bar: the table asks for its columns' width, and the layout goes to
        # two rows when the three columns do not fit (issue 37: rows hidden behind the bar, values cut)
        self.table.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.table.setToolTip("Per stage, from the engine's timing report (STRATA_PREFILL_TIMING): wall is the "
                              "first start to the last end of its prefill events; busy is compute / wall.")
        self.expert = QLabel()
        self.expert.setWordWrap(True)
        mid = QVBoxLayout()
        stage_title = QLabel("Per stage (prefill)")
        stage_title.setStyleSheet("font-weight: 600")
        mid.addWidget(stage_title)
        mid.addWidget(self.table)
        mid.addWidget(self.expert)
        mid.addStretch(1)

        self.hist, hp = busy_plot("Busy histogram", "share of prefill wall time (%)")
        self.hist.setMinimumWidth(190)
        # its height follows the figures beside it: a plot's own size hint (480 px) would make the
        # summary scroll for nothing
        self.hist.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Ignored)
        self.hist.setToolTip("Share of the prefill's wall time with exactly k stages computing, k = 0…N: "
                             "a full pipeline spends most of its time at k = N.")
        self.bars = pg.BarGraphItem(x=np.zeros(0), height=np.zeros(0), width=0.6,
                                    brush=pg.mkBrush(QColor(KIND_STYLES["compute"].color)), pen=pg.mkPen(None))
        hp.addItem(self.bars)
        self.bar_labels: list[pg.TextItem] = []

        self._mid = QWidget()
        mid.setContentsMargins(0, 0, 0, 0)
        self._mid.setLayout(mid)
        self.body = body = QGridLayout()
        self.narrow: bool | None = None
        self._arrange(narrow=False)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(title)
        lay.addLayout(body, 1)
        self.show_message("No run yet. Press Run to prefill the prompt through the split; "
                          "the engine's report appears here.")

    NARROW_PX = 1000  # below this width: figures and histogram side by side, the stage table under them

    def _fit_table_width(self) -> None:
        """The per-stage table at least as wide as its columns (sized to their contents)."""
        header = self.table.horizontalHeader()
        width = sum(header.sectionSize(c) for c in range(self.table.columnCount()))
        self.table.setMinimumWidth(width + 2 * self.table.frameWidth() + 2)

    def wide_px(self) -> int:
        """The width the three columns need side by side: each one's minimum, and the spacing."""
        gap = max(self.body.horizontalSpacing(), 0)
        return (max(self.figures.minimumWidth(), self.figures.minimumSizeHint().width())
                + self.table.minimumWidth() + self.hist.minimumWidth() + 2 * gap + 8)

    def _arrange(self, narrow: bool) -> None:
        """Three columns on a wide window; two rows on a narrow one (1280 px, 150% scale)."""
        if narrow == self.narrow:
            return
        self.narrow = narrow
        for w in (self.figures, self._mid, self.hist):
            self.body.removeWidget(w)
        for c in range(3):
            self.body.setColumnStretch(c, 0)
        if narrow:
            self.body.addWidget(self.figures, 0, 0)
            self.body.addWidget(self.hist, 0, 1)
            self.body.addWidget(self._mid, 1, 0, 1, 2)
            self.body.setColumnStretch(0, 3)
            self.body.setColumnStretch(1, 2)
            self.hist.setMinimumHeight(200)
        else:
            self.body.addWidget(self.figures, 0, 0)
            self.body.addWidget(self._mid, 0, 1)
            self.body.addWidget(self.hist, 0, 2)
            for c, stretch in enumerate((5, 8, 4)):
                self.body.setColumnStretch(c, stretch)
            self.hist.setMinimumHeight(0)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        self._arrange(event.size().width() < max(self.NARROW_PX, self.wide_px()))
        super().resizeEvent(event)

    # ------------------------------------------------------------------ states
    def show_message(self, text: str) -> None:
        self.report = None
        self.repeats: list[RunReport] = []
        self.figures.setText(f"<p style='color:{MUTED_COLOR}'>{html.escape(text)}</p>")
        self.table.setRowCount(0)
        fit_height(self.table, min_rows=2)
        self.expert.setText("")
        self._set_hist([])

    def show_report(self, r: RunReport, repeats: Sequence[RunReport] = (), measure: str = "") -> None:
        """The report `r` (the run the Gantt shows); with `repeats` (every measured repeat, `r`
        among them) the prefill and decode figures are their median and spread.  `measure` says
        how the runs were measured (warm-up, cold)."""
        self.report = r
        self.repeats = list(repeats)
        rows = _rate_rows(r, self.repeats, measure) + _run_rows(r)
        self.figures.setText("<table cellspacing='0' cellpadding='2'>" + "".join(
            f"<tr><td style='color:{MUTED_COLOR}; padding-right:10px' valign='top'>{k}</td><td>{v}</td></tr>"
            for k, v in rows) + "</table>")
        # as narrow as its longest unbreakable piece (the digest) allows, never narrower: a squeezed
        # rich-text label is cut at the right, not wrapped
        self.figures.setMinimumWidth(max(FIGURES_MIN_PX, self.figures.minimumSizeHint().width()))

        self._fill_stages(r)
        self.expert.setText(expert_text(r.expert_stats))
        self._set_hist(r.busy_histogram)
        self._arrange(self.width() < max(self.NARROW_PX, self.wide_px()))

    def _fill_stages(self, r: RunReport) -> None:
        plan = r.plan
        self.table.setRowCount(len(r.per_stage))
        layers = {s.stage: s for s in plan.stages}
        for i, t in enumerate(r.per_stage):
            sp = layers.get(t.stage)
            busy = 100.0 * t.compute_ns / t.wall_ns if t.wall_ns else 0.0
            cells = (str(t.stage), t.device or (sp.device if sp else ""),
                     f"{sp.first_layer}–{sp.end_layer - 1}" if sp else "", str(t.chunks),
                     f"{t.wall_ns / 1e6:,.1f}", f"{t.compute_ns / 1e6:,.1f}", f"{t.wait_ns / 1e6:,.1f}",
                     f"{t.copy_ns / 1e6:,.1f}", f"{busy:.0f}")
            for j, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if j >= 3:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.table.setItem(i, j, item)
        self._fit_table_width()
        fit_height(self.table)
    def _set_hist(self, shares: list[float]) -> None:
        hp = self.hist.getPlotItem()
        for lab in self.bar_labels:
            hp.removeItem(lab)
        self.bar_labels = []
        x = np.arange(len(shares), dtype=float)
        h = np.asarray(shares, dtype=float) * 100.0
        self.bars.setOpts(x=x, height=h, width=0.6)
        ticks = [(float(k), str(k)) for k in range(len(shares))]
        hp.getAxis("bottom").setTicks([ticks, []])
        for k, v in zip(x, h):
            lab = pg.TextItem(f"{v:.0f}%", color="#202124", anchor=(0.5, 1.0))
            lab.setPos(k, v)
            hp.addItem(lab)
            self.bar_labels.append(lab)
        hp.setXRange(-0.6, max(len(shares) - 0.4, 1.4), padding=0)
        hp.setYRange(0, 112, padding=0)


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def expert_text(stats: list[dict]) -> str:
    """The expert cache per stage (engine.models.experts.ExpertStats.as_dict), or that nothing streamed."""
    streamed = [st for st in stats if st.get("misses") or st.get("bytes_pinned") or st.get("bytes_pageable")]
    if not streamed:
        resident = stats and all(st.get("resident") for st in stats)
        return "<b>Expert cache:</b> no expert streaming in this run" + \
            (" (every expert resident on its stage)" if resident else "")
    lines = []
    for st in stats:
        moved = st.get("bytes_pinned", 0) + st.get("bytes_pageable", 0)
        hits, misses = st.get("hits", 0), st.get("misses", 0)
        rate = hits / (hits + misses) * 100 if hits + misses else 0.0
        lines.append(f"stage {st.get('stage', '?')} ({st.get('device', '')}): {st.get('slots', 0)} slots, "
                     f"{hits:,} hits / {misses:,} misses ({rate:.0f}% hit), {_bytes(moved)} streamed"
                     + (f" at {st.get('gbs', 0.0):,.1f} GB/s" if moved else "")
                     + (f" ({_bytes(st.get('bytes_pageable', 0))} pageable)" if st.get("bytes_pageable") else ""))
    return "<b>Expert cache</b><br>" + "<br>".join(html.escape(x) for x in lines)


HANDOFF_MEANING = {
    "peer": "GPU to GPU directly (peer access)",
    "host": "host-staged: device → pinned host buffer → device (no peer access between these devices, "
            "as under WDDM)",
    "same-device": "none needed (the stages share a device)",
}


def handoff_text(kind: str) -> str:
    """The hand-off kind the engine chose, with what it means ("host,peer": per stage pair)."""
    parts = [k.strip() for k in kind.split(",") if k.strip()]
    if len(parts) == 1 and parts[0] in HANDOFF_MEANING:
        return f"{parts[0]}: {HANDOFF_MEANING[parts[0]]}"
    if parts and all(k in HANDOFF_MEANING for k in parts):
        return f"{kind} (per stage pair; host = host-staged through pinned memory, peer = direct)"
    return kind


def _short(reason: str, limit: int = 110) -> str:
    return reason if len(reason) <= limit else reason[: limit - 1] + "…"
