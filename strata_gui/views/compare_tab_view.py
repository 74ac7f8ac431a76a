"""The Compare tab's frame in the main window: builds the CompareView when first shown (three
plots: not free) or first asked for, and refreshes its run choices only once it exists."""
from __future__ import annotations

from PySide6.QtWidgets import QVBoxLayout, QWidget

from .compare_view import CompareView


class CompareTab(QWidget):
    def __init__(self, history, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.history = history
        self._view: CompareView | None = None
        QVBoxLayout(self).setContentsMargins(0, 0, 0, 0)

    @property
    def view(self) -> CompareView:
        if self._view is None:
            self._view = CompareView(self.history)
            self.layout().addWidget(self._view)
        return self._view

    def showEvent(self, event) -> None:  # noqa: N802 - Qt's name
        self.view  # noqa: B018 - builds it
        super().showEvent(event)

    def refresh(self) -> None:
        if self._view is not None:
            self._view.refresh_choices()
