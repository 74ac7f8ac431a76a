"""strata-bench as a user runs it: make-model, run (md/json, arms, sweeps), prompt inputs."""
from __future__ import annotations

import json

import numpy as np
import pytest

from engine.cli import bench
from engine.io import gguf_model


def run_cli(capsys, *argv):
    rc = bench.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_make_model_is_deterministic_and_loadable(tmp_path, capsys):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    for p in (a, b):
        rc, out, _ = run_cli(capsys, "make-model", str(p), "--layers", "3", "--experts", "4", "--seed", "5")
        assert rc == 0 and "qwen3moe: 3 layers" in out
    assert a.read_bytes() == b.read_bytes()
    rc, _, _ = run_cli(capsys, "make-model", str(tmp_path / "l.gguf"), "--arch", "llama", "--quant", "f16")
    assert gguf_model.load(tmp_path / "l.gguf").spec.arch == "llama"


def test_run_json_has_the_fields(demo_path, capsys):
    rc, out, _ = run_cli(capsys, "run", "--model", str(demo_path), "--devices", "cpu", "--prompt-tokens", "48",
                         "--decode-tokens", "4", "--chunk-tokens", "16", "--format", "jsonl", "--warmup", "0")
    assert rc == 0
    rows = [json.loads(line) for line in out.splitlines()]
    run = rows[0]
    assert run["row"] == "run" and run["prefill_tok_s"] > 0 and run["decode_tok_s"] > 0
    assert len(run["digest"]) == 32 and len(run["generated"]) == 4 and run["chunk"] == 16


def test_arms_and_sweep_share_prompts(demo_path, capsys):
    rc, out, _ = run_cli(capsys, "run", "--model", str(demo_path), "--devices", "cpu,cpu", "--chunk-tokens", "32",
                         "--prompt-tokens", "64,96", "--arm", "pipeline_depth=0", "--arm", "pipeline_depth=1",
                         "--repeat", "2", "--format", "jsonl", "--warmup", "0")
    assert rc == 0
    rows = [json.loads(line) for line in out.splitlines()]
    runs = [r for r in rows if r["row"] == "run"]
    summary = [r for r in rows if r["row"] == "summary"]
    assert len(runs) == 8 and len(summary) == 4
    for r in summary:
        assert {"arm", "prompt_tokens", "chunk", "busy_histogram", "per_stage", "ratio"} <= r.keys()
    by = {(r["arm"], r["prompt_tokens"], r["repeat"]): r["digest"] for r in runs}
    assert by[("pipeline_depth=0", 64, 0)] == by[("pipeline_depth=1", 64, 0)]  # arms see identical prompts
    assert by[("pipeline_depth=0", 64, 0)] != by[("pipeline_depth=0", 64, 1)]  # repeats differ (nonce)
    assert [r["ratio"] for r in summary if r["arm"] == "pipeline_depth=0"] == [1.0, 1.0]


def test_md_table_and_prompt_ids_and_logits(tmp_path, demo_path, capsys):
    ids = tmp_path / "ids.txt"
    ids.write_text("1, 2 3\n4,5 6 7 8 9 10")
    out_npy = tmp_path / "logits.npy"
    rc, out, _ = run_cli(capsys, "run", "--model", str(demo_path), "--prompt-ids", str(ids), "--decode-tokens", "3",
                         "--logits-out", str(out_npy), "--warmup", "0")
    assert rc == 0 and out.startswith("| model | size | params | backend | test | arm |") and "digest:" in out
    arr = np.load(out_npy)
    assert arr.shape == (10, gguf_model.load(demo_path).spec.vocab) and arr.dtype == np.float32


def test_text_prompt_uses_the_files_vocabulary(demo_path, capsys):
    rc, out, _ = run_cli(capsys, "run", "--model", str(demo_path), "--prompt", "hello world, the pipeline",
                         "--format", "jsonl", "--warmup", "0")
    assert rc == 0
    assert json.loads(out.splitlines()[0])["prompt_tokens"] > 3


@pytest.mark.parametrize("argv, words", [
    (["--pipeline-depth", "2"], ["pipeline_depth", "0 (join) or 1 (overlap)"]),
    (["--devices", "cpu,cpu", "--layer-split", "1,1"], ["layer_split", "4 layers"]),
    (["--model", "/nonexistent.gguf"], ["/nonexistent.gguf", "no such file"]),
    (["--arm", "pipeline_depth"], ["arm", "setting=value"]),
])
def test_errors_are_one_clear_line(demo_path, capsys, argv, words):
    base = ["run", "--model", str(demo_path), "--prompt-tokens", "16", "--warmup", "0"]
    rc, _, err = run_cli(capsys, *base, *argv)
    assert rc == 2
    for w in words:
        assert w in err, err


