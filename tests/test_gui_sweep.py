"""Prompt-size sweeps: the plan (sizes, arms, strata-bench's order and nonces), the results table
(the bench's median, ± sd and ratio), CSV and markdown, and real sweeps of the demo model in the
window: charted point by point, stoppable with the finished points kept, reopened from the history."""
from __future__ import annotations

import csv
import io
import statistics
import threading
import time

import pytest
from gui_support import qsettings, qt_settings_sandbox, set_form, themed_app, wait_no_engine_threads, window  # noqa: F401
from PySide6.QtCore import Qt

from engine.cli.bench import Point
from engine.config import ConfigError
from engine.io import prompt as prompts
from engine.pipeline.session import PipelineHooks
from strata_gui.sweep.sweep_model import SweepArm, SweepPlan, SweepResults, arm_config, format_tokens, parse_sizes

BASE = {"devices": "cpu,cpu", "chunk_tokens": "32", "pipeline_depth": 1, "layer_split": "auto", "gpu_order": "pcie"}
ARMS = (SweepArm("join", "pipeline_depth=0"), SweepArm("overlap", "pipeline_depth=1"))
SWEEP_TIMEOUT_MS = 90_000


def test_sizes_parse_with_k_suffixes_and_bad_ones_are_named():
    assert parse_sizes("8K, 16K,32768 64k") == [8192, 16384, 32768, 65536]
    assert parse_sizes("1.5K 512 512") == [512, 1536]
    assert [format_tokens(n) for n in (8192, 1536, 300)] == ["8K", "1.5K", "300"]
    for bad in ("", "8X", "0", "1.3", "2M"):
        with pytest.raises(ConfigError) as info:
            parse_sizes(bad)
        assert "prompt sizes" in str(info.value)


def test_plan_runs_every_arm_on_the_same_prompt_in_the_bench_order():
    plan = SweepPlan((64, 128), ARMS, repeats=2)
    plan.validate()
    steps = plan.steps()
    assert plan.total == len(steps) == 8
    assert [(s.prompt_tokens, s.repeat, s.arm) for s in steps[:4]] == [(64, 0, 0), (64, 0, 1), (64, 1, 0), (64, 1, 1)]
    # arms share the nonce of (size, repeat): identical prompts; repeats differ (engine/cli/bench.py's scheme)
    assert steps[0].nonce == steps[1].nonce == prompts.sweep_nonce(64, 0)
    assert steps[2].nonce == prompts.sweep_nonce(64, 1) != steps[0].nonce
    cfg = arm_config(BASE, SweepArm("x", "pipeline_depth=0 chunk_tokens=64"), env={})
    assert (cfg.pipeline_depth, cfg.chunk_tokens, cfg.devices) == (0, 64, ["cpu", "cpu"])
    with pytest.raises(ConfigError, match="pipeline_depth"):
        arm_config(BASE, SweepArm("bad", "pipeline_depth=5"), env={})
    with pytest.raises(ConfigError, match="a name used by one arm only"):
        SweepPlan((64,), (SweepArm("a", ""), SweepArm("a", "pipeline_depth=0"))).validate()
    cmd = SweepPlan((8192, 16384), ARMS, repeats=3, base=BASE).bench_command("demo")
    assert cmd == ("strata-bench run --model demo --prompt-tokens 8192,16384 --devices cpu,cpu "
                   "--chunk-tokens 32 --pipeline-depth 1 --arm pipeline_depth=0 --arm pipeline_depth=1 "
                   "--repeat 3 --warmup 1")


