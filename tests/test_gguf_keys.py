"""Every metadata key llama.cpp's loader reads for a supported family is used, refused or known
harmless (engine/models/gguf_keys.py): none is ignored in silence (issue 39).

The lists below are what llama.cpp's `llama_model::load_hparams` (src/llama-model.cpp, with the
per-model `load_arch_hparams` of newer versions) reads: the keys read for every architecture,
then each family's own; key names as src/llama-arch.cpp spells them."""
from __future__ import annotations

import pytest

from engine import models
from engine.io import gguf_model, synth
from engine.models import gguf_keys

# read for every architecture with attention heads
LLAMA_CPP_COMMON = [
    "general.name", "general.architecture",
    "{a}.context_length", "{a}.embedding_length", "{a}.block_count", "{a}.expert_count", "{a}.expert_used_count",
    "{a}.feed_forward_length", "{a}.attention.head_count", "{a}.attention.head_count_kv",
    "{a}.rope.scaling.finetuned", "{a}.rope.scaling.original_context_length", "{a}.rope.freq_base",
    "{a}.rope.scaling.type", "{a}.rope.scaling.factor", "{a}.rope.scale_linear", "{a}.rope.scaling.attn_factor",
    "{a}.rope.scaling.alpha", "{a}.attention.key_length", "{a}.attention.value_length", "{a}.rope.dimension_count",
    "{a}.vocab_size", "tokenizer.ggml.tokens", "{a}.nextn_predict_layers", "{a}.expert_group_count",
    "{a}.expert_group_used_count",
]
# each family's own
LLAMA_CPP_FAMILY = {
    "llama": ["{a}.attention.layer_norm_rms_epsilon"],
    "qwen2": ["{a}.attention.layer_norm_rms_epsilon"],
    "qwen3": ["{a}.attention.layer_norm_rms_epsilon"],
    "qwen3moe": ["{a}.expert_feed_forward_length", "{a}.attention.layer_norm_rms_epsilon"],
    "qwen3vlmoe": ["{a}.n_deepstack_layers", "{a}.rope.dimension_sections", "{a}.expert_feed_forward_length",
                   "{a}.attention.layer_norm_rms_epsilon"],  # src/models/qwen3vlmoe.cpp
    "gpt-oss": ["{a}.attention.layer_norm_rms_epsilon", "{a}.expert_feed_forward_length",
                "{a}.attention.sliding_window", "{a}.attention.sliding_window_pattern",
                "{a}.rope.freq_base_swa"],  # src/models/openai-moe.cpp
    "minimax-m2": ["{a}.attention.layer_norm_rms_epsilon", "{a}.expert_feed_forward_length",
                   "{a}.expert_gating_func"],  # src/models/minimax-m2.cpp
    "glm4moe": ["{a}.expert_feed_forward_length", "{a}.attention.layer_norm_rms_epsilon",
                "{a}.rope.dimension_sections", "{a}.expert_shared_count", "{a}.leading_dense_block_count",
                "{a}.expert_weights_scale", "{a}.expert_weights_norm", "{a}.expert_gating_func"],  # src/models/glm4-moe.cpp
    "deepseek2": ["{a}.attention.layer_norm_rms_epsilon", "{a}.leading_dense_block_count", "{a}.attention.q_lora_rank",
                  "{a}.attention.kv_lora_rank", "{a}.attention.key_length_mla", "{a}.attention.value_length_mla",
                  "{a}.expert_feed_forward_length", "{a}.expert_shared_count", "{a}.expert_weights_scale",
                  "{a}.expert_weights_norm", "{a}.expert_gating_func", "{a}.rope.scaling.yarn_log_multiplier",
                  "{a}.attention.temperature_scale", "{a}.attention.temperature_length"],  # src/models/deepseek2.cpp
    "qwen3next": ["{a}.expert_feed_forward_length", "{a}.expert_shared_feed_forward_length",
                  "{a}.attention.layer_norm_rms_epsilon", "{a}.ssm.conv_kernel", "{a}.ssm.inner_size",
                  "{a}.ssm.state_size", "{a}.ssm.time_step_rank", "{a}.ssm.group_count",
                  "{a}.attention.recurrent_layers", "{a}.full_attention_interval",
                  "{a}.nextn_predict_layers"],  # src/models/qwen3next.cpp (nextn: llama-model.cpp, every family)
    "qwen35moe": ["{a}.expert_feed_forward_length", "{a}.expert_shared_feed_forward_length",
                  "{a}.attention.layer_norm_rms_epsilon", "{a}.rope.dimension_sections", "{a}.ssm.conv_kernel",
                  "{a}.ssm.inner_size", "{a}.ssm.state_size", "{a}.ssm.time_step_rank", "{a}.ssm.group_count",
                  "{a}.attention.recurrent_layers", "{a}.full_attention_interval",
                  "{a}.nextn_predict_layers"],  # src/models/qwen35moe.cpp
}
# the YaRN keys llama.cpp reads for other families (grok, laguna …): refused here unless default,
# so a file that carries them for a supported family is not run with them ignored
YARN_EXTRAS = ["{a}.rope.scaling.yarn_ext_factor", "{a}.rope.scaling.yarn_attn_factor",
               "{a}.rope.scaling.yarn_beta_fast", "{a}.rope.scaling.yarn_beta_slow",
               "{a}.rope.scaling.yarn_log_multiplier", "{a}.rope.dimension_sections"]
