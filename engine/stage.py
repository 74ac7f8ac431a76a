"""A stage of the split and its worker thread (the pipeline's order: see engine/pipeline.py).

A `Stage` owns a contiguous layer range on one device, the KV of those layers, ONE set of chunk
buffers and, after the first stage, one worker thread kept from run to run.  Everything a stage
needs of the run it computes for (run id, event sink, hooks, the NaN check, depth, the CUDA
graph sizes, the prompt, the last stage's output) arrives in a `StageContext`, passed with
every chunk: a stage holds no reference to its session or run.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from . import models, nvtx
from .errors import Cancelled, NonFiniteError, StageError
from .events import StageEvent
from .experts import ExpertCache
from .gpu_timing import DeferredTimer, DeviceClock, GpuInterval, timing_event
from .kv import LayerKV
from .model import Head, Layer
from .stage_graphs import StageGraphs

log = logging.getLogger(__name__)

IDLE_MIN_NS = 20_000  # a GPU's idle gaps between chunks shorter than this are not reported as waits

# allocate(what, device, nbytes, advice, make): through the fault hook, out-of-memory named
Allocate = Callable[[str, "torch.device | str", int, str, Callable], object]


@dataclass
class PipelineHooks:
    """Test and fault-injection seams.  after_layer(stage, layer, chunk) runs after each layer;
    before_alloc(what, device, nbytes) runs before each large allocation (raise MemoryError to
    simulate an out-of-memory on a machine without that device)."""

    after_layer: Callable[[int, int, int], None] | None = None
    before_alloc: Callable[[str, str, int], None] | None = None


# finish_chunk(last stage, its output, chunk, pos, n, head or None for the stage's own)
FinishChunk = Callable[["Stage", torch.Tensor, int, int, int, "Head | None"], None]


@dataclass(frozen=True)
class StageContext:
    """What a stage needs of one run (built by `engine.run.Run`, passed with every chunk)."""

    run_id: str
    emit: Callable[[StageEvent], None]  # every event of the run
    note: Callable[[str], None]  # a line for the run's report notes
    timer: DeferredTimer  # resolves GPU timings off the hot path (the session's)
    clock: DeviceClock
    events_on: bool
    hooks: PipelineHooks
    check_nan: bool
    pipeline_depth: int  # 1 overlap, 0 join
    graph_sizes: frozenset[int] = frozenset()  # chunk sizes this run replays as CUDA graphs
    prompt_ids: torch.Tensor | None = None  # on the first stage's device
    finish_chunk: FinishChunk | None = None  # the last stage's output: norm, digest, logits


def _work(jobs: queue.SimpleQueue, busy: threading.Event) -> None:
    """A stage worker's loop; holds no reference to its stage, so an unclosed session is freed."""
    while True:
        job = jobs.get()
        if job is None:
            return
        fut, fn, args = job
        if not fut.set_running_or_notify_cancel():
            continue
        busy.set()
        error: BaseException | None = None
        result = None
        try:
            result = fn(*args)
        except BaseException as exc:
            error = exc
        busy.clear()  # before the reaper wakes: in_flight() is 0 once the future is done
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
        del job, fut, fn, args, error, result


class _Worker:
    """One stage's thread, kept from run to run: jobs in, futures out (stopped by `stop` or when
    the worker is garbage-collected)."""

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.busy = threading.Event()
        self.thread = threading.Thread(target=_work, args=(self.jobs, self.busy), name=name, daemon=True)
        self.thread.strata_busy = self.busy  # type: ignore[attr-defined]  # lets leak checks skip idle workers
        self.thread.start()
        self._finalizer = weakref.finalize(self, self.jobs.put, None)

    def submit(self, fn: Callable, *args) -> Future:
        fut: Future = Future()
        self.jobs.put((fut, fn, args))
        return fut

    def stop(self) -> None:
        self._finalizer()  # puts the stop marker once
        if self.thread is not threading.current_thread():
            self.thread.join()



