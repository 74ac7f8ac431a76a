"""Issue 37: `strata-bench run` speaks llama-bench's conventions: -m -p -n -r -o, tests named
pp<N> / pp<N>+tg<M>, model/size/params/backend/build/GPU fields, --version; -o json is one JSON
document, -o jsonl a line per object, -o sql loads into sqlite3; ± is a standard deviation; CSV
cells with no value are empty."""
from __future__ import annotations

import csv
import io
import json
import sqlite3
import statistics

import pytest

from engine.cli import bench, bench_format
from engine.cli.run_progress import RunProgress, duration


def run_cli(capsys, *argv):
    rc = bench.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def short_flags_json(demo_path, tmp_path_factory):
    """One small sweep (two sizes, two repeats) through the short flags, as one JSON document."""
    import contextlib

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = bench.main(["run", "-m", str(demo_path), "-p", "32,48", "-n", "2", "-r", "2", "-o", "json",
                         "--devices", "cpu", "--chunk-tokens", "16", "--warmup", "0", "--quiet"])
    assert rc == 0
    return buf.getvalue()


def test_json_is_one_document_with_llama_bench_fields(short_flags_json, demo_path):
    rows = json.loads(short_flags_json)  # one JSON document, not JSON Lines
    assert isinstance(rows, list)
    runs = [r for r in rows if r["row"] == "run"]
    summary = [r for r in rows if r["row"] == "summary"]
    assert len(runs) == 4 and len(summary) == 2
    assert [r["test"] for r in summary] == ["pp32+tg2", "pp48+tg2"]
    assert {r["test"] for r in runs} == {"pp32+tg2", "pp48+tg2"}
    for r in summary:
        assert r["model_filename"] == str(demo_path) and r["model_size"] > 0 and r["model_n_params"] > 0
        assert r["backend"] == "CPU" and r["gpu_info"] == "" and r["cpu_info"]
        assert r["build_commit"] and r["build_version"]
        assert r["n_prompt"] == r["prompt_tokens"] and r["n_gen"] == 2
        samples = [x["prefill_tok_s"] for x in runs if x["prompt_tokens"] == r["prompt_tokens"]]
        assert r["samples_ts"] == samples
        assert r["stddev_ts"] == pytest.approx(statistics.stdev(samples))  # a standard deviation, not a range
        assert r["avg_ts"] == pytest.approx(statistics.fmean(samples))
        assert r["prefill_tok_s"] == pytest.approx(statistics.median(samples))
        decode = [x["decode_tok_s"] for x in runs if x["prompt_tokens"] == r["prompt_tokens"]]
        assert r["decode_sd"] == pytest.approx(statistics.stdev(decode))  # the md table's tg "±": a sd too


def test_model_params_count_the_tensors(demo_path):
    from engine.io.gguf_model import load

    m = load(demo_path)
    f = bench_format.model_fields(m)
    n = 0
    for name in m.tensor_names():
        k = 1
        for d in m.shape(name):
            k *= d
        n += k
    assert f["model_n_params"] == n and f["model_size"] == sum(m.nbytes(t) for t in m.tensor_names())
    assert f["model_size"] <= m.file_bytes


def test_jsonl_is_one_object_a_line(demo_path, capsys):
    rc, out, _ = run_cli(capsys, "run", "-m", str(demo_path), "-p", "32", "-r", "2", "-o", "jsonl",
                         "--devices", "cpu", "--chunk-tokens", "16", "--warmup", "0")
    assert rc == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["row"] for r in rows] == ["run", "run", "summary"] and rows[-1]["test"] == "pp32"


