"""Wheel events over a combo box or spin box that does not have the keyboard focus scroll the
page instead of changing the value (issue 37: scrolling the settings panel turned Executor from
threads to processes and Pipeline depth from 1 to 0, unseen).

One application-wide event filter: a wheel event for an unfocused QComboBox or QAbstractSpinBox
never reaches the box; it goes to the nearest scroll area around it (which scrolls), or, with
none, is left unaccepted for Qt to offer to the parents.  A focused box (clicked or tabbed into)
takes the wheel as usual.
"""
from __future__ import annotations

from PySide6.QtCore import QEvent, QObject
from PySide6.QtGui import QWheelEvent
from PySide6.QtWidgets import QAbstractScrollArea, QAbstractSpinBox, QApplication, QComboBox, QWidget


def _scroll_area(w: QWidget) -> QAbstractScrollArea | None:
    p = w.parentWidget()
    while p is not None and not isinstance(p, QAbstractScrollArea):
        p = p.parentWidget()
    return p


class WheelGuard(QObject):
    def eventFilter(self, obj: QObject, event: QEvent) -> bool:  # noqa: N802 (Qt's name)
        if (event.type() != QEvent.Type.Wheel or not isinstance(obj, (QComboBox, QAbstractSpinBox))
                or obj.hasFocus()):
            return False
        area = _scroll_area(obj)
        if area is None:
            event.ignore()  # not accepted: Qt offers it to the parent widgets
            return True
        view = area.viewport()
        g = event.globalPosition()
        moved = QWheelEvent(view.mapFromGlobal(g), g, event.pixelDelta(), event.angleDelta(), event.buttons(),
                            event.modifiers(), event.phase(), event.inverted(), event.source())
        QApplication.sendEvent(view, moved)  # handed over whole: Qt does not propagate it a second time
        event.accept()
        return True


def install(app: QApplication | None = None) -> WheelGuard:
    """Install the guard on the application once (later calls return the same guard)."""
    app = app or QApplication.instance()
    guard = getattr(app, "_strata_wheel_guard", None)
    if guard is None:
        guard = WheelGuard(app)
        app.installEventFilter(guard)
        app._strata_wheel_guard = guard  # type: ignore[attr-defined]
    return guard
