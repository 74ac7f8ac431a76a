"""Soak through the app: consecutive runs started from the main window (offscreen).

    QT_QPA_PLATFORM=offscreen python benchmarks/soak_app.py --runs 20

Each run is a real demo-model run on a 2-stage CPU split, clicked like a user would, saved to a
temporary run history. Prints RSS, threads and open files; exits non-zero if they grow (RSS
beyond 5% of its level after the warm-up runs).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QSettings  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from engine.io.synth import demo_model_path  # noqa: E402


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wait(app: QApplication, cond, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        app.processEvents()
        if cond():
            return True
        time.sleep(0.01)
    return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1024)
    ns = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="strata-soak-"))
    os.environ["STRATA_GUI_DATA_DIR"] = str(tmp)
    app = QApplication.instance() or QApplication(sys.argv)
    from strata_gui.run.settings_model import RunSettings
    from strata_gui.views import theme
    from strata_gui.views.main_window_view import MainWindow

    theme.apply(app)
    win = MainWindow(QSettings(str(tmp / "settings.ini"), QSettings.Format.IniFormat), demo_model_path(),
                     history_path=tmp / "history.sqlite3")
    win.resize(1600, 1000)
    win.show()
    wait(app, lambda: not win.jobs.busy, 30)
    form = win.current_settings().to_dict()
    form.update(devices="cpu,cpu", chunk_mode="fixed", chunk_size="128", prompt_mode="tokens",
                prompt_tokens=ns.tokens, decode_tokens=4)
    win.apply_settings(RunSettings.from_dict(form))
    rows, base = [], None
    t0 = time.perf_counter()
    for i in range(1, ns.runs + 1):
        if not win.run_button.isEnabled():
            print(f"run {i}: Run is disabled: {win.status_label.text()}")
            return 2
        win.run_button.click()
        if not wait(app, lambda: win.last_outcome != "" and not win.controller.is_running, 120):
            print(f"run {i} did not finish")
            return 2
        if win.last_outcome != "finished":
            print(f"run {i}: {win.last_outcome}: {win.status_label.text()}")
            return 2
        wait(app, lambda: False, 0.05)  # let the batched signals and the history save settle
        s = (i, rss_mib(), threading.active_count(), len(os.listdir("/proc/self/fd")))
        if i == ns.warmup:
            base = s
        if i >= ns.warmup and (i % 5 == 0 or i == ns.warmup):
            rows.append(s)
    runs_saved = win.history.count()
    win.close()
    print(f"app soak: {ns.runs} runs of {ns.tokens} tokens (+4 decode) clicked in the main window on cpu,cpu, "
          f"{time.perf_counter() - t0:.1f} s, {runs_saved} runs in the history")
    print("| run | RSS MiB | threads | open files |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1f} | {r[2]} | {r[3]} |")
    last = rows[-1]
    growth = (last[1] - base[1]) / base[1]
    ok = abs(growth) <= 0.05 and last[2] <= base[2] and last[3] <= base[3] and runs_saved == ns.runs
    print(f"RSS {base[1]:.1f} -> {last[1]:.1f} MiB ({growth * 100:+.1f}%), threads {base[2]} -> {last[2]}, "
          f"open files {base[3]} -> {last[3]}: {'flat' if ok else 'GROWING'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
