"""The position of a decode token as a tensor on its device: what makes a decode step's shapes static.

A decode step of one token at position p reads p in three places: the RoPE row (cos/sin of p),
the KV append (row p of each layer's cache) and the attention length (keys [0, p]).  With p a
host integer every one of them is a different kernel argument or shape per token, so a CUDA
graph captured at one step cannot replay the next.  A `DevicePos` carries p as a one-element
int64 tensor on the stage's device (written before each step) and a host `span` that bounds it:

* RoPE: the cos/sin row gathered by the tensor (`index_select`) from tables of `span` rows;
* KV: keys and values written by index (`index_copy_`) into the preallocated cache;
* attention: over the first `span` cached keys, those past p masked (`masked`).

`span` changes only when p crosses a bucket (`span_for`: powers of two from `MIN_SPAN`, capped
by the cache's capacity), so a short context does not attend over the whole cache and a stage
keeps one graph per bucket.  `Rope`, `LayerKV.append` and `Layer._attend` take a `DevicePos`
where they take a host position (`LayerKV.hold` then counts the token on the host, and
`LayerKV.clear_from` zeroes the rows a sequence's steps will mask); `Layer.forward(x, kv, DevicePos)` is then the static-shape
step, on every device (the CPU runs it eagerly: the suite tests the same code the graph holds).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

MIN_SPAN = 256  # the smallest KV span a decode step attends over (tokens)


def span_for(pos: int, capacity: int, floor: int | None = None) -> int:
    """The KV span a decode token at `pos` attends over: the power of two >= pos + 1 (at least
    `floor`, MIN_SPAN by default), at most the cache's `capacity`."""
    need = pos + 1
    if need > capacity:
        raise RuntimeError(f"KV cache full: a decode token at position {pos} exceeds its capacity of {capacity}")
    span = max(floor if floor is not None else MIN_SPAN, 1 << (need - 1).bit_length())
    return min(span, capacity)


@dataclass(frozen=True)
class DevicePos:
    """One decode token's position on its device (see the module doc)."""

    index: torch.Tensor  # [1] int64: the position, on the stage's device
    span: int  # keys [0, span) are attended, the ones past `index` masked
    masked: torch.Tensor  # [span] bool: True past the position
    # rows already gathered in this step, by table: every layer of a stage shares its RoPE tables,
    # so a step gathers each table's row once, not once per layer (two kernels a layer fewer)
    _rows: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def at(cls, index: torch.Tensor, span: int) -> DevicePos:
        """The position held in `index` (no host read), attending over `span` keys."""
        return cls(index, span, torch.arange(span, device=index.device) > index)

    def row(self, table: torch.Tensor) -> torch.Tensor:
        """Row `index` of `table` [rows, ...] as [1, ...], gathered once per step and table (the
        same memory: a fresh slice of one table is the same table; tables live through the step)."""
        key = (table.data_ptr(), tuple(table.shape), tuple(table.stride()), table.dtype, table.device)
        got = self._rows.get(key)
        if got is None:
            got = self._rows[key] = (table, table.index_select(0, self.index))
        return got[1]

    def append(self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [1, KV, hd] at the position into caches keys/values [capacity, KV, hd];
        return views of their first `span` rows."""
        if self.span > keys.shape[0]:
            raise RuntimeError(f"a decode step over {self.span} keys, but the cache holds {keys.shape[0]}")
        keys.index_copy_(0, self.index, k)
        values.index_copy_(0, self.index, v)
        return keys[:self.span], values[:self.span]
