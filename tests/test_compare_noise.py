"""The noise model of Compare, without the GUI: intervals from repeats, neutral inside the noise,
figures a change cannot affect, cold runs, and the history's same-settings pool."""
from __future__ import annotations

import dataclasses

import pytest
from history_support import demo_runs  # noqa: F401

from strata_gui.history.compare_model import DiffRow, MetricRow, SampleSet, compare, gather_samples, unaffected_reason
from strata_gui.history.history_model import RunHistory
from strata_gui.run.spread_model import Spread, format_spread


def test_spread_median_range_and_relative_half_range():
    s = Spread.of([100.0, 110.0, 90.0, None])
    assert (s.n, s.median, s.lo, s.hi) == (3, 100.0, 90.0, 110.0)
    assert s.rel == pytest.approx(0.10)
    assert s.sd == pytest.approx(10.0)  # the sample sd (n - 1), strata-bench's ± sd
    assert format_spread(s, unit="tok/s") == "100 tok/s (median of 3; 90–110, ± sd 10)"
    one = Spread.of([5.0])
    assert not one.known and one.rel is None and format_spread(one) == "5"


def test_ratio_interval_decides_the_colour():
    overlap = MetricRow("prefill tok/s", "tok/s", 100.0, 104.0, "higher", Spread.of([95, 100, 106]),
                        Spread.of([99, 104, 108]))
    assert overlap.interval == pytest.approx((99 / 106, 108 / 95))
    assert overlap.within_noise is True and overlap.verdict == ""
    assert overlap.judgement.startswith("within noise (±")
    clear = dataclasses.replace(overlap, after=150.0, after_spread=Spread.of([145, 150, 155]))
    assert clear.within_noise is False and clear.verdict == "better"
    worse = dataclasses.replace(clear, better="lower")
    assert worse.verdict == "worse"
    single = MetricRow("prefill tok/s", "tok/s", 100.0, 150.0, "higher")
    assert single.interval is None and single.verdict == "" and single.judgement.startswith("noise unknown")


def test_decode_is_unaffected_by_prefill_only_settings():
    depth = [DiffRow("pipeline_depth", "0", "1")]
    assert unaffected_reason("decode tok/s", depth).startswith("not affected by pipeline_depth")
    assert unaffected_reason("prefill tok/s", depth) == ""
    assert unaffected_reason("decode tok/s", [DiffRow("devices", "cpu", "cpu,cpu")]) == ""
    assert unaffected_reason("prefill tok/s", []) == "no setting differs"
    within = MetricRow("decode tok/s", "tok/s", 100.0, 103.0, "higher", Spread.of([95, 105]), Spread.of([98, 108]),
                       unaffected_reason("decode tok/s", depth))
    assert within.verdict == "" and within.judgement.startswith("within noise (±")
    beyond = dataclasses.replace(within, after=280.0, after_spread=Spread.of([270, 290]))
    assert beyond.verdict == "" and "yet beyond the noise" in beyond.judgement  # flagged, never coloured


def test_measurement_keys_are_never_a_setting_difference(demo_runs):
    a = dataclasses.replace(demo_runs.join, config={**demo_runs.join.config, "repeat": 1, "repeats": 3,
                                                     "repeat_group": "aaa", "warmup": True, "cold": False})
    b = dataclasses.replace(demo_runs.join, config={**demo_runs.join.config, "repeat": 2, "repeats": 1,
                                                     "repeat_group": "bbb", "warmup": False, "cold": True})
    c = compare(a, b)
    assert c.diff == [] and c.cold == (False, True)


def test_history_pools_same_settings_runs_and_leaves_cold_ones_out(demo_runs, tmp_path):
    join, overlap = demo_runs.join, demo_runs.overlap
    with RunHistory(tmp_path / "h.sqlite3") as h:
        ids = [h.add(join), h.add(join), h.add(overlap)]
        cold = h.add(dataclasses.replace(join, config={**join.config, "cold": True}))
        got = gather_samples(h, ids[0], h.get(ids[0]))
        assert got.source == "same settings" and got.n == 2  # the two joins; not the overlap, not the cold run
        alone = gather_samples(h, ids[2], h.get(ids[2]))
        assert alone.source == "" and alone.n == 1
        group = [h.add(dataclasses.replace(overlap, config={**overlap.config, "repeat": k + 1, "repeats": 3,
                                                             "repeat_group": "g1"})) for k in range(3)]
        reps = gather_samples(h, group[1], h.get(group[1]))
        assert reps.source == "repeats" and reps.n == 3
        assert cold not in (ids + group)
    assert isinstance(SampleSet().reports, tuple)
