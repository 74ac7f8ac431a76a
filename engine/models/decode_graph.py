"""A stage's whole decode step as ONE CUDA graph: every layer, and the greedy head where it is.

A decode token through a stage is hundreds of small kernels (16 Qwen3-30B-A3B layers: ~40 each,
the routed-expert gather included); launched one by one from Python the step is bound by the
launches, not by the GPU.  With the position on the device (engine/models/decode_pos.py
`DevicePos`) nothing in the step depends on a host value but the KV span, so the step is
captured once per span and replayed per token: one launch per stage.

`decode_layers` and `greedy` are the step's arithmetic; the eager step (the stage runtime's
`forward_layers` with a `DevicePos`, then `greedy`) runs the same calls, so a replay is
bit-identical to it.  `static_reason` says whether layers and states take a `DevicePos` at all
(a layer class that overrides where `Layer` reads the position, or a state other than
`LayerKV`, keeps the per-layer decode until it declares `static_decode = True`; such a state
also has `LayerKV`'s `clear_from(start)` and `hold(length)`).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from engine.models.decode_pos import DevicePos
from engine.models.graphs import CAPTURE_LOCK, capture_stream
from engine.models.kv import LayerKV
from engine.models.layers import Head, Layer, Rope

log = logging.getLogger(__name__)

# where Layer, Rope and LayerKV read a decode token's position: a subclass that overrides one of
# these takes a DevicePos only when it says so (static_decode = True in its own class body)
POSITION_METHODS = {Layer: ("forward", "attention", "_attend"), Rope: ("lowp_tables", "apply"),
                    LayerKV: ("append",)}


def _reads_position_its_own_way(obj: object, base: type) -> bool:
    cls = type(obj)
    if cls.__dict__.get("static_decode"):
        return False
    if not isinstance(obj, base):
        return True
    return any(getattr(cls, m) is not getattr(base, m) for m in POSITION_METHODS[base])


def static_reason(layers: Sequence, states: Sequence) -> str:
    """'' when every layer and state takes a `DevicePos` (the static-shape decode step), else why not."""
    if not layers:
        return "no layers"
    for layer, state in zip(layers, states, strict=True):
        if _reads_position_its_own_way(layer, Layer):
            return f"layer {layer.index} ({type(layer).__name__}) has no static-shape decode step"
        if _reads_position_its_own_way(getattr(layer, "rope", None), Rope):
            return f"layer {layer.index}'s RoPE ({type(layer.rope).__name__}) has no static-shape decode step"
        if _reads_position_its_own_way(state, LayerKV):
            return f"layer {layer.index}'s state ({type(state).__name__}) has no static-shape decode step"
    return ""


def decode_layers(layers: Sequence[Layer], states: Sequence[LayerKV], x: torch.Tensor,
                  pos: DevicePos) -> torch.Tensor:
    """One token through the layers at a device position."""
    for layer, state in zip(layers, states):
        x = layer(x, state, pos)
    return x


def greedy(head: Head, x: torch.Tensor) -> torch.Tensor:
    """The greedy token of the last layer's output x [1, hidden]: [1] int64 on x's device."""
    return head.logits(head.final_norm(x)).argmax(-1)


class DecodeGraph:
    """A stage's layers (and its head, on the last stage) for one decode token at one KV span,
    as one CUDA graph.  `index` is the stage's position tensor, written before each replay;
    `replay(x)` returns (the output [1, hidden], the greedy token [1] or None): graph memory,
    valid until the next replay."""

    def __init__(self, layers: Sequence[Layer], states: Sequence[LayerKV], head: Head | None,
                 index: torch.Tensor, span: int, dtype: torch.dtype) -> None:
        self.layers, self.states, self.head = list(layers), list(states), head
        self.index, self.span, self.device = index, span, index.device
        with torch.cuda.device(self.device):
            self.pool = torch.cuda.graph_pool_handle()
            self.x_in = torch.zeros(1, self.layers[0].spec.hidden, device=self.device, dtype=dtype)
        # the RoPE tables cover the span before recording (a table grown inside a capture would be
        # graph memory, never computed), and the ones the graph reads stay alive even if a longer
        # prompt regrows them
        ropes = {id(layer.rope): layer.rope for layer in self.layers}.values()
        for r in ropes:
            r.lowp_tables(0, span, dtype)  # grows the fp32 tables too (Rope._ensure)
        self.tables = [t for r in ropes for t in vars(r).values() if isinstance(t, torch.Tensor)]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.tok: torch.Tensor | None = None
        self.capture_s = 0.0
        self.reserved_bytes = 0

    def serves(self, layers: Sequence[Layer], states: Sequence[LayerKV]) -> bool:
        """Whether this graph was captured over these very layers and caches (a cache that grew
        was reallocated: its graph is stale)."""
        return (len(layers) == len(self.layers) and all(a is b for a, b in zip(layers, self.layers))
                and all(a is b for a, b in zip(states, self.states, strict=True)))

    def capture(self) -> None:
        """Record the step (nothing runs on the GPU while recording: the KV is not touched)."""
        t0 = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        with CAPTURE_LOCK, torch.cuda.device(self.device), torch.inference_mode():
            stream = capture_stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                out = decode_layers(self.layers, self.states, self.x_in, DevicePos.at(self.index, self.span))
                tok = greedy(self.head, out) if self.head is not None else None
            torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graph, self.out, self.tok = graph, out, tok
        self.capture_s = time.perf_counter() - t0
        self.reserved_bytes = max(torch.cuda.memory_reserved(self.device) - reserved, 0)
        log.info("captured the decode step of layers %d-%d on %s at KV span %d in %.0f ms (%.0f MiB)",
                 self.layers[0].index, self.layers[-1].index, self.device, self.span, self.capture_s * 1e3,
                 self.reserved_bytes / 2**20)

    def replay(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if x is not self.x_in:
            self.x_in.copy_(x)
        self.graph.replay()
        return self.out, self.tok

    def close(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph = self.out = self.tok = None
