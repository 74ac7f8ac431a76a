"""The synthetic presets at the published shapes of MiniMax-M2 and GLM-4.5-Air (`synthetic:
minimax-m2-230b-a10b`, `synthetic:glm-4.5-air`, n_layers= to cut them) and `make-model --arch` for both
families: the shapes each layer kind draws, and small files made by the CLI that load and run
with the same digest over stages and with streamed experts."""
from __future__ import annotations

import pytest

from engine.cli import bench
from engine.config import EngineConfig
from engine.io import gguf_model
from engine.io.gguf_model import expected_shapes
from engine.io.prompt import synthetic
from engine.pipeline.session import Session


def test_glm_45_air_preset_has_its_dense_lead_shared_expert_and_partial_rotary():
    spec = bench.synthetic_recipe("synthetic:glm-4.5-air:n_layers=4").spec()
    assert (spec.arch, spec.n_layers, spec.dense_lead, spec.rotary_dim, spec.head_dim) == ("glm4moe", 4, 1, 64, 128)
    assert (spec.expert_gating, spec.expert_bias, spec.expert_weights_norm, spec.qkv_bias, spec.qk_norm) == \
        ("sigmoid", True, True, True, False)
    shapes = expected_shapes(spec)
    assert shapes["blk.0.ffn_gate.weight"] == (10944, 4096) and "blk.0.ffn_gate_exps.weight" not in shapes
    assert shapes["blk.1.ffn_gate_exps.weight"] == (128, 1408, 4096) and "blk.1.ffn_gate.weight" not in shapes
    assert shapes["blk.3.ffn_up_shexp.weight"] == (1408, 4096) and shapes["blk.3.exp_probs_b.bias"] == (128,)
    assert shapes["blk.2.attn_q.bias"] == (96 * 128,) and shapes["blk.2.post_attention_norm.weight"] == (4096,)


def test_glm_prefill_flops_count_the_dense_lead_layer_at_its_own_cost():
    from dataclasses import replace

    spec = bench.synthetic_recipe("synthetic:glm-4.5-air:n_layers=4").spec()
    n, d = 1000, spec.hidden
    moe_layer = replace(spec, n_layers=1, dense_lead=0)
    dense_ffn = 2.0 * n * 3 * d * 10944  # the lead layer's FFN: three GEMMs of hidden x 10944
    routed = 2.0 * n * (8 * 3 * d * 1408 + 128 * d + 3 * d * 1408)  # top 8 + router + shared expert
    assert spec.prefill_flops(n) == pytest.approx(4 * moe_layer.prefill_flops(n) - routed + dense_ffn)


def test_minimax_m2_preset_has_its_whole_projection_qk_norm():
    spec = bench.synthetic_recipe("synthetic:minimax-m2-230b-a10b:n_layers=2").spec()
    assert (spec.arch, spec.n_layers, spec.rotary_dim, spec.n_experts, spec.expert_gating) == \
        ("minimax-m2", 2, 64, 256, "sigmoid")
    shapes = expected_shapes(spec)
    assert shapes["blk.1.attn_q_norm.weight"] == (48 * 128,) and shapes["blk.1.attn_k_norm.weight"] == (8 * 128,)
    assert shapes["blk.0.exp_probs_b.bias"] == (256,) and shapes["blk.0.ffn_down_exps.weight"] == (256, 3072, 1536)


@pytest.mark.parametrize("arch", ["minimax-m2", "glm4moe"])
def test_make_model_arch_writes_a_file_that_runs(tmp_path, arch, capsys):
    path = tmp_path / f"{arch}.gguf"
    assert bench.main(["make-model", str(path), "--arch", arch, "--layers", "3", "--rope-dim", "16",
                       "--quant", "q4_k_m"]) == 0
    model = gguf_model.load(path)
    assert model.spec.arch == arch and model.spec.rope_dim == 16 and model.spec.expert_bias
    ids = synthetic(40, model.spec.vocab, nonce=1)
    digests = set()
    for cfg in (dict(devices=["cpu"]), dict(devices=["cpu", "cpu"], prefill_main=True),
                dict(devices=["cpu"], expert_cache=0.0002)):
        sess = Session(model, EngineConfig(chunk_tokens=16, **cfg))
        try:
            digests.add(sess.run(ids, decode_tokens=2).report.digest)
            if "expert_cache" in cfg:
                assert sess.expert_plan.streamed
        finally:
            sess.close()
    assert len(digests) == 1


