"""The independent numerics oracle: HF transformers loading the same GGUF file, fp32 on CPU."""
from __future__ import annotations

import torch


def hf_model(path, spec):
    """transformers' GGUF config mapping misses some keys: pass them from the file (STACK.md)."""
    import transformers

    extra = {}
    if spec.arch == "qwen3moe":
        extra = dict(moe_intermediate_size=spec.expert_ffn, norm_topk_prob=True)
    elif spec.arch == "qwen3":
        extra = dict(head_dim=spec.head_dim)
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **extra).eval()
