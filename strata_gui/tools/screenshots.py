"""The documentation screenshots, all of real runs of the demo model on a 2-stage CPU split (no
slowed-down hooks: the prompts are simply long enough to watch), in a temporary run history:

- main-during-run.png, main-after-run.png: the Run tab during and after a run;
- compare.png: pipeline_depth 0 (join) against pipeline_depth 1 (overlap) on the same prompt, three repeats each;
- sweep.png: join vs overlap over four prompt sizes, five repeats each;
- plan.png: the Plan tab predicting a pipeline_depth 1 run from its own measured costs, the predicted
  Gantt above the measured one (after a warm-up run: the planner's error is the point);
- history.png: the History tab holding all of those runs.

    QT_QPA_PLATFORM=offscreen python -m strata_gui.tools.screenshots docs/screenshots
    QT_QPA_PLATFORM=offscreen QT_SCALE_FACTOR=1.5 python -m strata_gui.tools.screenshots docs/screenshots \
        --screen 1280x688 --views main,compare --suffix=-150pct  # docs/screenshots/main-150pct.png: main-after-run-150pct.png

The window has the size the app gives it on first start on `--screen` (the available area, in
logical pixels; default 1920x1040: a 1920x1080 screen less a task bar), as users see it
(strata_gui/views/window_fit.py), not a larger, cleaner size; `--width/--height` override it.
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from PySide6.QtCore import QSettings

from ..run.settings_model import RunSettings

log = logging.getLogger(__name__)

SETTINGS = RunSettings(model_path="", devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="256", pipeline_depth=1,
                       prompt_mode="tokens", prompt_tokens=8192, decode_tokens=16)
# three repeats per arm: Compare then judges the ratio against their spread
COMPARE_SETTINGS = RunSettings(model_path="", devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="256",
                               pipeline_depth=0, prompt_mode="tokens", prompt_tokens=4096, decode_tokens=8, repeats=3)
SWEEP_SIZES = "1K, 2K, 4K, 8K"
SWEEP_ARMS = (("join", "pipeline_depth=0"), ("overlap", "pipeline_depth=1"))
SWEEP_REPEATS = 5
VIEWS = ("main", "compare", "sweep", "plan", "history")


class _Shots:
    """The window in a temporary history, and the runs and shots each view needs."""

    def __init__(self, app, win, out: Path, during_at: float, suffix: str = "") -> None:
        from .selftest import wait_until

        self.app, self.win, self.out, self.during_at, self.suffix = app, win, out, during_at, suffix
        self.wait_until = wait_until
        self.written: list[Path] = []

    def pump(self, until: Callable[[], bool], timeout_s: float) -> bool:
        return self.wait_until(self.app, until, timeout_s)

    def run(self, settings: RunSettings, during: Path | None = None) -> int | None:
        """One run from the Run tab; its id in the history."""
        win = self.win
        win.tabs.setCurrentWidget(win.run_tab)
        win.apply_settings(settings)
        saved_before = win.history.count()
        if not win.start_run():
            sys.stderr.write(f"cannot start: {win.validation.errors}\n")
            return None
        if during is not None:
            def far_enough() -> bool:
                snap = win.progress_model.snapshot() if win.progress_model else None
                return snap is not None and snap.chunks_done >= self.during_at * snap.n_chunks

            if not self.pump(far_enough, 120):
                sys.stderr.write("the run did not get far enough for the first screenshot\n")
                return None
            win.grab().save(str(during))
            self.written.append(during)
        if not self.pump(lambda: not win.controller.is_running, 300) or win.last_outcome != "finished":
            sys.stderr.write(f"the run did not finish: {win.status_label.text()}\n")
            return None
        self.pump(lambda: win.history.count() > saved_before, 10)
        return win.history.list_runs(limit=1)[0].id

    def path(self, name: str) -> Path:
        """main-after-run.png -> OUT/main-after-run<suffix>.png"""
        n = Path(name)
        return self.out / f"{n.stem}{self.suffix}{n.suffix}"

    def shot(self, name: str) -> bool:
        self.app.processEvents()
        path = self.path(name)
        self.win.grab().save(str(path))
        self.written.append(path)
        return True

    # ------------------------------------------------------------ one per view; False: it failed
    def main(self) -> bool:
        if self.run(SETTINGS, self.path("main-during-run.png")) is None:
            return False
        # Rendering the whole window holds the GIL for ~0.1 s, which shows as a gap in a CPU run's
        # timeline; the "after" shot is of a second, unobserved run (the loaded model is reused).
        return self.run(SETTINGS) is not None and self.shot("main-after-run.png")

    def compare(self) -> bool:
        join = self.run(COMPARE_SETTINGS)
        overlap = self.run(RunSettings.from_dict({**COMPARE_SETTINGS.to_dict(), "pipeline_depth": 1}))
        if join is None or overlap is None:
            return False
        self.win.compare_runs(join, overlap)
        return self.shot("compare.png")

    def sweep(self) -> bool:
        win = self.win
        view = win.sweep_view
        win.tabs.setCurrentWidget(win.run_tab)
        win.apply_settings(RunSettings.from_dict({**COMPARE_SETTINGS.to_dict(), "decode_tokens": 0}))
        win.tabs.setCurrentWidget(view)
        view.sizes.setText(SWEEP_SIZES)
        view.repeats.setValue(SWEEP_REPEATS)
        view.warmup.setValue(1)
        view.set_arms(SWEEP_ARMS)
        if not win.start_sweep():
            sys.stderr.write(f"cannot start the sweep: {view.errors.text()}\n")
            return False
        if not self.pump(lambda: not win.sweeps.is_running, 600) or not view.results.complete:
            sys.stderr.write(f"the sweep did not finish: {view.progress_label.text()}\n")
            return False
        return self.shot("sweep.png")

    def plan(self) -> bool:
        settings = RunSettings.from_dict({**COMPARE_SETTINGS.to_dict(), "pipeline_depth": 1})
        if self.run(settings) is None:  # warm-up: the planner's start run should not be a cold one
            return False
        source = self.run(settings)
        if source is None:
            return False
        self.win.tabs.setCurrentWidget(self.win.plan_tab)
        if not self.win.plan_tab.plan_from(source):
            sys.stderr.write(f"cannot plan from run #{source}: {self.win.plan_tab.view.headline.text()}\n")
            return False
        return self.shot("plan.png")

    def history(self) -> bool:
        self.win.tabs.setCurrentWidget(self.win.history_panel)
        self.win.history_panel.refresh()
        return self.shot("history.png")


def _window_size(win, ns: argparse.Namespace) -> tuple[int, int]:
    """--width/--height, else what MainWindow.fit_to_screen gives a first start on --screen."""
    from ..views.window_fit import Rect, fit

    sw, _, sh = ns.screen.partition("x")
    hint = win.minimumSizeHint()
    r = fit(None, Rect(0, 0, int(sw), int(sh)), (hint.width(), hint.height()))
    return ns.width or r.w, ns.height or r.h


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m strata_gui.tools.screenshots", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="folder for the PNG files")
    ap.add_argument("--screen", default="1920x1040", help="the screen's available area WxH (logical px): the window "
                                                         "gets the app's first-start size on it")
    ap.add_argument("--width", type=int, help="the window's width instead (logical px)")
    ap.add_argument("--height", type=int, help="the window's height instead (logical px)")
    ap.add_argument("--suffix", default="", help="added to each file's name (main-after-run-150pct.png)")
    ap.add_argument("--during-at", type=float, default=0.45, help="share of the chunks done at the first shot")
    ap.add_argument("--views", default=",".join(VIEWS), help=f"comma-separated, of {', '.join(VIEWS)}")
    ns = ap.parse_args(argv)
    views = [v.strip() for v in ns.views.split(",") if v.strip()]
    unknown = sorted(set(views) - set(VIEWS))
    if unknown:
        ap.error(f"unknown view(s) {', '.join(unknown)}: allowed {', '.join(VIEWS)}")
    from engine.io.synth import demo_model_path

    from ..app import make_app
    from ..views.main_window_view import MainWindow

    app = make_app()
    ns.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        win = MainWindow(QSettings(str(Path(tmp) / "s.ini"), QSettings.Format.IniFormat), demo_model_path(),
                         history_path=Path(tmp) / "history.sqlite3")
        w, h = _window_size(win, ns)
        win.resize(w, h)
        win.show()
        log.info("window %dx%d", win.width(), win.height())
        shots = _Shots(app, win, ns.out, ns.during_at, ns.suffix)
        shots.pump(lambda: not win.jobs.busy, 30)
        try:
            for view in VIEWS:  # in this order: compare's runs are the history's, and so on
                if view in views and not getattr(shots, view)():
                    return 1
        finally:
            win.close()
    sys.stdout.write("wrote " + ", ".join(str(p) for p in shots.written) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
