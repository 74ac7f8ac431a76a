"""The model: one module per model family (`qwen3moe`, `qwen3`, `qwen2`, `llama` with Mixtral's
experts, `qwen3vlmoe`, `gpt_oss`, `minimax_m2`, `glm4moe`, `deepseek2`, `qwen3next` with its GDN
and gated-attention layers, `qwen35moe`) in a registry, each declaring its metadata -> `ModelSpec`,
its layers' kinds and tensors, and the state each layer carries across chunks; and the parts
families compose (`layers`: RoPE, RMSNorm, attention and MoE blocks; `kv`; `experts`;
`gated_delta`, `gdn_layer`, `gated_attention`).
"How to add a model family": docs/architecture.md."""
from engine.models import deepseek2, glm4moe, gpt_oss, llama, minimax_m2, qwen2, qwen3, qwen3moe, qwen3next, qwen3vlmoe, qwen35moe
from engine.models.blocks import FULL_ATTENTION, KVState, LayerKind, Part, StateKind
from engine.models.family import Family, SpecSource
from engine.models.registry import (
    UnknownFamily,
    family,
    family_of,
    names,
    new_states,
    register,
    states_bytes,
    unregister,
)
from engine.models.spec import ModelSpec

# one line per family module, in the order errors list them (a new family: its module, then here)
for _module in (qwen3moe, qwen3, qwen2, llama, qwen3vlmoe, gpt_oss, minimax_m2, glm4moe, deepseek2, qwen3next,
                qwen35moe):
    register(_module.FAMILY)

__all__ = ["FULL_ATTENTION", "Family", "KVState", "LayerKind", "ModelSpec", "Part", "SpecSource", "StateKind",
           "UnknownFamily", "family", "family_of", "names", "new_states", "register", "states_bytes", "unregister"]
