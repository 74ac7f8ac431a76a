"""The state of a sliding-window attention layer: the keys and values of its last window - 1
tokens, all a later query can see (the window counts the query's own token).

Between chunks the cache holds tokens [length - m, length), m = min(length, window - 1), in
order in its first m rows.  `append` returns the held tokens followed by the chunk's (a new
tensor of m + n rows: the chunk's queries need both) and keeps the last window - 1 of them.
So the memory plan counts window - 1 tokens however long the prompt (`bytes_for`), and
prefill-main's hand-off moves those m rows (`handoff_views`), the same layout on both sides
because m depends on the length alone.
"""
from __future__ import annotations

import torch

from engine.models.kv import LayerState, copy_state


class SlidingKV:
    """A sliding layer's keys and values for one sequence of up to `capacity` tokens."""

    def __init__(self, capacity: int, window: int, n_kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        if window < 1:
            raise ValueError(f"a sliding window of {window} tokens")
        self.capacity, self.window = capacity, window
        self.keep = min(window - 1, capacity)
        self.k = torch.empty(self.keep, n_kv_heads, head_dim, device=device, dtype=dtype)
        self.v = torch.empty(self.keep, n_kv_heads, head_dim, device=device, dtype=dtype)
        self.length = 0  # tokens of the sequence seen so far

    @staticmethod
    def bytes_for(tokens: int, window: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * min(tokens, window - 1) * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def held(self, length: int) -> int:
        """Rows held after `length` tokens."""
        return min(length, self.keep)

    def reset(self) -> None:
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Take tokens [pos, pos+n); return keys/values of [pos - m, pos+n), m = the rows held."""
        n = k.shape[0]
        if pos != self.length:
            raise RuntimeError(f"KV append at position {pos}, but the cache holds {self.length} tokens")
        if pos + n > self.capacity:
            raise RuntimeError(f"KV cache full: {pos + n} tokens exceed its capacity of {self.capacity}")
        m = self.held(pos)
        keys, values = torch.cat((self.k[:m], k)), torch.cat((self.v[:m], v))
        kept = self.held(pos + n)
        self.k[:kept] = keys[keys.shape[0] - kept:]
        self.v[:kept] = values[values.shape[0] - kept:]
        self.length = pos + n
        return keys, values

    # ------------------------------------------------------------ the hand-off
    def handoff_length(self) -> int:
        return self.length

    def handoff_views(self, length: int) -> list[torch.Tensor]:
        """The rows held after `length` tokens: the window's keys and values."""
        if length > self.capacity:
            raise RuntimeError(f"KV copy of {length} tokens into a cache of capacity {self.capacity}")
        m = self.held(length)
        return [self.k[:m], self.v[:m]]

    def adopt(self, length: int) -> None:
        self.length = length

    def copy_from(self, other: LayerState) -> int:
        return copy_state(self, other)
