"""`strata-bench make-model`'s writer: one tensor in memory at a time, the bytes the whole-file
writer (the `edit` path the fuzzer uses) makes, a progress callback, bounded host memory."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from platform_support import needs_resource

from engine.io import gguf_model, synth

SHAPE = dict(hidden=256, head_dim=64, n_experts=8, expert_ffn=256, ffn=512)


@pytest.mark.parametrize("quant", ["q4_k_m", "q8_0", "f16"])
def test_streamed_file_is_byte_identical_to_the_whole_file_writer(tmp_path, quant):
    recipe = synth.recipe_from_args("demo", arch="qwen3moe", quant=quant, **SHAPE)
    streamed = synth.write_model(tmp_path / "streamed.gguf", recipe)
    whole = synth.write_model(tmp_path / "whole.gguf", recipe, edit=lambda name, data: data)
    assert streamed.read_bytes() == whole.read_bytes()
    m = gguf_model.load(streamed)  # and it is a file our reader (strict) takes
    assert m.spec.hidden == 256


def test_progress_reaches_the_whole_file_in_tensor_order(tmp_path):
    seen: list[tuple[str, float]] = []
    recipe = synth.recipe_from_args("demo", quant="q4_k_m", **SHAPE)
    path = synth.write_model(tmp_path / "p.gguf", recipe, progress=lambda what, frac: seen.append((what, frac)))
    fracs = [f for _, f in seen]
    assert fracs == sorted(fracs) and fracs[-1] == pytest.approx(1.0)
    names = [w for w, _ in seen]
    assert names[0] == "token_embd.weight" and len(names) == len(gguf_model.load(path).tensor_names())


WRITE = r"""
import json, resource, sys
from engine.io import synth
recipe = synth.recipe_from_args("demo", arch="qwen3moe", quant="q4_k_m", n_layers=int(sys.argv[2]), hidden=512,
                                head_dim=64, n_experts=64, expert_ffn=512, ffn=1024)
path = synth.write_model(sys.argv[1], recipe)
print(json.dumps({"size": path.stat().st_size, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


@needs_resource
def test_host_memory_does_not_grow_with_the_file(tmp_path):
    """Writing holds one tensor at a time: four times the layers (the file ~3.5x larger) raises
    the writer's peak RSS by well under the extra bytes (the whole-file writer held them all)."""
    def write(layers: int) -> dict:
        out = subprocess.run([sys.executable, "-c", WRITE, str(tmp_path / f"{layers}.gguf"), str(layers)],
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    small, big = write(2), write(8)
    assert big["size"] > 3 * small["size"]
    assert big["peak"] - small["peak"] < 0.25 * (big["size"] - small["size"]), (small, big)


@pytest.mark.parametrize("qt", ["Q8_0", "Q4_0", "Q5_1"])
def test_a_tensor_past_the_quantiser_limit_is_random_valid_blocks(monkeypatch, qt):
    """gguf's numpy quantiser is single-threaded (minutes for gpt-oss's 579M-value Q8_0
    embedding): past synth.QUANTISE_LIMIT values the writer draws no floats and stores random
    valid blocks of the tensor's spread, which gguf's own dequantiser reads back."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[qt]
    name, shape = "token_embd.weight", (64, 256)
    monkeypatch.setattr(synth, "QUANTISE_LIMIT", 64 * 256 - 1)

    def no_floats():
        raise AssertionError("floats drawn for a tensor past the limit")

    raw = synth._stored(name, qtype, shape, no_floats, seed=7)
    assert raw.dtype == np.uint8 and raw.shape == tuple(gguf.quants.quant_shape_to_byte_shape(shape, qtype))
    values = gguf.quants.dequantize(raw, qtype)
    assert values.shape == shape and np.isfinite(values).all()
    std = synth._std(name, shape)
    assert 0.5 * std < float(values.std()) < 2.0 * std
    # under the limit the same tensor is gguf's quantisation of its floats
    monkeypatch.setattr(synth, "QUANTISE_LIMIT", 64 * 256)
    floats = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    assert np.array_equal(synth._stored(name, qtype, shape, lambda: floats, seed=7), gguf.quants.quantize(floats, qtype))
