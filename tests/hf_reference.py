"""The independent numerics oracle: HF transformers loading the same GGUF file, fp32 on CPU."""
from __future__ import annotations

import torch


def hf_model(path, spec, rope_parameters: dict | None = None):
    """transformers' GGUF config mapping misses some keys: pass them from the file (docs/design.md, "Measured facts").

    rope_parameters: transformers 5.x's rope config (e.g. {"rope_type": "yarn", "factor": 4,
    "original_max_position_embeddings": 64, "rope_theta": ...}); its GGUF loader reads no rope
    scaling for these families, so a scaled file's scaling is passed here."""
    import transformers

    extra = {}
    if spec.arch == "qwen3moe":
        extra = dict(moe_intermediate_size=spec.expert_ffn, norm_topk_prob=True)
    elif spec.arch == "qwen3":
        extra = dict(head_dim=spec.head_dim)
    if rope_parameters is not None:
        extra["rope_parameters"] = rope_parameters
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **extra).eval()
