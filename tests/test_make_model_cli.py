"""Issue 37: make-model into a missing folder fails as cp does; --quant on a small model says
which tensors fell back and why (their rows are not a multiple of the type's 256-value block)."""
from __future__ import annotations

import re

from engine.cli import bench
from engine.io import quant_recipe
from engine.io.gguf_model import expected_shapes, load


def test_a_missing_folder_is_an_error_not_created(tmp_path, capsys):
    target = tmp_path / "no" / "such" / "m.gguf"
    assert bench.main(["make-model", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No such file or directory" in err[0] and "mkdir -p" in err[0]
    assert not (tmp_path / "no").exists()


def test_small_k_quant_models_say_why_tensors_fall_back(tmp_path, capsys):
    path = tmp_path / "small.gguf"
    assert bench.main(["make-model", str(path), "--quant", "q4_k_m"]) == 0
    out = capsys.readouterr().out
    note = next(line for line in out.splitlines() if line.startswith("note: "))
    assert "not a multiple of 256" in note and "Q4_K→Q5_0" in note
    # the count in the note is the file's: tensors whose type is not the one the mix wants
    m = load(path)
    spec = m.spec
    moved = [n for n in m.tensor_names()
             if m.tensor_type(n) != quant_recipe._wanted_before_fit(n, m.shape(n), "q4_k_m", spec).name]
    assert int(re.match(r"note: (\d+) of", note).group(1)) == len(moved) > 0
    assert len(expected_shapes(spec)) == len(m.tensor_names())


def test_rows_of_256_keep_the_mix_and_print_no_note(tmp_path, capsys):
    path = tmp_path / "wide.gguf"
    assert bench.main(["make-model", str(path), "--quant", "q4_k_m", "--hidden", "256", "--expert-ffn", "256",
                       "--heads", "8", "--kv-heads", "2", "--head-dim", "32"]) == 0
    out = capsys.readouterr().out
    assert "note:" not in out and "Q4_K" in out


def test_expert_flags_on_a_dense_family(tmp_path, capsys):
    """`--arch llama --experts N` writes Mixtral's layout (routed experts in a llama file, as
    Mixtral GGUFs have them); a dense family with no such layout refuses the flag instead of
    writing a dense model with it dropped."""
    path = tmp_path / "mixtral.gguf"
    assert bench.main(["make-model", str(path), "--arch", "llama", "--experts", "4", "--experts-used", "2"]) == 0
    m = load(path)
    assert m.spec.arch == "llama" and m.spec.n_experts == 4 and m.spec.n_experts_used == 2
    assert "blk.0.ffn_gate_exps.weight" in m.tensor_names() and "blk.0.ffn_gate.weight" not in m.tensor_names()
    capsys.readouterr()
    dense = tmp_path / "dense.gguf"
    assert bench.main(["make-model", str(dense), "--arch", "qwen3", "--experts", "4"]) == 2
    err = capsys.readouterr().err
    assert "--experts=4" in err and "qwen3 is dense" in err and "qwen3moe" in err and "llama" in err
    assert not dense.exists()
    mixed = tmp_path / "mixed.gguf"  # a Mixtral preset's experts do not carry over to a dense family
    assert bench.main(["make-model", str(mixed), "--preset", "mixtral-8x7b", "--arch", "qwen3", "--layers", "1",
                       "--hidden", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "32", "--experts", "2"]) == 2
    assert not mixed.exists()
    for bad in (["--experts", "1"], ["--experts", "0"]):  # Mixtral-style experts are checked as any family's
        capsys.readouterr()
        assert bench.main(["make-model", str(mixed), "--arch", "llama", *bad]) == 2
        assert "--experts" in capsys.readouterr().err and not mixed.exists()
    assert bench.main(["make-model", str(dense), "--arch", "qwen3"]) == 0  # no expert flag: dense, as asked
    assert load(dense).spec.n_experts == 0
