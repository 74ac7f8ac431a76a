"""The main window's menus, with the shortcuts a desktop app has: File (Ctrl+Q quit), Run
(Ctrl+R run, Ctrl+. stop), View (Ctrl+1..4: the first four tabs)."""
from __future__ import annotations

from collections.abc import Callable

from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QMainWindow, QMenu, QTabWidget


def _action(owner: QMainWindow, menu: QMenu, text: str, key: str, slot: Callable) -> QAction:
    act = QAction(text, owner)
    act.setShortcut(QKeySequence(key))
    act.triggered.connect(slot)
    menu.addAction(act)
    return act


def build_menus(win: QMainWindow, tabs: QTabWidget, run: Callable[[], object],
                stop: Callable[[], object]) -> tuple[QAction, QAction, QAction]:
    """The menus on `win`'s menu bar; returns the (quit, run, stop) actions."""
    bar = win.menuBar()
    # Ctrl+Q: StandardKey.Quit is empty on Windows
    quit_action = _action(win, bar.addMenu("&File"), "&Quit", "Ctrl+Q", win.close)
    run_menu = bar.addMenu("&Run")
    run_action = _action(win, run_menu, "&Run", "Ctrl+R", run)
    run_action.setToolTip("Prefill the prompt through the split with the Run tab's settings.")
    stop_action = _action(win, run_menu, "&Stop", "Ctrl+.", stop)
    view_menu = bar.addMenu("&View")
    for i in range(4):
        _action(win, view_menu, f"{tabs.tabText(i)} tab", f"Ctrl+{i + 1}",
                lambda _=False, i=i: tabs.setCurrentIndex(i))
    return quit_action, run_action, stop_action
