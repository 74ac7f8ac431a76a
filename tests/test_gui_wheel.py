"""Issue 37: a wheel event over a combo or spin box without the keyboard focus changes nothing
(the settings panel's scroll area scrolls instead); a focused box takes the wheel as before."""
from __future__ import annotations

import pytest
from gui_support import qsettings, qt_settings_sandbox, themed_app, window  # noqa: F401  (fixtures)
from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QWheelEvent
from PySide6.QtWidgets import QApplication, QScrollArea


def wheel(widget, steps: int = -1) -> None:
    """A mouse wheel turn (one notch down per -1) over the middle of `widget`."""
    centre = QPointF(widget.rect().center())
    glob = QPointF(widget.mapToGlobal(widget.rect().center()))
    ev = QWheelEvent(centre, glob, QPoint(0, 0), QPoint(0, 120 * steps), Qt.MouseButton.NoButton,
                     Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase, False)
    QApplication.sendEvent(widget, ev)


def test_an_unfocused_combo_or_spin_box_ignores_the_wheel_and_the_page_scrolls(window, qtbot):
    panel = window.settings_panel
    window.resize(1280, 720)  # small enough that the settings panel scrolls
    qtbot.wait(50)
    scroll = next(w for w in (panel.parentWidget(), panel.parentWidget().parentWidget(),
                              panel.parentWidget().parentWidget().parentWidget()) if isinstance(w, QScrollArea))
    bar = scroll.verticalScrollBar()
    assert bar.maximum() > 0, "the panel must scroll at this size for the test to mean anything"
    window.setFocus()
    for box in (panel.executor, panel.pipeline_depth, panel.prompt_tokens, panel.decode_tokens):
        assert not box.hasFocus()
        before = box.currentIndex() if hasattr(box, "currentIndex") else box.value()
        bar.setValue(0)
        wheel(box, -1)
        after = box.currentIndex() if hasattr(box, "currentIndex") else box.value()
        assert after == before, box.objectName() or type(box).__name__
        assert bar.value() > 0  # the wheel went to the scroll area


@pytest.mark.parametrize("name", ["executor", "pipeline_depth", "decode_tokens"])
def test_a_focused_box_takes_the_wheel(window, qtbot, name):
    box = getattr(window.settings_panel, name)
    box.setFocus(Qt.FocusReason.MouseFocusReason)
    qtbot.waitUntil(box.hasFocus, timeout=2000)
    read = (lambda: box.currentIndex()) if hasattr(box, "currentIndex") else box.value
    before = read()
    wheel(box, 1 if name == "decode_tokens" else (-1 if before == 0 else 1))  # up a count; to the other item
    assert read() != before
