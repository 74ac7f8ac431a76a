"""Measure what `chunking` plans from: one layer's cost per chunk size, the way chunks run.

A probe runs one layer of the main device at each candidate chunk size on a KV cache of its
own: t0(c) at position 0, attention's extra time per (query token x cached key) from one chunk
behind a long prefix, and the host's time to launch a layer.  With CUDA graphs on, a size is
first run eagerly once (kernels set up outside capture, as a run does), then captured, and
the timed calls replay the graph — eager timing is bound by host launches at small sizes.

The bookkeeping a run's KV cache enforces holds here too: before every call the probe's cache
holds exactly `pos` tokens, so a warm-up or capture pass never leaves the cache one chunk
ahead of the call that is timed.  The graph factory and the device sync are parameters, so
the bookkeeping is tested on CPU with a recording fake (tests/test_chunk_cost.py).

`measured(key, limit, measure)` keeps one measurement per process for a key (model shape, device
kind, dtype, streaming, graphs, expert types: `cost_key`), so the sessions of one benchmark or app plan the
same chunks and their digests stay comparable; `measure_layer` is the threaded executor's
measurement, `probe_shape` the sizes and shapes it (and a stage process) measures at;
`measure_hop` times a session's first hand-off.

A prompt is never probed past its own length: `probe_shape(device, n_tokens)` keeps the
candidate sizes below the prompt and adds the prompt's own length (its one-chunk option), and
the attention probe (a chunk behind a prefix) fits in it too.  A measurement's `limit` is the
largest size it timed; a later, longer prompt measures again up to its length (and replaces
the process's measurement), a shorter one reuses what is known.  A prompt no longer than the
smallest chunk candidate has one chunk whatever the costs, and is not probed at all
(`chunking.one_chunk_only`, applied by run_plan).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine import models
from engine.models.kv import LayerKV
from engine.models.layers import Layer
from engine.plan import chunking

log = logging.getLogger(__name__)


class LayerGraph(Protocol):
    """What the probe needs of a captured layer set (engine.models.graphs.GraphedLayers)."""

    def capture(self) -> None: ...
    def forward(self, i: int, x: torch.Tensor, kv: LayerKV, pos: int) -> torch.Tensor: ...
    def close(self) -> None: ...


GraphFactory = Callable[[Sequence[Layer], int, torch.device, torch.dtype], LayerGraph]


def _cuda_graphs(layers: Sequence[Layer], n: int, device: torch.device, dtype: torch.dtype) -> LayerGraph:
    from engine.models.graphs import GraphedLayers

    return GraphedLayers(layers, n, device, dtype)


@dataclass
class LayerCost:
    """Seconds per layer at each chunk size (position 0), attention seconds per (token x cached
    key), host launch seconds per layer: the first three fields of `chunking.ChunkCost`."""

    layer_s: dict[int, float]
    attn_s: float
    host_s: float

    def astuple(self) -> tuple[dict[int, float], float, float]:
        return self.layer_s, self.attn_s, self.host_s


@dataclass
class ChunkCostProbe:
    layer: Layer
    device: torch.device
    dtype: torch.dtype
    graphs: bool  # time graph replays (what a run with cuda_graphs on executes)
    graph_factory: GraphFactory = _cuda_graphs
    reps: int = 2  # timed calls per point (the best counts), after one untimed call
    _graphs: dict[int, LayerGraph | None] = field(default_factory=dict, init=False)  # None: eager
    kv: LayerKV | None = field(default=None, init=False)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure(self, sizes: Sequence[int], prefix: int, probe: int, seed: int = 0) -> LayerCost:
        spec = self.layer.spec
        self.kv = models.family_of(spec).new_state(spec, self.layer.index, max(max(sizes), prefix + probe),
                                                   self.device, self.dtype)
        gen = torch.Generator().manual_seed(seed)

        def tokens(n: int) -> torch.Tensor:
            return torch.randn(n, spec.hidden, generator=gen).to(self.device, self.dtype)

        try:
            with torch.inference_mode():
                for t in self.kv.handoff_views(self.kv.capacity):  # KV: every slot; a recurrent state: all of it
                    t.normal_()
                layer_s = self._sizes(sizes, tokens)
                x = tokens(probe)
                deep = self._best(x, prefix)
                attn = max(deep - self._best(x, 0), 0.0) / (probe * prefix)
                host = self._host_launch(tokens(min(sizes))) if self.device.type == "cuda" else 0.0
        finally:
            self.close()
        return LayerCost(layer_s, attn, host)

    def _sizes(self, sizes: Sequence[int], tokens) -> dict[int, float]:
        """One layer's time at each size, smallest first, up to the first size the device has
        no memory for (a 12 GB card cannot run a 64K-token chunk; auto then never picks one)."""
        out: dict[int, float] = {}
        for n in sorted(sizes):
            try:
                out[n] = self._best(tokens(n), 0)
            except torch.OutOfMemoryError:
                if not out:
                    raise
                g = self._graphs.pop(n, None)
                if g is not None:
                    g.close()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                log.info("chunk cost: %d tokens do not fit on %s; auto considers up to %d", n, self.device, max(out))
                break
        return out

    def close(self) -> None:
        """Free every captured graph (and the device's cached blocks they held)."""
        for g in self._graphs.values():
            if g is not None:
                g.close()
        self._graphs.clear()
        self.kv = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ internals
    def _call(self, x: torch.Tensor, pos: int) -> None:
        """One forward of the layer at `pos` as a run executes it; the cache first holds `pos`."""
        g = self._graph(x)  # may run an eager pass of its own first: set the cache after it
        kv = self.kv
        assert kv is not None
        kv.adopt(pos)  # holds `pos` tokens (a recurrent state: continues from its matrices)
        if g is not None:
            g.forward(0, x, kv, pos)
        else:
            self.layer(x, kv, pos)

    def _graph(self, x: torch.Tensor) -> LayerGraph | None:
        """The captured graph at x's size, capturing it on first sight (after one eager pass on
        an emptied cache, as a run's first chunk of that size); None where it runs eagerly."""
        n = x.shape[0]
        if not self.graphs:
            return None
        if n not in self._graphs:
            kv = self.kv
            assert kv is not None
            kv.adopt(0)
            self.layer(x, kv, 0)  # first: a layer decides its expert GEMM (and so graphability) here
            if not self.layer.graphable(x):
                self._graphs[n] = None
                return None
            try:
                g = self.graph_factory([self.layer], n, self.device, self.dtype)
                g.capture()
                self._graphs[n] = g
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                log.info("chunk cost at %d tokens measured eagerly: graph capture failed (%s)", n, exc)
                self._graphs[n] = None
        return self._graphs[n]

    def _best(self, x: torch.Tensor, pos: int) -> float:
        self._call(x, pos)  # untimed: warms this shape up (and captures its graph)
        best = float("inf")
        for _ in range(self.reps):
            self.sync()
            t0 = time.perf_counter()
            self._call(x, pos)
            self.sync()
            best = min(best, time.perf_counter() - t0)
        return best

    def _host_launch(self, x: torch.Tensor) -> float:
        """The host's share of a layer: launch time alone (the first call of a shape plans
        its kernels on the host, so the best of three)."""
        host = float("inf")
        for _ in range(3):
            self.sync()
            t0 = time.perf_counter()
            self._call(x, 0)
            host = min(host, time.perf_counter() - t0)
            self.sync()
        return host


# ---------------------------------------------------------------- a session's measurement
Measured = tuple[dict[int, float], float, float]  # LayerCost.astuple(): chunking.ChunkCost's first three
ProbeShape = tuple[tuple[int, ...], int, int, int]  # (sizes, attention prefix, probe chunk, repetitions)
_MEASURED: dict[tuple, tuple[int, Measured]] = {}  # per process and key: (limit, measurement); see `measured`
_MEASURED_LOCK = threading.Lock()


def cost_key(spec: object, device: torch.device, dtype: torch.dtype, streamed: bool, cuda_graphs: bool,
             stored: Sequence[str] = ()) -> tuple:
    """What a measurement depends on: the model's shape, the device kind (its name on CUDA),
    the dtype, streamed experts, CUDA graphs and the types the experts are stored in (a layer
    of Q4_K_M experts costs a dequantisation, and streams fewer bytes, than the same shape in
    F16: the two must not share a measurement)."""
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return (repr(spec), dev, str(dtype), streamed, cuda_graphs, tuple(sorted(stored)))


def measured(key: tuple, limit: int, measure: Callable[[], Measured]) -> tuple[Measured, int]:
    """The measurement for `key` and the largest size it timed: the one this process took
    already when it timed sizes up to `limit` or beyond, else a new one by `measure()` (timing
    sizes up to `limit`), which then replaces it."""
    with _MEASURED_LOCK:
        got = _MEASURED.get(key)
        if got is None or got[0] < limit:
            got = _MEASURED[key] = (limit, measure())
        return got[1], got[0]


def _full_shape(device: torch.device) -> ProbeShape:
    if device.type == "cuda":
        return chunking.GPU_CANDIDATES, 8192, 2048, 2
    return chunking.CPU_CANDIDATES[2:6], 256, 64, 4


def probe_shape(device: torch.device, n_tokens: int | None = None) -> ProbeShape:
    """(candidate sizes, attention prefix, probe chunk, timed repetitions) for a device kind,
    none of them past a prompt of `n_tokens` (None: no prompt in view, the full range): the
    sizes below the prompt and the prompt itself (its one-chunk option, where it is shorter
    than the largest size), and an attention probe of half the largest size behind a prefix
    of the rest at most, so that every timed call runs at most `n_tokens` positions."""
    sizes, prefix, probe, reps = _full_shape(device)
    if n_tokens is None or n_tokens >= sizes[-1]:
        return sizes, prefix, probe, reps
    if n_tokens < 2:
        raise ValueError(f"no chunk cost to measure for a prompt of {n_tokens} token(s)")
    sizes = (*(s for s in sizes if s < n_tokens), n_tokens)
    top = sizes[-1]
    probe = min(probe, top // 2)
    return sizes, min(prefix, top - probe), probe, reps


def measure_layer(layer: Layer, device: torch.device, dtype: torch.dtype, cuda_graphs: bool,
                  shape: ProbeShape | None = None) -> Measured:
    """Time one layer the way a fixed-size chunk runs: per candidate size at position 0,
    attention's extra time per (token x cached key), and host launch time per layer (graph
    replays when `cuda_graphs` is on and the device is a GPU); `shape` from `probe_shape`."""
    return measure_layers([layer], device, dtype, cuda_graphs, shape)


def representatives(layers: Sequence[Layer]) -> list[tuple[Layer, float]]:
    """The layers a probe times for a stage holding `layers`: the first of each layer kind among
    them (a hybrid's GDN and attention layers cost differently), weighted by that kind's share of
    the model's layers; one layer, weight 1, where the layers are all of one kind."""
    spec = layers[0].spec
    fam = models.family_of(spec)
    kinds = [fam.layer_kind(spec, i).name for i in range(spec.n_layers)]
    first: dict[str, Layer] = {}
    for layer in layers:
        first.setdefault(kinds[layer.index], layer)
    total = sum(kinds.count(k) for k in first)
    return [(layer, kinds.count(k) / total) for k, layer in first.items()]


def measure_layers(layers: Sequence[Layer], device: torch.device, dtype: torch.dtype, cuda_graphs: bool,
                   shape: ProbeShape | None = None) -> Measured:
    """`measure_layer` of each of `representatives(layers)`, averaged by their weights (the mean
    layer of the model, over the sizes every probe timed)."""
    sizes, prefix, probe, reps = shape or probe_shape(device)
    graphs = device.type == "cuda" and cuda_graphs
    costs = [(ChunkCostProbe(layer, device, dtype, graphs=graphs, reps=reps).measure(sizes, prefix=prefix, probe=probe),
              w) for layer, w in representatives(layers)]
    if len(costs) == 1:
        return costs[0][0].astuple()
    timed = set.intersection(*(set(c.layer_s) for c, _ in costs))
    return LayerCost({n: sum(w * c.layer_s[n] for c, w in costs) for n in sorted(timed)},
                     sum(w * c.attn_s for c, w in costs), sum(w * c.host_s for c, w in costs)).astuple()


def measure_hop(a: torch.device, b: torch.device, dtype: torch.dtype, hidden: int, n: int = 1024) -> float:
    """Seconds per token to hand a chunk's activations from device a to device b (best of four
    copies of an n-token chunk)."""
    x = torch.randn(n, hidden, dtype=torch.float32).to(a, dtype)
    dst = torch.empty(n, hidden, device=b, dtype=dtype)
    best = float("inf")
    for _ in range(4):
        for d in (a, b):
            if d.type == "cuda":
                torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        dst.copy_(x)
        for d in (a, b):
            if d.type == "cuda":
                torch.cuda.synchronize(d)
        best = min(best, time.perf_counter() - t0)
    return best / n