def test_sql_loads_into_sqlite3(demo_path, capsys):
    rc, out, _ = run_cli(capsys, "run", "-m", str(demo_path), "-p", "32,48", "-o", "sql", "--devices", "cpu,cpu",
                         "--chunk-tokens", "16", "--warmup", "0", "--arm", "pipeline_depth=0", "--arm",
                         "pipeline_depth=1")
    assert rc == 0
    db = sqlite3.connect(":memory:")
    db.executescript(out)
    got = db.execute(f"SELECT test, arm, prefill_tok_s, model_n_params, busy_histogram FROM {bench_format.SQL_TABLE} "
                     "WHERE row = 'summary' ORDER BY test, arm").fetchall()
    assert [(t, a) for t, a, *_ in got] == [("pp32", "pipeline_depth=0"), ("pp32", "pipeline_depth=1"),
                                            ("pp48", "pipeline_depth=0"), ("pp48", "pipeline_depth=1")]
    assert all(isinstance(tok, float) and tok > 0 and n > 0 for _, _, tok, n, _ in got)
    assert all(len(json.loads(h)) == 3 for *_, h in got)  # lists stored as JSON text
    assert db.execute(f"SELECT count(*) FROM {bench_format.SQL_TABLE} WHERE row = 'run'").fetchone() == (4,)
    db.executescript(out)  # a second run's output appends to the same table
    assert db.execute(f"SELECT count(*) FROM {bench_format.SQL_TABLE}").fetchone() == (16,)


def test_csv_has_empty_cells_and_clean_headers(demo_path, capsys):
    rc, out, _ = run_cli(capsys, "run", "-m", str(demo_path), "-p", "32", "-o", "csv", "--devices", "cpu",
                         "--chunk-tokens", "16", "--warmup", "0")
    assert rc == 0
    rows = list(csv.reader(io.StringIO(out)))
    header, body = rows[0], rows[1:]
    assert len(body) == 1  # nothing but the table: no digest or note lines after it
    assert all(h == h.strip() and h for h in header), header
    assert "—" not in out
    cell = dict(zip(header, body[0]))
    assert cell["decode tok/s"] == ""  # no decode steps: an empty cell
    assert cell["test"] == "pp32" and cell["backend"] == "CPU" and cell["± sd"] == "0.0"


def test_md_says_what_the_spread_is_and_names_the_build(demo_path, capsys):
    rc, out, _ = run_cli(capsys, "run", "-m", str(demo_path), "-p", "32", "-r", "2", "--devices", "cpu",
                         "--chunk-tokens", "16", "--warmup", "0")
    assert rc == 0
    header = out.splitlines()[0]
    assert "| ± sd |" in header and "| test |" in header and "| params |" in header
    assert "sample standard deviation" in out
    build = next(line for line in out.splitlines() if line.startswith("build: "))
    assert bench_format.build_fields()["build_commit"] in build
    assert "predicted" not in out  # the chunk-cost model's error line is -v's (and says what it means)


