"""The machine: GPUs, PCIe topology and link classes, GPU timing, NVTX ranges."""
