"""The state a layer carries from one chunk to the next, and the KV cache of attention layers.

`LayerState` is what the runtime holds per layer and per sequence (a stage's `kvs`): it is made
by the layer's family (`engine.models.new_states`), reset before a run, and handed from one
device to another by prefill-main.  `LayerKV` is the state of full attention: keys and values,
preallocated, appended chunk by chunk.  Other kinds (a recurrent state, a sliding window, a
latent KV) implement the same protocol.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from engine.models.decode_pos import DevicePos


class LayerState(Protocol):
    """One layer's state for one sequence.

    The hand-off (prefill-main: the state computed on the main device reaches the stage that
    owns the layer) is three steps, the same over a thread's copy and a process pipe: the
    sender's `handoff_length()`, then each of its `handoff_views(length)`, received into the
    receiver's `handoff_views(length)`, then the receiver's `adopt(length)`."""

    capacity: int  # tokens it can hold

    @property
    def nbytes(self) -> int: ...

    def reset(self) -> None: ...

    def handoff_length(self) -> int: ...

    def handoff_views(self, length: int) -> list[torch.Tensor]: ...

    def adopt(self, length: int) -> None: ...

    def copy_from(self, other: LayerState) -> int: ...


def copy_state(dst: LayerState, src: LayerState) -> int:
    """Copy `src` (any device) into `dst` through the hand-off views; returns the bytes moved
    (counted in `dst`'s dtype, what the receiving device holds)."""
    n = src.handoff_length()
    moved = 0
    for a, b in zip(dst.handoff_views(n), src.handoff_views(n), strict=True):
        a.copy_(b)
        moved += a.numel() * a.element_size()
    dst.adopt(n)
    return moved


def send_state(state: LayerState, send_length: Callable[[int], None],
               send: Callable[[torch.Tensor], None]) -> int:
    """The sending side of a hand-off over a transport (a process pipe): the length, then each
    view.  Returns the bytes sent."""
    n = state.handoff_length()
    send_length(n)
    views = state.handoff_views(n)
    for t in views:
        send(t)
    return sum(t.numel() * t.element_size() for t in views)


def receive_state(state: LayerState, length: int, recv: Callable[[torch.Tensor], None]) -> int:
    """The receiving side, after the length arrived: each view received in place, then adopted.
    Returns the bytes received."""
    views = state.handoff_views(length)
    for t in views:
        recv(t)
    state.adopt(length)
    return sum(t.numel() * t.element_size() for t in views)


class LayerKV:
    """Keys and values of one layer for one sequence: [capacity, kv_heads, head_dim] each."""

    def __init__(self, capacity: int, n_kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.capacity = capacity
        self.k = torch.empty(capacity, n_kv_heads, head_dim, device=device, dtype=dtype)
        self.v = torch.empty(capacity, n_kv_heads, head_dim, device=device, dtype=dtype)
        self.length = 0

    @staticmethod
    def bytes_for(tokens: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of a cache of `tokens` tokens (what the memory plan and the allocator count)."""
        return 2 * tokens * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def reset(self) -> None:
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v of tokens [pos, pos+n) and return views of [0, pos+n).  A `DevicePos` (a
        static-shape decode step) writes by index and returns its span; `hold` counts the token."""
        if isinstance(pos, DevicePos):
            return pos.append(self.k, self.v, k, v)
        n = k.shape[0]
        if pos != self.length:
            raise RuntimeError(f"KV append at position {pos}, but the cache holds {self.length} tokens")
        if pos + n > self.capacity:
            raise RuntimeError(f"KV cache full: {pos + n} tokens exceed its capacity of {self.capacity}")
        self.k[pos:pos + n] = k
        self.v[pos:pos + n] = v
        self.length = pos + n
        return self.k[: pos + n], self.v[: pos + n]

    def hold(self, length: int) -> None:
        """The cache holds `length` tokens now: a static-shape decode step wrote its row by index
        on the device (no `append` bookkeeping ran on the host)."""
        self.length = length

    def clear_from(self, start: int) -> None:
        """Zero the rows from `start` on: a static-shape decode step attends over rows past its
        token with weight 0, and 0 times an uninitialised (possibly NaN) row is NaN."""
        self.k[start:].zero_()
        self.v[start:].zero_()

    # ------------------------------------------------------------ the hand-off
    def handoff_length(self) -> int:
        return self.length

    def handoff_views(self, length: int) -> list[torch.Tensor]:
        """The keys and values of tokens [0, length): what travels to another device."""
        if length > self.capacity:
            raise RuntimeError(f"KV copy of {length} tokens into a cache of capacity {self.capacity}")
        return [self.k[:length], self.v[:length]]

    def adopt(self, length: int) -> None:
        """After the hand-off views were filled: the cache holds `length` tokens."""
        self.length = length

    def copy_from(self, other: LayerState) -> int:
        """Copy another cache's contents (any device) into this one; returns bytes moved."""
        return copy_state(self, other)
