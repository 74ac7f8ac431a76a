"""Real runs of the demo model as RunRecords, for the history, export and compare tests.

Two runs on a 2-stage CPU split, the same 128-token prompt in 32-token chunks with 3 decode
tokens: pipeline_depth 0 (join) and pipeline_depth 1 (overlap).  They are recorded the way the app
records a run (`record_config`), once per test session."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from gui_support import set_form
from PySide6.QtCore import Qt

PROMPT_TOKENS = 128
CHUNK = 32
DECODE = 3


@dataclass(frozen=True)
class DemoRuns:
    join: object  # RunRecord, pipeline_depth 0
    overlap: object  # RunRecord, pipeline_depth 1


def record_demo_run(demo_path, pipeline_depth: int, nonce: int = 0, prompt_tokens: int = PROMPT_TOKENS):
    from engine.config import EngineConfig
    from engine.io import prompt
    from engine.io.gguf_model import load
    from engine.pipeline.session import Session
    from strata_gui.run.record_model import RunRecord, record_config

    model = load(demo_path)
    cfg = EngineConfig.from_sources({"devices": "cpu,cpu", "chunk_tokens": CHUNK, "pipeline_depth": pipeline_depth},
                                    env={})
    sess = Session(model, cfg)
    try:
        res = sess.run(prompt.synthetic(prompt_tokens, model.spec.vocab, nonce), DECODE)
        events = list(sess.events)
    finally:
        sess.close()
    config = record_config(cfg, "built-in demo", f"synthetic, nonce {nonce}", prompt_tokens, DECODE)
    return RunRecord(res.report, events, config)


@pytest.fixture(scope="session")
def demo_runs(demo_path) -> DemoRuns:
    return DemoRuns(record_demo_run(demo_path, 0), record_demo_run(demo_path, 1))


RUN_TIMEOUT_MS = 60_000


def run_once(qtbot, win, **form) -> int:
    """Click Run with these settings; wait until the run finished and is in the history."""
    set_form(win, **form)
    before = win.history.count()
    assert win.run_button.isEnabled(), win.validation.errors
    qtbot.mouseClick(win.run_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: win.last_outcome != "" and not win.controller.is_running, timeout=RUN_TIMEOUT_MS)
    assert win.last_outcome == "finished", win.status_label.text()
    qtbot.waitUntil(lambda: len(win.history_panel.rows) == before + 1, timeout=5_000)
    return win.history_panel.rows[0].id


# the Run tab's form for small real runs in the window tests: 256 tokens in 8 chunks of 32
FORM = dict(devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="32", prompt_mode="tokens", prompt_tokens=256,
            decode_tokens=3)