def test_trace_option_writes_a_loadable_trace(tmp_path, demo_path, capsys):
    from engine.io import trace
    p = tmp_path / "run.json.gz"
    rc, _, _ = run_cli(capsys, "run", "--model", str(demo_path), "--devices", "cpu,cpu", "--chunk-tokens", "16",
                       "--prompt-tokens", "48", "--trace", str(p), "--warmup", "0")
    assert rc == 0
    events, meta = trace.load(p)
    assert {e.stage for e in events if e.kind == "compute"} == {0, 1}
    assert meta["report"]["plan"]["n_chunks"] == 3


def test_warm_up_runs_every_prompt_size_unmeasured(demo_path, capsys, monkeypatch):
    """A measured run never pays the first sight of its size's chunk shapes: every arm runs
    each prompt size once, unmeasured and on a prompt no measured run uses, before its repeats."""
    from engine.pipeline.session import Session

    calls: list[tuple[int, int]] = []
    real_run = Session.run

    def run(self, ids, *a, **kw):
        calls.append((len(ids), tuple(list(ids)[:4])))
        return real_run(self, ids, *a, **kw)

    monkeypatch.setattr(Session, "run", run)
    rc, out, _ = run_cli(capsys, "run", "--model", str(demo_path), "--devices", "cpu", "--chunk-tokens", "16",
                         "--prompt-tokens", "32,48", "--arm", "pipeline_depth=0", "--arm", "pipeline_depth=1",
                         "--format", "jsonl", "--warmup", "1")
    assert rc == 0
    runs = [json.loads(line) for line in out.splitlines() if json.loads(line)["row"] == "run"]
    assert len(runs) == 4  # warm-ups print no rows
    assert [n for n, _ in calls] == [32, 32, 32, 32, 48, 48, 48, 48]
    warm32, meas32 = calls[0][1], calls[2][1]
    assert warm32 != meas32  # the first token carries the nonce: warm-up and measured prompts differ


def test_load_progress_on_a_terminal_is_one_rewritten_line_with_an_eta(monkeypatch):
    import io

    from engine.cli.load_progress import LoadProgress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    clock = iter([0.0, 0.5, 1.0, 3.0])
    monkeypatch.setattr("engine.cli.load_progress.time.perf_counter", lambda: next(clock))
    term = Terminal()
    shown = LoadProgress(term, 4 * 10**9, "big.gguf")  # t0 = 0
    shown("loading layer 3", 0.25)  # at 0.5 s: a quarter done, about 1.5 s left
    shown("loading layer 6", 0.5)  # at 1.0 s
    took = shown.finish()  # at 3.0 s
    text = term.getvalue()
    assert "\n" not in text.rstrip("\n") and text.count("\r") >= 2  # rewritten in place, one final line
    assert "about 2 s left" in text and "about 1 s left" in text
    assert took == 3.0 and text.endswith("loaded big.gguf (3.73 GiB) in 3.00 s: 1.33 GB/s of file\n")


