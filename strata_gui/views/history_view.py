"""The History tab: every saved run in a filterable list; compare, show, export, import, delete.

The list reads the history (`history.RunHistory`); exports and imports run as background jobs
(the GUI thread only draws the Gantt PNG), every file is written atomically, and a bad trace file
gets a message naming the file and the problem while nothing stored changes.
"""
from __future__ import annotations

import html
import logging
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.io.trace import TraceError

from ..history.history_model import MOVE_ASIDE, HistoryError, RunHistory, RunRow, unknown_filter_keys
from ..run import run_files
from ..run.background import BackgroundJobs
from .gantt_image import gantt_png
from .theme import ERROR_COLOR, MUTED_COLOR

log = logging.getLogger(__name__)

COLUMNS = ("#", "when", "source", "status", "label", "model", "devices", "prompt\ntokens", "chunk", "depth",
           "prefill\ntok/s", "decode\ntok/s", "digest")
LABEL_COL = COLUMNS.index("label")
SOURCES = (("all runs", None), ("runs", "run"), ("sweep runs", "sweep"), ("imported", "import"))
EXPORT_KINDS = {"trace": ("Chrome trace (Perfetto)", "Chrome trace JSON (*.json *.json.gz)", ".json"),
                "csv": ("events as CSV", "CSV (*.csv)", ".events.csv"),
                "png": ("Gantt as PNG", "PNG image (*.png)", ".gantt.png")}
LIST_LIMIT = 2000


class _NumberItem(QTableWidgetItem):
    """Sorts by its number, not its text."""

    def __init__(self, text: str, value: float) -> None:
        super().__init__(text)
        self.setData(Qt.ItemDataRole.UserRole + 1, value)
        self.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)

    def __lt__(self, other: QTableWidgetItem) -> bool:
        a = self.data(Qt.ItemDataRole.UserRole + 1)
        b = other.data(Qt.ItemDataRole.UserRole + 1)
        if a is None or b is None:
            return super().__lt__(other)
        return a < b


