"""One stage's body, for both executors: what a stage computes, whatever carries its chunks.

A `StageRuntime` owns a contiguous layer range on one device: its layers (and their weight and
expert-cache loading), its head, the KV of those layers, its ONE chunk input buffer and its
CUDA graphs.  It runs the layers with the test hook, the non-finite check and the graphs
(`forward_layers`), times a chunk's compute and emits its events (`compute`, `emit_streams`),
finishes the last layer's output (`finish_chunk`: digest and logits, engine/pipeline/stage_output.py),
runs a decode step (`decode_step`) and takes in prefill-main's KV (`receive_kv`).

The two executors differ only in how chunks arrive and leave and in the control loop around
them: `engine.pipeline.stage.Stage` (threads: a worker thread per stage, copies or CUDA events between
devices) and `engine.pipeline.stage_process.StageProcess` (a process per stage: torch.distributed
send/recv, commands from the controller).  What a stage needs of the run comes in a
`StageContext` with every call; a stage holds no reference to its session or run.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine import models
from engine.errors import NonFiniteError, StageError
from engine.events import StageEvent
from engine.hw import nvtx
from engine.hw.gpu_timing import DeferredTimer, DeviceClock, GpuInterval, timing_event
from engine.models.decode_pos import DevicePos
from engine.models.experts import ExpertCache, ExpertStats, HostArena
from engine.models.kv import LayerKV
from engine.models.layers import Head, Layer, Rope, WeightSource, load_head
from engine.models.loading import load_layer_weights, new_layer
from engine.pipeline.stage_decode import StageDecode
from engine.pipeline.stage_graphs import DECODE_SIZE, StageGraphs
from engine.pipeline.stage_output import StageOutput
from engine.quant.host_scratch import HostScratch

log = logging.getLogger(__name__)

IDLE_MIN_NS = 20_000  # a GPU's idle gaps between chunks shorter than this are not reported as waits
CHUNK_ADVICE = "lower the chunk size (chunk_tokens: --chunk-tokens or STRATA_CHUNK_TOKENS)"
LAYER_ADVICE = "move layers to another device (--layer-split) or stream experts (--expert-cache GiB)"

# allocate(what, device, nbytes, advice, make): through the fault hook, out-of-memory named
Allocate = Callable[[str, "torch.device | str", int, str, Callable], object]


def plain_alloc(what: str, device: torch.device | str, nbytes: int, advice: str, make: Callable):
    """An `Allocate` without a fault hook (a stage process: its error names the stage)."""
    return make()


@dataclass
class PipelineHooks:
    """Test and fault-injection seams.  after_layer(stage, layer, chunk) runs after each layer;
    before_alloc(what, device, nbytes) runs before each large allocation (raise MemoryError to
    simulate an out-of-memory on a machine without that device)."""

    after_layer: Callable[[int, int, int], None] | None = None
    before_alloc: Callable[[str, str, int], None] | None = None


@dataclass(frozen=True)
class StageContext:
    """What a stage needs of one run (built by `engine.pipeline.run.Run`, or by a stage process from its
    `RunOrder`), passed with every chunk."""

    run_id: str
    emit: Callable[[StageEvent], None]  # every event of the run
    note: Callable[[str], None]  # a line for the run's report notes
    timer: DeferredTimer | None  # resolves GPU timings off the hot path (None: host-timed stages)
    clock: DeviceClock
    events_on: bool
    hooks: PipelineHooks
    check_nan: bool
    pipeline_depth: int  # 1 overlap, 0 join
    graph_sizes: frozenset[int] = frozenset()  # chunk sizes this run replays as CUDA graphs
    prompt_ids: torch.Tensor | None = None  # on the first stage's device
    output: StageOutput | None = None  # the last layer's output: norm, digest, logits


class StageRuntime:
    """A stage's layers, head, KV, input buffer and graphs on one device, and what it does with
    a chunk (see the module doc).  `host_timed`: a compute is timed on the host after a device
    synchronisation (the stage processes), not by CUDA events."""

    host_timed = False
    last = False  # runs the model's last layers (the threaded Stage: no successor)

    def __init__(self, index: int, device: torch.device, first: int, end: int, dtype: torch.dtype,
                 name: str | None = None) -> None:
        self.index = index
        self.device = device
        self.name = name or str(device)
        self.first, self.end = first, end
        self.dtype = dtype
        self.layers: list[Layer] = []
        self.kvs: list[LayerKV] = []
        self.head: Head | None = None
        self.cache: ExpertCache | None = None  # streamed experts of this stage's device
        # a CPU stage's one buffer for expanding stored experts, shared by its layers
        self.scratch = HostScratch(self.name) if device.type == "cpu" else None
        self.input_buf: torch.Tensor | None = None  # this stage's ONE chunk input buffer
        self.done: torch.cuda.Event | None = None  # CUDA: the end of the last compute on the stream
        self.prev_end: torch.cuda.Event | None = None  # for the idle gap before the next compute
        # CUDA graphs per (first layer, layer count, chunk size): engine/pipeline/stage_graphs.py
        self.graphs = StageGraphs(device, self.name, note=log.info)
        # the decode step: position on the device, one graph per step (engine/pipeline/stage_decode.py)
        self.decoding = StageDecode(device, self.name)
        # NVTX ranges name the stage as the Gantt does (the Session relabels interleaved groups)
        self.label = nvtx.stage_label(index, device, first, end)

    # ------------------------------------------------------------------ loading
    def load_layers(self, source: WeightSource, rope: Rope, indices: range, streamed: bool, alloc: Allocate,
                    before: Callable[[int], None] | None = None,
                    after: Callable[[int], None] | None = None) -> list[Layer]:
        """Layers `indices` on this stage's device (their experts left in the arena when they
        stream), each prefetching the next one's experts; `before`/`after` run around each."""
        spec = source.spec
        fam, size = models.family_of(spec), torch.empty((), dtype=self.dtype).element_size()
        out: list[Layer] = []
        for i in indices:
            if before is not None:
                before(i)
            nbytes = fam.layer_params(spec, i) * size  # a hybrid's layers differ (GDN, attention)
            w = alloc(f"the weights of layer {i}", self.device, nbytes, LAYER_ADVICE,
                      lambda: load_layer_weights(source, i, self.device, self.dtype, experts=not streamed))  # noqa: B023  (alloc calls it now)
            out.append(new_layer(spec, i, w, rope, cache=self.cache if streamed else None))
            out[-1].scratch = self.scratch
            if after is not None:
                after(i)
        for a, b in zip(out, out[1:]):
            a.prefetch_next = b.index
        return out

    def load_head(self, source: WeightSource, embed: bool, final: bool) -> Head:
        return load_head(source, self.device, self.dtype, embed=embed, final=final)

    def use_cache(self, arena: HostArena, slots: int, stats: ExpertStats, alloc: Allocate) -> None:
        """Streamed experts: this stage's ExpertCache of `slots` over `arena` (none for a stage
        whose layers route no experts: leading dense layers)."""
        if not arena.spec.expert_layers(self.first, self.end):
            return
        self.cache = alloc(f"an expert cache of {slots} slots", self.device, slots * arena.expert_bytes,
                           "lower --expert-cache", lambda: ExpertCache(arena, self.device, slots, stats))
        for layer in self.layers:
            layer.cache = self.cache

    # ------------------------------------------------------------------ buffers
    def prepare_kv(self, capacity: int, n_kv_heads: int, head_dim: int, alloc: Allocate) -> None:
        """Each layer's state for `capacity` tokens (reset), as its family makes it (KV for
        attention): grown when too small, kept from run to run otherwise."""
        if not self.kvs or self.kvs[0].capacity < capacity:
            self.kvs = []  # free before allocating the larger cache (the decode graphs hold it too)
            self.decoding.drop()
            spec = self.layers[0].spec if self.layers else None
            idx = [layer.index for layer in self.layers]
            self.kvs = alloc(
                f"KV for layers {self.first}-{self.end - 1} ({capacity} tokens)", self.device,
                models.states_bytes(spec, idx, capacity, self.dtype),
                "shorten the prompt or decode, or move layers to another device (--layer-split)",
                lambda: models.new_states(spec, idx, capacity, self.device, self.dtype))
        for kv in self.kvs:
            kv.reset()

    def prepare_input(self, chunk: int, hidden: int, alloc: Allocate) -> None:
        """The ONE chunk input buffer (stages after the first) for `chunk` tokens, grown when too small."""
        if self.index > 0 and (self.input_buf is None or self.input_buf.shape[0] < chunk):
            nbytes = chunk * hidden * torch.empty((), dtype=self.dtype).element_size()
            self.input_buf = alloc(f"the chunk input buffer ({chunk} tokens)", self.device, nbytes, CHUNK_ADVICE,
                                   lambda: torch.empty(chunk, hidden, device=self.device, dtype=self.dtype))

    @property
    def graph_sets(self) -> dict:
        """The captured graph sets by (first layer, layer count, chunk size)."""
        return self.graphs.sets

    def drop_graphs(self, keep: set[int] | None = None) -> None:
        """Free the graph sets of chunk sizes not in `keep` (all when None), and the decode
        graphs unless `keep` holds the decode size."""
        self.graphs.drop(keep)
        if keep is None or DECODE_SIZE not in keep:
            self.decoding.drop()

    def release(self) -> None:
        """Free layers, KV, head, buffers, graphs, the expert cache and the host scratch."""
        self.drop_graphs()
        if self.scratch is not None:
            self.scratch.release()
        self.layers, self.kvs, self.head, self.input_buf, self.cache = [], [], None, None, None

    # ------------------------------------------------------------------ events
    def event(self, ctx: StageContext, chunk: int, kind: str, start: int, end: int, tokens: int = 0,
              nbytes: int = 0, note: str = "") -> None:
        ctx.emit(StageEvent(ctx.run_id, self.index, self.name, chunk, kind, start, end, tokens, nbytes, note))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def gpu_event(self, ctx: StageContext, chunk: int, kind: str, start: torch.cuda.Event, end: torch.cuda.Event,
                  end_device: torch.device | None = None, tokens: int = 0, nbytes: int = 0, note: str = "",
                  min_ns: int = 0) -> None:
        """An event timed by CUDA events, delivered once the GPU has passed `end` (never blocks)."""
        emit, run_id, index, name = ctx.emit, ctx.run_id, self.index, self.name

        def deliver(t0: int, t1: int) -> None:
            emit(StageEvent(run_id, index, name, chunk, kind, t0, t1, tokens, nbytes, note))

        ctx.timer.submit(GpuInterval(self.device, start, end_device or self.device, end, deliver, min_ns))

    def emit_streams(self, ctx: StageContext) -> None:
        """Stream events for the expert copies that have finished (timed on the copy stream)."""
        if self.cache is None:
            return
        for layer, chunk, t0, t1, pinned, pageable in self.cache.drain_timings(ctx.clock):
            if ctx.events_on:
                self.event(ctx, chunk, "stream", t0, t1, nbytes=pinned + pageable,
                           note=f"layer {layer}: {pinned / 2**20:.1f} MiB pinned, {pageable / 2**20:.1f} MiB pageable")

    # ----------------------------------------------------------------- compute
    def compute(self, ctx: StageContext, x: torch.Tensor, layers: Sequence[Layer], kvs: Sequence[LayerKV],
                pos: int, chunk: int, tokens: int, note: str = "") -> torch.Tensor:
        """Run layers on x, timed, with the NaN check and test hook.

        On CUDA (unless host-timed) this launches the work and returns; `self.done` marks its
        end on the stream and CUDA events time it."""
        timed = ctx.events_on
        if self.cache is not None:
            self.cache.chunk = chunk
        if self.device.type == "cuda" and not self.host_timed:
            ev0 = timing_event(self.device) if timed else None
            with nvtx.span(self.device, f"{self.label} C{chunk} compute" + (f" {note}" if note else "")):
                x = self.forward_layers(ctx, x, layers, kvs, pos, chunk)
            self.done = ev1 = timing_event(self.device)
            if timed:
                self.gpu_event(ctx, chunk, "compute", ev0, ev1, tokens=tokens, note=note)
                if self.prev_end is not None:  # the device idled between this stage's chunks
                    self.gpu_event(ctx, chunk, "wait", self.prev_end, ev0, note="idle", min_ns=IDLE_MIN_NS)
                self.prev_end = ev1
        else:
            t0 = time.perf_counter_ns()
            with nvtx.span(self.device, f"{self.label} C{chunk} compute" + (f" {note}" if note else "")):
                x = self.forward_layers(ctx, x, layers, kvs, pos, chunk)
            if self.host_timed:
                self.sync()
            if timed:
                self.event(ctx, chunk, "compute", t0, time.perf_counter_ns(), tokens=tokens, note=note)
        self.emit_streams(ctx)
        return x

    def forward_layers(self, ctx: StageContext, x: torch.Tensor, layers: Sequence[Layer],
                       kvs: Sequence[LayerKV], pos: int | DevicePos, chunk: int) -> torch.Tensor:
        """The layers in order (replaying their CUDA graphs where captured), with the NaN check,
        the test hook and errors that name stage, layer and chunk."""
        hook = ctx.hooks.after_layer
        # sizes: the run planned them (graphs.plan); a static decode step is graphed whole (stage_decode)
        graphed, capture = self.graphs.lookup(x, layers) if not isinstance(pos, DevicePos) else (None, False)
        for i, (layer, kv) in enumerate(zip(layers, kvs)):
            try:
                x = graphed.forward(i, x, kv, pos) if graphed is not None else layer(x, kv, pos)
                if hook is not None:
                    hook(self.index, layer.index, chunk)
                if ctx.check_nan and not bool(torch.isfinite(x).all()):
                    raise NonFiniteError(f"non-finite value after layer {layer.index}")
            except StageError:
                raise
            except Exception as exc:
                raise StageError(self.index, self.name, chunk, layer.index, exc) from exc
        if capture:  # after the eager pass: each layer decides its expert GEMM (graphability) on its first call
            try:
                self.graphs.after_eager(layers, x, ctx.note)
            except Exception as exc:
                raise StageError(self.index, self.name, chunk, None, exc) from exc
        return x

    def finish_chunk(self, ctx: StageContext, x: torch.Tensor, pos: int, n: int, head: Head | None = None) -> None:
        """The last layer's output of a chunk: final norm, digest, logits (`head`: not the stage's own)."""
        ctx.output.add(head or self.head, x, pos, n)

    def decode_step(self, ctx: StageContext, x: torch.Tensor, pos: int, step: int) -> tuple[torch.Tensor, int | None]:
        """One decode token through this stage's layers (as chunk -1; the position on the device,
        one CUDA graph per step where it can: engine/pipeline/stage_decode.py); the last stage
        also picks the greedy token.  Returns (its output, the token or None)."""
        if self.cache is not None:
            self.cache.chunk = -1  # decode steps stream as chunk -1
        t0 = time.perf_counter_ns()
        with nvtx.span(self.device, f"{self.label} decode {step}"):
            x, tok = self.decoding.step(self, ctx, x, pos)
        if ctx.events_on or self.host_timed:
            self.sync()
        if ctx.events_on:
            self.event(ctx, step, "decode", t0, time.perf_counter_ns(), tokens=1)
        return x, tok

    def receive_kv(self, ctx: StageContext, fill: Callable[[int, LayerKV], int], source: str) -> None:
        """Prefill-main's receiving side: `fill(layer, kv)` puts the main device's KV of each of
        this stage's layers into its own (returning the bytes moved); one copy event for all."""
        t0 = time.perf_counter_ns()
        nbytes = 0
        for i, kv in zip(range(self.first, self.end), self.kvs):
            nbytes += fill(i, kv)
        self.sync()
        if ctx.events_on:
            self.event(ctx, -1, "copy", t0, time.perf_counter_ns(), nbytes=nbytes,
                       note=f"kv layers {self.first}-{self.end - 1} from {source}")
