"""Generated quantized models: llama.cpp's tensor-type mixes, valid random blocks, and logits
that agree with HF transformers loading the same file (which dequantises with gguf)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants
from hf_reference import hf_model

from engine.config import EngineConfig
from engine.io import gguf_model, quant_recipe, synth
from engine.io.prompt import synthetic
from engine.pipeline.session import Session

# rows of 256 values so the K-quants apply (the demo's 128 would fall back to legacy types)
K_SHAPES = dict(hidden=256, head_dim=64, n_experts=16, expert_ffn=256, ffn=512)


def _spec(**kw):
    return synth.recipe_from_args("demo", **{**K_SHAPES, **kw}).spec()


def test_use_more_bits_matches_llama_cpp_rule():
    # n=32: first 4, last 4, and every third from 4 on
    picked = [i for i in range(32) if quant_recipe.use_more_bits(i, 32)]
    assert picked == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


def test_q4_k_m_mix():
    s = _spec(n_layers=4)
    tt = lambda name, shape: quant_recipe.tensor_type(name, shape, "q4_k_m", s)  # noqa: E731
    assert tt("output.weight", (300, 256)) == T.Q6_K
    assert tt("token_embd.weight", (300, 256)) == T.Q4_K
    assert tt("blk.0.attn_q.weight", (256, 256)) == T.Q4_K
    assert [tt(f"blk.{i}.attn_v.weight", (128, 256)) for i in range(4)] == [T.Q4_K, T.Q4_K, T.Q6_K, T.Q6_K]
    assert [tt(f"blk.{i}.ffn_down_exps.weight", (16, 256, 256)) for i in range(4)] == \
        [T.Q4_K, T.Q4_K, T.Q6_K, T.Q6_K]
    assert tt("blk.1.ffn_gate_exps.weight", (16, 256, 256)) == T.Q4_K
    assert tt("blk.1.ffn_gate_inp.weight", (16, 256)) == T.F32
    assert tt("blk.1.attn_norm.weight", (256,)) == T.F32
    # rows that are not whole 256-blocks fall back as llama.cpp does
    assert tt("blk.1.ffn_up_exps.weight", (16, 64, 96)) == T.Q5_0
    assert tt("blk.3.ffn_down_exps.weight", (16, 256, 96)) == T.Q8_0
    assert tt("blk.1.ffn_up_exps.weight", (16, 64, 48)) == T.F16
    # the 8-expert bumps
    s8 = _spec(n_layers=4, n_experts=8)
    assert quant_recipe.tensor_type("blk.0.attn_v.weight", (128, 256), "q4_k_m", s8) == T.Q8_0
    assert quant_recipe.tensor_type("blk.0.attn_k.weight", (128, 256), "q4_k_m", s8) == T.Q8_0
    assert quant_recipe.tensor_type("blk.0.attn_output.weight", (256, 256), "q4_k_m", s8) == T.Q5_K
    # other mixes
    assert quant_recipe.tensor_type("blk.0.ffn_down_exps.weight", (16, 256, 256), "q6_k", s) == T.Q6_K
    assert quant_recipe.tensor_type("output.weight", (300, 256), "q8_0", s) == T.Q8_0
    assert quant_recipe.tensor_type("output.weight", (300, 256), "iq4_xs", s) == T.Q6_K
    assert quant_recipe.tensor_type("blk.2.ffn_up.weight", (512, 256), "iq4_xs", s) == T.IQ4_XS
    with pytest.raises(ValueError, match="unknown quant mix"):
        quant_recipe.tensor_type("output.weight", (300, 256), "q3_k_s", s)


@pytest.mark.parametrize("source", ["torch", "numpy"])  # the synthetic source's stream, the file writer's
@pytest.mark.parametrize("qtype", sorted(quant_recipe.QUANTIZED, key=lambda t: t.name), ids=lambda t: t.name)
def test_random_blocks_are_valid_and_of_the_asked_size(qtype, source):
    g = torch.Generator().manual_seed(3) if source == "torch" else np.random.default_rng(3)
    raw = quant_recipe.random_blocks(qtype, (64, 512), 0.05, g)
    vals = gguf_quants.dequantize(raw.numpy().reshape(64, -1), qtype)  # the independent reader
    assert np.isfinite(vals).all()
    assert 0.035 < float(vals.std()) < 0.065, float(vals.std())
    assert abs(float(vals.mean())) < 0.01


@pytest.fixture(scope="module")
def quant_model(make_arch):
    def make(arch: str, quant: str):
        return make_arch(arch, quant=quant, **K_SHAPES)
    return make


@pytest.mark.parametrize("arch,quant", [("qwen3moe", "q4_k_m"), ("qwen3moe", "q6_k"), ("llama", "q4_k_m"),
                                        ("qwen3", "q4_k_m")])
def test_quantized_logits_match_transformers(quant_model, arch, quant):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = quant_model(arch, quant)
    model = gguf_model.load(path)
    mix = dict(model.quant_mix())
    main = "Q4_K" if quant == "q4_k_m" else "Q6_K"
    assert max(mix, key=mix.get) == main and math.isclose(sum(mix.values()), 1.0)
    if quant == "q4_k_m":
        assert "Q6_K" in mix
    ids = synthetic(64, model.spec.vocab, nonce=7)
    res = Session(model, EngineConfig(devices=["cpu"], chunk_tokens=32)).run(ids, decode_tokens=4, logits_all=True)
    ref_model = hf_model(path, model.spec)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
        gen = ref_model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, 64:].tolist()
    assert ref.std() > 0.1  # a model whose logits say something
    diff = (res.logits - ref).abs().max().item()
    assert diff <= 1e-4, f"{arch} {quant}: max |logits - HF| = {diff}"
    assert res.report.generated == gen


def test_synthetic_source_generates_quantized_blocks():
    """synthetic:PRESET:quant=q4_k_m makes blocks on the source's device (no file) that expand
    like any file's, and a session runs on them."""
    recipe = synth.recipe_from_args("demo", quant="q4_k_m", n_layers=2, **K_SHAPES)
    src = synth.SyntheticSource(recipe, "cpu")
    name = "blk.1.ffn_down_exps.weight"
    assert src.qtype(name) == T.Q6_K and src.qtype("blk.0.ffn_up_exps.weight") == T.Q4_K
    raw = src.raw(name)
    assert raw.dtype == torch.uint8 and raw.numel() == src.nbytes(name) == 16 * 256 * 256 // 256 * 210
    ref = gguf_quants.dequantize(raw.numpy().reshape(16, 256, -1), T.Q6_K)
    assert np.array_equal(src.tensor(name).numpy(), ref)
    assert torch.equal(src.raw(name), raw)  # deterministic
    res = Session(src, EngineConfig(devices=["cpu"], chunk_tokens=16)).run(synthetic(32, src.spec.vocab, nonce=1),
                                                                      logits_all=True)
    assert torch.isfinite(res.logits).all()


