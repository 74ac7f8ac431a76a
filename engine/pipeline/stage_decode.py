"""One stage's decode step: static shapes on every device, one CUDA graph per step on CUDA.

Every decode step of a stage runs with its position on the device (engine/models/decode_pos.py):
the stage's one position tensor is written (`fill_`, no host synchronisation), then its layers
run at a `DevicePos` over the KV span of the token's bucket (`decode_pos.span_for`), then, on
the last stage, the greedy head.  The CPU runs that step eagerly (the suite tests it there); on
CUDA with graphs on, the first step at a span runs eagerly (it warms the kernels up and lets
each layer decide its expert GEMM), the step is then captured as one graph (all layers and the
head: engine/models/decode_graph.py) and every later token at that span is one replay.  A span
crossed (the context grew past a power of two) is one more eager step and one more capture;
the last `MAX_SPANS` spans' graphs are kept.  The run report notes each capture ("decode: 1 graph
per step ..."), or why a step stays eager (a capture that failed, a layer that synchronises
with the host such as streamed experts, fp32 on CUDA, the test hook or the non-finite check).

Layers or states that read the position their own way (`decode_graph.static_reason`) keep the
per-layer step with a host position (`StageRuntime.forward_layers`, each layer's own graphs).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.models import decode_pos
from engine.models.decode_graph import DecodeGraph, greedy, static_reason
from engine.models.decode_pos import DevicePos

if TYPE_CHECKING:
    from engine.pipeline.stage_runtime import StageContext, StageRuntime

log = logging.getLogger(__name__)

MAX_SPANS = 3  # decode graphs kept per stage (one per KV span; the least recently used goes)
STATIC = True  # the static-shape step where the layers allow it (False: the per-layer step; tests compare)


class StageDecode:
    """A stage's decode position tensor and its decode graphs by KV span (see the module doc)."""

    def __init__(self, device: torch.device, name: str) -> None:
        self.device, self.name = device, name
        self.index = torch.zeros(1, dtype=torch.int64, device=device)  # the position, written per step
        self.graphs: dict[int, DecodeGraph] = {}  # by span, least recently used first
        self.failed: dict[int, str] = {}  # spans that stay eager, and why
        self._run, self._said = "", set()  # the notes given in this run (each reason once per run)
        self._next = -1  # the position the next step of the same sequence is at
        self._why: tuple | None = None  # (layers, states, their counts, static_reason of them)

    def step(self, rt: StageRuntime, ctx: StageContext, x: torch.Tensor,
             pos: int) -> tuple[torch.Tensor, int | None]:
        """One token at `pos` through the stage: (its output, the greedy token on the last stage)."""
        fresh = ctx.run_id != self._run or pos != self._next  # the first step of a sequence
        if ctx.run_id != self._run:
            self._run, self._said = ctx.run_id, set()
        self._next = pos + 1
        why = self._reason(rt) if STATIC else "the static-shape step is off"
        if why:
            self._say(ctx, f"decode on {self.name}: one layer at a time ({why})")
            x = rt.forward_layers(ctx, x, rt.layers, rt.kvs, pos, -1)
            return x, int(greedy(rt.head, x)) if rt.last else None
        span = decode_pos.span_for(pos, rt.kvs[0].capacity)
        if fresh:  # the rows its steps will mask: zeros, not what the allocator left there
            for kv in rt.kvs:
                kv.clear_from(pos)
        self.index.fill_(pos)
        graphed = self._graphs_on(rt, ctx)
        g = self._graph(span, rt) if graphed else None
        if g is not None:
            out, tok = g.replay(x)
        else:
            out = rt.forward_layers(ctx, x, rt.layers, rt.kvs, DevicePos.at(self.index, span), -1)
            tok = greedy(rt.head, out) if rt.last else None
            if graphed and span in self.failed:
                self._say(ctx, self.failed[span])
            elif graphed:
                self._capture(rt, ctx, out, span)
        for kv in rt.kvs:
            kv.hold(pos + 1)  # the host's count of the tokens each cache holds
        return out, int(tok) if tok is not None else None

    def _reason(self, rt: StageRuntime) -> str:
        """`static_reason` of the stage's layers and states, asked again only when they change."""
        layers, kvs = rt.layers, rt.kvs
        cached = self._why
        if cached is None or cached[0] is not layers or cached[1] is not kvs or cached[2] != (len(layers), len(kvs)):
            cached = self._why = (layers, kvs, (len(layers), len(kvs)), static_reason(layers, kvs))
        return cached[3]

    def _graphs_on(self, rt: StageRuntime, ctx: StageContext) -> bool:
        """Whether this run replays decode graphs here (CUDA, graphs on, no per-layer hook or check)."""
        if not (rt.graphs.active and rt.graphs.decode_on):
            self.drop()  # graphs off for this run: their memory back
            return False
        return ctx.hooks.after_layer is None and not ctx.check_nan

    def _graph(self, span: int, rt: StageRuntime) -> DecodeGraph | None:
        g = self.graphs.get(span)
        if g is not None and not g.serves(rt.layers, rt.kvs):  # the caches were reallocated
            self.graphs.pop(span).close()
            return None
        if g is not None:
            self.graphs[span] = self.graphs.pop(span)  # most recently used last
        return g

    def _capture(self, rt: StageRuntime, ctx: StageContext, x: torch.Tensor, span: int) -> None:
        """After the eager step at a span: capture it, when every layer can be graphed."""
        layers = rt.layers
        where = f"layers {layers[0].index}-{layers[-1].index} on {self.name}"
        stuck = next((layer.index for layer in layers if not layer.graphable(x)), None)
        if stuck is not None:
            self.failed[span] = (f"decode: eager steps for {where} (layer {stuck} cannot be graphed: streamed "
                                 f"experts, or not the bf16/fp16 GPU path)")
            self._say(ctx, self.failed[span])
            return
        try:
            g = DecodeGraph(layers, rt.kvs, rt.head if rt.last else None, self.index, span, x.dtype)
            g.capture()
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            self.failed[span] = (f"decode: CUDA graph off for {where} at KV span {span}: capture failed ({first}); "
                                 f"running eagerly")
            self._say(ctx, self.failed[span], log.warning)
            _empty_cache()
            return
        while len(self.graphs) >= MAX_SPANS:
            self.graphs.pop(next(iter(self.graphs))).close()
        self.graphs[span] = g
        ctx.note(f"decode: 1 graph per step for {where} at KV span {span}, captured in "
                 f"{g.capture_s * 1e3:.0f} ms ({g.reserved_bytes / 2**20:.0f} MiB)")

    def _say(self, ctx: StageContext, text: str, log_it: Callable[[str], None] = log.info) -> None:
        if text not in self._said:
            self._said.add(text)
            log_it(text)
            ctx.note(text)

    def drop(self) -> None:
        """Free every decode graph (and forget the failures)."""
        for g in self.graphs.values():
            g.close()
        self.graphs = {}
        self.failed = {}
        self._why = None


def _empty_cache() -> None:
    from engine.models.graphs import CAPTURE_LOCK

    with CAPTURE_LOCK:  # emptying the cache must not meet another thread's capture
        torch.cuda.empty_cache()
