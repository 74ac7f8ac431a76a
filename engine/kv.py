"""Per-layer KV cache: preallocated, appended chunk by chunk, copyable to another device."""
from __future__ import annotations

import torch


class LayerKV:
    """Keys and values of one layer for one sequence: [capacity, kv_heads, head_dim] each."""

    def __init__(self, capacity: int, n_kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.capacity = capacity
        self.k = torch.empty(capacity, n_kv_heads, head_dim, device=device, dtype=dtype)
        self.v = torch.empty(capacity, n_kv_heads, head_dim, device=device, dtype=dtype)
        self.length = 0

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def reset(self) -> None:
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v of tokens [pos, pos+n) and return views of [0, pos+n)."""
        n = k.shape[0]
        if pos != self.length:
            raise RuntimeError(f"KV append at position {pos}, but the cache holds {self.length} tokens")
        if pos + n > self.capacity:
            raise RuntimeError(f"KV cache full: {pos + n} tokens exceed its capacity of {self.capacity}")
        self.k[pos:pos + n] = k
        self.v[pos:pos + n] = v
        self.length = pos + n
        return self.k[: pos + n], self.v[: pos + n]

    def copy_from(self, other: LayerKV) -> int:
        """Copy another cache's contents (any device) into this one; returns bytes moved."""
        n = other.length
        if n > self.capacity:
            raise RuntimeError(f"KV copy of {n} tokens into a cache of capacity {self.capacity}")
        self.k[:n].copy_(other.k[:n])
        self.v[:n].copy_(other.v[:n])
        self.length = n
        return 2 * n * self.k[0].numel() * self.k.element_size()
