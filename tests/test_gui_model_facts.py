"""The GGUF facts read once, off the GUI thread (issue 16 item 5): the form's parse of a model
file runs in a background job, Run waits for it, and the run's Session reuses that parse."""
from __future__ import annotations

import shutil
import threading

from gui_support import qsettings, qt_settings_sandbox, set_form, themed_app, wait_model, window  # noqa: F401
from history_support import FORM, run_once


def _recording(win):
    threads: list[threading.Thread] = []
    gate = threading.Event()
    gate.set()
    load = win.models.loader

    def loader(path):
        threads.append(threading.current_thread())
        gate.wait(30)
        return load(path)

    win.models.loader = loader
    return threads, gate


def test_a_model_is_parsed_once_off_the_gui_thread_and_the_run_reuses_it(window, qtbot, tmp_path):
    win = window
    assert win.models.facts(win.demo_model) is not None  # the demo, read behind the window's start
    threads, _ = _recording(win)
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(win.demo_model, copy)
    parses = win.models.parses
    win.settings_panel.set_model_path(str(copy))
    wait_model(qtbot, win)
    assert len(threads) == 1 and threads[0] is not threading.main_thread()
    assert "qwen3moe: 4 layers" in win.settings_panel.model_info.text()
    run_once(qtbot, win, model_path=str(copy), **FORM)
    assert win.models.parses == parses + 1 and len(threads) == 1  # the Session took the form's parse
    assert win.controller.sessions.builds == 1


def test_run_waits_while_the_model_file_is_read(window, qtbot, tmp_path):
    win = window
    threads, gate = _recording(win)
    gate.clear()
    copy = tmp_path / "slow.gguf"
    shutil.copyfile(win.demo_model, copy)
    set_form(win, model_path=str(copy))
    qtbot.waitUntil(lambda: len(threads) == 1, timeout=10_000)
    assert win.model_pending and not win.run_button.isEnabled()
    assert "reading the model file" in win.settings_panel.model_info.text()
    assert not win.start_run()
    gate.set()
    wait_model(qtbot, win)
    assert win.run_button.isEnabled() and "qwen3moe" in win.settings_panel.model_info.text()


def test_model_cache_parses_once_keeps_a_few_and_turns_errors_into_facts(demo_path, tmp_path):
    from strata_gui.run.model_cache import ModelCache

    cache = ModelCache(keep=1)
    facts = cache.read(demo_path)
    assert facts.n_layers == 4 and facts.error == "" and cache.get(demo_path) is facts.model
    assert cache.read(demo_path) is facts and cache.parses == 1
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTGGUF" + bytes(64))
    broken = cache.read(bad)
    assert broken.n_layers is None and broken.model is None and "not a GGUF file" in broken.error
    assert cache.facts(demo_path) is None  # keep=1: the demo made room for the last file read
