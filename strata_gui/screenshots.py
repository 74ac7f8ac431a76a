"""The documentation screenshots: the main window during and after a real run of the demo model
on a 2-stage CPU split (no slowed-down hooks: the prompt is simply long enough to watch).

    QT_QPA_PLATFORM=offscreen python -m strata_gui.screenshots docs/screenshots
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from PySide6.QtCore import QEventLoop, QSettings

from .run_settings import RunSettings

log = logging.getLogger(__name__)

SETTINGS = RunSettings(model_path="", devices="cpu,cpu", chunk_mode="fixed", chunk_size="256", pf_depth=1,
                       prompt_mode="tokens", prompt_tokens=8192, decode_tokens=16)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m strata_gui.screenshots", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="folder for main-during-run.png and main-after-run.png")
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--height", type=int, default=1000)
    ap.add_argument("--during-at", type=float, default=0.45, help="share of the chunks done at the first shot")
    ns = ap.parse_args(argv)
    from engine.synth import demo_model_path

    from .app import make_app
    from .mainwindow import MainWindow

    app = make_app()
    ns.out.mkdir(parents=True, exist_ok=True)

    def pump(until, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not until():
            if time.monotonic() > deadline:
                return False
            app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 20)
            time.sleep(0.002)
        return True

    with tempfile.TemporaryDirectory() as tmp:
        win = MainWindow(QSettings(str(Path(tmp) / "s.ini"), QSettings.Format.IniFormat), demo_model_path())
        win.resize(ns.width, ns.height)
        win.show()
        pump(lambda: not win.jobs.busy, 30)
        win.apply_settings(SETTINGS)
        if not win.start_run():
            sys.stderr.write(f"cannot start: {win.validation.errors}\n")
            return 1

        def far_enough() -> bool:
            snap = win.progress_model.snapshot() if win.progress_model else None
            return snap is not None and snap.chunks_done >= ns.during_at * snap.n_chunks

        if not pump(far_enough, 120):
            sys.stderr.write("the run did not get far enough for the first screenshot\n")
            return 1
        during = ns.out / "main-during-run.png"
        win.grab().save(str(during))
        if not pump(lambda: not win.controller.is_running, 300) or win.last_outcome != "finished":
            sys.stderr.write(f"the run did not finish: {win.status_label.text()}\n")
            return 1
        # Rendering the whole window holds the GIL for ~0.1 s, which shows as a gap in a CPU run's
        # timeline; the "after" shot is of a second, unobserved run (the loaded model is reused).
        if not win.start_run() or not pump(lambda: not win.controller.is_running, 300) \
                or win.last_outcome != "finished":
            sys.stderr.write(f"the second run did not finish: {win.status_label.text()}\n")
            return 1
        app.processEvents()
        after = ns.out / "main-after-run.png"
        win.grab().save(str(after))
        win.close()
    sys.stdout.write(f"wrote {during} and {after}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
