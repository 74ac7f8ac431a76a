"""Issue 37: a run's warm-up pass shows its progress and the previous run's Gantt is gone; a
stop during the warm-up says truthfully that nothing was kept; a stop after repeats names them."""
from __future__ import annotations

import time

from gui_support import qsettings, qt_settings_sandbox, set_form, themed_app, wait_no_engine_threads, window  # noqa: F401
from PySide6.QtCore import Qt

from engine.pipeline.session import PipelineHooks

RUN_TIMEOUT_MS = 60_000


def _click_run(qtbot, win) -> None:
    assert win.run_button.isEnabled(), win.validation.errors
    qtbot.mouseClick(win.run_button, Qt.MouseButton.LeftButton)


def _wait_done(qtbot, win, outcome: str) -> None:
    qtbot.waitUntil(lambda: win.last_outcome != "" and not win.controller.is_running, timeout=RUN_TIMEOUT_MS)
    assert win.last_outcome == outcome, f"{win.last_outcome}: {win.status_label.text()}"


def test_warm_up_shows_progress_and_clears_the_old_gantt_then_a_stop_says_nothing_was_kept(window, qtbot):
    win = window
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="32", prompt_tokens=128, decode_tokens=0,
             warmup=False)
    _click_run(qtbot, win)
    _wait_done(qtbot, win, "finished")
    assert win.gantt.store.count("compute") > 0  # a timeline to clear
    saved_before = win.history.count()
    # a new shape with a warm-up; every layer slowed so the warm-up is long enough to see and stop
    win.controller.hooks = PipelineHooks(after_layer=lambda s, layer, c: time.sleep(0.02))
    set_form(win, prompt_tokens=1024, warmup=True)
    seen: list[tuple[int, int]] = []
    win.controller.warmup.connect(lambda done, total: seen.append((done, total)))
    _click_run(qtbot, win)
    assert win.gantt.store.count() == 0  # cleared at Run, not at the measured pass
    qtbot.waitUntil(lambda: any(d >= 2 for d, _ in seen), timeout=RUN_TIMEOUT_MS)
    assert win.in_warmup and win.progress_model is None  # still the warm-up: nothing measured
    text = win.progress_label.text()
    assert text.startswith("warm-up pass (not measured): chunk ") and text.endswith("/32"), text
    assert win.progress.maximum() == 32 and win.progress.value() >= 2
    assert win.gantt.store.count() == 0  # the warm-up draws nothing
    win.stop_button.click()
    _wait_done(qtbot, win, "cancelled")
    win.controller.hooks = None
    assert wait_no_engine_threads() == []
    message = win.summary.figures.text()
    assert "during the warm-up pass" in message and "nothing was saved" in message.lower(), message
    assert "goes to the History tab" not in message
    assert win.saved_this_run == []
    if saved_before is not None:
        assert win.history.count() == saved_before
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[0] == (0, 32)


def test_a_stop_after_finished_repeats_names_what_was_saved(window, qtbot):
    win = window
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="32", prompt_tokens=256, decode_tokens=0,
             warmup=False, repeats=3)
    measured: list = []
    win.controller.measured.connect(measured.append)
    win.controller.hooks = PipelineHooks(after_layer=lambda s, layer, c: time.sleep(0.01) if measured else None)
    _click_run(qtbot, win)
    qtbot.waitUntil(lambda: len(measured) == 1 and win.progress_model is not None
                    and win.progress_model.snapshot().chunks_done >= 1, timeout=RUN_TIMEOUT_MS)
    win.stop_button.click()
    _wait_done(qtbot, win, "cancelled")
    win.controller.hooks = None
    message = win.summary.figures.text()
    finished = [r.run for r in win.saved_this_run if r.status == "finished"]
    assert len(finished) >= 1 and f"#{finished[0]}" in message, message
    assert "finished repeat(s) saved to the History tab" in message