def test_streamed_quantized_experts_match_resident_and_transformers(quant_model):
    """Experts streamed through a cache smaller than a layer, as stored (Q4_K rows in some
    layers, Q4_K+Q6_K rows in others), give the resident run's output and HF's logits."""
    pytest.importorskip("transformers")
    path = quant_model("qwen3moe", "q4_k_m")
    model = gguf_model.load(path)
    rows = {model.qtype(f"blk.{i}.ffn_down_exps.weight").name for i in range(model.spec.n_layers)}
    assert rows == {"Q4_K", "Q6_K"}
    ids = synthetic(64, model.spec.vocab, nonce=7)
    one_expert = sum(model.nbytes(f"blk.3.{p}.weight") for p in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    one_expert /= model.spec.n_experts
    cfg = EngineConfig(devices=["cpu", "cpu"], chunk_tokens=32, expert_cache=5.5 * one_expert / 2**30)
    sess = Session(model, cfg)
    streamed = sess.run(ids, decode_tokens=4, logits_all=True)
    resident = Session(model, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=32)).run(ids, decode_tokens=4,
                                                                                   logits_all=True)
    st = streamed.report.expert_stats[0]
    assert st["slots"] == 5 and st["misses"] > 0 and not st["resident"]
    # the cache streamed file bytes, not expanded weights
    assert sess.arena.nbytes < 1.1 * sum(model.nbytes(f"blk.{i}.{p}.weight") for i in range(4)
                                         for p in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    assert streamed.report.digest == resident.report.digest
    # streaming moved the experts' stored bytes: between the smallest and the largest row each
    rows = [lay.row_bytes for lay in sess.arena.layouts.values()]
    moved = st["bytes_pinned"] + st["bytes_pageable"]
    assert st["misses"] * min(rows) <= moved <= st["misses"] * max(rows)
    assert max(rows) < 0.3 * 3 * 256 * 256 * 4  # under a third of the fp32 weights (Q4_K/Q6_K)
    with torch.no_grad():
        ref = hf_model(path, model.spec)(torch.tensor([ids])).logits[0]
    assert (streamed.logits - ref).abs().max().item() <= 1e-4


def test_quant_mix_is_described(quant_model):
    model = gguf_model.load(quant_model("qwen3moe", "q4_k_m"))
    mix = model.quant_mix()
    by_bytes: dict[str, int] = {}
    for n in model.tensor_names():
        by_bytes[model.qtype(n).name] = by_bytes.get(model.qtype(n).name, 0) + model.nbytes(n)
    total = sum(by_bytes.values())
    assert mix == sorted(((k, v / total) for k, v in by_bytes.items()), key=lambda kv: -kv[1])
    text = gguf_model.format_quant_mix(mix)
    assert text.startswith("Q4_K 7") and "Q6_K 2" in text and "F32" in text
    assert text in model.describe()
    assert gguf_model.format_quant_mix([("Q4_K", 0.8234), ("Q6_K", 0.1420), ("F32", 0.0346), ("F16", 0.001)]) == \
        "Q4_K 82%, Q6_K 14%, F32 3%, F16 <1%"


def test_low_bit_mixes_follow_llama_cpp():
    """llama.cpp's choices (with an importance matrix, which these types need) for the IQ3, IQ2,
    IQ1 and MXFP4 mixes: which tensors it promotes, and the row-size fallback."""
    s = _spec(n_layers=8)  # 4 query heads over 2 KV heads: n_gqa 2; 16 experts
    tt = lambda name, shape, q: quant_recipe.tensor_type(name, shape, q, s)  # noqa: E731
    exps = (16, 256, 256)
    # IQ3_XXS: experts IQ3_XXS; token_embd and attn_output IQ3_S; attn_q/attn_k IQ2_S; output Q5_K
    assert tt("blk.3.ffn_gate_exps.weight", exps, "iq3_xxs") == T.IQ3_XXS
    assert [tt(f"blk.{i}.ffn_down_exps.weight", exps, "iq3_xxs") for i in (0, 7)] == [T.IQ3_XXS] * 2
    assert tt("token_embd.weight", (300, 256), "iq3_xxs") == T.IQ3_S
    assert tt("blk.0.attn_output.weight", (256, 256), "iq3_xxs") == T.IQ3_S
    assert tt("blk.0.attn_q.weight", (256, 256), "iq3_xxs") == T.IQ2_S
    assert tt("blk.0.attn_k.weight", (128, 256), "iq3_xxs") == T.IQ2_S
    assert tt("blk.0.attn_v.weight", (128, 256), "iq3_xxs") == T.IQ3_XXS
    assert tt("output.weight", (300, 256), "iq3_xxs") == T.Q5_K
    # IQ3_S: everything IQ3_S but the output (Q6_K)
    assert {tt(n, sh, "iq3_s") for n, sh in [("blk.0.attn_q.weight", (256, 256)), ("token_embd.weight", (300, 256)),
                                             ("blk.1.ffn_up_exps.weight", exps)]} == {T.IQ3_S}
    assert tt("output.weight", (300, 256), "iq3_s") == T.Q6_K
    # 4+ query heads per KV head: attn_v Q4_K; 8 experts: attn_v/attn_k Q8_0, attn_output Q5_K
    g4 = synth.recipe_from_args("demo", **{**K_SHAPES, "n_heads": 8, "n_kv_heads": 2}).spec()
    assert quant_recipe.tensor_type("blk.0.attn_v.weight", (128, 256), "iq3_xxs", g4) == T.Q4_K
    assert quant_recipe.tensor_type("blk.0.attn_v.weight", (128, 256), "iq3_s", g4) == T.Q4_K
    s8 = _spec(n_layers=8, n_experts=8)
    assert quant_recipe.tensor_type("blk.0.attn_v.weight", (128, 256), "iq3_xxs", s8) == T.Q8_0
    assert quant_recipe.tensor_type("blk.0.attn_k.weight", (128, 256), "iq3_s", s8) == T.Q8_0
    assert quant_recipe.tensor_type("blk.0.attn_output.weight", (256, 256), "iq3_s", s8) == T.Q5_K
    # IQ2_XXS / IQ1_M: token_embd and the first eighth of ffn_down Q2_K, attn_v Q4_K (4+ experts)
    for q, main in (("iq2_xxs", T.IQ2_XXS), ("iq1_m", T.IQ1_M)):
        assert tt("blk.3.ffn_up_exps.weight", exps, q) == main
        assert [tt(f"blk.{i}.ffn_down_exps.weight", exps, q) for i in (0, 1)] == [T.Q2_K, main]
        assert tt("token_embd.weight", (300, 256), q) == T.Q2_K
        assert tt("blk.0.attn_v.weight", (128, 256), q) == T.Q4_K
        assert tt("output.weight", (300, 256), q) == T.Q5_K
    assert tt("blk.0.attn_output.weight", (256, 256), "iq1_m") == T.IQ2_XXS
    assert tt("blk.0.attn_output.weight", (256, 256), "iq2_xxs") == T.IQ2_XXS
    # MXFP4 (gpt-oss): experts MXFP4, every other weight and the output Q8_0; router/norms F32
    assert tt("blk.2.ffn_down_exps.weight", exps, "mxfp4") == T.MXFP4
    assert {tt(n, sh, "mxfp4") for n, sh in [("blk.0.attn_q.weight", (256, 256)), ("token_embd.weight", (300, 256)),
                                             ("output.weight", (300, 256))]} == {T.Q8_0}
    assert tt("blk.0.ffn_gate_inp.weight", (16, 256), "mxfp4") == T.F32
    # rows that are not whole 256-blocks: the lattice types fall back to IQ4_NL, Q2_K to Q4_0
    assert tt("blk.1.ffn_up_exps.weight", (16, 64, 96), "iq3_xxs") == T.IQ4_NL
    assert tt("blk.0.ffn_down_exps.weight", (16, 256, 96), "iq1_m") == T.Q4_0
    assert tt("blk.1.ffn_up_exps.weight", (16, 64, 48), "iq3_s") == T.F16
    assert tt("output.weight", (300, 96), "iq3_s") == T.Q8_0


LOW_BIT_FILES = [("iq3_xxs", "IQ3_XXS"), ("iq3_s", "IQ3_S"), ("mxfp4", "MXFP4")]


@pytest.mark.parametrize("quant,main", LOW_BIT_FILES)
def test_low_bit_file_runs_bit_for_bit_as_its_dequantised_float_copy(quant_model, tmp_path, capsys, quant, main):
    """`strata-bench run --devices cpu` on a make-model low-bit qwen3moe file gives the digest
    (of every prompt position's final hidden state) and the tokens of the same file with each
    tensor expanded by gguf's dequantiser and stored as F32: the engine's expansion is exact."""
    import json

    from engine.cli import bench

    path = quant_model("qwen3moe", quant)
    model = gguf_model.load(path)
    mix = dict(model.quant_mix())
    assert max(mix, key=mix.get) == main, mix
    assert model.qtype("blk.1.ffn_gate_exps.weight").name == main

    def as_f32(name, data):
        qt = model.qtype(name)
        return data if qt == T.F32 else gguf_quants.dequantize(data, qt).astype(np.float32)
    ref_path = synth.write_model(tmp_path / f"{quant}-as-f32.gguf",
                                 synth.recipe_from_args("demo", quant=quant, **K_SHAPES), edit=as_f32)
    assert dict(gguf_model.load(ref_path).quant_mix()) == {"F32": 1.0}
    rows = []
    for p in (path, ref_path):
        rc = bench.main(["run", "--model", str(p), "--devices", "cpu", "--prompt-tokens", "48", "--decode-tokens", "3",
                         "--chunk-tokens", "16", "--format", "json", "--warmup", "0"])
        out = capsys.readouterr().out
        assert rc == 0, out
        rows.append(json.loads(out)[0])  # -o json: one array, its runs first
    assert rows[0]["digest"] == rows[1]["digest"] and len(rows[0]["digest"]) == 32
    assert rows[0]["generated"] == rows[1]["generated"]


@pytest.mark.parametrize("quant,main", LOW_BIT_FILES)
def test_low_bit_logits_match_transformers(quant_model, quant, main):
    """transformers loads the same file (expanding it with gguf): logits agree to 1e-4 in fp32."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = quant_model("qwen3moe", quant)
    model = gguf_model.load(path)
    ids = synthetic(64, model.spec.vocab, nonce=7)
    res = Session(model, EngineConfig(devices=["cpu"], chunk_tokens=32)).run(ids, logits_all=True)
    ref_model = hf_model(path, model.spec)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    assert ref.std() > 0.1
    diff = (res.logits - ref).abs().max().item()
    assert diff <= 1e-4, f"{quant}: max |logits - HF| = {diff}"


@pytest.mark.parametrize("quant,types", [("iq3_xxs", {T.IQ3_XXS, T.IQ3_S, T.IQ2_S}), ("iq1_m", {T.IQ1_M, T.Q2_K}),
                                         ("mxfp4", {T.MXFP4, T.Q8_0})])
def test_synthetic_source_generates_low_bit_blocks(quant, types):
    """synthetic:PRESET:quant=iq3_xxs (etc.) makes the mix's blocks on the source's device;
    they expand as gguf expands them, and a session runs on them."""
    recipe = synth.recipe_from_args("demo", quant=quant, n_layers=2, **K_SHAPES)
    src = synth.SyntheticSource(recipe, "cpu")
    got = {src.qtype(n) for n in gguf_model.expected_shapes(src.spec)}
    assert types <= got, got
    for name in ("blk.1.ffn_down_exps.weight", "token_embd.weight", "blk.0.attn_q.weight"):
        qt, shape = src.qtype(name), src.shape(name)
        ref = gguf_quants.dequantize(src.raw(name).numpy().reshape(*shape[:-1], -1), qt)
        assert np.isfinite(ref).all() and np.array_equal(src.tensor(name).numpy(), ref), name
    res = Session(src, EngineConfig(devices=["cpu"], chunk_tokens=16)).run(synthetic(32, src.spec.vocab, nonce=1),
                                                                      logits_all=True)
    assert torch.isfinite(res.logits).all()


@pytest.mark.parametrize("quant", ["iq3_xxs", "mxfp4", "iq1_m"])
def test_streamed_low_bit_experts_match_resident(quant_model, quant):
    """Low-bit experts streamed through a cache of a few slots (host arena and cache slots of
    their own block sizes; IQ1_M layers mix IQ1_M and Q2_K rows) give the resident run's digest,
    and the cache moved stored bytes, not expanded ones."""
    path = quant_model("qwen3moe", quant)
    model = gguf_model.load(path)
    exps = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    ids = synthetic(48, model.spec.vocab, nonce=5)
    one_expert = max(sum(model.nbytes(f"blk.{i}.{p}.weight") for p in exps) for i in range(4)) / model.spec.n_experts
    sess = Session(model, EngineConfig(devices=["cpu"], chunk_tokens=16, expert_cache=5.5 * one_expert / 2**30))
    streamed = sess.run(ids, decode_tokens=2, logits_all=True)
    resident = Session(model, EngineConfig(devices=["cpu"], chunk_tokens=16)).run(ids, decode_tokens=2,
                                                                              logits_all=True)
    st = streamed.report.expert_stats[0]
    assert st["slots"] == 5 and st["misses"] > 0 and not st["resident"]
    assert streamed.report.digest == resident.report.digest
    assert torch.equal(streamed.logits, resident.logits)
    stored = sum(model.nbytes(f"blk.{i}.{p}.weight") for i in range(4) for p in exps)
    assert sess.arena.nbytes < 1.1 * stored
    rows = [lay.row_bytes for lay in sess.arena.layouts.values()]
    moved = st["bytes_pinned"] + st["bytes_pageable"]
    assert st["misses"] * min(rows) <= moved <= st["misses"] * max(rows)
    sess.close()



LLAMA_QUANTIZE_ENV = "STRATA_LLAMA_QUANTIZE"  # llama.cpp's llama-quantize (not a dependency)
# llama.cpp's file types: (its name, our --quant, needs an importance matrix)
LLAMA_CPP_FTYPES = [("IQ3_S", "iq3_s", False), ("MXFP4_MOE", "mxfp4", False), ("IQ3_XXS", "iq3_xxs", True),
                    ("IQ2_XXS", "iq2_xxs", True), ("IQ1_M", "iq1_m", True)]


@pytest.fixture(scope="module")
def llama_cpp(tmp_path_factory):
    """llama-quantize (and llama-imatrix beside it, where built) and an F32 qwen3moe file with
    its importance matrix; skipped without them (scripts/llama_quantize.sh builds both)."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    exe = os.environ.get(LLAMA_QUANTIZE_ENV) or shutil.which("llama-quantize")
    if not exe or not os.access(exe, os.X_OK):
        pytest.skip(f"no llama-quantize (set {LLAMA_QUANTIZE_ENV}; scripts/llama_quantize.sh builds one)")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    d = tmp_path_factory.mktemp("llama_cpp")
    recipe = synth.recipe_from_args("demo", quant="f32", n_layers=8, **K_SHAPES)
    f32 = synth.write_model(d / "f32.gguf", recipe)
    imatrix = None
    tool = Path(exe).with_name("llama-imatrix")
    if os.access(tool, os.X_OK):
        words = [f"w{i % 97} " for i in range(4000)]  # any text: the matrix only weights the rounding
        (d / "calib.txt").write_text("".join(words))
        proc = subprocess.run([str(tool), "-m", str(f32), "-f", str(d / "calib.txt"), "-o", str(d / "imatrix.gguf"),
                               "-c", "128", "-t", "2"], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        imatrix = d / "imatrix.gguf"
    return exe, f32, imatrix, recipe.spec(), d


@pytest.mark.parametrize("ftype,quant,needs_imatrix", LLAMA_CPP_FTYPES, ids=[f[0] for f in LLAMA_CPP_FTYPES])
def test_llama_cpp_quantized_file_matches_recipe_and_transformers(llama_cpp, capsys, ftype, quant, needs_imatrix):
    """The issue's files: a qwen3moe quantised by llama.cpp's own llama-quantize (IQ3_S and
    MXFP4_MOE need no importance matrix; IQ3_XXS, IQ2_XXS and IQ1_M do: llama-imatrix makes one)
    loads, every tensor has the type make-model's mix gives it, it runs through strata-bench, and
    its logits agree with transformers loading the same file to 1e-4 (fp32, CPU)."""
    import subprocess

    from engine.cli import bench

    exe, f32, imatrix, spec, d = llama_cpp
    if needs_imatrix and imatrix is None:
        pytest.skip(f"{ftype} needs an importance matrix: no llama-imatrix beside {exe}")
    out = d / f"{ftype}.gguf"
    cmd = [exe, *(["--imatrix", str(imatrix)] if needs_imatrix else []), str(f32), str(out), ftype, "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    model = gguf_model.load(out)
    differ = [(n, model.qtype(n).name, quant_recipe.tensor_type(n, model.shape(n), quant, spec).name)
              for n in model.tensor_names() if model.qtype(n) != quant_recipe.tensor_type(n, model.shape(n), quant, spec)]
    assert not differ, differ  # make-model's mix is llama.cpp's, tensor by tensor
    rc = bench.main(["run", "--model", str(out), "--devices", "cpu", "--prompt-tokens", "32", "--decode-tokens", "2",
                     "--warmup", "0"])
    assert rc == 0, capsys.readouterr().err
    ids = synthetic(64, model.spec.vocab, nonce=7)
    res = Session(model, EngineConfig(devices=["cpu"], chunk_tokens=32)).run(ids, logits_all=True)
    with torch.no_grad():
        ref = hf_model(out, model.spec)(torch.tensor([ids])).logits[0]
    assert ref.std() > 0.1
    diff = (res.logits - ref).abs().max().item()
    assert diff <= 1e-4, f"llama.cpp {ftype}: max |logits - HF| = {diff}"
