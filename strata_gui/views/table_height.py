"""Size a small read-only table to its rows: no empty band under the last row, no scrolling."""
from __future__ import annotations

from PySide6.QtWidgets import QTableWidget


def fit_height(table: QTableWidget, max_rows: int = 8, min_rows: int = 1) -> None:
    table.resizeRowsToContents()
    rows = min(table.rowCount(), max_rows)
    row_h = sum(table.rowHeight(r) for r in range(rows))
    if rows < min_rows:
        row_h += (min_rows - rows) * table.verticalHeader().defaultSectionSize()
    h = table.horizontalHeader().sizeHint().height() + row_h + 2 * table.frameWidth() + 2
    table.setFixedHeight(h)
