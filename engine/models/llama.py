"""Llama (llama.cpp `llama`): SwiGLU FFN, no biases, no q/k norm.  llama.cpp's converter permutes
q/k so that RoPE rotates adjacent pairs ("norm" style).  A llama file with experts (Mixtral) is
refused by the base class.  Oracle: tests/test_numerics.py (transformers' LlamaForCausalLM)."""
from .family import Family

FAMILY = Family("llama", rope_style="norm")
