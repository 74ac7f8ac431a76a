"""Qwen3-MoE (llama.cpp `qwen3moe`): routed experts in every layer (softmax top-k, renormalised),
per-head q/k RMSNorm, neox RoPE.  Oracle: tests/test_numerics.py (transformers' Qwen3MoeForCausalLM)."""
from engine.models.family import Family

FAMILY = Family("qwen3moe", moe=True, qk_norm=True)
