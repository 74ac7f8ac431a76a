"""Compute kernels and their plumbing: attention, fused QK-norm+RoPE, MoE kernels, CUDA graphs,
Triton's import, the kernel report."""
