"""The independent numerics oracle: HF transformers loading the same GGUF file, fp32 on CPU."""
from __future__ import annotations

import contextlib
import importlib

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


# transformers' hybrid modeling modules pick flash-linear-attention's Triton kernels at import when
# `fla` imports (the gdn extra, a GPU machine): those run on CUDA tensors only (a CPU reference
# crashes in them, before 5.25) and take TF32 products in fp32, so the oracle would not be the
# plain-torch one the bounds assume.  Each such function is a wrapper over its torch version:
# functools.wraps' __wrapped__ (5.17-5.24), and from 5.25, which requires the `kernels` package,
# that wrapper again inside one of kernels' function modules (an nn.Module whose forward calls it).
_HYBRID_MODULES = ("transformers.models.qwen3_next.modeling_qwen3_next",
                   "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
_KERNEL_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",  # 5.24's names
                     "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",  # older ones
                     "causal_conv1d_fn", "causal_conv1d_update")


def _inner(fn: object) -> object | None:
    """What one kernel wrapper wraps, or None for a plain function."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None and isinstance(fn, torch.nn.Module):  # kernels' function module (transformers 5.25+)
        forward = type(fn).forward
        cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))
        inner = cells["func"].cell_contents if "func" in cells else None
    return inner


def torch_function(fn: object) -> object | None:
    """transformers' own torch function behind `fn`'s kernel wrappers (None where `fn` wraps nothing)."""
    inner = _inner(fn)
    if inner is None:
        return None
    for _ in range(4):  # a wrapper of a wrapper, at most a few deep
        deeper = _inner(inner)
        if deeper is None:
            return inner
        inner = deeper
    return None


@contextlib.contextmanager
def torch_linear_attention():
    """Within: transformers' Qwen3-Next / Qwen3.5 gated-DeltaNet layers run their torch code,
    whatever kernel packages are installed; restored after."""
    swapped: list[tuple[object, str, object]] = []
    try:
        for name in _HYBRID_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            for fn_name in _KERNEL_FUNCTIONS:
                fn = getattr(module, fn_name, None)
                torch_fn = torch_function(fn)
                if torch_fn is not None:
                    swapped.append((module, fn_name, fn))
                    setattr(module, fn_name, torch_fn)
        yield
    finally:
        for module, fn_name, fn in swapped:
            setattr(module, fn_name, fn)
