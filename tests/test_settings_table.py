"""Issue 31: every setting is one row of engine/settings_table.py, and the README, the config
dataclass, the CLI and the form's fields are that table."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from engine import settings_table as table
from engine.config import ENV_ALIASES, ENV_NAMES, NAME_ALIASES, SETTING_NAMES, EngineConfig

ROOT = Path(__file__).resolve().parents[1]


def _readme_rows(section: str) -> list[str]:
    return [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| setting")
            and not line.startswith("| variable")]


def test_the_readme_settings_tables_are_the_table():
    section = table.readme_section((ROOT / "README.md").read_text())
    assert section, f"README.md has no section between {table.README_BEGIN!r} and {table.README_END!r}"
    want = table.readme_tables()
    got_rows, want_rows = _readme_rows(section), _readme_rows(want)
    missing = [r for r in want_rows if r not in got_rows]
    extra = [r for r in got_rows if r not in want_rows]
    assert not missing and not extra, (
        f"README.md's settings tables differ from engine/settings_table.py (print them with "
        f"`python -m engine.settings_table`): missing or changed {missing}, not in the table {extra}")
    assert section == want


def test_the_readme_check_fails_on_a_missing_or_changed_row():
    good = table.readme_tables()
    rows = _readme_rows(good)
    assert len(rows) == len(table.SETTINGS) + len(table.DIAGNOSTICS)
    dropped = good.replace(rows[3] + "\n", "")
    changed = good.replace(rows[0], rows[0].replace("cpu |", "cuda |"))
    for text in (dropped, changed):
        assert table.readme_section(text) != good


def test_the_config_dataclass_holds_the_engine_rows_with_their_defaults():
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    assert set(fields) == set(SETTING_NAMES) == set(table.ENGINE_ROWS)
    default = EngineConfig()
    for s in table.SETTINGS:
        value = getattr(default, s.name)
        assert (list(s.default) if isinstance(value, list) else s.default) == value, s.name


def test_env_names_and_aliases_come_from_the_rows():
    assert ENV_NAMES == {s.name: s.env for s in table.SETTINGS if s.env}
    assert ENV_ALIASES == {"pipeline_depth": ("STRATA_PF_DEPTH",), "chunk_tokens": ("STRATA_PREFILL",)}
    assert NAME_ALIASES == {"pf_depth": "pipeline_depth", "prefill": "chunk_tokens"}


def test_every_row_is_whole():
    envs = [s.env for s in table.ROWS.values() if s.env]
    assert len(envs) == len(set(envs)), "an environment variable on two rows"
    for s in table.ROWS.values():
        assert s.kind in table.KINDS and s.doc and s.default_text, s.name
        assert "|" not in s.doc + s.default_text + s.flag_value, s.name  # would break the README table
    for s in table.SETTINGS:
        assert s.flag == "--" + s.name.replace("_", "-") and s.help and s.allowed, s.name
        assert (s.kind == "choice") == bool(s.choices) or s.kind == "gib", s.name
        assert not s.label or s.tooltip, s.name
    for s in table.DIAGNOSTICS:
        assert s.env.startswith("STRATA_") and not s.flag and not s.label and s.group == "diagnostics"


def test_the_cli_flags_are_the_rows():
    ap = argparse.ArgumentParser()
    table.add_flags(ap)
    ns = ap.parse_args(["--pf-depth", "0", "--prefill", "64", "--timing", "--cuda-graphs=0"])
    assert table.flag_values(ns) == {"pipeline_depth": "0", "chunk_tokens": "64", "timing": "1", "cuda_graphs": "0"}
    helps = {a.dest: a.help for a in ap._actions if a.dest != "help" and a.help != argparse.SUPPRESS}
    assert helps == {s.name: s.help for s in table.SETTINGS}


@pytest.mark.parametrize("name", [s.name for s in table.DIAGNOSTICS])
def test_a_diagnostic_is_read_through_its_row(name):
    var = table.row(name).env
    assert table.env_text(name, {var: "  Torch \n"}) == "Torch"
    assert table.env_text(name, {}) == ""
    assert table.env_value(name, {var: " k "}) == " k " and table.env_value(name, {}) is None


def test_the_side_channel_variables_are_named_only_in_the_table():
    """Every STRATA_* diagnostic is read through `env_text`/`env_value`: its name as a string
    literal appears in no other engine or app module (docstrings and messages aside)."""
    import ast

    names = {s.env for s in table.DIAGNOSTICS}
    for path in [*(ROOT / "engine").rglob("*.py"), *(ROOT / "strata_gui").rglob("*.py")]:
        if path.name == "settings_table.py":
            continue
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docs:
                raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno} names {node.value} itself")


def test_the_forms_fields_are_the_labelled_rows():
    from strata_gui.run.settings_model import FIELDS, RunSettings

    labelled = [s.name for s in table.SETTINGS if s.label]
    assert [f for f in FIELDS if f in table.ENGINE_ROWS] == labelled
    form = RunSettings()
    for s in table.form_rows():
        if s.name in ("devices", "layer_split", "chunk_tokens"):  # the form's own start (two CPU stages, modes)
            continue
        assert getattr(form, s.name) == s.default, s.name
    env = {"STRATA_PIN_LIMIT_GIB": "20", "STRATA_GPU_ORDER": " Configured", "STRATA_PREFILL": "96",
           "STRATA_PF_DEPTH": "0", "STRATA_CUDA_GRAPHS": "off", "STRATA_EXECUTOR": "nope"}
    s = RunSettings.from_env(env)
    assert (s.pin_limit_gib, s.gpu_order, s.chunk_mode, s.chunk_tokens, s.pipeline_depth, s.cuda_graphs,
            s.executor) == ("20", "configured", "fixed", "96", 0, False, "threads")


def test_a_recorded_run_goes_back_into_the_forms_fields():
    from strata_gui.run.settings_model import RunSettings, settings_from_config

    record = {"model": "built-in demo", "devices": "cpu,cpu", "layer_split": "1,3", "chunk_tokens": 64,
              "pipeline_depth": 0, "pin_limit_gib": 12.0, "expert_cache": "all", "cuda_graphs": False,
              "gpu_order": "configured", "executor": "processes", "rendezvous": "h:1", "decode_tokens": 3}
    s, kept = settings_from_config(record, RunSettings())
    assert (s.split_mode, s.split_counts, s.chunk_mode, s.chunk_tokens, s.pipeline_depth, s.pin_limit_gib,
            s.expert_cache, s.cuda_graphs, s.gpu_order, s.decode_tokens) == \
        ("manual", "1,3", "fixed", "64", 0, "12", "all", False, "configured", 3)
    assert (s.executor, s.rendezvous) == ("threads", "") and kept == []  # where a past run's stages ran: not taken
    auto, _ = settings_from_config({"layer_split": "auto", "chunk_tokens": "auto"}, s)
    assert (auto.split_mode, auto.split_counts, auto.chunk_mode, auto.chunk_tokens) == ("auto", "1,3", "auto", "64")
