"""Quantised weights: dequantisers (torch and Triton), gguf's code books, quantised tensors, llama.cpp's quant mixes."""
