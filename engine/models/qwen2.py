"""Qwen2 (llama.cpp `qwen2`): SwiGLU FFN, biases on q/k/v, neox RoPE.
Oracle: tests/test_numerics.py (transformers' Qwen2ForCausalLM)."""
from engine.models.family import Family

FAMILY = Family("qwen2", qkv_bias=True)
