"""Issue 19, item 5: strata-bench input errors are one line naming the flag and value (exit 2),
output paths are checked before a run, and a write that fails after it loses nothing."""
from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest
from platform_support import not_on_windows

from engine.cli import bench
from engine.io import synth
from engine.io.atomic_file import UMASK
from engine.io.gguf_model import load

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def binary_ids(tmp_path) -> Path:
    p = tmp_path / "ids.bin"
    p.write_bytes(bytes(range(256)) * 4)
    return p


@pytest.mark.parametrize("argv, flag", [
    (["run", "--prompt-tokens", "abc"], "--prompt-tokens='abc'"),
    (["run", "--prompt-tokens", "512,-1"], "--prompt-tokens='512,-1'"),
    (["run", "--model", "synthetic:bogus"], "--model='synthetic:bogus'"),
    (["run", "--model", "synthetic:demo:n_layers=abc"], "n_layers=<int> ('abc' is not an integer)"),
    (["run", "--model", "synthetic:demo:wings=2"], "'wings=2' is not key=value with a known key"),
    (["run", "--model", "synthetic:demo:n_experts_used=9"], "n_experts_used: 1..n_experts (8)"),
    (["make-model", "{tmp}/m.gguf", "--vocab", "10"], "--vocab=10"),
    (["make-model", "{tmp}/m.gguf", "--experts-used", "9"], "--experts-used=9: allowed 1..n_experts (8)"),
    (["make-model", "{tmp}/m.gguf", "--layers", "0"], "--layers=0"),
    (["make-model", "{tmp}/m.gguf", "--heads", "4", "--kv-heads", "3"], "--kv-heads=3"),
    pytest.param(["make-model", "/proc/x.gguf"], "make-model PATH='/proc/x.gguf'", marks=not_on_windows),
    (["run", "--prompt-ids", "{ids}"], "--prompt-ids="),
    pytest.param(["run", "--trace", "/proc/x.json"], "--trace='/proc/x.json'", marks=not_on_windows),
    pytest.param(["run", "--logits-out", "/proc/x.npy"], "--logits-out='/proc/x.npy'", marks=not_on_windows),
    (["run", "--trace", "{tmp}/" + "x" * 300 + ".json"], "(File name too long)"),
])
def test_input_errors_are_one_line_naming_the_flag_exit_2(argv, flag, tmp_path, binary_ids, capsys):
    argv = [a.format(tmp=tmp_path, ids=binary_ids) for a in argv]
    rc = bench.main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("strata-bench: error: invalid ") and flag in lines[0], err
    # refused before any model is loaded: tests/test_cli_settings_early.py checks sys.modules
    assert not list(tmp_path.glob("*.gguf*"))  # make-model wrote nothing


def test_prompt_ids_outside_the_vocabulary(tmp_path, capsys):
    p = tmp_path / "ids.txt"
    p.write_text("1 2 999999")
    assert bench.main(["run", "--prompt-ids", str(p)]) == 2
    assert "token ids 0..390" in capsys.readouterr().err


def test_make_model_refuses_nothing_the_loader_accepts(tmp_path):
    """Edge shapes that check_recipe lets through load (so the two rules agree at the boundary)."""
    for changes in ({"n_layers": 1, "n_experts": 1, "n_experts_used": 1}, {"n_experts_used": 8},
                    {"vocab": len(synth.byte_vocab()[0])}, {"arch": "llama", "n_heads": 4, "n_kv_heads": 4}):
        recipe = synth.recipe_from_args("demo", **changes)
        synth.check_recipe(recipe)
        path = synth.write_model(tmp_path / "edge.gguf", recipe)
        assert load(path).spec.n_layers == recipe.n_layers
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~UMASK  # not mkstemp's 0600


def test_help_and_argument_errors_do_not_import_torch():
    """--help and argument errors answer without importing torch, gguf or the pipeline (seconds)."""
    code = ("import sys, engine.cli.bench as b\n"
            "for argv in (['run', '--prompt-tokens', 'abc'], ['run', '--trace', '/proc/x.json'],"
            " ['make-model', '/proc/x.gguf']):\n"
            "    assert b.main(argv) == 2\n"
            "try:\n    b.main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print(sorted(m for m in ('torch', 'gguf', 'engine.pipeline.session', 'engine.io.gguf_model') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_the_preset_names_of_the_parser_are_synths():
    assert bench.PRESET_NAMES == tuple(sorted(synth.PRESETS))
    assert bench.QUANT_NAMES == synth.QUANTS
