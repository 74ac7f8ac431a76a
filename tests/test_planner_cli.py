"""`strata-bench plan` on recorded GPU traces (docs/bench) and on a run of the app's history."""
from __future__ import annotations

import re
from pathlib import Path

from history_support import demo_runs  # noqa: F401

from engine.cli import bench
from engine.plan import planner

BENCH = Path(__file__).resolve().parents[1] / "docs" / "bench"
TRACE = BENCH / "overlap2-fixed-1024-64k-s3.json.gz"


def tok_s(text: str, what: str = "predicted prefill") -> float:
    m = re.search(rf"{what}: ([0-9,]+) tok/s", text)
    assert m, text
    return float(m.group(1).replace(",", ""))


def test_plan_predicts_the_source_run_and_prints_its_error(capsys):
    assert bench.main(["plan", "--from-run", str(TRACE)]) == 0
    out = capsys.readouterr().out
    src = planner.load_trace_run(TRACE)
    assert abs(tok_s(out) / src.prefill_tok_s - 1) < 0.05  # its own configuration from its own profile
    assert "busy histogram" in out and "bottleneck: stage" in out
    m = re.search(r"measured ([0-9,]+) tok/s \(([+-][0-9.]+)%\)", out)
    assert m and float(m.group(1).replace(",", "")) == round(src.prefill_tok_s)


def test_a_slow_host_link_without_peer_access_costs_time(capsys):
    bench.main(["plan", "--from-run", str(TRACE), "--chunk-tokens", "1024"])
    peer = tok_s(capsys.readouterr().out)
    bench.main(["plan", "--from-run", str(TRACE), "--chunk-tokens", "1024", "--peer", "none", "--link", "gen5x16,0.5"])
    out = capsys.readouterr().out
    assert tok_s(out) < peer
    assert "host" in out or re.search(r"copy ms", out)


def test_sweep_ranks_settings_best_first(capsys):
    assert bench.main(["plan", "--from-run", str(TRACE), "--devices", "cuda:0,cuda:1,cuda:2", "--sweep",
                       "--top", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) == 3  # 1024 fixed: overlap, join, prefill-main (the trace measured one size)
    speeds = [float(r.split("|")[4].replace(",", "")) for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    assert "gain vs base" in out


def test_bad_input_is_refused_with_a_message(capsys, tmp_path):
    assert bench.main(["plan", "--from-run", str(TRACE), "--link", "fast"]) == 2
    assert "link 'fast'" in capsys.readouterr().err
    assert bench.main(["plan", "--from-run", "7", "--history", str(tmp_path / "none.sqlite3")]) == 2


def test_plan_from_a_history_run(capsys, tmp_path, demo_runs):  # noqa: F811
    from strata_gui.history.history_model import RunHistory

    with RunHistory(tmp_path / "h.sqlite3") as h:
        run = h.add(demo_runs.overlap)
    assert bench.main(["plan", "--from-run", str(run), "--history", str(tmp_path / "h.sqlite3"),
                       "--pipeline-depth", "0"]) == 0
    out = capsys.readouterr().out
    assert "depth 0" in out and tok_s(out) > 0
