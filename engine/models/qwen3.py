"""Qwen3 dense (llama.cpp `qwen3`): SwiGLU FFN, per-head q/k RMSNorm, neox RoPE.
Oracle: tests/test_numerics.py (transformers' Qwen3ForCausalLM)."""
from engine.models.family import Family

FAMILY = Family("qwen3", qk_norm=True)