class Stage:
    """A contiguous layer range on one device, its KV, ONE set of chunk buffers and (after the
    first stage) a worker thread.  What a run gives it comes in a `StageContext`."""

    def __init__(self, index: int, device: torch.device, first: int, end: int, dtype: torch.dtype) -> None:
        self.index = index
        self.device = device
        self.name = str(device)
        self.first, self.end = first, end
        self.dtype = dtype
        self.layers: list[Layer] = []
        self.kvs: list[LayerKV] = []
        self.head: Head | None = None
        self.successor: Stage | None = None
        self.pending: Future | None = None
        self.worker: _Worker | None = None  # runs this stage's chunks (stages after the first)
        self.input_buf: torch.Tensor | None = None  # this stage's ONE chunk input buffer
        # CUDA: the stream all of this stage's compute runs on (every thread's default stream of
        # the device), a stream for hand-offs to the next GPU, and the end of the last compute
        self.stream = torch.cuda.default_stream(device) if device.type == "cuda" else None
        self.copy_stream: torch.cuda.Stream | None = None
        self.done: torch.cuda.Event | None = None
        self.prev_end: torch.cuda.Event | None = None  # for the idle gap before the next compute
        self.host_buf: torch.Tensor | None = None  # pinned staging for a host hand-off to the successor
        self.handoff = "none"
        self.cache: ExpertCache | None = None  # streamed experts of this stage's device
        # CUDA graphs per (first layer, layer count, chunk size): engine/stage_graphs.py
        self.graphs = StageGraphs(device, self.name, note=log.info)
        # NVTX ranges name the stage as the Gantt does (the Session relabels interleaved groups)
        self.label = nvtx.stage_label(index, device, first, end)

    # ------------------------------------------------------------------ helpers
    def event(self, ctx: StageContext, chunk: int, kind: str, start: int, end: int, tokens: int = 0,
              nbytes: int = 0, note: str = "") -> None:
        ctx.emit(StageEvent(ctx.run_id, self.index, self.name, chunk, kind, start, end, tokens, nbytes, note))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _gpu_event(self, ctx: StageContext, chunk: int, kind: str, start: torch.cuda.Event,
                   end: torch.cuda.Event, end_device: torch.device | None = None, tokens: int = 0,
                   nbytes: int = 0, note: str = "", min_ns: int = 0) -> None:
        """An event timed by CUDA events, delivered once the GPU has passed `end` (never blocks)."""
        emit, run_id, index, name = ctx.emit, ctx.run_id, self.index, self.name

        def deliver(t0: int, t1: int) -> None:
            emit(StageEvent(run_id, index, name, chunk, kind, t0, t1, tokens, nbytes, note))

        ctx.timer.submit(GpuInterval(self.device, start, end_device or self.device, end, deliver, min_ns))

    def compute(self, ctx: StageContext, x: torch.Tensor, layers: Sequence[Layer], kvs: Sequence[LayerKV],
                pos: int, chunk: int, tokens: int, note: str = "") -> torch.Tensor:
        """Run layers on x, timed on the device clock, with the NaN check and test hook.

        On CUDA this launches the work and returns; `self.done` marks its end on the stream."""
        timed = ctx.events_on
        if self.cache is not None:
            self.cache.chunk = chunk
        if self.device.type == "cuda":
            ev0 = timing_event(self.device) if timed else None
            with nvtx.span(self.device, f"{self.label} C{chunk} compute" + (f" {note}" if note else "")):
                x = self.forward_layers(ctx, x, layers, kvs, pos, chunk)
            self.done = ev1 = timing_event(self.device)
            if timed:
                self._gpu_event(ctx, chunk, "compute", ev0, ev1, tokens=tokens, note=note)
                if self.prev_end is not None:  # the device idled between this stage's chunks
                    self._gpu_event(ctx, chunk, "wait", self.prev_end, ev0, note="idle", min_ns=IDLE_MIN_NS)
                self.prev_end = ev1
        else:
            t0 = time.perf_counter_ns()
            x = self.forward_layers(ctx, x, layers, kvs, pos, chunk)
            if timed:
                self.event(ctx, chunk, "compute", t0, time.perf_counter_ns(), tokens=tokens, note=note)
        self.emit_streams(ctx)
        return x

    def throttle(self, prev: torch.cuda.Event | None) -> None:
        """Wait (off the GPU's critical path: the next chunk is already queued behind it) until
        the chunk before last has finished: at most two chunks queued on a device."""
        if prev is not None:
            prev.synchronize()

    def forward_layers(self, ctx: StageContext, x: torch.Tensor, layers: Sequence[Layer],
                       kvs: Sequence[LayerKV], pos: int, chunk: int) -> torch.Tensor:
        """The layers in order (replaying their CUDA graphs where captured), with the NaN check,
        the test hook and errors that name stage, layer and chunk."""
        hook = ctx.hooks.after_layer
        graphed, capture = self.graphs.lookup(x, layers)  # sizes: Run planned them (graphs.plan)
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
            self.graphs.after_eager(layers, x, ctx.note)
        return x

    @property
    def graph_sets(self) -> dict:
        """The captured graph sets by (first layer, layer count, chunk size)."""
        return self.graphs.sets

    def drop_graphs(self, keep: set[int] | None = None) -> None:
        """Free the graph sets of chunk sizes not in `keep` (all when None)."""
        self.graphs.drop(keep)

    def emit_streams(self, ctx: StageContext) -> None:
        """Stream events for the expert copies that have finished (timed on the copy stream)."""
        if self.cache is None:
            return
        for layer, chunk, t0, t1, pinned, pageable in self.cache.drain_timings(ctx.clock):
            if ctx.events_on:
                self.event(ctx, chunk, "stream", t0, t1, nbytes=pinned + pageable,
                            note=f"layer {layer}: {pinned / 2**20:.1f} MiB pinned, {pageable / 2**20:.1f} MiB pageable")

    # ----------------------------------------------------------------- buffers
    def prepare(self, capacity: int, chunk: int, n_kv_heads: int, head_dim: int, hidden: int,
                alloc: Allocate) -> None:
        """KV for `capacity` tokens (reset), the chunk input buffer and the pinned hand-off
        buffer for `chunk` tokens: grown when too small, kept from run to run otherwise."""
        dt = self.dtype
        esize = torch.empty((), dtype=dt).element_size()
        if not self.kvs or self.kvs[0].capacity < capacity:
            self.kvs = []  # free before allocating the larger cache
            spec = self.layers[0].spec if self.layers else None  # each layer's state, as its family makes it
            idx = [layer.index for layer in self.layers]
            self.kvs = alloc(
                f"KV for layers {self.first}-{self.end - 1} ({capacity} tokens)", self.device,
                models.states_bytes(spec, idx, capacity, dt),
                "shorten the prompt or decode, or move layers to another device (--layer-split)",
                lambda: models.new_states(spec, idx, capacity, self.device, dt))
        for kv in self.kvs:
            kv.reset()
        buf_bytes = chunk * hidden * esize
        if self.index > 0 and (self.input_buf is None or self.input_buf.shape[0] < chunk):
            self.input_buf = alloc(
                f"the chunk input buffer ({chunk} tokens)", self.device, buf_bytes, "lower the chunk size (--prefill)",
                lambda: torch.empty(chunk, hidden, device=self.device, dtype=dt))
        if self.handoff == "host" and (self.host_buf is None or self.host_buf.shape[0] < chunk):
            self.host_buf = alloc(
                f"the pinned hand-off buffer ({chunk} tokens)", "host", buf_bytes, "lower the chunk size (--prefill)",
                lambda: torch.empty(chunk, hidden, dtype=dt, pin_memory=torch.cuda.is_available()))

    def free_buffers(self) -> None:
        """Drop the per-run buffers and graphs (after a failed run)."""
        self.kvs, self.input_buf, self.host_buf = [], None, None
        self.drop_graphs()

    # --------------------------------------------------------------- the pipeline
    def on_stream(self):
        """The stage's stream as the current one (stage 0 runs in the caller's thread, which may
        have made another stream current): every event and hand-off assumes it."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def run(self, ctx: StageContext, chunk: int, pos: int, n: int) -> None:
        """Compute this stage's layers for one chunk, then hand it on (see engine/pipeline.py)."""
        try:
            with torch.inference_mode(), self.on_stream():
                self._run(ctx, chunk, pos, n)
        except (StageError, Cancelled):
            raise
        except Exception as exc:
            raise StageError(self.index, self.name, chunk, None, exc) from exc

    def _run(self, ctx: StageContext, chunk: int, pos: int, n: int) -> None:
        prev = self.done
        if self.index == 0:
            x = self.head.embed_tokens(ctx.prompt_ids[pos:pos + n])
        else:
            x = self.input_buf[:n]
        x = self.compute(ctx, x, self.layers, self.kvs, pos, chunk, n)
        if self.successor is None:
            ctx.finish_chunk(self, x, chunk, pos, n, None)
            if ctx.pipeline_depth == 0:
                self.throttle(self.done)  # join: the chain returns once the last GPU finished the chunk
            else:
                self.throttle(prev)
            return
        self.reap(ctx, chunk)
        self.hand_off(ctx, x, chunk, n)
        self.pending = self.successor.worker.submit(self.successor.run, ctx, chunk, pos, n)
        if ctx.pipeline_depth == 0:
            self.reap(ctx, chunk, note="join")
        else:
            self.throttle(prev)

    def reap(self, ctx: StageContext | None, chunk: int, note: str = "reap") -> None:
        """Wait for the one outstanding successor job; its exception surfaces here."""
        fut, self.pending = self.pending, None
        if fut is None:
            return
        t0 = time.perf_counter_ns()
        try:
            fut.result()
        finally:
            t1 = time.perf_counter_ns()
            # a GPU stage's thread waits while its device still works: its waits are the idle
            # gaps between computes, timed on the device (see `compute`)
            if ctx is not None and ctx.events_on and t1 - t0 > 0 and self.device.type != "cuda":
                self.event(ctx, chunk, "wait", t0, t1, note=note)

    def hand_off(self, ctx: StageContext, x: torch.Tensor, chunk: int, n: int) -> None:
        """Copy activations into the successor's input buffer (peer, host-staged or same device)."""
        succ = self.successor
        dst = succ.input_buf[:n]
        nbytes = x.numel() * x.element_size()
        timed = ctx.events_on
        if self.device.type == "cuda" and succ.device.type == "cuda":
            with nvtx.span(self.device, f"{self.label} C{chunk} copy {self.handoff}"):
                if self.device == succ.device:  # one GPU: both stages' work is ordered on its stream
                    start = timing_event(self.device) if timed else None
                    dst.copy_(x)
                    end, end_device = (timing_event(self.device) if timed else None), self.device
                else:
                    start, end, end_device = self._copy_between_gpus(x, dst, n)
            if timed:
                self._gpu_event(ctx, chunk, "copy", start, end, end_device=end_device, tokens=n, nbytes=nbytes,
                                note=self.handoff)
            return
        t0 = time.perf_counter_ns()  # a CPU on either side: synchronous copies, timed on the host
        with nvtx.span(x.device, f"{self.label} C{chunk} copy {self.handoff}"):
            if self.handoff == "host" and self.host_buf is not None and x.device.type == "cuda":
                staged = self.host_buf[:n]
                staged.copy_(x)  # D2H into pinned memory (synchronous)
                dst.copy_(staged)
            else:
                dst.copy_(x)
        if timed:
            self.event(ctx, chunk, "copy", t0, time.perf_counter_ns(), tokens=n, nbytes=nbytes, note=self.handoff)

    def _copy_between_gpus(self, x: torch.Tensor, dst: torch.Tensor, n: int) -> tuple:
        """Queue the copy of x into the successor's input buffer, ordered by events alone:

        * it starts once this stage's compute of x ended (`self.done`) and once the successor's
          stream has run everything queued so far: its run of the previous chunk (reaped before
          this hand-off), the last reader of the ONE input buffer;
        * the successor's stream waits for the copy before it computes this chunk;
        * this stage's stream waits for the copy to have read x before the next chunk may
          overwrite it (graph replays reuse their output memory).

        Peer copies run on this stage's copy stream; a host hand-off stages through pinned memory
        (device-to-host on the copy stream, host-to-device on the successor's stream)."""
        succ = self.successor
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(self.device)
        cs = self.copy_stream
        cs.wait_event(self.done)
        free = torch.cuda.Event()
        free.record(succ.stream)
        cs.wait_event(free)
        start = timing_event(self.device, cs)
        if self.handoff == "host":
            staged = self.host_buf[:n]
            with torch.cuda.stream(cs):
                staged.copy_(x, non_blocking=True)
            on_host = torch.cuda.Event()
            on_host.record(cs)
            succ.stream.wait_event(on_host)
            with torch.cuda.device(succ.device):  # the successor's (current, default) stream
                dst.copy_(staged, non_blocking=True)
            end, end_device = timing_event(succ.device, succ.stream), succ.device
            read = on_host
        else:
            with torch.cuda.stream(cs):
                dst.copy_(x, non_blocking=True)  # torch makes the successor's current stream wait for it
            end, end_device = timing_event(self.device, cs), self.device
            read = end
        self.stream.wait_event(read)  # x has been read
        return start, end, end_device

    def finish(self, ctx: StageContext | None = None) -> None:
        """Join this stage's outstanding successor job (and, through it, the chain below)."""
        self.reap(ctx, -1, note="finish")