def test_the_memory_plan_counts_no_expert_slots_for_the_dense_lead_layer(tmp_path):
    from engine.plan.memory_plan import plan_memory

    path = tmp_path / "glm.gguf"
    assert bench.main(["make-model", str(path), "--arch", "glm4moe", "--layers", "4", "--experts", "8"]) == 0
    model = gguf_model.load(path)
    plan = plan_memory(model, EngineConfig(devices=["cpu", "cpu"]), 64)
    assert [d.expert_slots for d in plan.devices] == [1 * 8, 2 * 8]  # layers 0-1 (0 dense), 2-3


def test_a_rotary_count_for_a_family_without_partial_rotary_is_refused(tmp_path):
    assert bench.main(["make-model", str(tmp_path / "x.gguf"), "--arch", "qwen3moe", "--rope-dim", "16"]) == 2


def test_glm_reads_grouped_top_k_and_refuses_groups_the_experts_cannot_form(tmp_path):
    from engine.io import synth

    recipe = synth.recipe_from_args("demo", arch="glm4moe", n_layers=2, n_experts=8, n_experts_used=2)
    path = synth.write_model(tmp_path / "g.gguf", recipe,
                             metadata={"{a}.expert_group_count": 4, "{a}.expert_group_used_count": 2})
    model = gguf_model.load(path)
    assert (model.spec.expert_groups, model.spec.expert_groups_used) == (4, 2)
    sess = Session(model, EngineConfig(devices=["cpu"], chunk_tokens=16))
    try:
        assert sess.run(synthetic(24, model.spec.vocab), decode_tokens=1).report.digest
    finally:
        sess.close()
    bad = synth.write_model(tmp_path / "b.gguf", recipe,
                            metadata={"{a}.expert_group_count": 3, "{a}.expert_group_used_count": 1})
    with pytest.raises(gguf_model.GGUFError, match=r"glm4moe\.expert_group_count 3"):
        gguf_model.load(bad)


def test_mixtral_8x7b_preset_is_a_llama_file_with_experts_in_every_layer():
    """synthetic:mixtral-8x7b: Mistral's published shapes (46.7B parameters, embedding and head
    included), written as llama.cpp's converter writes Mixtral: a llama file whose every layer
    routes 8 experts of 14336, top 2."""
    spec = bench.synthetic_recipe("synthetic:mixtral-8x7b").spec()
    assert (spec.arch, spec.is_moe, spec.n_experts, spec.n_experts_used, spec.expert_ffn, spec.rope_style) == \
        ("llama", True, 8, 2, 14336, "norm")
    total = spec.n_layers * spec.layer_params() + 2 * spec.vocab * spec.hidden + spec.hidden
    assert round(total / 1e9, 1) == 46.7
    shapes = expected_shapes(spec)
    assert shapes["blk.31.ffn_gate_exps.weight"] == (8, 14336, 4096) and "blk.0.ffn_gate.weight" not in shapes
    dense = bench.synthetic_recipe("synthetic:demo").spec()  # a llama recipe stays dense unless it asks
    from dataclasses import replace

    from engine.io import synth
    assert not synth.recipe_from_args("demo", arch="llama").spec().is_moe and dense.is_moe
    assert replace(synth.recipe_from_args("demo", arch="llama"), llama_experts=True).spec().is_moe


def test_make_model_writes_a_mixtral_style_file_that_runs(tmp_path):
    """make-model --preset mixtral-8x7b, cut to a few small layers: it reads back as llama with
    experts (the family's Mixtral path) and runs with one digest over stages."""
    path = tmp_path / "mixtral.gguf"
    assert bench.main(["make-model", str(path), "--preset", "mixtral-8x7b", "--layers", "2", "--hidden", "128",
                       "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--expert-ffn", "64",
                       "--quant", "q8_0"]) == 0
    model = gguf_model.load(path)
    assert (model.spec.arch, model.spec.is_moe, model.spec.n_experts, model.spec.expert_ffn) == ("llama", True, 8, 64)
    ids = synthetic(40, model.spec.vocab, nonce=3)
    digests = set()
    for devices in (["cpu"], ["cpu", "cpu"]):
        sess = Session(model, EngineConfig(devices=devices, chunk_tokens=16))
        try:
            digests.add(sess.run(ids, decode_tokens=2).report.digest)
        finally:
            sess.close()
    assert len(digests) == 1