# the routing and layout keys llama.cpp reads for other MoE families (glm4moe, deepseek2, minimax-m2 …):
# refused here unless they say what the family's own routing is
MOE_EXTRAS = ["{a}.expert_gating_func", "{a}.expert_weights_norm", "{a}.expert_weights_scale",
              "{a}.leading_dense_block_count"]


@pytest.mark.parametrize("family", models.names())
def test_every_key_llama_cpp_reads_is_used_refused_or_harmless(family):
    assert set(LLAMA_CPP_FAMILY) == set(models.names())
    missing = [k for k in LLAMA_CPP_COMMON + LLAMA_CPP_FAMILY[family] + YARN_EXTRAS + MOE_EXTRAS
               if k not in gguf_keys.TABLE]
    assert not missing, f"{family}: llama.cpp reads {missing}, which the engine neither uses nor refuses"
    for key in LLAMA_CPP_COMMON + LLAMA_CPP_FAMILY[family]:
        assert gguf_keys.TABLE[key] in (gguf_keys.USED, gguf_keys.REFUSED, gguf_keys.HARMLESS)


def test_the_table_holds_no_key_llama_cpp_does_not_read():
    known = set(LLAMA_CPP_COMMON + YARN_EXTRAS + MOE_EXTRAS).union(*LLAMA_CPP_FAMILY.values())
    assert set(gguf_keys.TABLE) <= known, set(gguf_keys.TABLE) - known


# a value for each REFUSED key that the engine cannot honour
NOT_DEFAULT = {
    "{a}.attention.value_length": 16, "{a}.rope.dimension_count": 16, "{a}.rope.dimension_sections": 3,
    "{a}.rope.scaling.attn_factor": 0.5, "{a}.rope.scaling.alpha": 2.0, "{a}.rope.scaling.yarn_ext_factor": 0.25,
    "{a}.rope.scaling.yarn_attn_factor": 2.0, "{a}.rope.scaling.yarn_beta_fast": 8.0,
    "{a}.rope.scaling.yarn_beta_slow": 2.0, "{a}.rope.scaling.yarn_log_multiplier": 0.1,
    "{a}.expert_gating_func": 2, "{a}.expert_weights_norm": False, "{a}.expert_weights_scale": 2.5,
    "{a}.leading_dense_block_count": 1, "{a}.nextn_predict_layers": 1, "{a}.expert_shared_count": 1,
    "{a}.expert_group_count": 8, "{a}.expert_group_used_count": 4,
    "{a}.attention.temperature_scale": 0.5, "{a}.attention.temperature_length": 8192,
}


def test_every_refused_key_is_refused_by_name(tmp_path):
    refused = [k for k, v in gguf_keys.TABLE.items() if v == gguf_keys.REFUSED]
    assert set(refused) == set(NOT_DEFAULT)
    for i, key in enumerate(refused):
        path = synth.write_model(tmp_path / f"k{i}.gguf", synth.recipe_from_args("demo", n_layers=1),
                                 metadata={key: NOT_DEFAULT[key]})
        with pytest.raises(gguf_model.GGUFError, match=key.replace("{a}", "qwen3moe").replace(".", r"\.")):
            gguf_model.load(path)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # a llama file with experts is Mixtral: it runs
def test_a_dense_family_with_experts_is_refused_naming_the_key(tmp_path, family):
    path = synth.write_model(tmp_path / "moe.gguf", synth.recipe_from_args("demo", arch=family, n_layers=1),
                             metadata={"{a}.expert_count": 8, "{a}.expert_used_count": 2})
    with pytest.raises(gguf_model.GGUFError, match=rf"{family}\.expert_count is 8"):
        gguf_model.load(path)
