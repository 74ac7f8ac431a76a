"""Fixtures and helpers of the GUI tests (imported by tests/test_gui_*.py).

tests/conftest.py already puts Qt on the offscreen platform and provides `demo_path` (the demo
model generated into a temporary folder).  Here: settings that never touch the user's (a temporary
QSettings file, and any default-constructed QSettings redirected to a temporary folder), the
application theme, and a shown main window that is closed (run cancelled, threads joined) after
the test."""
from __future__ import annotations

import os
import threading
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
from PySide6.QtCore import QCoreApplication, QSettings  # noqa: E402

ENGINE_THREAD_PREFIXES = ("strata-stage", "strata-gui-batcher", "strata-telemetry", "strata-digest")


@pytest.fixture(scope="session", autouse=True)
def qt_settings_sandbox(tmp_path_factory: pytest.TempPathFactory):
    """Any QSettings() made without a file goes to a temporary folder under a test organisation,
    and the run history of a window made without a history path to a temporary data folder."""
    folder = tmp_path_factory.mktemp("qsettings")
    for scope in (QSettings.Scope.UserScope, QSettings.Scope.SystemScope):
        QSettings.setPath(QSettings.Format.IniFormat, scope, str(folder))
    QSettings.setDefaultFormat(QSettings.Format.IniFormat)
    QCoreApplication.setOrganizationName("strata-gui-tests")
    QCoreApplication.setApplicationName("strata-gui-tests")
    from strata_gui.history.history_model import ENV_DIR

    old = os.environ.get(ENV_DIR)
    os.environ[ENV_DIR] = str(tmp_path_factory.mktemp("strata-gui-data"))
    yield folder
    if old is None:
        os.environ.pop(ENV_DIR, None)
    else:
        os.environ[ENV_DIR] = old


@pytest.fixture
def qsettings(tmp_path):
    return QSettings(str(tmp_path / "strata-gui-test.ini"), QSettings.Format.IniFormat)


@pytest.fixture
def themed_app(qapp):
    from strata_gui.views import theme

    theme.apply(qapp)
    return qapp


@pytest.fixture
def window(themed_app, qtbot, qsettings, demo_path, tmp_path):
    """The main window on the demo model (a run history of its own), shown, device discovery done."""
    from strata_gui.views.main_window_view import MainWindow

    win = MainWindow(qsettings, demo_path, history_path=tmp_path / "history.sqlite3")
    qtbot.addWidget(win)
    win.resize(1600, 1000)
    win.show()
    qtbot.waitUntil(lambda: not win.jobs.busy, timeout=20_000)
    yield win
    win.close()
    assert not win.controller.is_running


def wait_model(qtbot, win, timeout_ms: int = 20_000) -> None:
    """Until the model file the form names is parsed (a background job) and the form revalidated."""
    qtbot.waitUntil(lambda: not win.model_pending, timeout=timeout_ms)


def set_form(win, **values) -> None:
    """Put RunSettings values into the window's panels (as a user would, then revalidate)."""
    from strata_gui.run.settings_model import RunSettings

    current = win.current_settings().to_dict()
    current.update(values)
    win.apply_settings(RunSettings.from_dict(current))


def engine_threads() -> list[str]:
    """Engine threads doing work.  A loaded session keeps its stage workers between runs; idle
    ones (`strata_busy` clear) are not counted — closing the session stops them."""
    return [t.name for t in threading.enumerate() if t.is_alive() and t.name.startswith(ENGINE_THREAD_PREFIXES)
            and not (hasattr(t, "strata_busy") and not t.strata_busy.is_set())]


def wait_no_engine_threads(timeout_s: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while engine_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine_threads()
