"""benchmarks/vs_hf.py --preset gpt-oss-*: transformers' GptOssForCausalLM is built from our
spec and given our synthetic weights (benchmarks/hf_models.py).  Proven here at tiny shapes in
fp32 on CPU: its logits equal ours at every position of a prompt longer than the 128-token
window, so both sides of the benchmark run the same model on the same weights."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.config import EngineConfig
from engine.io.prompt import synthetic
from engine.io.synth import SyntheticSource
from engine.pipeline.session import Session

TOKENS = 300  # over two windows of 128: the sliding layer's mask and cache both matter


@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("transformers")
    from benchmarks import hf_models, vs_hf

    recipe = replace(vs_hf.bench_recipe("gpt-oss-20b", 2), hidden=64, n_heads=4, n_kv_heads=2, head_dim=16,
                     n_experts=4, n_experts_used=2, expert_ffn=32, vocab=512)
    src = SyntheticSource(recipe, "cpu")
    model, _, impl, skipped = hf_models.hf_gpt_oss(src, "cpu", dtype=torch.float32)
    return src, model, impl, skipped


def test_the_benchmark_runs_gpt_oss_experts_as_floats():
    from benchmarks import vs_hf

    src = SyntheticSource(vs_hf.bench_recipe("gpt-oss-20b", 1))
    assert {src.qtype(f"blk.0.ffn_{p}_exps.weight").name for p in ("gate", "up", "down")} == {"F16"}


def test_the_config_is_openais():
    """transformers' GptOssConfig defaults are gpt-oss-120b's config.json: ours of the preset
    (and 20b's, which differs in layers and experts) must agree field by field."""
    transformers = pytest.importorskip("transformers")
    from benchmarks import hf_models, vs_hf

    published = transformers.GptOssConfig()
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "num_experts_per_tok", "sliding_window", "max_position_embeddings", "rms_norm_eps",
            "attention_bias", "tie_word_embeddings", "layer_types",
            "num_hidden_layers", "num_local_experts")
    ours = hf_models.gpt_oss_config(vs_hf.bench_recipe("gpt-oss-120b", 36).spec())
    assert {k: getattr(ours, k) for k in keys} == {k: getattr(published, k) for k in keys}
    rope = {k: published.rope_parameters[k] for k in ours.rope_parameters}
    assert ours.rope_parameters == rope and rope["rope_theta"] == 150000.0
    small = hf_models.gpt_oss_config(vs_hf.bench_recipe("gpt-oss-20b", 24).spec())
    assert (small.num_hidden_layers, small.num_local_experts, small.num_experts_per_tok) == (24, 32, 4)


def test_transformers_experts_clamp_as_ours(tiny):
    from engine.models.gpt_oss_layer import SWIGLU_ALPHA, SWIGLU_LIMIT

    experts = [layer.mlp.experts for layer in tiny[1].model.layers]
    assert {(e.alpha, e.limit) for e in experts} == {(SWIGLU_ALPHA, SWIGLU_LIMIT)}


def test_on_the_cpu_transformers_takes_eager_attention_and_says_why_not_sdpa_or_flex(tiny):
    _, _, impl, skipped = tiny
    assert impl == "eager"
    assert len(skipped) == 2 and skipped[0].startswith("sdpa: ValueError: GptOssForCausalLM does not support")
    assert skipped[1].startswith("flex_attention: ValueError: Attention sinks cannot be run on CPU")


@pytest.mark.parametrize("chunk", [64, 512])
def test_transformers_on_the_bridged_weights_gives_our_logits(tiny, chunk):
    src, model, _, _ = tiny
    ids = synthetic(TOKENS, src.spec.vocab, nonce=5)
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0]
    sess = Session(src, EngineConfig(dtype="float32", devices=["cpu"], chunk_tokens=chunk))
    try:
        got = sess.run(ids, decode_tokens=0, logits_all=True).logits
    finally:
        sess.close()
    assert want.abs().max().item() > 1.0  # logits of some size: a zero model would pass the next line
    assert (got - want).abs().max().item() <= 1e-4


def test_every_transformers_parameter_is_filled_and_a_missing_one_is_named(tiny):
    """The bridge fills each parameter from our tensors in transformers' layout (gate in the
    even columns of gate_up); a source that leaves some unfilled is refused by name."""
    from benchmarks import hf_models

    src, model, _, _ = tiny
    p = model.model.layers[1].mlp.experts.gate_up_proj
    gate = src.tensor("blk.1.ffn_gate_exps.weight")
    up = src.tensor("blk.1.ffn_up_exps.weight")
    assert torch.equal(p[..., 0::2], gate.transpose(1, 2)) and torch.equal(p[..., 1::2], up.transpose(1, 2))
    assert torch.equal(model.model.layers[0].self_attn.sinks, src.tensor("blk.0.attn_sinks.weight"))
    one_layer = SyntheticSource(replace(src.recipe, n_layers=1))  # a source of another depth
    with pytest.raises(ValueError, match=r"does not fill: model\.layers\.1\."):
        hf_models.fill_gpt_oss(model, one_layer)
