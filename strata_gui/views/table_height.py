"""Size a small read-only table to its rows: no empty band under the last row, no scrolling."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QTableWidget


def fit_height(table: QTableWidget, max_rows: int = 8, min_rows: int = 1) -> None:
    table.resizeRowsToContents()
    rows = min(table.rowCount(), max_rows)
    row_h = sum(table.rowHeight(r) for r in range(rows))
    if rows < min_rows:
        row_h += (min_rows - rows) * table.verticalHeader().defaultSectionSize()
    h = table.horizontalHeader().sizeHint().height() + row_h + 2 * table.frameWidth() + 2
    if table.horizontalScrollBarPolicy() != Qt.ScrollBarPolicy.ScrollBarAlwaysOff:
        h += table.horizontalScrollBar().sizeHint().height()  # a sideways bar must not hide the last row
    table.setFixedHeight(h)
    # every row shown: no vertical bar (its width would come out of the columns'); more rows scroll
    table.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff if table.rowCount() <= max_rows
                                     else Qt.ScrollBarPolicy.ScrollBarAsNeeded)