INJECT = """
import sys
import engine.models.layers
def boom(self, *args, **kwargs):
    raise ZeroDivisionError("injected internal error")
engine.models.layers.Head.final_norm = boom
from engine.cli.bench import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_internal_error_is_one_line_naming_its_log_not_a_traceback(demo_path, tmp_path):
    import os
    import subprocess
    import sys

    from engine import failure

    env = {**os.environ, "STRATA_LOG_DIR": str(tmp_path / "logs")}
    proc = subprocess.run([sys.executable, "-c", INJECT, "run", "--model", str(demo_path), "--devices", "cpu",
                           "--prompt-tokens", "32", "--warmup", "0"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == failure.INTERNAL_ERROR == 3, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("strata-bench:")]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr  # beside it: the load's one line
    line = lines[0]
    assert line.startswith("strata-bench: internal error in strata-bench run at ")
    assert "ZeroDivisionError: injected internal error" in line
    log_file = tmp_path / "logs" / line.rsplit("full traceback in ", 1)[1].split("/")[-1]
    text = log_file.read_text()
    assert "Traceback (most recent call last)" in text and "injected internal error" in text


def test_bad_input_keeps_its_own_exit_code(capsys):
    from engine import failure

    rc, _, err = run_cli(capsys, "run", "--model", "demo", "--devices", "cpu", "--chunk-tokens", "abc")
    assert rc == failure.BAD_INPUT == 2 and err.startswith("strata-bench: error: ") and "chunk_tokens" in err


def test_make_model_quant_mix(tmp_path, capsys):
    p = tmp_path / "q4km.gguf"
    rc, out, _ = run_cli(capsys, "make-model", str(p), "--layers", "4", "--quant", "q4_k_m", "--hidden", "256",
                         "--head-dim", "64", "--expert-ffn", "256")
    assert rc == 0
    m = gguf_model.load(p)
    assert m.qtype("blk.0.ffn_gate_exps.weight").name == "Q4_K"
    assert m.qtype("blk.3.ffn_down_exps.weight").name == "Q6_K" and m.qtype("output.weight").name == "Q6_K"


def test_load_reports_progress_on_stderr_and_the_rate(tmp_path, capsys):
    p = tmp_path / "q.gguf"
    assert run_cli(capsys, "make-model", str(p), "--layers", "2", "--quant", "q4_k_m", "--hidden", "256",
                   "--head-dim", "64", "--expert-ffn", "256")[0] == 0
    rc, out, err = run_cli(capsys, "load", "--model", str(p), "--devices", "cpu", "--expert-cache", "0.0005")
    assert rc == 0, err
    assert err.count("\n") == 1 and "GB/s of file" in err  # into a log: a short load is one line
    assert "GB/s of file" in out and "arena" in out
    rc, _, err = run_cli(capsys, "run", "--model", str(p), "--prompt-tokens", "16", "--warmup", "0")
    assert rc == 0 and "loaded q.gguf" in err


def test_decode_only_prints_tg_and_the_roofline(demo_path, capsys):
    """`--decode-tokens N` without a prompt measures tg like llama-bench `-p 0 -n N`: a tg<N> column,
    no prefill figures, the weight bytes per token and the roofline (unknown on a CPU)."""
    from engine.plan import roofline

    rc, out, err = run_cli(capsys, "run", "--model", str(demo_path), "--devices", "cpu", "--decode-tokens", "4",
                           "--warmup", "0")
    assert rc == 0, err
    header, _, row = out.splitlines()[:3]
    cols = [c.strip() for c in header.strip("|").split("|")]
    cells = dict(zip(cols, (c.strip() for c in row.strip("|").split("|"))))
    assert cells["test"] == "tg4" and cells["prefill tok/s"] == "—" and cells["ratio"] == "—"
    assert float(cells["decode tok/s"]) > 0 and cells["tg4"].startswith(cells["decode tok/s"] + " ± ")
    db = roofline.decode_weight_bytes(gguf_model.load(demo_path))
    assert cells["MiB/token"] == f"{db.total / 2**20:.1f}" and cells["roofline tok/s"] == "unknown"
    assert "roofline:" in out and "unknown" in out
    rc, out, _ = run_cli(capsys, "run", "--model", str(demo_path), "--devices", "cpu", "--prompt-tokens", "0,16",
                         "--decode-tokens", "3", "--mem-gbs", "10", "--format", "json", "--warmup", "0")
    assert rc == 0
    rows = json.loads(out)  # -o json: one array, as llama-bench's
    summary = [r for r in rows if r["row"] == "summary"]
    assert [r["prompt_tokens"] for r in summary] == [0, 16]
    assert [r["test"] for r in summary] == ["tg3", "pp16+tg3"]
    for r in summary:
        assert r["tg"] == "tg3" and r["decode_weight_bytes"] == db.total
        assert r["roofline_tok_s"] == pytest.approx(10e9 / db.total)
        assert r["roofline_share"] == pytest.approx(r["decode_tok_s"] / r["roofline_tok_s"])
    runs = [r for r in rows if r["row"] == "run"]
    assert len(runs[0]["generated"]) == 3 and runs[0]["tg"] == "tg3"


def test_prompt_tokens_zero_needs_decode(demo_path, capsys):
    rc, _, err = run_cli(capsys, "run", "--model", str(demo_path), "--prompt-tokens", "0")
    assert rc == 2 and "--decode-tokens" in err and err.count("\n") == 1
    rc, out, _ = run_cli(capsys, "run", "--model", str(demo_path), "--devices", "cpu", "--prompt-tokens", "16",
                         "--warmup", "0")
    assert rc == 0 and "tg" not in out.splitlines()[0] and "roofline" not in out  # no decode, no tg
    rc, _, err = run_cli(capsys, "run", "--model", str(demo_path), "--decode-tokens", "3", "--mem-gbs", "-1")
    assert rc == 2 and "--mem-gbs" in err and err.count("\n") == 1
