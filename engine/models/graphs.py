"""CUDA graphs of a run of layers at one chunk size: one launch where eager mode makes ~50.

Why: every stage of a split runs in a thread of one Python interpreter, and every torch op
releases and retakes the GIL, so with two or more stages the threads hand the GIL back and
forth on every kernel launch and a GPU waits for its thread.  A graph replays a layer's
kernels with one call.

What is captured: for each layer, the part before attention (norm, fused q/k/v, q/k norm,
RoPE from cos/sin tables fed in as inputs) and the part after it (output projection,
residual, FFN norm, experts or dense FFN, residual).  Neither depends on the chunk's
position.  The KV append and the attention itself, whose length grows with every chunk,
stay eager: about ten Python ops a layer instead of about fifty.  The kernels are the
eager path's own (`Layer.pre_attention` / `Layer.post_attention`), so results are
bit-identical to it.

Graph memory (a private pool per set) holds each layer's static input/outputs and the
largest layer's intermediates; `GraphedLayers.nbytes` reports it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.models.kv import LayerKV
from engine.models.layers import Layer

log = logging.getLogger(__name__)

_streams = threading.local()
# One capture at a time in the process: entering a capture synchronises the device and empties
# the allocator's cache, which must not meet another thread's capture in progress.
CAPTURE_LOCK = threading.RLock()


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's capture stream for a device.  Reused: libraries keep a workspace per stream
    they run on (measured 256 MiB per new stream on H200), so a fresh stream per capture would
    leave one behind every time.  High priority: torch hands out streams of each priority from
    its own pool in rotation, so no side stream of another thread (digest, hand-off) can be
    this one while it captures."""
    per_device = getattr(_streams, "by_device", None)
    if per_device is None:
        per_device = _streams.by_device = {}
    stream = per_device.get(device)
    if stream is None:
        stream = per_device[device] = torch.cuda.Stream(device, priority=-1)
    return stream


@dataclass
class _LayerGraph:
    layer: Layer
    x_in: torch.Tensor  # the layer's input (the previous layer's output tensor, or the set's input)
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o_in: torch.Tensor  # attention output, copied in before `post`
    out: torch.Tensor
    pre: torch.cuda.CUDAGraph
    post: torch.cuda.CUDAGraph


class GraphedLayers:
    """Layers [first, end) of one device at chunk size n, captured as two graphs per layer.

    Call `forward(i, x, kv, pos)` for i = 0..len-1 in order; the returned tensor is graph
    memory, valid until the next replay of the same set (copy it to keep it)."""

    def __init__(self, layers: Sequence[Layer], n: int, device: torch.device, dtype: torch.dtype) -> None:
        self.layers = list(layers)
        self.n, self.device, self.dtype = n, device, dtype
        spec = self.layers[0].spec
        self.capture_s = 0.0
        with torch.cuda.device(device):
            self.pool = torch.cuda.graph_pool_handle()
            self.x_in = torch.zeros(n, spec.hidden, device=device, dtype=dtype)
            self.cos = torch.zeros(n, 1, spec.rotary_dim, device=device, dtype=dtype)  # RoPE's part of a head
            self.sin = torch.zeros(n, 1, spec.rotary_dim, device=device, dtype=dtype)
        self.graphs: list[_LayerGraph] = []
        self.reserved_bytes = 0  # what capturing added to the device's reserved memory

    def capture(self) -> None:
        """Record every layer's two graphs (nothing runs on the GPU while recording)."""
        t0 = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        spec = self.layers[0].spec
        n = self.n
        x = self.x_in
        with CAPTURE_LOCK, torch.cuda.device(self.device), torch.inference_mode():
            stream = capture_stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            for layer in self.layers:
                pre = torch.cuda.CUDAGraph()
                with torch.cuda.graph(pre, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                    q, k, v = layer.pre_attention(x, self.cos, self.sin)
                o_in = torch.zeros(n, spec.n_heads * spec.head_dim, device=self.device, dtype=self.dtype)
                post = torch.cuda.CUDAGraph()
                with torch.cuda.graph(post, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                    out = layer.post_attention(x, o_in)
                self.graphs.append(_LayerGraph(layer, x, q, k, v, o_in, out, pre, post))
                x = out
            torch.cuda.current_stream(self.device).wait_stream(stream)
        self.capture_s = time.perf_counter() - t0
        self.reserved_bytes = max(torch.cuda.memory_reserved(self.device) - reserved, 0)
        log.info("captured CUDA graphs of layers %d-%d on %s at chunk %d in %.0f ms (%.0f MiB)",
                 self.layers[0].index, self.layers[-1].index, self.device, n, self.capture_s * 1e3,
                 self.reserved_bytes / 2**20)

    def forward(self, i: int, x: torch.Tensor, kv: LayerKV, pos: int) -> torch.Tensor:
        g = self.graphs[i]
        if x is not g.x_in:
            g.x_in.copy_(x)
        if i == 0:  # one table fill per chunk, shared by the set's layers
            cos, sin = g.layer.rope.lowp_tables(pos, self.n, self.dtype)
            self.cos.copy_(cos)
            self.sin.copy_(sin)
        g.pre.replay()
        keys, values = kv.append(g.k, g.v, pos)
        g.o_in.copy_(g.layer._attend(g.q, keys, values, self.n, pos))
        g.post.replay()
        return g.out

    def close(self) -> None:
        for g in self.graphs:
            g.pre.reset()
            g.post.reset()
        self.graphs = []
