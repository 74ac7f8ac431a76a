"""Issue 37: the Sweep tab's default job shows a time estimate, scaled from a measured run."""
from __future__ import annotations

from gui_support import qsettings, qt_settings_sandbox, set_form, themed_app, wait_model, window  # noqa: F401
from PySide6.QtCore import Qt


def test_the_default_sweep_says_how_long_it_will_take(window, qtbot):
    win = window
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="64", prompt_tokens=256, decode_tokens=0,
             warmup=False)
    wait_model(qtbot, win)
    text = win.sweep_view.estimate.text()
    assert text.startswith("32 runs (24 measured + 8 warm-up) of up to 64K tokens") and "No time estimate yet" in text
    qtbot.mouseClick(win.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: win.last_outcome == "finished" and not win.controller.is_running, timeout=60_000)
    qtbot.waitUntil(lambda: "scaled from run #" in win.sweep_view.estimate.text(), timeout=10_000)
    text = win.sweep_view.estimate.text()
    assert "of prefill" in text and "256 tokens at" in text, text
    win.sweep_view.sizes.setText("8K")  # the estimate follows the plan
    assert win.sweep_view.estimate.text().startswith("8 runs (6 measured + 2 warm-up) of up to 8K tokens")
