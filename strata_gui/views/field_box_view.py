"""A form field with its error message underneath: red border on the input, the engine's text below."""
from __future__ import annotations

from PySide6.QtWidgets import QHBoxLayout, QLabel, QVBoxLayout, QWidget


class FieldBox(QWidget):
    """Holds one or more input widgets in a row; `inputs[0]` (or all) get the red border."""

    def __init__(self, *inputs: QWidget, tooltip: str = "", stretch_last: bool = True,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.inputs = list(inputs)
        self.row = row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        for i, w in enumerate(inputs):
            row.addWidget(w, 1 if (stretch_last and i == len(inputs) - 1) else 0)
            if tooltip:
                w.setToolTip(tooltip)
        self.error = QLabel()
        self.error.setProperty("role", "error")
        self.error.setWordWrap(True)
        self.error.setVisible(False)
        self.column = lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(2)
        lay.addLayout(row)
        lay.addWidget(self.error)
        self.flag_targets: list[QWidget] = list(inputs)

    @property
    def message(self) -> str:
        return self.error.text()

    @property
    def invalid(self) -> bool:
        return bool(self.error.text())

    def set_error(self, message: str | None) -> None:
        text = message or ""
        if text == self.error.text():
            return
        self.error.setText(text)
        self.error.setVisible(bool(text))
        for w in self.flag_targets:
            w.setProperty("invalid", bool(text))
            w.style().unpolish(w)
            w.style().polish(w)
            w.update()
