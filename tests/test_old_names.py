"""One name per idea (issue 16): `chunk_tokens` (was `prefill` / the form's `chunk_size`) and
`pipeline_depth` (was `pf_depth`).  The seeds' names stay accepted everywhere a user or an old
file may still use them: environment, CLI, arms, the engine's constructors, saved settings,
history records, traces and reports."""
from __future__ import annotations

import dataclasses
import json
import sqlite3

import pytest
from history_support import demo_runs  # noqa: F401  (fixture)

from engine.cli import bench
from engine.config import ConfigError, EngineConfig, migrate_keys
from engine.events import RunPlan
from engine.sweep import parse_arm
from strata_gui.history.history_model import RunHistory
from strata_gui.run.record_model import report_from_dict, report_to_dict
from strata_gui.run.run_files import export_trace, import_trace
from strata_gui.run.settings_model import RunSettings, settings_from_config


def _old(d: dict) -> dict:
    """A settings dict as written before issue 16."""
    back = {"chunk_tokens": "prefill", "pipeline_depth": "pf_depth"}
    return {back.get(k, k): v for k, v in d.items()}


def test_env_aliases_are_read_and_the_new_name_wins():
    cfg = EngineConfig.from_sources({}, env={"STRATA_PREFILL": "64", "STRATA_PF_DEPTH": "0"})
    assert (cfg.chunk_tokens, cfg.pipeline_depth) == (64, 0)
    cfg = EngineConfig.from_sources({}, env={"STRATA_PREFILL": "64", "STRATA_CHUNK_TOKENS": "128",
                                             "STRATA_PF_DEPTH": "0", "STRATA_PIPELINE_DEPTH": "1"})
    assert (cfg.chunk_tokens, cfg.pipeline_depth) == (128, 1)
    with pytest.raises(ConfigError, match="STRATA_PF_DEPTH"):  # the message names the variable that was set
        EngineConfig.from_sources({}, env={"STRATA_PF_DEPTH": "2"})
    s = RunSettings.from_env({"STRATA_PREFILL": "512", "STRATA_PF_DEPTH": "0"})
    assert (s.chunk_mode, s.chunk_tokens, s.pipeline_depth) == ("fixed", "512", 0)


def test_cli_takes_the_old_flags_without_showing_them():
    ap = bench.build_parser()
    old = ap.parse_args(["run", "--prefill", "16", "--pf-depth", "0"])
    new = ap.parse_args(["run", "--chunk-tokens", "16", "--pipeline-depth", "0"])
    assert (old.chunk_tokens, old.pipeline_depth) == (new.chunk_tokens, new.pipeline_depth) == ("16", "0")
    run_help = next(a for a in ap._subparsers._group_actions[0].choices.items() if a[0] == "run")[1].format_help()
    assert "--chunk-tokens" in run_help and "--pipeline-depth" in run_help
    assert "--prefill " not in run_help and "--pf-depth" not in run_help
    plan = ap.parse_args(["plan", "--from-run", "x.json", "--prefill", "1024", "--pf-depth", "0"])
    assert (plan.chunk_tokens, plan.pipeline_depth) == ("1024", 0)


def test_arms_constructors_and_attributes_take_the_old_names():
    assert parse_arm("pf_depth=0 prefill=64") == parse_arm("pipeline_depth=0 chunk_tokens=64") == \
        {"pipeline_depth": 0, "chunk_tokens": 64}
    cfg = EngineConfig(devices=["cpu", "cpu"], prefill=64, pf_depth=0)
    assert (cfg.chunk_tokens, cfg.pipeline_depth, cfg.prefill, cfg.pf_depth) == (64, 0, 64, 0)
    assert dataclasses.replace(cfg, pf_depth=1).pipeline_depth == 1 and cfg.replace(prefill=32).chunk_tokens == 32
    assert EngineConfig.from_sources({"prefill": "32", "pf_depth": "0"}, env={}) == \
        EngineConfig.from_sources({"chunk_tokens": "32", "pipeline_depth": "0"}, env={})
    assert migrate_keys({"chunk_tokens": 1, "prefill": 2}) == {"chunk_tokens": 2}  # the later wins: {**base, **arm}


def test_saved_form_settings_with_the_old_keys_load():
    s = RunSettings.from_dict({"chunk_mode": "fixed", "chunk_size": "512", "pf_depth": 0})
    assert (s.chunk_tokens, s.pipeline_depth) == ("512", 0)
    restored, _ = settings_from_config({"prefill": 64, "pf_depth": 0, "devices": "cpu,cpu"}, RunSettings())
    assert (restored.chunk_mode, restored.chunk_tokens, restored.pipeline_depth) == ("fixed", "64", 0)


def test_a_report_written_with_pf_depth_reads_back():
    d = {"run_id": "r", "stages": [], "prompt_tokens": 8, "chunk": 8, "n_chunks": 1, "decode_tokens": 0,
         "handoff": "", "prefill_main": False, "pf_depth": 0}
    plan = RunPlan(**migrate_keys(d) | {"stages": ()})
    assert plan.pipeline_depth == plan.pf_depth == 0


def test_a_history_record_of_the_old_format_loads_and_filters(tmp_path, demo_runs):  # noqa: F811
    path = tmp_path / "h.sqlite3"
    with RunHistory(path) as h:
        join = h.add(demo_runs.join)
        overlap = h.add(demo_runs.overlap)
    # rewrite both rows as a version before issue 16 wrote them: old keys in config and report
    con = sqlite3.connect(path)
    for run, in con.execute("SELECT id FROM runs").fetchall():
        config, report = con.execute("SELECT config_json, report_json FROM runs WHERE id = ?", (run,)).fetchone()
        config, report = _old(json.loads(config)), json.loads(report)
        report["plan"] = _old(report["plan"])
        assert "pf_depth" in config and "prefill" in config and "pf_depth" in report["plan"]
        con.execute("UPDATE runs SET config_json = ?, report_json = ? WHERE id = ?",
                    (json.dumps(config), json.dumps(report), run))
    con.commit()
    con.close()
    with RunHistory(path) as h:
        old = h.get(join)
        assert old.config["pipeline_depth"] == 0 and old.config["chunk_tokens"] == 32
        assert "pf_depth" not in old.config and "prefill" not in old.config
        assert old.report.plan.pipeline_depth == 0 and h.report(overlap).plan.pipeline_depth == 1
        assert h.row(join).pipeline_depth == 0
        for text in ("pf_depth=0", "pipeline_depth=0", "depth=0"):
            assert [r.id for r in h.list_runs(text)] == [join], text
        for text in ("prefill=32", "chunk_tokens=32", "chunk=32", "chunk_size=32"):
            assert sorted(r.id for r in h.list_runs(text)) == [join, overlap], text
        # a run recorded now sits beside them and matches the same filters
        new = h.add(demo_runs.join)
        assert sorted(r.id for r in h.list_runs("pf_depth=0")) == [join, new]


def test_a_trace_of_the_old_format_imports(tmp_path, demo_runs):  # noqa: F811
    path = export_trace(demo_runs.join, tmp_path / "run.json")
    data = json.loads(path.read_text())
    other = data["otherData"]
    other["config"] = _old(other["config"])
    other["report"] = report_to_dict(report_from_dict(other["report"]))
    other["report"]["plan"] = _old(other["report"]["plan"])
    path.write_text(json.dumps(data))
    record = import_trace(path)
    assert record.config["pipeline_depth"] == 0 and record.config["chunk_tokens"] == 32
    assert record.report.plan.pipeline_depth == 0
