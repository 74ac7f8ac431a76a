"""The "CUDA graphs per chunk size" policy of one stage, for either executor.

A stage replays CUDA graphs of its layer runs (engine/models/graphs.py `GraphedLayers`) at the chunk
sizes of the run (the fixed size and the remainder, a balanced schedule's few sizes: the largest
`MAX_GRAPHED_SIZES`).  Size 1 in the plan also turns on the decode steps' graphs, each stage's
whole step as one graph (engine/pipeline/stage_decode.py); a layer whose decode step stays per
layer (a host position) replays its size-1 sets here.  A size is captured right after its first,
eager, pass (which warms the kernels up and lets each layer decide its expert GEMM, and so
whether it is graphable); a size that leaves the plan has its graphs freed; a capture that fails
falls back to eager for that size with a note.

`graph_sizes` is the run's choice of sizes; `StageGraphs` holds one stage's graph sets keyed by
(first layer, layer count, chunk size) and follows the policy.  The stage runtime of both
executors (engine/pipeline/stage_runtime.py) uses this module.  Without CUDA everything here is a no-op.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import torch

log = logging.getLogger(__name__)

MAX_GRAPHED_SIZES = 6  # chunk sizes of one run captured as CUDA graphs at most (graph memory per size)
DECODE_SIZE = 1  # a decode step is a chunk of one token


def graph_sizes(bounds: Iterable[tuple[int, int]], cuda_graphs: bool) -> set[int]:
    """The chunk sizes a run replays as graphs: its sizes (the largest MAX_GRAPHED_SIZES) and 1
    for decode; none when graphs are off."""
    if not cuda_graphs:
        return set()
    sizes = {n for _, n in bounds}
    if len(sizes) > MAX_GRAPHED_SIZES:
        sizes = set(sorted(sizes, reverse=True)[:MAX_GRAPHED_SIZES])
    return sizes | {DECODE_SIZE}


class StageGraphs:
    """One stage's CUDA graph sets on its device.

    Use: `graphed, capture = g.lookup(x, layers)`; run the layers (through `graphed.forward`
    where it is not None, eagerly otherwise); then, when `capture`, `g.after_eager(layers, x)`
    captures them if every layer is graphable.  `note` receives what the run report should say
    (a capture, or a capture that failed)."""

    def __init__(self, device: torch.device, name: str, note: Callable[[str], None],
                 factory: Callable | None = None) -> None:
        self.device, self.name, self.note = device, name, note
        self.sizes: set[int] = set()
        self.sets: dict[tuple[int, int, int], object] = {}
        self.failed: set[tuple[int, int, int]] = set()
        self._factory = factory

    @property
    def active(self) -> bool:
        return self.device.type == "cuda" and bool(self.sizes)

    @property
    def decode_on(self) -> bool:
        """Whether this run replays decode steps as graphs (engine/pipeline/stage_decode.py)."""
        return DECODE_SIZE in self.sizes

    def plan(self, sizes: Iterable[int]) -> None:
        """A run's sizes: keep the graphs of these, free the others (and forget their failures)."""
        self.sizes = set(sizes) if self.device.type == "cuda" else set()
        self.drop(keep=self.sizes)

    def lookup(self, x: torch.Tensor, layers: Sequence) -> tuple[object | None, bool]:
        """(the graph set of these layers at x's size or None = eager, whether to capture them
        after this eager pass)."""
        n = x.shape[0]
        if not self.active or not layers or n not in self.sizes:
            return None, False
        key = (layers[0].index, len(layers), n)
        graphed = self.sets.get(key)
        if graphed is not None or key in self.failed:
            return graphed, False
        return None, True

    def after_eager(self, layers: Sequence, x: torch.Tensor, note: Callable[[str], None] | None = None) -> None:
        """After the first eager pass of a size: capture when every layer can be graphed (a layer
        whose experts stream synchronises with the host and cannot).  `note`: where this run's
        report notes go, when not the one given at construction."""
        if all(layer.graphable(x) for layer in layers):
            self.capture(layers, x.shape[0], x.dtype, note)

    def capture(self, layers: Sequence, n: int, dtype: torch.dtype, note: Callable[[str], None] | None = None) -> None:
        say = note or self.note
        from engine.models.graphs import CAPTURE_LOCK, GraphedLayers

        key = (layers[0].index, len(layers), n)
        factory = self._factory or GraphedLayers
        try:
            graphed = factory(layers, n, self.device, dtype)
            graphed.capture()
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            self.failed.add(key)
            msg = (f"CUDA graphs off for layers {layers[0].index}-{layers[-1].index} on {self.name} at "
                   f"chunk {n}: capture failed ({str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}); "
                   f"running eagerly")
            log.warning("%s", msg)
            say(msg)
            if self.device.type == "cuda":
                with CAPTURE_LOCK:  # emptying the cache must not meet another thread's capture
                    torch.cuda.empty_cache()
            return
        self.sets[key] = graphed
        say(f"CUDA graphs captured for layers {layers[0].index}-{layers[-1].index} on {self.name} "
                  f"at chunk {n}: {graphed.capture_s * 1e3:.0f} ms, {graphed.reserved_bytes / 2**20:.0f} MiB")

    def drop(self, keep: set[int] | None = None) -> None:
        """Free the graph sets of chunk sizes not in `keep` (all when None)."""
        for key in list(self.sets):
            if keep is None or key[2] not in keep:
                self.sets.pop(key).close()
        self.failed = {k for k in self.failed if keep is not None and k[2] in keep}
