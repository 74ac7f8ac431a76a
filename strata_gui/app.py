"""`strata-gui`: the application entry point (also `python -m strata_gui`)."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence

from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QApplication

from . import __version__, theme

log = logging.getLogger("strata_gui")

ORGANIZATION = "Strata"
APPLICATION = "Strata GUI"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="strata-gui", description="Watch and tune a layer-split MoE prefill "
                                                                "pipeline across the devices of one workstation.")
    ap.add_argument("--selftest", action="store_true",
                    help="run the demo model on a 2-stage CPU split, check the Gantt, exit 0 when it passed")
    ap.add_argument("--screenshot", type=Path, help="with --selftest: save a screenshot of the window (PNG)")
    ap.add_argument("--model", type=Path, help="open this GGUF model instead of the last one used")
    ap.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return ap


def make_app(argv: Sequence[str] | None = None) -> QApplication:
    app = QApplication.instance() or QApplication([sys.argv[0], *(argv or [])])
    app.setOrganizationName(ORGANIZATION)
    app.setApplicationName(APPLICATION)
    app.setApplicationVersion(__version__)
    theme.apply(app)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if ns.screenshot is not None and not ns.selftest:
        print("strata-gui: --screenshot needs --selftest", file=sys.stderr)
        return 2
    app = make_app()
    from engine.synth import demo_model_path

    from .mainwindow import MainWindow

    try:
        demo = demo_model_path()
    except Exception as exc:  # e.g. an unwritable cache directory
        print(f"strata-gui: cannot prepare the demo model: {exc}", file=sys.stderr)
        return 1
    if ns.selftest:
        from .selftest import run_selftest

        result = run_selftest(app, demo, ns.screenshot)
        print(result.message, file=sys.stdout if result.ok else sys.stderr)
        return 0 if result.ok else 1
    win = MainWindow(QSettings(), demo)
    if ns.model is not None:
        win.settings_panel.set_model_path(str(ns.model))
    win.resize(1600, 1000)
    win.show()
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
