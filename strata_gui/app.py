"""`strata-gui`: the application entry point (also `python -m strata_gui`).

Start-up: only Qt is imported before a splash screen shows (about 1 s here); then pyqtgraph and
the window, which import no torch (issue 37: torch is 1.3-2 s of imports on a 2-core machine, more
on a cold Windows disk).  The window's first jobs (device discovery, the model's parse: they import
torch) are held until it is drawn, then run in the background.  A first start writes the demo model
before the window (that needs torch).  `--startup-exit splash|window` quits as soon as that is
on screen, after writing "strata-gui: window on screen" to stderr: benchmarks/startup.sh times
that line (plain `time strata-gui --startup-exit window` adds the interpreter's exit).
"""
from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from PySide6.QtCore import QSettings, Qt, QTimer
from PySide6.QtGui import QColor, QFont, QIcon, QPainter, QPixmap
from PySide6.QtWidgets import QApplication, QSplashScreen

from . import __version__
from .views import theme

log = logging.getLogger("strata_gui")

ORGANIZATION = "Strata"
APPLICATION = "Strata GUI"
# assets/ beside the packages: the source tree, and the PyInstaller bundle (packaging/strata_gui.spec)
ICON = Path(__file__).resolve().parents[1] / "assets" / "strata.png"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="strata-gui", description="Watch and tune a layer-split MoE prefill "
                                                                "pipeline across the devices of one workstation.")
    ap.add_argument("--selftest", action="store_true",
                    help="run the demo model on a 2-stage CPU split, check the Gantt, exit 0 when it passed")
    ap.add_argument("--screenshot", type=Path, help="with --selftest: save a screenshot of the window (PNG) and "
                                                    "the result beside it (same name, .log)")
    ap.add_argument("--model", type=Path, help="open this GGUF model instead of the last one used")
    ap.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    ap.add_argument("--startup-exit", choices=("splash", "window"),
                    help="quit as soon as the splash screen or the main window is on screen (to time the start-up)")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return ap


def make_app(argv: Sequence[str] | None = None, plots: bool = True) -> QApplication:
    app = QApplication.instance() or QApplication([sys.argv[0], *(argv or [])])
    app.setOrganizationName(ORGANIZATION)
    app.setApplicationName(APPLICATION)
    app.setApplicationVersion(__version__)
    if ICON.is_file():
        app.setWindowIcon(QIcon(str(ICON)))
    theme.apply(app, plots)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if ns.screenshot is not None and not ns.selftest:
        print("strata-gui: --screenshot needs --selftest", file=sys.stderr)
        return 2
    app = make_app(plots=False)
    splash = None if ns.selftest else show_splash(app)
    if ns.startup_exit == "splash":
        return _exit_soon(app, splash, "splash")
    theme.configure_pyqtgraph()
    try:
        if splash is not None:
            splash.showMessage("preparing the demo model …", SPLASH_ALIGN, QColor("#202124"))
            app.processEvents()
        from engine.io.demo_file import demo_file

        demo = demo_file()
        if not demo.exists():  # the first start writes it (torch and the gguf writer: only then)
            from engine.io.synth import demo_model_path

            demo = demo_model_path()
    except Exception as exc:  # e.g. an unwritable cache directory
        message = f"strata-gui: cannot prepare the demo model: {exc}"
        print(message, file=sys.stderr)
        if ns.selftest:
            _write_selftest_log(ns.screenshot, False, message)
        return 1
    if ns.selftest:
        try:
            from .tools.selftest import run_selftest

            result = run_selftest(app, demo, ns.screenshot)
            ok, message = result.ok, result.message
        except Exception:  # a frozen build missing a module lands here: report it, never a dialog
            ok, message = False, f"selftest: crashed\n{traceback.format_exc()}"
        print(message, file=sys.stdout if ok else sys.stderr)
        _write_selftest_log(ns.screenshot, ok, message)
        return 0 if ok else 1
    splash.showMessage("loading torch and the engine …", SPLASH_ALIGN, QColor("#202124"))
    app.processEvents()
    from .views.main_window_view import MainWindow

    splash.showMessage("opening the window …", SPLASH_ALIGN, QColor("#202124"))
    app.processEvents()
    win = MainWindow(QSettings(), demo, hold_jobs=True)
    if ns.model is not None:
        win.settings_panel.set_model_path(str(ns.model))
    win.show()  # at its remembered size and place, clamped to the screen (MainWindow.fit_to_screen)
    splash.finish(win)
    app.processEvents()  # drawn: now device discovery and the model's parse (they import torch)
    if ns.startup_exit == "window":
        _say_on_screen("window")  # before the held jobs start: what follows is not the window's start-up
    win.jobs.release()
    if ns.startup_exit == "window":
        return _exit_soon(app, win)
    return app.exec()


SPLASH_ALIGN = Qt.AlignmentFlag.AlignBottom | Qt.AlignmentFlag.AlignHCenter


def show_splash(app: QApplication) -> QSplashScreen:
    """A splash screen drawn from the icon, on screen before any heavy import."""
    pix = QPixmap(420, 200)
    pix.fill(QColor("#F4F6F8"))
    painter = QPainter(pix)
    icon = QPixmap(str(ICON)) if ICON.is_file() else QPixmap()
    if not icon.isNull():
        painter.drawPixmap(24, 40, icon.scaled(96, 96, Qt.AspectRatioMode.KeepAspectRatio,
                                               Qt.TransformationMode.SmoothTransformation))
    font = QFont(app.font())
    font.setPointSize(16)
    font.setBold(True)
    painter.setFont(font)
    painter.setPen(QColor("#202124"))
    painter.drawText(140, 80, APPLICATION)
    font.setPointSize(10)
    font.setBold(False)
    painter.setFont(font)
    painter.drawText(140, 106, "layer-split prefill pipeline")
    painter.end()
    splash = QSplashScreen(pix)
    splash.showMessage("starting …", SPLASH_ALIGN, QColor("#202124"))
    splash.show()
    app.processEvents()
    return splash


def _say_on_screen(what: str) -> None:
    print(f"strata-gui: {what} on screen", file=sys.stderr, flush=True)


def _exit_soon(app: QApplication, shown, what: str | None = None) -> int:
    """Let the event loop paint what was shown (saying so on stderr when `what`), then quit
    (--startup-exit)."""
    def done() -> None:
        if what:
            _say_on_screen(what)
        app.quit()

    QTimer.singleShot(50, done)
    code = app.exec()
    if shown is not None:
        shown.close()
    return code


def _write_selftest_log(screenshot: Path | None, ok: bool, message: str) -> None:
    """The result beside the screenshot (selftest.png -> selftest.log): a windowed Windows build
    has no console, so this file is where its self-test speaks."""
    if screenshot is None:
        return
    try:
        log_path = screenshot.with_suffix(".log")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        frozen = " (frozen)" if getattr(sys, "frozen", False) else ""
        log_path.write_text(f"strata-gui {__version__}{frozen} selftest: {'PASSED' if ok else 'FAILED'}\n"
                            f"{message}\n", encoding="utf-8")
    except OSError as exc:
        print(f"strata-gui: cannot write the selftest log: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