class HistoryPanel(QWidget):
    compare_requested = Signal(int, int)  # before, after
    show_requested = Signal(int)  # a run to show in the Run tab
    changed = Signal()  # runs were added, deleted or relabelled
    error = Signal(str, str)  # title, message

    def __init__(self, history: RunHistory | None, jobs: BackgroundJobs, unavailable: str = "",
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.history = history
        self.jobs = jobs
        self.rows: list[RunRow] = []
        self.pending: set[str] = set()  # background jobs of this panel in flight
        self._filling = False
        self._build(unavailable)
        self.refresh()

    # ------------------------------------------------------------------ layout
    def _build(self, unavailable: str) -> None:
        title = QLabel("Run history")
        title.setProperty("role", "panel-title")
        where = self.history.path if self.history is not None else None
        self.where = QLabel(f"Every finished or stopped run is saved here, with its settings, report, events and "
                            f"telemetry: <code>{html.escape(str(where))}</code>" if where else "")
        self.where.setProperty("role", "hint")
        # wrapped: a long data-folder path on one line had held the window wider than a 1280-px screen (issue 37)
        self.where.setWordWrap(True)
        self.where.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        top = _filter_row(self)
        _history_table(self)
        buttons = _action_buttons(self)
        hint = QLabel("Select two runs and press Compare (the older one is 'before'); double-click a run to show "
                      "it in the Run tab, its label to edit it.")
        hint.setProperty("role", "hint")
        hint.setWordWrap(True)

        self.message = QLabel()
        self.message.setWordWrap(True)
        self.message.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.unavailable = QLabel(unavailable)
        self.unavailable.setWordWrap(True)
        self.unavailable.setStyleSheet(f"color: {ERROR_COLOR}; font-size: 11pt; padding: 12px;")
        self.unavailable.setVisible(self.history is None)

        lay = QVBoxLayout(self)
        lay.addWidget(title)
        lay.addWidget(self.where)
        lay.addWidget(self.unavailable)
        lay.addLayout(top)
        lay.addWidget(self.table, 1)
        lay.addWidget(hint)
        lay.addLayout(buttons)
        lay.addWidget(self.message)
        if self.history is None:
            for w in (self.filter, self.source, self.table, self.import_button):
                w.setEnabled(False)
        self._update_buttons()

    # ------------------------------------------------------------------ listing
    def refresh(self) -> None:
        if self.history is None:
            self.rows = []
            self.count.setText("")
            return
        keep = set(self.selected_ids())
        try:
            self.rows = self.history.list_runs(self.filter.text(), self.source.currentData(), LIST_LIMIT)
            total = self.history.count()
        except Exception as exc:  # a locked, vanished or damaged file: say so, keep the app
            log.exception("reading the history failed")
            damaged = "malformed" in str(exc) or "corrupt" in str(exc)
            self.set_message(f"cannot read the history: {exc}" + (f". {MOVE_ASIDE}." if damaged else ""), error=True)
            return
        self._filling = True
        self.table.setSortingEnabled(False)
        try:
            self.table.setRowCount(len(self.rows))
            for i, r in enumerate(self.rows):
                try:
                    cells = self._cells(r)
                except Exception as exc:  # noqa: BLE001 - a row of a damaged or foreign file never stops the app
                    log.warning("run #%s of the history cannot be shown: %s", r.id, exc)
                    cells = self._unreadable_cells(r, f"{type(exc).__name__}: {exc}")
                for j, item in enumerate(cells):
                    if j != LABEL_COL:
                        item.setFlags(item.flags() & ~Qt.ItemFlag.ItemIsEditable)
                    item.setData(Qt.ItemDataRole.UserRole, r.id)
                    self.table.setItem(i, j, item)
        finally:
            self.table.setSortingEnabled(True)
            self._filling = False
        self.select_ids(keep)
        shown = f"{len(self.rows):,} of {total:,} runs" if len(self.rows) != total else f"{total:,} runs"
        if len(self.rows) == LIST_LIMIT:
            shown += f" (the newest {LIST_LIMIT:,} that match)"
        unknown = unknown_filter_keys(self.filter.text())
        if unknown:
            shown += f" · no setting is called {', '.join(repr(k) for k in unknown)} (try chunk=, depth=, devices=)"
        self.count.setText(shown)
        self._update_buttons()

    @staticmethod
    def _cells(r: RunRow) -> list[QTableWidgetItem]:
        problem = r.problem()
        if problem:
            return HistoryPanel._unreadable_cells(r, problem)
        depth = {0: "0 join", 1: "1 overlap"}.get(r.pipeline_depth, "?")
        cells: list[QTableWidgetItem] = [
            _NumberItem(str(r.id), r.id), QTableWidgetItem(r.when), QTableWidgetItem(r.source),
            QTableWidgetItem(r.status), QTableWidgetItem(r.label), QTableWidgetItem(_short_model(r.model)),
            QTableWidgetItem(r.devices), _NumberItem(f"{r.prompt_tokens:,}", r.prompt_tokens),
            _NumberItem(str(r.chunk), r.chunk), QTableWidgetItem(depth),
            _NumberItem(f"{r.prefill_tok_s:,.0f}", r.prefill_tok_s),
            _NumberItem(f"{r.decode_tok_s:,.1f}" if r.decode_tok_s else "—", r.decode_tok_s),
            QTableWidgetItem(r.digest[:12])]
        cells[5].setToolTip(r.model)
        cells[12].setToolTip(r.digest)
        return cells

    @staticmethod
    def _unreadable_cells(r: RunRow, problem: str) -> list[QTableWidgetItem]:
        """A row that cannot be formatted: its id and "unreadable run #n", the problem as a tooltip."""
        run = r.id if isinstance(r.id, int) else -1
        cells = [QTableWidgetItem("") for _ in COLUMNS]
        cells[0] = _NumberItem(str(run), run)
        cells[LABEL_COL] = QTableWidgetItem(f"unreadable run #{run}")
        for c in cells:
            c.setToolTip(f"This run cannot be shown ({problem}); delete it, or move the history aside.")
            c.setForeground(QColor(ERROR_COLOR))
        return cells

    def selected_ids(self) -> list[int]:
        ids = []
        for idx in self.table.selectionModel().selectedRows():
            item = self.table.item(idx.row(), 0)
            if item is not None:
                ids.append(int(item.data(Qt.ItemDataRole.UserRole)))
        return ids

    def select_ids(self, ids: set[int] | list[int]) -> None:
        ids = set(ids)
        self.table.clearSelection()
        mode = self.table.selectionMode()
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.MultiSelection)
        for row in range(self.table.rowCount()):
            item = self.table.item(row, 0)
            if item is not None and int(item.data(Qt.ItemDataRole.UserRole)) in ids:
                self.table.selectRow(row)
        self.table.setSelectionMode(mode)

    def _update_buttons(self) -> None:
        n = len(self.selected_ids()) if self.history is not None else 0
        self.compare_button.setEnabled(n == 2)
        self.show_button.setEnabled(n == 1)
        for b in self.export_buttons.values():
            b.setEnabled(n == 1)
        self.delete_button.setEnabled(n >= 1)

    def set_message(self, text: str, error: bool = False) -> None:
        color = ERROR_COLOR if error else MUTED_COLOR
        self.message.setText(f"<span style='color:{color}'>{html.escape(text)}</span>")

    def _one_selected(self, fn: Callable[[int], None]) -> None:
        ids = self.selected_ids()
        if len(ids) == 1:
            fn(ids[0])

    def _on_double_click(self, index) -> None:
        if index.column() != LABEL_COL:
            item = self.table.item(index.row(), 0)
            if item is not None:
                self.show_requested.emit(int(item.data(Qt.ItemDataRole.UserRole)))

    def _on_item_changed(self, item: QTableWidgetItem) -> None:
        if self._filling or self.history is None or item.column() != LABEL_COL:
            return
        run = int(item.data(Qt.ItemDataRole.UserRole))
        try:
            self.history.set_label(run, item.text().strip())
        except Exception as exc:
            self.set_message(f"cannot relabel run #{run}: {exc}", error=True)
            return
        self.set_message(f"run #{run} relabelled")
        self.changed.emit()

    # ------------------------------------------------------------------ compare
    def _compare_selected(self) -> None:
        ids = self.selected_ids()
        if len(ids) != 2:
            return
        before, after = self.order_pair(ids[0], ids[1])
        self.compare_requested.emit(before, after)

    def order_pair(self, a: int, b: int) -> tuple[int, int]:
        """(older, newer) by the time they were saved, then by id."""
        rows = {r.id: r for r in self.rows}
        key = lambda i: (rows[i].created_at if i in rows and not rows[i].problem() else 0.0, i)  # noqa: E731
        return (a, b) if key(a) <= key(b) else (b, a)

    # ------------------------------------------------------------------ delete
    def _ask_delete(self) -> None:
        ids = self.selected_ids()
        if not ids:
            return
        answer = QMessageBox.question(self, "Delete runs",
                                      f"Delete {len(ids)} run(s) from the history? This cannot be undone.")
        if answer == QMessageBox.StandardButton.Yes:
            self.delete_runs(ids)

    def delete_runs(self, ids: list[int]) -> int:
        if self.history is None:
            return 0
        try:
            n = self.history.delete(ids)
        except Exception as exc:
            self.set_message(f"cannot delete: {exc}", error=True)
            return 0
        self.set_message(f"deleted {n} run(s)")
        self.refresh()
        self.changed.emit()
        return n

    # ------------------------------------------------------------------ export
    def _ask_export(self, kind: str) -> None:
        ids = self.selected_ids()
        if len(ids) != 1:
            return
        what, pattern, suffix = EXPORT_KINDS[kind]
        row = self.history.row(ids[0]) if self.history is not None else None
        name = f"strata-run-{ids[0]}" + (f"-{row.engine_run_id}" if row else "") + suffix
        path, _ = QFileDialog.getSaveFileName(self, f"Export {what}", str(Path.home() / name), pattern)
        if path:
            self.export_run(ids[0], kind, Path(path))

    def export_run(self, run: int, kind: str, path: Path) -> None:
        """Write one run's file: the trace and CSV in a background job, the PNG here (it draws)."""
        if self.history is None:
            return
        history = self.history
        if kind == "png":
            try:
                record = history.get(run)
                run_files.write_bytes(path, gantt_png(record))
            except Exception as exc:
                self._export_done(None, f"{type(exc).__name__}: {exc}", run, path)
                return
            self._export_done(path, None, run, path)
            return
        writer = run_files.export_trace if kind == "trace" else run_files.export_events_csv
        self.pending.add("export")
        self.set_message(f"writing {path} …")
        self.jobs.submit("export", lambda: writer(history.get(run), path),
                         lambda result, err: self._export_done(result, err, run, path))

    def _export_done(self, result: object, error: str | None, run: int, path: Path) -> None:
        self.pending.discard("export")
        if error is not None:
            self.set_message(f"export of run #{run} to {path} failed: {error}", error=True)
            self.error.emit("Export failed", f"Run #{run} was not written to {path}: {error}")
            return
        self.set_message(f"run #{run} written to {path}")

    # ------------------------------------------------------------------ import
    def _ask_import(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Import a trace", str(Path.home()),
                                              "Chrome trace JSON (*.json *.json.gz);;All files (*)")
        if path:
            self.import_file(Path(path))

    def import_file(self, path: Path, max_bytes: int = run_files.MAX_IMPORT_BYTES) -> None:
        """Read a trace and add it to the history (in a background job); a bad file changes nothing."""
        if self.history is None:
            return
        history = self.history

        def work() -> int:
            record = run_files.import_trace(path, max_bytes=max_bytes)
            return history.add(record)

        self.pending.add("import")
        self.set_message(f"importing {path} …")
        self.jobs.submit("import", work, lambda result, err: self._import_done(result, err, path))

    def _import_done(self, run: object, error: str | None, path: Path) -> None:
        self.pending.discard("import")
        if error is not None:
            # BackgroundJobs gives "TypeName: message"; a TraceError's message names the file already
            text = error.split(": ", 1)[1] if error.startswith((TraceError.__name__, HistoryError.__name__)) else error
            self.set_message(f"nothing imported: {text}", error=True)
            self.error.emit("Import failed", f"Nothing was imported, and the history is unchanged.\n\n{text}")
            return
        self.refresh()
        self.select_ids([int(run)])
        self.set_message(f"imported {path.name} as run #{run}")
        self.changed.emit()

    @property
    def busy(self) -> bool:
        return bool(self.pending)


