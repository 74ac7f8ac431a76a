"""`strata-gui --selftest`: in process, and as the command a user (or CI) runs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gui_support import qt_settings_sandbox, themed_app  # noqa: F401
from PySide6.QtGui import QImage

from strata_gui.app import build_parser
from strata_gui.tools.selftest import run_selftest

ROOT = Path(__file__).resolve().parents[1]


def test_selftest_in_process_passes_and_saves_a_screenshot(themed_app, demo_path, tmp_path):
    shot = tmp_path / "selftest.png"
    result = run_selftest(themed_app, demo_path, shot)
    assert result.ok, result.message
    assert "one per (stage, chunk) for 2 stages x 8 chunks" in result.message
    img = QImage(str(shot))
    assert not img.isNull() and img.width() >= 1200 and img.height() >= 800


def test_python_m_strata_gui_selftest_exits_0(tmp_path):
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "XDG_CONFIG_HOME": str(tmp_path / "config"), "PYTHONPATH": str(ROOT)}
    shot = tmp_path / "cli.png"
    proc = subprocess.run([sys.executable, "-m", "strata_gui", "--selftest", "--screenshot", str(shot)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "selftest passed" in proc.stdout and shot.is_file()
    assert (tmp_path / "cache" / "strata-gui").is_dir()  # the demo model went to the (redirected) cache


def test_screenshot_needs_selftest():
    ns = build_parser().parse_args(["--selftest", "--screenshot", "x.png"])
    assert ns.selftest and ns.screenshot == Path("x.png")
    from strata_gui.app import main

    assert main(["--screenshot", "x.png"]) == 2
