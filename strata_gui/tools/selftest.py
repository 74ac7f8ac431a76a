"""`strata-gui --selftest`: open the main window, run the demo model on a 2-stage CPU split, check
the Gantt, tokenise a text prompt with the demo model's vocabulary, run a Triton kernel where CUDA
is present (engine.pipeline.kernel_report.exercise: a frozen build's Triton needs engine/ as source),
optionally save a screenshot.
Works on the offscreen platform; touches no user settings or history (a temporary QSettings file and
run history)."""
from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QEventLoop, QSettings
from PySide6.QtWidgets import QApplication

from ..run.settings_model import RunSettings
from ..views import window_fit
from ..views.main_window_view import MainWindow

log = logging.getLogger(__name__)

SCREEN = (1600, 1000)  # the screen the self-test's window (and the README's screenshot) is sized for

SELFTEST_SETTINGS = RunSettings(model_path="", devices="cpu,cpu", gpu_order="pcie", split_mode="auto",
                                chunk_mode="fixed", chunk_tokens="256", pipeline_depth=1, prompt_mode="tokens",
                                prompt_tokens=2048, decode_tokens=8)
# Text prompts import transformers lazily (GGUF vocabulary -> tokenizer); tokenising this with the
# demo model's vocabulary proves a frozen build carries what that path needs.
SELFTEST_TEXT = "hello world, the pipeline split"


@dataclass(frozen=True)
class SelftestResult:
    ok: bool
    message: str


def wait_until(app: QApplication, done: Callable[[], bool], timeout_s: float) -> bool:
    """Process Qt events until done() or the timeout; whether done() came true."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)
        time.sleep(0.005)
    return True


def _check_text_prompt(demo_model: Path) -> tuple[bool, str]:
    from engine.io import prompt
    from engine.io.gguf_model import load

    try:
        ids = prompt.tokenize(load(demo_model), SELFTEST_TEXT)
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return True, f"text prompt tokenised ({len(ids)} tokens)"


def run_selftest(app: QApplication, demo_model: Path, screenshot: Path | None = None,
                 timeout_s: float = 180.0) -> SelftestResult:
    with tempfile.TemporaryDirectory(prefix="strata-selftest-") as tmp:
        qs = QSettings(str(Path(tmp) / "selftest.ini"), QSettings.Format.IniFormat)
        win = MainWindow(qs, demo_model, history_path=Path(tmp) / "history.sqlite3")
        try:
            # the size a first start picks on a 1600x1000 screen (about 1520x920): what users see,
            # and what the README's screenshot shows
            size = window_fit.fit(None, window_fit.Rect(0, 0, *SCREEN), minimum=(0, 0))
            win.resize(size.w, size.h)
            win.show()
            wait_until(app, lambda: not win.jobs.busy, 30.0)
            win.apply_settings(SELFTEST_SETTINGS)
            if not win.start_run():
                errors = "; ".join(f"{k}: {v}" for k, v in win.validation.errors.items())
                return SelftestResult(False, f"selftest: Run refused: {errors or 'a run is already in flight'}")
            if not wait_until(app, lambda: not win.controller.is_running, timeout_s):
                win.controller.stop()
                return SelftestResult(False, f"selftest: the run did not finish within {timeout_s:.0f} s")
            app.processEvents()
            if screenshot is not None:
                screenshot.parent.mkdir(parents=True, exist_ok=True)
                if not win.grab().save(str(screenshot)):
                    return SelftestResult(False, f"selftest: could not write the screenshot {screenshot}")
            if win.last_outcome != "finished" or win.last_report is None:
                return SelftestResult(False, f"selftest: the run did not finish ({win.last_outcome or 'no outcome'}): "
                                             f"{win.status_label.text()}")
            plan = win.last_report.plan
            ok, what = win.gantt.store.one_compute_per_stage_chunk(len(plan.stages), plan.n_chunks)
            if not ok:
                return SelftestResult(False, f"selftest: Gantt check failed: {what}")
            text_ok, text_what = _check_text_prompt(demo_model)
            if not text_ok:
                return SelftestResult(False, f"selftest: text prompt failed: {text_what}")
            from engine.pipeline import kernel_report

            triton_ok, triton_what = kernel_report.exercise()
            if not triton_ok:
                return SelftestResult(False, f"selftest: Triton kernel failed: {triton_what}")
            r = win.last_report
            shot = f"; screenshot {screenshot}" if screenshot is not None else ""
            return SelftestResult(True, f"selftest passed: {what}; prefill {r.prefill_tok_s:,.0f} tok/s, "
                                        f"digest {r.digest}; {text_what}; {triton_what}{shot}")
        finally:
            win.close()
