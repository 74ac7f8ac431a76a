"""RoPE scaling from the file's metadata (issue 39): YaRN and linear scaling change the logits
exactly as transformers' rope of the same kind does; values the engine cannot honour are refused
at load, naming the key."""
from __future__ import annotations

import math

import pytest
import torch
from hf_reference import hf_model

from engine.cli import bench
from engine.config import EngineConfig
from engine.io import gguf_model, synth
from engine.io.prompt import synthetic
from engine.pipeline.session import Session

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

PROMPT = 96
YARN = {"{a}.rope.scaling.type": "yarn", "{a}.rope.scaling.factor": 4.0,
        "{a}.rope.scaling.original_context_length": 64}


@pytest.fixture(scope="module")
def write(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rope")

    def make(name: str, metadata: dict, arch: str = "qwen3moe", checked: bool = True, **changes):
        recipe = synth.recipe_from_args("demo", arch=arch, rope_base=10000.0, **changes)
        return synth.write_model(folder / f"{name}.gguf", recipe, metadata=metadata, checked=checked)

    return make


def _engine_logits(path):
    model = gguf_model.load(path)
    ids = synthetic(PROMPT, model.spec.vocab, nonce=7)
    res = Session(model, EngineConfig(devices=["cpu"], chunk_tokens=32)).run(ids, decode_tokens=0, logits_all=True)
    return model, ids, res.logits


def _hf_logits(path, spec, ids, rope_parameters):
    ref = hf_model(path, spec, rope_parameters=rope_parameters)
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize(("arch", "kind", "meta", "hf_rope"), [
    ("qwen3moe", "yarn", YARN, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ("qwen3", "yarn", {"{a}.rope.scaling.type": "yarn", "{a}.rope.scaling.factor": 2.5},  # original: context_length
     {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 4096}),
    ("llama", "linear", {"{a}.rope.scaling.type": "linear", "{a}.rope.scaling.factor": 3.0},
     {"rope_type": "linear", "factor": 3.0}),
    ("qwen2", "linear", {"{a}.rope.scale_linear": 2.0},  # the old key, no type: llama.cpp reads it as linear
     {"rope_type": "linear", "factor": 2.0}),
])
def test_scaled_rope_logits_equal_transformers(write, arch, kind, meta, hf_rope):
    path = write(f"{arch}-{kind}", meta, arch=arch)
    model, ids, logits = _engine_logits(path)
    assert model.spec.rope_scaling is not None and model.spec.rope_scaling.kind == kind
    ref = _hf_logits(path, model.spec, ids, {**hf_rope, "rope_theta": model.spec.rope_base})
    diff = (logits - ref).abs().max().item()
    assert diff <= 1e-4, f"{arch} {kind}: max |logits - HF| = {diff}"
    # and the scaling matters: the same file without it gives other logits
    plain = _hf_logits(path, model.spec, ids, None)
    assert (logits - plain).abs().max().item() > 100 * diff + 1e-3


def test_yarn_digest_differs_from_the_same_file_without_it(write):
    """The issue's symptom: a yarn file printed the digest of the unscaled one."""
    digests = []
    for name, meta in (("plain", {}), ("yarn", YARN)):
        model = gguf_model.load(write(f"digest-{name}", meta))
        run = Session(model, EngineConfig(devices=["cpu"], chunk_tokens=32)).run(synthetic(64, model.spec.vocab), 0)
        digests.append(run.report.digest)
    assert digests[0] != digests[1]


@pytest.mark.parametrize(("meta", "key", "words"), [
    ({"{a}.rope.scaling.type": "yarn", "{a}.rope.scaling.factor": math.nan}, "rope.scaling.factor", "finite"),
    ({"{a}.rope.scaling.type": "yarn", "{a}.rope.scaling.factor": math.inf}, "rope.scaling.factor", "finite"),
    ({"{a}.rope.scaling.type": "linear", "{a}.rope.scaling.factor": -2.0}, "rope.scaling.factor", "above 0"),
    ({"{a}.rope.scaling.type": "yarn", "{a}.rope.scaling.factor": 0.5}, "rope.scaling.factor", "at least 1"),
    ({"{a}.rope.scale_linear": math.nan}, "rope.scale_linear", "finite"),
    ({"{a}.rope.scaling.type": "longrope", "{a}.rope.scaling.factor": 4.0}, "rope.scaling.type", "longrope"),
    ({"{a}.rope.scaling.type": "dynamic"}, "rope.scaling.type", "implements none, linear, yarn"),
    ({**YARN, "{a}.rope.scaling.original_context_length": 0}, "rope.scaling.original_context_length", ">= 1"),
    ({**YARN, "{a}.rope.scaling.yarn_beta_fast": 16.0}, "rope.scaling.yarn_beta_fast", "default 32"),
    ({**YARN, "{a}.rope.scaling.yarn_ext_factor": 0.5}, "rope.scaling.yarn_ext_factor", "default"),
    ({**YARN, "{a}.rope.scaling.attn_factor": 0.8}, "rope.scaling.attn_factor", "default 1"),
    ({"{a}.rope.dimension_count": 16}, "rope.dimension_count", "partial rotary"),
    ({"{a}.attention.value_length": 16}, "attention.value_length", "not implemented"),
    ({"{a}.rope.scaling.alpha": 1000.0}, "rope.scaling.alpha", "default 0"),
])
def test_values_the_engine_cannot_honour_are_refused_naming_the_key(write, capsys, meta, key, words):
    path = write("refused-" + "-".join(f"{k.split('.')[-1]}{v}" for k, v in sorted(meta.items())), meta)
    with pytest.raises(gguf_model.GGUFError) as info:
        gguf_model.load(path)
    assert f"qwen3moe.{key}" in str(info.value) and words in str(info.value), str(info.value)
    assert bench.main(["run", "--model", str(path), "--prompt-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert f"qwen3moe.{key}" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_defaults_written_out_load_as_no_scaling(write):
    """Keys holding llama.cpp's defaults change nothing: type none, factor 1 or 0, the head's
    own rotary size, yarn's default betas."""
    meta = {"{a}.rope.scaling.type": "none", "{a}.rope.scaling.factor": 4.0, "{a}.rope.dimension_count": 32,
            "{a}.attention.value_length": 32, "{a}.rope.scaling.yarn_beta_fast": 32.0,
            "{a}.rope.scaling.finetuned": True}
    assert gguf_model.load(write("defaults", meta)).spec.rope_scaling is None
    assert gguf_model.load(write("factor-one", {"{a}.rope.scaling.factor": 1.0})).spec.rope_scaling is None


def test_stage_processes_apply_the_scaling_as_the_threads_do(write):
    """Each stage process builds its RoPE tables from the file's scaling too: same digest."""
    model = gguf_model.load(write("procs", YARN))
    ids = synthetic(64, model.spec.vocab)
    digests = []
    for executor in ("threads", "processes"):
        sess = Session(model, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=32, executor=executor))
        try:
            digests.append(sess.run(ids, 0).report.digest)
        finally:
            sess.close()
    plain = gguf_model.load(write("procs-plain", {}))
    unscaled = Session(plain, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=32)).run(ids, 0).report.digest
    assert digests[0] == digests[1] != unscaled
