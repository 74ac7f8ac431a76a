"""The main window's place on the screen: remembered, clamped, and a default that fits."""
from strata_gui.views.window_fit import TITLE_BAR, Rect, fit

FULL_HD_150 = Rect(0, 0, 1280, 672)  # 1920x1080 at 150%, less a 48 px task bar


def test_first_start_fits_a_scaled_screen_and_is_centred():
    r = fit(None, FULL_HD_150, minimum=(1000, 600))
    assert r.w <= 1280 and r.y + r.h <= 672 and r.y >= TITLE_BAR
    assert r.x == (1280 - r.w) // 2
    assert fit(None, Rect(0, 0, 2560, 1400)) == Rect(480, TITLE_BAR + (1368 - 1000) // 2, 1600, 1000)


def test_a_remembered_window_keeps_its_size_and_place_when_it_fits():
    saved = Rect(100, 80, 1200, 600)
    assert fit(saved, Rect(0, 0, 1920, 1040)) == saved


def test_a_remembered_window_larger_than_the_screen_is_shrunk_and_moved_on_screen():
    r = fit(Rect(900, 500, 1600, 1000), FULL_HD_150, minimum=(1000, 600))
    assert (r.w, r.h) == (1280, 672 - TITLE_BAR)
    assert r.x == 0 and r.y + r.h <= 672
    left_screen = fit(Rect(-3000, 100, 800, 600), Rect(0, 0, 1920, 1040))  # a monitor that is gone
    assert left_screen.x == 0 and left_screen.w == 800


def test_never_below_the_layouts_minimum_unless_the_screen_is_smaller():
    r = fit(Rect(0, 100, 400, 300), Rect(0, 0, 1920, 1040), minimum=(1000, 600))
    assert (r.w, r.h) == (1000, 600)
    tiny = fit(None, Rect(0, 0, 800, 600), minimum=(1000, 600))
    assert tiny.w == 800 and tiny.h == 600 - TITLE_BAR
