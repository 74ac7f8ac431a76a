"""Saved settings never brick the app (issue 39): each field's worst values, written into the
settings file as a hand-edited or damaged file would hold them, and the window still starts,
the field at its default and the status bar naming it."""
from __future__ import annotations

from dataclasses import fields

import pytest
from gui_support import qt_settings_sandbox, themed_app  # noqa: F401
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PySide6.QtCore import QSettings

from strata_gui.run.settings_model import MAX_PROMPT_TEXT_CHARS, RunSettings, field_problem

HUGE = "99999999999999999999"
BYTES = "@ByteArray(\\0\\xff\\xfe)"  # QSettings reads this back as a QByteArray
LIST = "a, b, c"  # unquoted commas: QSettings reads a list
# each field's worst values, as text of the INI file
WORST: dict[str, list[str]] = {
    "prompt_tokens": [HUGE, f"-{HUGE}", "0", "1.5", "nan", BYTES, LIST],
    "decode_tokens": [HUGE, "-1", "4097", "1e9", BYTES],
    "repeats": [HUGE, "0", "21", "many", LIST],
    "pipeline_depth": [HUGE, "2", "-1", "x"],
    "prefill_main": ["maybe", HUGE, BYTES],
    "cuda_graphs": ["perhaps", LIST],
    "warmup": ["2", BYTES],
    "split_mode": ["sideways", BYTES, LIST],
    "chunk_mode": ["huge", HUGE],
    "chunk_schedule": ["random", BYTES],
    "prompt_mode": ["images", LIST],
    "executor": ["fibres", HUGE],
    "gpu_order": ["random", BYTES],
    "devices": [BYTES, LIST, "x" * 5000],
    "split_counts": [BYTES, "9" * 5000],
    "chunk_tokens": [BYTES, LIST],
    "pin_limit_gib": [BYTES, LIST],
    "expert_cache": [BYTES, LIST],
    "rendezvous": [BYTES, LIST],
    "model_path": [BYTES, "/" + "d/" * 3000],
    "prompt_text": [BYTES, LIST],
}


def test_every_field_has_worst_values():
    assert set(WORST) == {f.name for f in fields(RunSettings)}


def _ini(tmp_path, lines: dict[str, str]):
    path = tmp_path / "poisoned.ini"
    path.write_text("[run]\n" + "".join(f"{k}={v}\n" for k, v in lines.items()), encoding="utf-8")
    return QSettings(str(path), QSettings.Format.IniFormat)


def _start(qtbot, qs, demo_path, tmp_path):
    from strata_gui.views.main_window_view import MainWindow

    win = MainWindow(qs, demo_path, history_path=tmp_path / "history.sqlite3")
    qtbot.addWidget(win)
    win.show()
    qtbot.waitUntil(lambda: not win.jobs.busy, timeout=20_000)
    return win


@pytest.mark.parametrize("name", sorted(WORST))
def test_the_app_starts_on_each_fields_worst_values(themed_app, qtbot, tmp_path, demo_path, name):  # noqa: F811
    defaults = RunSettings.from_env({}, "cpu,cpu", demo=True)
    for k, raw in enumerate(WORST[name]):
        folder = tmp_path / str(k)
        folder.mkdir()
        neighbour = "repeats" if name == "decode_tokens" else "decode_tokens"
        win = _start(qtbot, _ini(folder, {neighbour: "3", name: raw}), demo_path, folder)
        try:
            got = win.current_settings()
            assert getattr(got, name) == getattr(defaults, name), (name, raw)
            assert getattr(got, neighbour) == 3  # a good neighbour is kept
            status = win.status_label.text()
            assert status.startswith("saved settings not usable") and f"{name}=" in status, (raw, status)
            assert "\n" not in status
        finally:
            win.close()


def test_all_fields_poisoned_at_once_start_with_every_field_named(themed_app, qtbot, tmp_path, demo_path):  # noqa: F811
    win = _start(qtbot, _ini(tmp_path, {k: v[0] for k, v in WORST.items()}), demo_path, tmp_path)
    try:
        status = win.status_label.text()
        for name in WORST:
            assert f"{name}=" in status, name
        assert win.current_settings().to_dict() == RunSettings.from_env({}, "cpu,cpu", demo=True).to_dict()
    finally:
        win.close()


def test_a_huge_saved_prompt_text_is_dropped_naming_its_size(themed_app, qtbot, tmp_path, demo_path):  # noqa: F811
    qs = _ini(tmp_path, {"prompt_mode": "text"})
    qs.setValue("run/prompt_text", "word " * (MAX_PROMPT_TEXT_CHARS // 5 + 1))
    qs.sync()
    win = _start(qtbot, qs, demo_path, tmp_path)
    try:
        assert win.current_settings().prompt_text == ""
        assert "prompt_text=" in win.status_label.text() and "characters" in win.status_label.text()
    finally:
        win.close()


def test_good_saved_values_give_no_note(themed_app, qtbot, tmp_path, demo_path):  # noqa: F811
    qs = _ini(tmp_path, {"prompt_tokens": "4096", "repeats": "3", "chunk_schedule": "auto", "prefill_main": "true"})
    win = _start(qtbot, qs, demo_path, tmp_path)
    try:
        s = win.current_settings()
        assert (s.prompt_tokens, s.repeats, s.chunk_schedule, s.prefill_main) == (4096, 3, "auto", True)
        assert not win.status_label.text().startswith("saved settings")
    finally:
        win.close()


ANY = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=30),
                st.binary(max_size=8), st.lists(st.text(max_size=3), max_size=3))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(sorted(WORST)), ANY)
def test_any_value_is_accepted_in_range_or_rejected_with_a_reason(name, value):
    default = getattr(RunSettings(), name)
    verdict = field_problem(name, value, default)
    if isinstance(verdict, str):
        assert verdict
        return
    assert type(verdict.value) is type(default)
    s, notes = RunSettings.from_dict_checked({name: value})
    assert not notes and getattr(s, name) == verdict.value


def test_the_forms_text_bound_is_the_engines():
    from engine.io.prompt import MAX_TEXT_CHARS

    assert MAX_PROMPT_TEXT_CHARS == MAX_TEXT_CHARS
