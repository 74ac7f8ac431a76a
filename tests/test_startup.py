"""Start-up: the splash screen is on screen before torch, the engine or pyqtgraph are imported."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_splash_shows_before_any_heavy_import():
    code = ("import sys\n"
            "from strata_gui import app\n"
            "a = app.make_app(plots=False)\n"
            "s = app.show_splash(a)\n"
            "assert s.isVisible()\n"
            "heavy = sorted(m for m in ('torch', 'pyqtgraph', 'engine.pipeline.session', 'numpy') if m in sys.modules)\n"
            "print('heavy:', heavy)\n")
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "heavy: []" in out.stdout, out.stdout


def test_the_main_window_is_drawn_before_torch_is_imported(tmp_path, demo_path):
    """Issue 37: the window shows without torch; device discovery and the model's parse (which
    import it) are held until it is drawn, then start in the background."""
    code = ("import sys\n"
            "from PySide6.QtCore import QSettings\n"
            "from strata_gui import app\n"
            f"demo = {str(demo_path)!r}  # written by this test's process (the writer needs torch)\n"
            "a = app.make_app(plots=False)\n"
            "from strata_gui.views.main_window_view import MainWindow\n"
            "w = MainWindow(QSettings(sys.argv[1], QSettings.Format.IniFormat), demo, hold_jobs=True)\n"
            "w.show()\n"
            "a.processEvents()\n"
            "print('drawn, torch:', 'torch' in sys.modules, 'jobs held:', w.jobs.busy)\n"
            "w.jobs.release()\n"
            "import time\n"
            "t = time.monotonic()\n"
            "while w.jobs.busy and time.monotonic() - t < 120:\n"
            "    a.processEvents(); time.sleep(0.01)\n"
            "print('after the jobs, torch:', 'torch' in sys.modules, 'devices found:', w.controller.topology is not None)\n"
            "w.close()\n")
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(ROOT),
           "STRATA_GUI_DATA_DIR": str(tmp_path / "data")}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s.ini")], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "drawn, torch: False jobs held: True" in out.stdout, out.stdout
    assert "after the jobs, torch: True devices found: True" in out.stdout, out.stdout


def test_startup_exit_window_opens_the_main_window_and_quits(tmp_path):
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(ROOT),
           "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "STRATA_GUI_DATA_DIR": str(tmp_path / "data")}
    out = subprocess.run([sys.executable, "-m", "strata_gui", "--startup-exit", "window"], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "strata-gui: window on screen" in out.stderr  # the line benchmarks/startup.sh times
    assert (tmp_path / "cache").exists()  # the demo model was prepared behind the splash