class _Outlet:
    """A SweepJob outlet keeping every call's arguments, by name (no Qt)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple]] = {}

    def __getattr__(self, name: str):
        return lambda *args: self.calls.setdefault(name, []).append(args)

    def args(self, name: str) -> list:
        """The single argument of each call of `name`."""
        return [a[0] for a in self.calls.get(name, [])]


def test_a_real_sweep_job_run_matches_the_bench_table(demo_path):
    """The job, run in this thread on real demo runs without Qt: the table's median and ± sd (the
    sample standard deviation, in the markdown, the CSV and the tab) are strata-bench's
    (engine.cli.bench.Point) over the same reports; digests agree across arms."""
    from strata_gui.sweep.sweep_job import SweepJob, SweepRequest
    from strata_gui.sweep.sweep_model import SweepSample

    plan = SweepPlan((64, 128), ARMS, repeats=2, warmup=0, model="demo", base=BASE)
    configs = tuple(arm_config(BASE, a, env={}) for a in ARMS)
    reports: dict[tuple[int, int], list] = {}
    samples: list[SweepSample] = []

    def recorder(record, member) -> int:
        reports.setdefault((member[1].arm, member[1].prompt_tokens), []).append(record.report)
        assert record.source == "sweep" and record.events and record.config["prompt"].startswith("synthetic, nonce")
        return len(samples) + 1

    out = _Outlet()
    SweepJob(SweepRequest(demo_path, "demo", plan, configs, sweep_id=7), threading.Event(), out, recorder).execute()
    samples.extend(out.args("point_done"))
    assert out.calls["finished"] == [(False, "finished all 8 runs")] and out.calls["done"] == [()]
    res = SweepResults(plan, samples)
    rows = res.rows()
    assert [(r.arm_name, r.prompt_tokens, r.n) for r in rows] == \
        [("join", 64, 2), ("overlap", 64, 2), ("join", 128, 2), ("overlap", 128, 2)]
    for r in rows:
        p = Point(r.arm_name, r.prompt_tokens, reports[(r.arm, r.prompt_tokens)])
        assert r.median == p.median and r.sd == pytest.approx(statistics.stdev(p.tok_s))  # the bench's ± sd
        base = next(x for x in rows if x.arm == 0 and x.prompt_tokens == r.prompt_tokens)
        assert r.ratio == pytest.approx(r.median / base.median)
        assert r.chunk == 32 and r.n_chunks == r.prompt_tokens // 32
    assert all(r.same_output for r in rows if r.arm == 1)  # depth never changes the output bytes
    lines = list(csv.reader(io.StringIO(res.to_csv())))
    assert lines[0][:3] == ["arm", "settings", "prompt_tokens"] and len(lines) == 5
    sd_col = lines[0].index("stddev_ts")  # strata-bench's json field (llama-bench's) for the same figure
    assert [float(x[sd_col]) for x in lines[1:]] == [pytest.approx(r.sd, abs=1e-3) for r in rows]
    assert all(r.sd > 0 for r in rows)  # two repeats of a real run never take the same time to the ns
    assert [x[0] for x in lines[1:]] == ["join", "overlap", "join", "overlap"]
    md = res.to_markdown("demo")
    assert "| arm | settings | prompt |" in md and "8 of 8 runs" in md
    assert "| prefill tok/s | ± sd | n |" in md and "half" not in md
    assert "strata-bench run --model demo --prompt-tokens 64,128" in md


def _start_sweep(qtbot, win, sizes: str, repeats: int) -> None:
    view = win.sweep_view
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="32", prompt_tokens=256, decode_tokens=0)
    win.tabs.setCurrentWidget(view)
    view.sizes.setText(sizes)
    view.repeats.setValue(repeats)
    view.warmup.setValue(0)
    view.set_arms([("join", "pipeline_depth=0"), ("overlap", "pipeline_depth=1")])
    assert view.start_button.isEnabled()
    qtbot.mouseClick(view.start_button, Qt.MouseButton.LeftButton)
    assert win.sweeps.is_running, view.errors.text()
    assert not win.run_button.isEnabled() and view.stop_button.isEnabled()


def test_a_2_size_2_arm_sweep_charts_4_points_and_exports(window, qtbot, tmp_path, monkeypatch):
    from strata_gui.sweep import sweep_job
    win = window
    view = win.sweep_view
    parses, own = win.models.parses, []  # the form parsed the demo model already
    real_load = sweep_job.load
    monkeypatch.setattr(sweep_job, "load", lambda path: own.append(path) or real_load(path))
    _start_sweep(qtbot, win, "64, 128", 1)
    qtbot.waitUntil(lambda: not win.sweeps.is_running, timeout=SWEEP_TIMEOUT_MS)
    assert wait_no_engine_threads() == []
    assert parses >= 1 and win.models.parses == parses and own == []  # the sweep took the form's parse
    assert "finished all 4 runs" in view.progress_label.text()
    points = view.chart_points()
    assert len(points) == 4
    assert sorted((name.split(" ")[0], n) for name, n, _ in points) == \
        [("join", 64.0), ("join", 128.0), ("overlap", 64.0), ("overlap", 128.0)]
    rows = view.results.rows()
    assert view.table.rowCount() == 4 and view.progress.value() == 4
    assert {round(tok) for _, _, tok in points} == {round(r.median) for r in rows}
    assert view.table.item(1, 0).text() == "overlap" and view.table.item(1, 5).text() == f"{rows[1].ratio:.3f}×"
    assert view.table.item(1, 7).text() == "yes"
    assert view.table.horizontalHeaderItem(4).text().split("\n")[0] == "± sd"  # the CLI's name for it
    assert view.table.item(1, 4).text() == "—"  # one repeat: no standard deviation
    assert win.run_button.isEnabled()
    # saved: four sweep runs, and the sweep itself
    assert len(win.history.list_runs(source="sweep")) == 4
    sweeps = win.history.list_sweeps()
    assert sweeps[0].status == "finished" and sweeps[0].n_runs == 4
    # exports
    assert view.export("csv", tmp_path / "s.csv") and view.export("md", tmp_path / "s.md")
    assert (tmp_path / "s.csv").read_text() == view.results.to_csv()
    assert len(list(csv.reader((tmp_path / "s.csv").open()))) == 5
    assert "| overlap | pipeline_depth=1 | 128 |" in (tmp_path / "s.md").read_text()
    # reopened from the history, the same table
    view.show_results(None)
    assert view.chart_points() == []
    assert win.open_sweep(sweeps[0].id)
    assert [(r.arm_name, r.prompt_tokens, r.median) for r in view.results.rows()] == \
        [(r.arm_name, r.prompt_tokens, r.median) for r in rows]
    assert len(view.chart_points()) == 4


def test_bad_plans_are_refused_then_a_stopped_sweep_keeps_its_finished_points(window, qtbot):
    win = window
    view = win.sweep_view
    view.sizes.setText("64, lots")
    assert not win.start_sweep()
    assert "prompt sizes" in view.errors.text() and "lots" in view.errors.text()
    view.sizes.setText("64")
    view.set_arms([("a", "pipeline_depth=0"), ("b", "pipeline_depth=7")])
    assert not win.start_sweep()
    assert "arm b" in view.errors.text() and "pipeline_depth" in view.errors.text()
    view.set_arms([("a", "layer_split=1,1,1")])
    set_form(win, devices="cpu,cpu")
    assert not win.start_sweep()
    assert "arm a" in view.errors.text() and "layer_split" in view.errors.text()
    assert not win.sweeps.is_running and win.history.list_sweeps() == []

    win.sweeps.hooks = PipelineHooks(after_layer=lambda s, layer, c: time.sleep(0.005))
    _start_sweep(qtbot, win, "64, 128, 256", 2)
    qtbot.waitUntil(lambda: view.results is not None and len(view.results) >= 2, timeout=SWEEP_TIMEOUT_MS)
    qtbot.mouseClick(view.stop_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not win.sweeps.is_running, timeout=SWEEP_TIMEOUT_MS)
    assert wait_no_engine_threads() == []
    done = len(view.results)
    assert 2 <= done < 12
    assert f"stopped after {done} of 12 runs" in view.progress_label.text()
    assert len(view.chart_points()) == len(view.results.rows()) >= 1
    assert win.history.list_sweeps()[0].status == "stopped"
    assert len(win.history.list_runs(source="sweep")) == done
    assert win.run_button.isEnabled() and view.start_button.isEnabled()


def test_sweep_job_warms_up_every_size_like_the_bench(demo_path, monkeypatch):
    """Each prompt size gets its unmeasured warm-up runs (one per arm) before its first point."""
    from engine.pipeline.session import Session
    from strata_gui.sweep.sweep_job import SweepJob, SweepRequest

    sizes: list[int] = []
    real_run = Session.run

    def run(self, ids, *a, **kw):
        sizes.append(len(ids))
        return real_run(self, ids, *a, **kw)

    monkeypatch.setattr(Session, "run", run)
    plan = SweepPlan((64, 96), ARMS, repeats=1, warmup=1, model="demo", base=BASE)
    configs = tuple(arm_config(BASE, a, env={}) for a in ARMS)
    out = _Outlet()
    SweepJob(SweepRequest(demo_path, "demo", plan, configs, sweep_id=8), threading.Event(), out).execute()
    statuses, samples = out.args("status"), out.args("point_done")
    assert sizes == [64, 64, 64, 64, 96, 96, 96, 96]  # warm-up x 2 arms, then the 2 measured runs
    assert len(samples) == 4
    assert any("warming up arm join at 96 tokens" in s for s in statuses)


def test_sweep_tab_before_any_sweep_says_not_started_and_explains_digests(window):
    v = window.sweep_view
    assert v.progress.text() == "not started"  # not "0 / 1 runs"
    assert "digests differ between repeats by design" in v.chart_note.text()
    assert v.past_detail.text() == "no sweep saved yet"


def test_a_sweep_ratio_inside_the_repeats_noise_is_not_judged():
    from strata_gui.sweep.sweep_model import SweepRow, ratio_noise

    def row(arm: int, tok: tuple[float, ...]) -> SweepRow:
        med = sorted(tok)[len(tok) // 2]
        return SweepRow(arm, f"a{arm}", "", 1024, tok, med, 0.0, None, 0.0, 256, 4, 2, "same-device", (), (), None)

    base = row(0, (90.0, 100.0, 110.0))
    close = row(1, (95.0, 101.0, 112.0))
    close = SweepRow(**{**close.__dict__, "ratio": close.median / base.median})
    assert ratio_noise(close, base)[0] is True
    far = row(1, (150.0, 155.0, 160.0))
    far = SweepRow(**{**far.__dict__, "ratio": far.median / base.median})
    within, noise = ratio_noise(far, base)
    assert within is False and noise > 0
    single = SweepRow(**{**row(1, (120.0,)).__dict__, "ratio": 1.2})
    assert ratio_noise(single, row(0, (100.0,))) == (None, None)


def test_the_cli_and_the_app_walk_one_sweep():
    """engine.sweep is the one order and statistic: strata-bench's and the Sweep tab's."""
    from engine import sweep as engine_sweep
    from strata_gui.sweep.sweep_model import SweepArm, SweepPlan

    plan = SweepPlan(sizes=(64, 128), arms=(SweepArm("a", ""), SweepArm("b", "pipeline_depth=0")), repeats=2)
    assert plan.steps() == engine_sweep.steps((64, 128), 2, 2)
    firsts = [s for s in plan.steps() if s.first_of_size]
    assert [(s.prompt_tokens, s.repeat, s.arm) for s in firsts] == [(64, 0, 0), (128, 0, 0)]
    assert engine_sweep.median_spread([90.0, 100.0, 110.0]) == (100.0, 0.1)
    assert engine_sweep.median_spread([5.0]) == (5.0, 0.0)
