"""The live Gantt: a row per stage, compute blocks C0…Cn, wait / copy / stream / decode.

Drawing is batched: ONE pyqtgraph item per kind (one pen, one brush, `drawRects`), never one
per block.  Only the visible time range is handed to those items: every X-range change (zoom,
pan, the live edge moving) asks the `EventStore` for the blocks in view, merges neighbours that
are less than a pixel apart, and replaces the items' rectangles.  Chunk labels are painted by one
more item, only for blocks wide enough to hold them.  Hover a block for its times and tokens.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QColor, QCursor, QFont, QPainter, QPainterPath, QPaintEvent, QPen, QStaticText
from PySide6.QtWidgets import (
    QCheckBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from engine.events import StageEvent

from ..run.gantt_model import Block, EventStore
from .theme import KIND_STYLES, MUTED_COLOR

log = logging.getLogger(__name__)

# (offset of the top edge from the row centre, height) in rows; the Y axis points down
LANES: dict[str, tuple[float, float]] = {
    "wait": (-0.20, 0.22),
    "copy": (-0.34, 0.50),
    "compute": (-0.34, 0.50),
    "decode": (-0.34, 0.50),
    "stream": (0.22, 0.14),
}
DRAW_ORDER = ("wait", "copy", "compute", "decode", "stream")
HOVER_ORDER = ("compute", "decode", "copy", "wait", "stream")
MERGE_ABOVE = 600  # a lane with more visible blocks than this is merged at pixel resolution
LABEL_MAX = 400  # label candidates per redraw at most
HOVER_PX = 3

WAIT_MEANING = {
    "reap": "reap: waiting for the successor's previous job before handing this chunk over",
    "join": "join (depth 0): waiting until the successor's run of this chunk returned",
    "finish": "finish guard: draining the split at the end of the prefill",
    "idle": "GPU idle before this chunk: its input had not arrived, the successor's input buffer was "
            "still busy, or the host had not launched it yet",
}


class _BlockItem(pg.BarGraphItem):
    """A BarGraphItem whose hit shape is its bounding box: pyqtgraph's hover handling would
    otherwise build a QPainterPath of every rectangle on each mouse move (hit tests are done
    against the EventStore instead)."""

    def shape(self) -> QPainterPath:
        path = QPainterPath()
        path.addRect(self.boundingRect())
        return path


class _PlotWidget(pg.PlotWidget):
    """A PlotWidget that says when a frame has been painted (latency measurements, tests)."""

    painted = Signal()

    def paintEvent(self, ev: QPaintEvent) -> None:
        super().paintEvent(ev)
        self.painted.emit()


class _GridLayer(pg.GraphicsObject):
    """Vertical lines at the time axis' ticks, opaque and cosmetic, behind the blocks.  (The axis'
    own alpha-blended grid cost about 12 ms per paint at 1600 px; this costs well under 1 ms.)"""

    def __init__(self, axis: pg.AxisItem, vb: pg.ViewBox) -> None:
        super().__init__()
        self.axis, self.vb = axis, vb
        self.pens = (QPen(QColor("#D5D9DE"), 0), QPen(QColor("#ECEEF1"), 0))
        self.setZValue(-10)

    def boundingRect(self) -> QRectF:
        (x0, x1), (y0, y1) = self.vb.viewRange()
        return QRectF(x0, y0, x1 - x0, y1 - y0)

    def refresh(self) -> None:
        self.prepareGeometryChange()
        self.update()

    def paint(self, p: QPainter, *args: object) -> None:
        (x0, x1), (y0, y1) = self.vb.viewRange()
        width = self.vb.boundingRect().width()
        if width <= 0 or x1 <= x0:
            return
        levels = self.axis.tickValues(x0, x1, width)[:2]
        tr = p.transform()
        p.save()
        p.resetTransform()
        top, bottom = tr.map(QPointF(x0, y0)).y(), tr.map(QPointF(x0, y1)).y()
        seen: set[float] = set()
        for pen, (_, values) in zip(self.pens, levels):
            p.setPen(pen)
            for v in values:
                if v in seen:
                    continue
                seen.add(v)
                x = tr.map(QPointF(v, y0)).x()
                p.drawLine(QPointF(x, top), QPointF(x, bottom))
        p.restore()


class _LabelLayer(pg.GraphicsObject):
    """Paints 'C3'-style labels centred in blocks that are wide enough, in device pixels."""

    def __init__(self) -> None:
        super().__init__()
        self._rects: list[QRectF] = []
        self._texts: list[str] = []
        self._bounds = QRectF()
        self._font = QFont()
        self._font.setPointSizeF(8.0)
        self._static: dict[str, QStaticText] = {}  # laid out once per text, drawn many times
        self.setZValue(10)

    def set_labels(self, rects: list[QRectF], texts: list[str]) -> None:
        self.prepareGeometryChange()
        self._rects, self._texts = rects, texts
        bounds = QRectF()
        for r in rects:
            bounds = bounds.united(r)
        self._bounds = bounds
        self.update()

    @property
    def count(self) -> int:
        return len(self._texts)

    def boundingRect(self) -> QRectF:
        return self._bounds

    def paint(self, p: QPainter, *args: object) -> None:
        if not self._rects:
            return
        tr = p.transform()
        p.save()
        p.resetTransform()
        p.setFont(self._font)
        p.setPen(QColor("#FFFFFF"))
        for rect, text in zip(self._rects, self._texts):
            st = self._static.get(text)
            if st is None:
                st = self._static[text] = QStaticText(text)
                st.prepare(font=self._font)
            size = st.size()
            dev = tr.mapRect(rect)
            if dev.width() >= size.width() + 4 and dev.height() >= size.height():
                p.drawStaticText(QPointF(dev.center().x() - size.width() / 2, dev.center().y() - size.height() / 2), st)
        p.restore()


class GanttView(QWidget):
    """The Gantt panel: title, legend, controls and the plot."""

    def __init__(self, store: EventStore | None = None, parent: QWidget | None = None,
                 title: str = "Pipeline timeline: prompt chunks C0…Cn per stage", live: bool = True) -> None:
        """`live`: a run's timeline as it happens (with "Follow live edge"); otherwise a stored run's."""
        super().__init__(parent)
        self.store = store or EventStore()
        self._title_text = title
        self._live = live
        self._n_rows = 0
        self._drawn: dict[str, int] = {k: 0 for k in DRAW_ORDER}
        self._follow_width: float | None = None  # None: keep the whole run in view
        self.redraws = 0
        self._build()

    # ------------------------------------------------------------------ layout
    def _build(self) -> None:
        self.title = title = QLabel(self._title_text)
        title.setProperty("role", "panel-title")
        title.setTextFormat(Qt.TextFormat.PlainText)
        self.follow = QCheckBox("Follow live edge")
        self.follow.setChecked(True)
        self.follow.setToolTip("Keep the newest blocks in view while a run is going; zooming or panning turns it off.")
        self.follow.toggled.connect(self._on_follow_toggled)
        self.fit_button = fit = QPushButton("Fit all")
        fit.setToolTip("Show the whole run.")
        fit.clicked.connect(self.fit)
        head = QHBoxLayout()
        head.addWidget(title, 1)
        self.hint = hint = QLabel("wheel: zoom · drag: pan · hover: details")
        hint.setProperty("role", "hint")
        head.addWidget(hint)
        head.addWidget(self.follow)
        head.addWidget(fit)
        self.follow.setVisible(self._live)
        if not self._live:
            self.follow.setChecked(False)

        self.legend = QWidget()
        legend = QHBoxLayout(self.legend)
        legend.setContentsMargins(0, 0, 0, 0)
        legend.setSpacing(14)
        for kind in DRAW_ORDER:
            st = KIND_STYLES[kind]
            lab = QLabel(f"<span style='color:{st.color}; font-size:14pt'>■</span> {st.label}")
            lab.setToolTip(st.meaning)
            legend.addWidget(lab)
        legend.addStretch(1)
        # narrow windows (1280 px, or 150% scale) clip the legend and the hint instead of widening the window
        for w in (title, self.legend):
            w.setSizePolicy(QSizePolicy.Policy.Ignored, w.sizePolicy().verticalPolicy())

        self.plot = _PlotWidget()
        self.plot.setMinimumHeight(160 if self._live else 100)  # Compare stacks two
        pi = self.plot.getPlotItem()
        pi.setMenuEnabled(False)
        pi.hideButtons()
        pi.setLabel("bottom", "time since the run started", units="s")
        self.vb = pi.getViewBox()
        self.vb.invertY(True)
        self.vb.setMouseEnabled(x=True, y=False)
        self.vb.enableAutoRange(enable=False)
        self.vb.setLimits(minXRange=1e-6)
        left = pi.getAxis("left")
        left.setWidth(118)
        left.setStyle(tickLength=0)
        self.items: dict[str, _BlockItem] = {}
        for kind in DRAW_ORDER:
            color = QColor(KIND_STYLES[kind].color)
            pen = pg.mkPen(QColor("#FFFFFF"), width=1) if kind in ("compute", "decode") else pg.mkPen(None)
            item = _BlockItem(x0=np.zeros(0), width=np.zeros(0), y0=np.zeros(0), height=np.zeros(0),
                              pen=pen, brush=pg.mkBrush(color))
            self.items[kind] = item
            pi.addItem(item)
        self.labels = _LabelLayer()
        pi.addItem(self.labels)
        self.grid = _GridLayer(pi.getAxis("bottom"), self.vb)
        pi.addItem(self.grid)
        self.empty_text = pg.TextItem("Press Run: each stage gets a row, each chunk a block.",
                                      color=MUTED_COLOR, anchor=(0.5, 0.5))
        pi.addItem(self.empty_text)
        self.vb.sigXRangeChanged.connect(self._on_range_changed)
        self.vb.sigResized.connect(self._on_range_changed)
        self.vb.sigRangeChangedManually.connect(self._on_manual_range)
        self.plot.scene().sigMouseMoved.connect(self._on_mouse_moved)

        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(head)
        lay.addWidget(self.legend)
        lay.addWidget(self.plot, 1)
        self.set_rows([])
        self.vb.setXRange(0, 1, padding=0)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        """The hint goes first when the heading's row is too narrow: the title is never cut for it
        (issue 37: "Pipeline timeline: prompt chunks C0." at 1280 px); the hint moves to the tooltip."""
        title_px = self.title.fontMetrics().horizontalAdvance(self.title.text()) + 12
        others = sum(w.sizeHint().width() + 8 for w in (self.follow, self.fit_button) if not w.isHidden())
        room = event.size().width() - title_px - others
        show = room >= self.hint.sizeHint().width() + 8
        self.hint.setVisible(show)
        self.title.setToolTip("" if show else self.hint.text())
        super().resizeEvent(event)

    # -------------------------------------------------------------------- data
    def reset(self, run_id: str, origin_ns: int, stages: Sequence[tuple[int, str, int, int]],
              interleave: int = 1) -> None:
        """A new run: (stage, device, first_layer, end_layer) per stage; interleaved layer
        groups (V > 1) share their device's row and are labelled C<k>·g<j>."""
        self.store.reset(run_id, origin_ns, stages, interleave)
        self._follow_width = None
        self.set_rows(stages)
        self.follow.setChecked(self._live)
        self._set_x(0.0, 1.0)

    def show_run(self, run_id: str, origin_ns: int, stages: Sequence[tuple[int, str, int, int]],
                 events: Sequence[StageEvent], interleave: int = 1) -> None:
        """A stored run, whole: its rows, its events, all of it in view."""
        self.reset("", origin_ns, stages, interleave)  # "": keep every event, whatever run id it carries
        if not self._live:
            self.follow.setChecked(False)
        self.store.add(events)
        self.store.run_id = run_id
        self.empty_text.setVisible(not events)
        self.fit()

    def set_title(self, text: str) -> None:
        self.title.setText(text)

    def set_empty_text(self, text: str) -> None:
        self.empty_text.setText(text)

    def set_rows(self, stages: Sequence[tuple[int, str, int, int]]) -> None:
        store = self.store
        if store.interleave > 1 and stages:
            self._n_rows = store.n_rows
            ticks = [(r, f"{stages[r][1]}\ngroups " + ", ".join(f"g{s}" for s, *_ in stages if s % store.n_rows == r))
                     for r in range(store.n_rows)]
        else:
            self._n_rows = max(len(stages), 1)
            ticks = [(s, f"stage {s} · {dev}" + (f"\nlayers {a}–{b - 1}" if b > a else ""))
                     for s, dev, a, b in stages]
        self.plot.getPlotItem().getAxis("left").setTicks([ticks, []])
        self.vb.setLimits(yMin=-0.6, yMax=self._n_rows - 0.4)
        self.vb.setYRange(-0.5, self._n_rows - 0.5, padding=0)
        self.empty_text.setPos(0.5, (self._n_rows - 1) / 2)
        self.empty_text.setVisible(len(stages) == 0)

    def add_events(self, events: list[StageEvent]) -> int:
        """One coalesced batch from the run worker."""
        added = self.store.add(events)
        if added:
            self.empty_text.setVisible(False)
            if self.follow.isChecked():
                self._follow_edge()
            else:
                self.redraw()
        return added

    def finish(self) -> None:
        """The run ended: show all of it when following."""
        if self.follow.isChecked():
            self.fit()
        else:
            self.redraw()

    # ----------------------------------------------------------------- viewing
    def seconds(self, t_ns: np.ndarray | int) -> np.ndarray | float:
        return (np.asarray(t_ns, dtype=np.float64) - self.store.origin_ns) / 1e9

    def fit(self) -> None:
        a, b = self.store.span_ns()
        x0, x1 = float(self.seconds(min(a, self.store.origin_ns))), float(self.seconds(b))
        if x1 <= x0:
            x1 = x0 + 1.0
        self._set_x(x0, x1 + (x1 - x0) * 0.02)

    def _set_x(self, x0: float, x1: float) -> None:
        """Set the X range and make sure the items show it (a range change redraws through
        sigXRangeChanged; an unchanged range redraws here, for the new data)."""
        before = self.redraws
        self.vb.setXRange(x0, x1, padding=0)
        if self.redraws == before:
            self.redraw()

    def _follow_edge(self) -> None:
        """Move the view so the newest block is in view (and redraw)."""
        edge = float(self.seconds(self.store.end_ns))
        if self._follow_width is None:
            x1 = max(edge * 1.05, 1e-3)
            self._set_x(min(0.0, float(self.seconds(self.store.span_ns()[0]))), x1)
            return
        w = self._follow_width
        x1 = max(edge + 0.05 * w, w)
        self._set_x(x1 - w, x1)

    def _on_follow_toggled(self, on: bool) -> None:
        if not on:
            return
        (x0, x1), _ = self.vb.viewRange()
        edge = float(self.seconds(self.store.end_ns))
        self._follow_width = (x1 - x0) if (x1 - x0) < edge else None
        if self.store.count():
            self._follow_edge()

    def _on_manual_range(self, *args: object) -> None:
        if self.follow.isChecked():
            self.follow.blockSignals(True)
            self.follow.setChecked(False)
            self.follow.blockSignals(False)

    def _on_range_changed(self, *args: object) -> None:
        self.redraw()

    # ----------------------------------------------------------------- drawing
    def redraw(self) -> None:
        """Hand the items only what is in view (merged below a pixel), and label wide blocks."""
        (x0, x1), _ = self.vb.viewRange()
        origin = self.store.origin_ns
        a, b = origin + int(x0 * 1e9), origin + int(x1 * 1e9)
        px = self.pixel_seconds()
        px_ns = int(px * 1e9)
        rects: list[QRectF] = []
        texts: list[str] = []
        for kind in DRAW_ORDER:
            off, h = LANES[kind]
            runs = self.store.visible_runs(kind, a, b, px_ns, merge_above=MERGE_ABOVE)
            n = len(runs)
            xs = (runs.start_ns - origin) / 1e9
            ws = np.maximum((runs.end_ns - runs.start_ns) / 1e9, px * 0.8 if px else 0.0)
            y0, hs = self._bands(runs.stage, off, h)
            self.items[kind].setOpts(x0=xs, width=ws, y0=y0, height=hs)
            self._drawn[kind] = n
            if kind in ("compute", "decode") and 0 < n <= LABEL_MAX and not runs.merged:
                blocks = self.store.visible(kind, a, b)
                prefix = "C" if kind == "compute" else "T"
                grouped = self.store.interleave > 1
                for s, c, st, en in zip(blocks.stage, blocks.chunk, blocks.start_ns, blocks.end_ns):
                    if c < 0:
                        continue
                    y, hh = self._bands(np.array([s]), off, h)
                    rects.append(QRectF((st - origin) / 1e9, float(y[0]), (en - st) / 1e9, float(hh[0])))
                    texts.append(f"{prefix}{c}·g{s}" if grouped else f"{prefix}{c}")
        self.labels.set_labels(rects, texts)
        self.grid.refresh()
        self.redraws += 1

    def _bands(self, stages: np.ndarray, off: float, h: float) -> tuple[np.ndarray, np.ndarray]:
        """(top, height) of blocks of these stages in a lane at (offset, height) of a row: the
        whole lane, or with interleaved groups the group's own band of it (g0 top, g1 below…),
        so groups that share a device stay apart where they overlap (CPU threads do)."""
        store = self.store
        if store.interleave <= 1:
            return stages + off, np.full(len(stages), h)
        band = h / store.interleave
        return store.rows(stages) + off + (stages // store.n_rows) * band, np.full(len(stages), band)

    def pixel_seconds(self) -> float:
        """Seconds per screen pixel along X, from the range being set (the view's cached
        transform lags behind during sigXRangeChanged)."""
        (x0, x1), _ = self.vb.viewRange()
        width = self.vb.boundingRect().width()
        return (x1 - x0) / width if width > 0 else 0.0

    def drawn_counts(self) -> dict[str, int]:
        """Rectangles each item holds now (what is drawn, after clipping and merging)."""
        return dict(self._drawn)

    # ------------------------------------------------------------------- hover
    def _on_mouse_moved(self, pos: QPointF) -> None:
        if not self.plot.getPlotItem().sceneBoundingRect().contains(pos):
            return
        p = self.vb.mapSceneToView(pos)
        text = self.tooltip_at(p.x(), p.y())
        if text:
            QToolTip.showText(QCursor.pos(), text, self.plot)
        else:
            QToolTip.hideText()

    def tooltip_at(self, x_s: float, y: float) -> str | None:
        """The tooltip for a point in view coordinates (seconds, rows), None over empty space."""
        row = int(round(y))
        if row < 0 or row >= self._n_rows or abs(y - row) > 0.45:
            return None
        tol = int(self.pixel_seconds() * HOVER_PX * 1e9)
        t_ns = self.store.origin_ns + int(x_s * 1e9)
        order = ("stream",) + HOVER_ORDER[:-1] if y - row > LANES["stream"][0] - 0.02 else HOVER_ORDER
        block = self.store.block_in_row(row, t_ns, tol, order)
        return None if block is None else self.describe(block)

    def describe(self, b: Block) -> str:
        return describe_block(b, self.store)


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def stacked_pair(top_title: str, bottom_title: str, fit: Callable[[], None]) -> tuple[GanttView, GanttView, QSplitter]:
    """Two stored-run Gantts stacked on one shared time axis (Compare, Plan): the top one keeps
    the legend, both Fit buttons call `fit` (which should show both whole)."""
    top, bottom = GanttView(title=top_title, live=False), GanttView(title=bottom_title, live=False)
    bottom.legend.setVisible(False)
    bottom.plot.setXLink(top.plot)
    for g in (top, bottom):
        g.fit_button.clicked.disconnect()
        g.fit_button.clicked.connect(fit)
    split = QSplitter(Qt.Orientation.Vertical)
    split.addWidget(top)
    split.addWidget(bottom)
    return top, bottom, split


def describe_block(b: Block, store: EventStore) -> str:
    """A block's tooltip: what it is, where, when, and its figures."""
    t0 = (b.start_ns - store.origin_ns) / 1e6
    t1 = (b.end_ns - store.origin_ns) / 1e6
    dur_ms = b.dur_ns / 1e6
    layers = store.stage_layers.get(b.stage)
    who = f"group g{b.stage}" if store.interleave > 1 else f"stage {b.stage}"
    where = f"{who} ({b.device or '?'})" + (f", layers {layers[0]}–{layers[1] - 1}" if layers else "")
    times = f"{t0:,.3f} → {t1:,.3f} ms  ({dur_ms:,.3f} ms)"
    if b.kind == "compute":
        lines = [f"C{b.chunk} · compute · {where}", times]
        if b.tokens:
            rate = b.tokens / (b.dur_ns / 1e9) if b.dur_ns > 0 else 0.0
            lines.append(f"{b.tokens:,} tokens · {rate:,.0f} tok/s")
        if b.note:
            lines.append(b.note)
    elif b.kind == "decode":
        lines = [f"T{b.chunk} · decode step · {where}", times, f"{b.tokens} token"]
    elif b.kind == "wait":
        what = WAIT_MEANING.get(b.note, b.note or "waiting")
        chunk = f"C{b.chunk} · " if b.chunk >= 0 else ""
        lines = [f"{chunk}wait · {where}", what, times]
    elif b.kind == "copy":
        head = f"C{b.chunk} hand-off" if b.chunk >= 0 else "KV copy"
        lines = [f"{head} · {where}" + (f" → stage {b.stage + 1}" if b.chunk >= 0 else ""), times]
        detail = []
        if b.tokens:
            detail.append(f"{b.tokens:,} tokens")
        if b.nbytes:
            detail.append(_bytes(b.nbytes))
            if b.dur_ns > 0:
                detail.append(f"{b.nbytes / b.dur_ns:,.2f} GB/s")
        if detail:
            lines.append(" · ".join(detail))
        if b.note:
            lines.append(f"via {b.note}" if b.chunk >= 0 else b.note)
    else:  # stream
        lines = [f"expert stream · {where}", times]
        if b.nbytes:
            lines.append(_bytes(b.nbytes) + (f" · {b.nbytes / b.dur_ns:,.2f} GB/s" if b.dur_ns > 0 else ""))
        if b.note:
            lines.append(b.note)
    return "\n".join(lines)
