"""Shapes the forward cannot run are refused at load, naming the key, before any weight is
expanded (issue 39): a file whose tensors consistently use head_dim 33 used to load and then
fail inside RoPE with "The size of tensor a (16) must match the size of tensor b (17)"."""
from __future__ import annotations

import pytest

from engine.cli import bench
from engine.io import gguf_model, synth


@pytest.mark.parametrize("arch", ["qwen3moe", "llama"])
def test_an_odd_head_dim_is_refused_at_load_naming_the_key(tmp_path, capsys, arch):
    recipe = synth.recipe_from_args("demo", arch=arch, head_dim=33, n_layers=2)
    with pytest.raises(synth.RecipeError, match="head_dim"):
        synth.check_recipe(recipe)  # make-model refuses it too
    path = synth.write_model(tmp_path / "hd33.gguf", recipe, checked=False)
    with pytest.raises(gguf_model.GGUFError, match=rf"{arch}\.attention\.key_length is 33: RoPE rotates pairs"):
        gguf_model.load(path)
    assert bench.main(["run", "--model", str(path), "--prompt-tokens", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "key_length is 33" in err[0] and "internal error" not in err[0], err


def test_an_odd_head_dim_from_the_embedding_size_names_where_it_came_from(tmp_path):
    """No key_length in the file: the head size is embedding_length / head_count (llama.cpp's rule)."""
    recipe = synth.recipe_from_args("demo", arch="llama", hidden=132, n_heads=4, n_kv_heads=4, head_dim=33,
                                    n_layers=1)
    path = synth.write_model(tmp_path / "hd33.gguf", recipe, checked=False,
                             metadata={"{a}.attention.key_length": None, "{a}.attention.value_length": None})
    with pytest.raises(gguf_model.GGUFError, match=r"key_length is 33 \(embedding_length 132 / head_count 4\)"):
        gguf_model.load(path)


@pytest.mark.parametrize(("changes", "words"), [
    ({"n_heads": 4, "n_kv_heads": 3}, "query heads must be a positive multiple of KV heads"),
])
def test_head_counts_that_do_not_divide_are_refused(tmp_path, changes, words):
    path = synth.write_model(tmp_path / "heads.gguf", synth.recipe_from_args("demo", n_layers=1, **changes),
                             checked=False)
    with pytest.raises(gguf_model.GGUFError, match=words):
        gguf_model.load(path)
