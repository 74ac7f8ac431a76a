"""The main window opens inside the screen: its remembered size, clamped to the available area."""
from __future__ import annotations

from gui_support import qsettings, qt_settings_sandbox, themed_app  # noqa: F401


def test_a_remembered_window_larger_than_the_screen_opens_inside_it(themed_app, qtbot, qsettings, demo_path, tmp_path):
    from strata_gui.views.main_window_view import MainWindow

    first = MainWindow(qsettings, demo_path, history_path=tmp_path / "h.sqlite3")
    qtbot.addWidget(first)
    first.setGeometry(40, 40, 3000, 2000)  # e.g. saved on a larger monitor, or at 100% before going to 150%
    first.show()
    first.close()
    again = MainWindow(qsettings, demo_path, history_path=tmp_path / "h.sqlite3")
    qtbot.addWidget(again)
    again.show()
    try:
        avail = again.screen().availableGeometry()  # the offscreen platform's screen: 800x800
        g = again.geometry()
        assert avail.top() <= g.top() and g.bottom() <= avail.bottom(), (g, avail)
        assert g.left() >= avail.left()
        # as wide as the screen, or as narrow as the layout goes (about 1090 px: a 1280-px screen fits it)
        assert g.width() <= max(avail.width(), again.minimumSizeHint().width() + 1)
        # 1920x1080 at 150% leaves about 1280x656 logical px below a task bar and a title bar
        assert again.minimumSizeHint().width() <= 1180 and again.minimumSizeHint().height() <= 640
    finally:
        again.close()
