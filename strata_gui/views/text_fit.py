"""Where a widget's text does not fit: table cells and headers narrower than their text, tables
that need a horizontal scroll bar, table rows a fixed-height table hides, labels cut short.

A test tool (tests/test_gui_text_fit.py checks the summary, plan, compare and sweep tabs at the
window sizes users have) and a debugging aid: `clipped(widget)` lists what a user cannot read.
"""
from __future__ import annotations

from PySide6.QtCore import QRect, Qt
from PySide6.QtGui import QFontMetrics
from PySide6.QtWidgets import (
    QAbstractItemView,
    QAbstractScrollArea,
    QHeaderView,
    QLabel,
    QScrollArea,
    QStyle,
    QTableWidget,
    QWidget,
)


def _pads(table: QTableWidget) -> tuple[int, int]:
    """(header, cell) margins around a text, from the table's style (what ResizeToContents adds)."""
    st = table.style()
    head = 2 * st.pixelMetric(QStyle.PixelMetric.PM_HeaderMargin, None, table.horizontalHeader())
    cell = 2 * (st.pixelMetric(QStyle.PixelMetric.PM_FocusFrameHMargin, None, table) + 1)
    return head, cell


def _text_px(fm: QFontMetrics, text: str) -> int:
    return max((fm.horizontalAdvance(line) for line in text.split("\n")), default=0)


def table_problems(table: QTableWidget, name: str, all_rows: bool = False) -> list[str]:
    """The cells and headers of a visible table that are narrower than their text; with
    `all_rows`, rows the table's height hides too."""
    out: list[str] = []
    header = table.horizontalHeader()
    hfm = QFontMetrics(header.font())
    head_pad, cell_pad = _pads(table)
    for c in range(table.columnCount()):
        if table.isColumnHidden(c):
            continue
        width = header.sectionSize(c)
        head = table.horizontalHeaderItem(c)
        if head is not None and _text_px(hfm, head.text()) + head_pad > width:
            out.append(f"{name}: header {head.text()!r} cut ({width} px)")
        for r in range(table.rowCount()):
            item = table.item(r, c)
            if item is None or not item.text():
                continue
            fm = QFontMetrics(item.font())
            if table.wordWrap():  # wrapped: the row must be tall enough for the wrapped lines
                box = fm.boundingRect(QRect(0, 0, max(width - cell_pad, 1), 100_000),
                                      int(Qt.TextFlag.TextWordWrap), item.text())
                if box.width() + cell_pad <= width and box.height() <= table.rowHeight(r):
                    continue
            if _text_px(fm, item.text()) + cell_pad > width:
                out.append(f"{name}: row {r} {head.text() if head else c!r} {item.text()!r} cut ({width} px)")
    if header.length() > table.viewport().width() + 1:
        out.append(f"{name}: {header.length()} px of columns in {table.viewport().width()} px (scrolls sideways)")
    if all_rows and table.rowCount():
        last = table.rowCount() - 1
        bottom = table.rowViewportPosition(last) + table.rowHeight(last)
        if bottom > table.viewport().height() + 1 or table.rowViewportPosition(0) < 0:
            out.append(f"{name}: {table.rowCount()} rows in {table.viewport().height()} px (some hidden)")
    return out


def label_problems(label: QLabel, name: str) -> list[str]:
    """A label cut short: plain text wider than the label (no wrap), or wrapped text taller than it."""
    text = label.text()
    if not text or not label.isVisible():
        return []
    width = label.contentsRect().width()
    if label.wordWrap() or label.textFormat() == Qt.TextFormat.RichText or "<" in text:
        need_w = label.minimumSizeHint().width()
        if need_w > width + 1:
            return [f"{name}: needs {need_w} px, has {width} (cut at the right)"]
        if label.hasHeightForWidth() and label.heightForWidth(label.width()) > label.height() + 1:
            return [f"{name}: needs {label.heightForWidth(label.width())} px of height, has {label.height()}"]
        return []
    if _text_px(label.fontMetrics(), text) > width + 1:
        return [f"{name}: {text[:40]!r} needs {_text_px(label.fontMetrics(), text)} px, has {width}"]
    return []


def clipped(root: QWidget, all_rows: tuple[QTableWidget, ...] = ()) -> list[str]:
    """Everything cut short under `root` that is on screen (hidden widgets are skipped), and
    scroll areas (a tab's page) that scroll sideways: their right edge is off screen."""
    out: list[str] = []
    for area in root.findChildren(QScrollArea):
        bar = area.horizontalScrollBar()
        if area.isVisible() and not isinstance(area, QAbstractItemView) and bar.isVisible() and bar.maximum() > 0:
            out.append(f"{area.objectName() or type(area.widget()).__name__} scrolls sideways "
                       f"({bar.maximum()} px beyond its {area.viewport().width()} px)")
    for t in root.findChildren(QTableWidget):
        if t.isVisibleTo(root) and t.isVisible() and t.columnCount():
            out += table_problems(t, t.objectName() or type(t.parent()).__name__ + " table", t in all_rows)
    for lab in root.findChildren(QLabel):
        if lab.isVisible() and not isinstance(lab.parent(), (QHeaderView, QAbstractScrollArea)):
            out += label_problems(lab, lab.objectName() or f"label {lab.text()[:30]!r}")
    return out