def _short_model(model: str) -> str:
    return Path(model).name if ("/" in model or "\\" in model) else model


def _history_table(self: HistoryPanel) -> None:
    """The runs' table, set on the panel (as Qt Designer's setupUi does): sortable, labels editable."""
    self.table = QTableWidget(0, len(COLUMNS))
    self.table.setHorizontalHeaderLabels(COLUMNS)
    self.table.verticalHeader().setVisible(False)
    self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    self.table.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
    self.table.setEditTriggers(QAbstractItemView.EditTrigger.DoubleClicked
                               | QAbstractItemView.EditTrigger.EditKeyPressed)
    self.table.setAlternatingRowColors(True)
    self.table.setSortingEnabled(True)
    self.table.sortByColumn(0, Qt.SortOrder.DescendingOrder)
    header = self.table.horizontalHeader()
    header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    header.setSectionResizeMode(LABEL_COL, QHeaderView.ResizeMode.Stretch)
    self.table.setToolTip("Select two runs and press Compare (the older one is 'before'); double-click a "
                          "label to edit it.")
    self.table.itemSelectionChanged.connect(self._update_buttons)
    self.table.itemChanged.connect(self._on_item_changed)
    self.table.doubleClicked.connect(self._on_double_click)


def _action_buttons(self: HistoryPanel) -> QHBoxLayout:
    """Compare, Show, the exports, Import and Delete, set on the panel (as setupUi does); their row."""
    self.compare_button = QPushButton("Compare before → after")
    self.compare_button.setToolTip("Compare the two selected runs: the older is 'before', the newer 'after'.")
    self.compare_button.clicked.connect(self._compare_selected)
    self.show_button = QPushButton("Show in Run tab")
    self.show_button.setToolTip("Show the selected run's timeline and summary in the Run tab.")
    self.show_button.clicked.connect(lambda: self._one_selected(self.show_requested.emit))
    self.export_buttons: dict[str, QPushButton] = {}
    for kind, (what, _, _) in EXPORT_KINDS.items():
        b = QPushButton(f"Export {what.split(' (')[0]}…")
        b.setToolTip(f"Write the selected run's {what} (written atomically: never a half-written file).")
        b.clicked.connect(lambda _=False, k=kind: self._ask_export(k))
        self.export_buttons[kind] = b
    self.import_button = QPushButton("Import trace…")
    self.import_button.setToolTip("Add a run from a Chrome trace JSON written by this app or strata-bench "
                                  "(--trace); compare works on imported runs.")
    self.import_button.clicked.connect(self._ask_import)
    self.delete_button = QPushButton("Delete…")
    self.delete_button.setToolTip("Delete the selected runs from the history (asks first).")
    self.delete_button.clicked.connect(self._ask_delete)
    buttons = QHBoxLayout()
    for b in (self.compare_button, self.show_button, *self.export_buttons.values()):
        buttons.addWidget(b)
    buttons.addStretch(1)
    buttons.addWidget(self.import_button)
    buttons.addWidget(self.delete_button)
    return buttons


def _filter_row(self: HistoryPanel) -> QHBoxLayout:
    """Which runs to show (source, filter text) and how many are, set on the panel (as setupUi does)."""
    self.filter = QLineEdit()
    self.filter.setPlaceholderText("filter: setting=value (depth=0, devices=cuda:0,cuda:1), #id, or words in "
                                   "the label, model, devices, digest")
    self.filter.setClearButtonEnabled(True)
    self.filter.textChanged.connect(self.refresh)
    self.source = QComboBox()
    for text, value in SOURCES:
        self.source.addItem(text, value)
    self.source.currentIndexChanged.connect(self.refresh)
    self.count = QLabel()
    self.count.setProperty("role", "hint")
    top = QHBoxLayout()
    top.addWidget(QLabel("Show"))
    top.addWidget(self.source)
    top.addWidget(self.filter, 1)
    top.addWidget(self.count)
    return top