def test_version_prints_and_exits_0(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("strata-bench ") and "torch" in out and bench_format.build_fields()["build_commit"] in out


def test_long_names_still_work(demo_path, capsys):
    rc, out, _ = run_cli(capsys, "run", "--model", str(demo_path), "--prompt-tokens", "32", "--decode-tokens", "1",
                         "--repeat", "1", "--format", "jsonl", "--devices", "cpu", "--warmup", "0")
    assert rc == 0 and json.loads(out.splitlines()[0])["test"] == "pp32+tg1"
    rc, out, _ = run_cli(capsys, "run", "--model", str(demo_path), "--prompt-tokens", "32", "--output", "jsonl",
                         "--devices", "cpu", "--warmup", "0")
    assert rc == 0 and json.loads(out.splitlines()[0])["test"] == "pp32"


@pytest.mark.parametrize("p, n, want", [(512, 0, "pp512"), (0, 128, "tg128"), (512, 128, "pp512+tg128")])
def test_labels(p, n, want):
    assert bench_format.label(p, n) == want


def test_sizes_and_params_read_as_llama_bench_shows_them():
    assert bench_format.human_size(6 * 2**30 + 2**29) == "6.50 GiB"
    assert bench_format.human_size(3 * 2**20) == "3.00 MiB"
    assert bench_format.human_params(30_532_122_624) == "30.53 B"
    assert bench_format.human_params(1_090_000) == "1.09 M"


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_names_the_run_the_arm_the_test_and_the_time_left():
    clock = iter([0.0, 0.0, 10.0, 20.0, 30.0]).__next__
    out = io.StringIO()
    p = RunProgress(out, measured=2, warmups=2, clock=clock)
    p.start("base", 512, warmup=0)
    p.start("depth0", 512, warmup=0)
    p.start("base", 512, repeat=0)
    p.start("depth0", 512, repeat=0)
    p.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "[1/4] warm-up 1 · arm base · pp512 · 0 s elapsed"
    assert lines[2] == "[3/4] run 1/2 · arm base · pp512 · 20 s elapsed, about 20 s left"
    assert lines[3] == "[4/4] run 2/2 · arm depth0 · pp512 · 30 s elapsed, about 10 s left"


def test_progress_is_quiet_when_piped_or_asked_and_for_one_run():
    assert RunProgress.for_stream(io.StringIO(), quiet=False, force=False, measured=4).stream is None  # piped
    assert RunProgress.for_stream(Tty(), quiet=True, force=False, measured=4).stream is None
    assert RunProgress.for_stream(Tty(), quiet=False, force=False, measured=1).stream is None
    assert RunProgress.for_stream(Tty(), quiet=False, force=False, measured=4).stream is not None
    assert RunProgress.for_stream(io.StringIO(), quiet=False, force=True, measured=4).stream is not None


def test_progress_on_a_terminal_is_one_line_cleared_at_the_end():
    out = Tty()
    p = RunProgress(out, measured=2, tty=True, tick_s=3600)
    p.start("base", 64, repeat=0)
    p.start("base", 64, repeat=1)
    p.close()
    text = out.getvalue()
    assert "\n" not in text and text.count("\r") == 4 and text.endswith(" \r")  # two lines, then the clear


def test_the_cli_writes_progress_to_stderr_only(demo_path, capsys):
    rc, out, err = run_cli(capsys, "run", "-m", str(demo_path), "-p", "32", "-r", "2", "-o", "jsonl",
                           "--devices", "cpu", "--chunk-tokens", "16", "--warmup", "1", "--progress")
    assert rc == 0 and all(json.loads(line) for line in out.splitlines())
    lines = [line for line in err.splitlines() if line.startswith("[")]
    assert [line.split(" · ")[0] for line in lines] == ["[1/3] warm-up 1", "[2/3] run 1/2", "[3/3] run 2/2 (repeat 2)"]
    rc, _, err = run_cli(capsys, "run", "-m", str(demo_path), "-p", "32", "-r", "2", "-o", "jsonl",
                         "--devices", "cpu", "--warmup", "0", "--quiet")
    assert rc == 0 and err == ""


def test_durations():
    assert [duration(x) for x in (4.4, 65, 3725)] == ["4 s", "1 min 05 s", "1 h 02 min"]


def test_a_loads_progress_names_the_heads_and_weighs_them(demo_path):
    """The heads (embedding, output) are dequantised at load: a named step with their share of the
    work, not a silent stretch after the last layer's percentage (issue 37: 'froze at 50%')."""
    from engine.config import EngineConfig
    from engine.io.gguf_model import load
    from engine.pipeline.session import Session

    calls: list[tuple[str, float]] = []
    sess = Session(load(demo_path), EngineConfig.from_sources({"devices": "cpu,cpu"}), events=False,
                   progress=lambda what, frac: calls.append((what, frac)))
    sess.close()
    fracs = [f for _, f in calls]
    assert fracs == sorted(fracs) and fracs[-1] == 1.0 and fracs[0] == 0.0
    whats = [w for w, _ in calls]
    embed = whats.index("loading the token embedding to cpu")  # after stage 0's layers
    head = whats.index("loading the output head to cpu")  # after the last stage's layers
    assert whats[:embed] == ["loading layer 0 to cpu", "loading layer 1 to cpu"]
    assert whats[embed + 2:head] == ["loading layer 2 to cpu", "loading layer 3 to cpu"]
    assert 0.0 < calls[embed][1] < calls[head][1] < 1.0


def test_a_load_line_on_a_terminal_keeps_ticking_between_steps():
    import time

    from engine.cli.load_progress import LoadProgress

    term = Tty()
    shown = LoadProgress(term, 0, "m.gguf", heartbeat_s=0.02)
    shown("loading the output head to cpu", 0.8)  # one long step: no callback for a while
    deadline = time.monotonic() + 30
    while term.getvalue().count("\r") < 3 and time.monotonic() < deadline:  # rewritten by the heartbeat
        time.sleep(0.01)
    shown.finish()
    after = term.getvalue()
    assert after.count("\r") >= 3 and "loading the output head to cpu 80%" in after
    time.sleep(0.1)
    assert term.getvalue() == after  # stopped by finish()
