"""A stage of the threaded executor: the stage runtime, a worker thread and its hand-offs.

A `Stage` is an `engine.pipeline.stage_runtime.StageRuntime` (its layers, KV, ONE chunk input buffer,
graphs, and what it computes) plus the threaded transport and control: after the first stage,
one worker thread kept from run to run; the hand-off into its successor's input buffer (a copy
on one device or through the host, a peer copy ordered by CUDA events between GPUs); the reap
of its one outstanding successor job (the pipeline's order: see engine/pipeline/session.py).
Everything a stage needs of the run arrives in a `StageContext`, passed with every chunk.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future

import torch

from engine.errors import Cancelled, StageError
from engine.hw import nvtx
from engine.hw.gpu_timing import timing_event
from engine.pipeline.stage_runtime import (  # noqa: F401  (the stage's public names, kept at their import path)
    CHUNK_ADVICE,
    IDLE_MIN_NS,
    Allocate,
    PipelineHooks,
    StageContext,
    StageRuntime,
)


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



class Stage(StageRuntime):
    """A stage runtime with the threaded transport: a worker thread (stages after the first), the
    hand-off to its successor and the reap of its one outstanding successor job."""

    def __init__(self, index: int, device: torch.device, first: int, end: int, dtype: torch.dtype) -> None:
        super().__init__(index, device, first, end, dtype)
        self.successor: Stage | None = None
        self.pending: Future | None = None
        self.worker: _Worker | None = None  # runs this stage's chunks (stages after the first)
        # CUDA: the stream all of this stage's compute runs on (every thread's default stream of
        # the device) and a stream for hand-offs to the next GPU
        self.stream = torch.cuda.default_stream(device) if device.type == "cuda" else None
        self.copy_stream: torch.cuda.Stream | None = None
        self.host_buf: torch.Tensor | None = None  # pinned staging for a host hand-off to the successor
        self.handoff = "none"

    @property
    def last(self) -> bool:  # type: ignore[override]
        return self.successor is None

    def throttle(self, prev: torch.cuda.Event | None) -> None:
        """Wait (off the GPU's critical path: the next chunk is already queued behind it) until
        the chunk before last has finished: at most two chunks queued on a device."""
        if prev is not None:
            prev.synchronize()

    # ----------------------------------------------------------------- buffers
    def prepare(self, capacity: int, chunk: int, n_kv_heads: int, head_dim: int, hidden: int,
                alloc: Allocate) -> None:
        """KV for `capacity` tokens (reset), the chunk input buffer and the pinned hand-off
        buffer for `chunk` tokens: grown when too small, kept from run to run otherwise."""
        self.prepare_kv(capacity, n_kv_heads, head_dim, alloc)
        self.prepare_input(chunk, hidden, alloc)
        if self.handoff == "host" and (self.host_buf is None or self.host_buf.shape[0] < chunk):
            buf_bytes = chunk * hidden * torch.empty((), dtype=self.dtype).element_size()
            self.host_buf = alloc(
                f"the pinned hand-off buffer ({chunk} tokens)", "host", buf_bytes, CHUNK_ADVICE,
                lambda: torch.empty(chunk, hidden, dtype=self.dtype, pin_memory=torch.cuda.is_available()))

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
        """Compute this stage's layers for one chunk, then hand it on (see engine/pipeline/session.py)."""
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
            self.finish_chunk(ctx, x, pos, n)
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
                self.gpu_event(ctx, chunk, "copy", start, end, end_device=end_device, tokens=n, nbytes=nbytes,
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
