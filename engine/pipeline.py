"""The layer-split prefill pipeline (seeds 000/001/002/004).

A `Stage` owns a contiguous layer range on one device, the KV of those layers, ONE set of chunk
buffers and one worker thread.  `Stage.run(chunk)` computes its layers, reaps its previous
successor job (one outstanding job per successor), hands the activations over and submits
`successor.run(chunk)`.  With depth 1 ("overlap") it returns right away; with depth 0 ("join")
it returns only after the successor's run for the same chunk returned.  The outermost prefill
never returns with chunks in flight: a guard calls `finish()` on every path.

Stage 0 runs in the caller's thread (the root `prefill`), every later stage in its own worker.

On CUDA a stage's `run` launches its work and does not wait for the GPU: the hand-off to the
next GPU is ordered by CUDA events between streams (`Stage.hand_off`), GPU timings are resolved
by a helper thread (`gpu_timing`), and a stage keeps at most two chunks queued on its device
(`Stage.throttle`), so a cancel or an error still surfaces within a chunk.  Join (depth 0)
keeps its meaning: the last stage's run returns only once its GPU finished computing the chunk.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import queue
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from . import chunking, nonfinite, planner
from .attention import kernel_for
from .chunk_cost import ChunkCostProbe
from .config import ConfigError, EngineConfig
from .events import (EventSink, RunPlan, RunReport, StageEvent, StagePlan, busy_histogram, by_device, format_timing,
                     handoff_cost, stage_totals)
from .gpu_timing import DeferredTimer, DeviceClock, GpuInterval, timing_event
from .graphs import CAPTURE_LOCK, GraphedLayers
from .experts import (ExpertCache, ExpertLayout, ExpertStats, HostArena, arena_bytes, physical_ram, plan_experts,
                      resolve_pin_limit)
from .kv import LayerKV
from .model import Head, Layer, Rope, WeightSource, load_head, load_layer_weights, resolve_dtype

if TYPE_CHECKING:
    from .topology import TelemetrySampler

log = logging.getLogger(__name__)


class Cancelled(Exception):
    """The run was stopped at a chunk boundary; the split was drained."""


class StageError(RuntimeError):
    """An exception inside a stage, with where it happened."""

    def __init__(self, stage: int, device: str, chunk: int, layer: int | None, cause: BaseException) -> None:
        self.stage, self.device, self.chunk, self.layer = stage, device, chunk, layer
        where = f"stage {stage} ({device}), chunk {chunk}" + (f", layer {layer}" if layer is not None else "")
        super().__init__(f"{where}: {type(cause).__name__}: {cause}")
        self.__cause__ = cause


class NonFiniteError(RuntimeError):
    pass


class DeviceMemoryError(RuntimeError):
    """A device ran out of memory; the message names the device, what was being allocated and
    what to change."""

    def __init__(self, device: str, what: str, nbytes: int, advice: str) -> None:
        self.device, self.what, self.nbytes, self.advice = device, what, nbytes, advice
        super().__init__(f"out of memory on {device} allocating {what} ({nbytes / 2**30:.2f} GiB): {advice}")


@dataclass
class PipelineHooks:
    """Test and fault-injection seams.  after_layer(stage, layer, chunk) runs after each layer;
    before_alloc(what, device, nbytes) runs before each large allocation (raise MemoryError to
    simulate an out-of-memory on a machine without that device)."""

    after_layer: Callable[[int, int, int], None] | None = None
    before_alloc: Callable[[str, str, int], None] | None = None


@dataclass
class RunResult:
    report: RunReport
    logits: torch.Tensor | None  # [prompt_tokens, vocab] float32 on CPU when asked for
    last_logits: torch.Tensor  # [vocab] float32 on CPU


def split_layers(n_layers: int, n_stages: int, split: str | list[int]) -> list[tuple[int, int]]:
    """Layer ranges per stage: explicit counts, or balanced (all blocks cost the same; the
    remainder goes to the earliest stages, the last stage also carries the LM head)."""
    if isinstance(split, list):
        counts = split
    else:
        base, extra = divmod(n_layers, n_stages)
        counts = [base + (1 if i < extra else 0) for i in range(n_stages)]
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


class _Digest:
    """md5 of the final normed hidden state bytes (in the compute dtype), in chunk order.

    On CUDA the bytes leave the GPU on a side stream into pinned memory and are hashed by a
    helper thread, so hashing never stalls the last stage (it cost 64% of a chunk inline)."""

    def __init__(self, streams: "dict[torch.device, torch.cuda.Stream]") -> None:
        self.md5 = hashlib.md5()
        self.pool: ThreadPoolExecutor | None = None
        self.streams = streams  # the session's: one side stream per device for its whole life
        self.pending: list[Future] = []

    def add(self, x: torch.Tensor) -> None:
        if x.device.type != "cuda":
            self.md5.update(x.detach().contiguous().view(torch.uint8).numpy())
            return
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-digest")
        stream = self.streams.get(x.device)
        if stream is None:
            stream = self.streams[x.device] = torch.cuda.Stream(x.device)
        ready = torch.cuda.Event()
        with torch.cuda.device(x.device):
            ready.record()
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            host.copy_(x, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        x.record_stream(stream)
        self.pending.append(self.pool.submit(self._hash, host, done))

    def _hash(self, host: torch.Tensor, done: "torch.cuda.Event") -> None:
        done.synchronize()
        self.md5.update(host.view(torch.uint8).numpy())

    def hexdigest(self) -> str:
        self.close()
        return self.md5.hexdigest()

    def close(self) -> None:
        for f in self.pending:
            f.result()
        self.pending = []
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


def _work(jobs: "queue.SimpleQueue", busy: threading.Event) -> None:
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


_MEASURED: dict[tuple, tuple[dict[int, float], float, float]] = {}  # see Session.chunk_cost
MAX_GRAPHED_SIZES = 6  # chunk sizes of one run captured as CUDA graphs at most (graph memory per size)
BALANCED_GRAIN_CUDA = 512  # balanced chunk sizes on CUDA: multiples of this, so few distinct sizes (graphs)
IDLE_MIN_NS = 20_000  # a GPU's idle gaps between chunks shorter than this are not reported as waits
_MEASURED_LOCK = threading.Lock()


class Stage:
    def __init__(self, session: "Session", index: int, device: torch.device, first: int, end: int) -> None:
        self.session = session
        self.index = index
        self.device = device
        self.name = str(device)
        self.first, self.end = first, end
        self.layers: list[Layer] = []
        self.kvs: list[LayerKV] = []
        self.head: Head | None = None
        self.successor: "Stage | None" = None
        self.pending: Future | None = None
        self.worker: _Worker | None = None  # runs this stage's chunks (stages after the first)
        self.input_buf: torch.Tensor | None = None  # this stage's ONE chunk input buffer
        # CUDA: the stream all of this stage's compute runs on (every thread's default stream of
        # the device), a stream for hand-offs to the next GPU, and the end of the last compute
        self.stream = torch.cuda.default_stream(device) if device.type == "cuda" else None
        self.copy_stream: "torch.cuda.Stream | None" = None
        self.done: "torch.cuda.Event | None" = None
        self._prev_end: "torch.cuda.Event | None" = None  # for the idle gap before the next compute
        self.host_buf: torch.Tensor | None = None  # pinned staging for a host hand-off to the successor
        self.handoff = "none"
        self.cache: ExpertCache | None = None  # streamed experts of this stage's device
        # CUDA graphs per (first layer, layer count, chunk size): see engine/graphs.py
        self.graph_sets: dict[tuple[int, int, int], GraphedLayers] = {}
        self.graph_failed: set[tuple[int, int, int]] = set()

    # ------------------------------------------------------------------ helpers
    def _event(self, chunk: int, kind: str, start: int, end: int, tokens: int = 0, nbytes: int = 0,
               note: str = "") -> None:
        self.session._emit(StageEvent(self.session.run_id, self.index, self.name, chunk, kind,
                                      start, end, tokens, nbytes, note))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _gpu_event(self, chunk: int, kind: str, start: "torch.cuda.Event", end: "torch.cuda.Event",
                   end_device: torch.device | None = None, tokens: int = 0, nbytes: int = 0, note: str = "",
                   min_ns: int = 0) -> None:
        """An event timed by CUDA events, delivered once the GPU has passed `end` (never blocks)."""
        s = self.session
        run_id, index, name = s.run_id, self.index, self.name

        def deliver(t0: int, t1: int) -> None:
            s._emit(StageEvent(run_id, index, name, chunk, kind, t0, t1, tokens, nbytes, note))

        s.timer.submit(GpuInterval(self.device, start, end_device or self.device, end, deliver, min_ns))

    def compute(self, x: torch.Tensor, layers: Sequence[Layer], kvs: Sequence[LayerKV], pos: int,
                chunk: int, tokens: int, note: str = "") -> torch.Tensor:
        """Run layers on x, timed on the device clock, with the NaN check and test hook.

        On CUDA this launches the work and returns; `self.done` marks its end on the stream."""
        s = self.session
        timed = s.events_on
        if self.cache is not None:
            self.cache.chunk = chunk
        if self.device.type == "cuda":
            ev0 = timing_event(self.device) if timed else None
            x = self.forward_layers(x, layers, kvs, pos, chunk)
            self.done = ev1 = timing_event(self.device)
            if timed:
                self._gpu_event(chunk, "compute", ev0, ev1, tokens=tokens, note=note)
                if self._prev_end is not None:  # the device idled between this stage's chunks
                    self._gpu_event(chunk, "wait", self._prev_end, ev0, note="idle", min_ns=IDLE_MIN_NS)
                self._prev_end = ev1
        else:
            t0 = time.perf_counter_ns()
            x = self.forward_layers(x, layers, kvs, pos, chunk)
            if timed:
                self._event(chunk, "compute", t0, time.perf_counter_ns(), tokens=tokens, note=note)
        self.emit_streams()
        return x

    def throttle(self, prev: "torch.cuda.Event | None") -> None:
        """Wait (off the GPU's critical path: the next chunk is already queued behind it) until
        the chunk before last has finished: at most two chunks queued on a device."""
        if prev is not None:
            prev.synchronize()

    def forward_layers(self, x: torch.Tensor, layers: Sequence[Layer], kvs: Sequence[LayerKV], pos: int,
                       chunk: int) -> torch.Tensor:
        """The layers in order (replaying their CUDA graphs where captured), with the NaN check,
        the test hook and errors that name stage, layer and chunk."""
        s = self.session
        hook = s.hooks.after_layer
        graphed, capture = self._graphs_for(x, layers)
        for i, (layer, kv) in enumerate(zip(layers, kvs)):
            try:
                x = graphed.forward(i, x, kv, pos) if graphed is not None else layer(x, kv, pos)
                if hook is not None:
                    hook(self.index, layer.index, chunk)
                if s.config.check_nan and not bool(torch.isfinite(x).all()):
                    raise NonFiniteError(f"non-finite value after layer {layer.index}")
            except StageError:
                raise
            except Exception as exc:
                raise StageError(self.index, self.name, chunk, layer.index, exc) from exc
        # graphability is known only after a first pass (each layer decides its expert GEMM
        # on its first call), so the warm-up run's eager pass is what captures
        if capture and all(layer.graphable(x) for layer in layers):
            self._capture(layers, x.shape[0], x.dtype)
        return x

    def _graphs_for(self, x: torch.Tensor, layers: Sequence[Layer]) -> tuple[GraphedLayers | None, bool]:
        """(the CUDA graphs of these layers at x's chunk size or None = eager, whether to capture
        them after this eager pass).  A size the run asks for is captured right after its first,
        eager, pass (which warms the kernels up), so a one-chunk prompt captures in its first run."""
        s = self.session
        n = x.shape[0]
        if self.device.type != "cuda" or not layers or n not in s.graph_sizes:
            return None, False
        key = (layers[0].index, len(layers), n)
        graphed = self.graph_sets.get(key)
        if graphed is not None or key in self.graph_failed:
            return graphed, False
        return None, True

    def _capture(self, layers: Sequence[Layer], n: int, dtype: torch.dtype) -> None:
        s = self.session
        key = (layers[0].index, len(layers), n)
        try:
            graphed = GraphedLayers(layers, n, self.device, dtype)
            graphed.capture()
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            self.graph_failed.add(key)
            msg = (f"CUDA graphs off for layers {layers[0].index}-{layers[-1].index} on {self.name} at "
                   f"chunk {n}: capture failed ({str(exc).splitlines()[0][:200]}); running eagerly")
            log.warning("%s", msg)
            s.notes.append(msg)
            with CAPTURE_LOCK:  # emptying the cache must not meet another thread's capture
                torch.cuda.empty_cache()
            return
        self.graph_sets[key] = graphed
        s.notes.append(f"CUDA graphs captured for layers {layers[0].index}-{layers[-1].index} on {self.name} "
                       f"at chunk {n}: {graphed.capture_s * 1e3:.0f} ms, "
                       f"{graphed.reserved_bytes / 2**20:.0f} MiB")

    def drop_graphs(self, keep: set[int] | None = None) -> None:
        """Free the graph sets of chunk sizes not in `keep` (all when None)."""
        for key in list(self.graph_sets):
            if keep is None or key[2] not in keep:
                self.graph_sets.pop(key).close()
        self.graph_failed = {k for k in self.graph_failed if keep is not None and k[2] in keep}

    def emit_streams(self) -> None:
        """Stream events for the expert copies that have finished (timed on the copy stream)."""
        if self.cache is None:
            return
        for layer, chunk, t0, t1, pinned, pageable in self.cache.drain_timings(self.session.clock):
            if self.session.events_on:
                self._event(chunk, "stream", t0, t1, nbytes=pinned + pageable,
                            note=f"layer {layer}: {pinned / 2**20:.1f} MiB pinned, {pageable / 2**20:.1f} MiB pageable")

    # --------------------------------------------------------------- the pipeline
    def on_stream(self):
        """The stage's stream as the current one (stage 0 runs in the caller's thread, which may
        have made another stream current): every event and hand-off assumes it."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def run(self, chunk: int, pos: int, n: int) -> None:
        """Compute this stage's layers for one chunk, then hand it on (see module doc)."""
        try:
            with torch.inference_mode(), self.on_stream():
                self._run(chunk, pos, n)
        except (StageError, Cancelled):
            raise
        except Exception as exc:
            raise StageError(self.index, self.name, chunk, None, exc) from exc

    def _run(self, chunk: int, pos: int, n: int) -> None:
        s = self.session
        prev = self.done
        if self.index == 0:
            x = self.head.embed_tokens(s.prompt_ids[pos:pos + n])
        else:
            x = self.input_buf[:n]
        x = self.compute(x, self.layers, self.kvs, pos, chunk, n)
        if self.successor is None:
            s._finish_chunk(self, x, chunk, pos, n)
            if s.config.pipeline_depth == 0:
                self.throttle(self.done)  # join: the chain returns once the last GPU finished the chunk
            else:
                self.throttle(prev)
            return
        self.reap(chunk)
        self.hand_off(x, chunk, n)
        self.pending = self.successor.worker.submit(self.successor.run, chunk, pos, n)
        if s.config.pipeline_depth == 0:
            self.reap(chunk, note="join")
        else:
            self.throttle(prev)

    def reap(self, chunk: int, note: str = "reap") -> None:
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
            if self.session.events_on and t1 - t0 > 0 and self.device.type != "cuda":
                self._event(chunk, "wait", t0, t1, note=note)

    def hand_off(self, x: torch.Tensor, chunk: int, n: int) -> None:
        """Copy activations into the successor's input buffer (peer, host-staged or same device)."""
        succ = self.successor
        dst = succ.input_buf[:n]
        nbytes = x.numel() * x.element_size()
        timed = self.session.events_on
        if self.device.type == "cuda" and succ.device.type == "cuda":
            if self.device == succ.device:  # one GPU: both stages' work is ordered on its stream
                start = timing_event(self.device) if timed else None
                dst.copy_(x)
                end, end_device = (timing_event(self.device) if timed else None), self.device
            else:
                start, end, end_device = self._copy_between_gpus(x, dst, n)
            if timed:
                self._gpu_event(chunk, "copy", start, end, end_device=end_device, tokens=n, nbytes=nbytes,
                                note=self.handoff)
            return
        t0 = time.perf_counter_ns()  # a CPU on either side: synchronous copies, timed on the host
        if self.handoff == "host" and self.host_buf is not None and x.device.type == "cuda":
            staged = self.host_buf[:n]
            staged.copy_(x)  # D2H into pinned memory (synchronous)
            dst.copy_(staged)
        else:
            dst.copy_(x)
        if timed:
            self._event(chunk, "copy", t0, time.perf_counter_ns(), tokens=n, nbytes=nbytes, note=self.handoff)

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

    def finish(self) -> None:
        """Join this stage's outstanding successor job (and, through it, the chain below)."""
        self.reap(-1, note="finish")


class Session:
    """A model split over devices, ready to prefill prompts and decode through the split."""

    def __new__(cls, source: WeightSource, config: EngineConfig | None = None, *args, **kwargs):
        """executor=processes: the stages run as processes (engine/executor.py), same API."""
        if cls is Session and config is not None and getattr(config, "executor", "threads") == "processes":
            from .executor import ProcessSession

            cls = ProcessSession
        return super().__new__(cls)

    def __init__(self, source: WeightSource, config: EngineConfig | None = None,
                 sink: EventSink | None = None, hooks: PipelineHooks | None = None,
                 events: bool = True,
                 progress: Callable[[str, float], None] | None = None,
                 telemetry_interval_s: float | None = 0.2,
                 cancel: threading.Event | None = None) -> None:
        self.source = source
        self.spec = source.spec
        self.config = config or EngineConfig()
        self.config.validate()
        self.config.check_layers(self.spec.n_layers)
        self.sink = sink
        self.hooks = hooks or PipelineHooks()
        self.events_on = events
        self._load_cancel = cancel  # checked between layers while weights load
        self.telemetry_interval_s = telemetry_interval_s
        self.clock = DeviceClock()
        self.timer = DeferredTimer(self.clock, lambda: _Worker("strata-timing"))
        self._digest_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.run_id = ""
        self.events: list[StageEvent] = []
        self._events_lock = threading.Lock()
        self.notes: list[str] = []
        self.setup_notes: list[str] = []
        self._progress = progress or (lambda what, frac: None)
        self._chunk_cost: chunking.ChunkCost | None = None
        self._hop_s: float | None = None  # hand-off seconds per token between the first two devices
        self.graph_sizes: set[int] = set()  # chunk sizes this run replays as CUDA graphs
        self.order_reason = ""
        self.device_order = self._order_devices(self.config.devices)
        self.devices = [torch.device(d) for d in self.device_order]
        self.config.check_machine(torch.cuda.device_count() if torch.cuda.is_available() else 0, physical_ram())
        self.dtypes = {d: resolve_dtype(d, self.config.dtype) for d in self.devices}
        # interleave:V: V layer groups per device, each group a stage; a chunk visits the
        # devices V times over (group j on device j mod D)
        self.interleave = self.config.interleave
        groups = len(self.devices) * self.interleave
        split = "auto" if self.interleave > 1 else self.config.layer_split
        ranges = split_layers(self.spec.n_layers, groups, split)
        stage_devices = [self.devices[j % len(self.devices)] for j in range(groups)]
        self.stages = [Stage(self, i, d, a, b) for i, (d, (a, b)) in enumerate(zip(stage_devices, ranges))]
        for a, b in zip(self.stages, self.stages[1:]):
            a.successor = b
        self.expert_layouts = [ExpertLayout.of(source, self.spec, i) for i in range(self.spec.n_layers)] \
            if self.spec.is_moe else []
        self.expert_plan = plan_experts(self.config.expert_cache, self.spec, self.stages, self.dtypes,
                                        max((lay.row_bytes for lay in self.expert_layouts), default=None))
        self.arena: HostArena | None = None
        self._main_extra: list[Layer] | None = None  # prefill-main: later layers on the main device
        self._main_head: Head | None = None
        try:
            self._load_weights()
        except BaseException:
            self.close()  # free whatever was loaded: a failed or cancelled load keeps nothing
            raise
        self._choose_handoffs()

    # ------------------------------------------------------------------- set-up
    def _order_devices(self, devices: list[str]) -> list[str]:
        cudas = [d for d in devices if d.startswith("cuda")]
        if self.config.gpu_order != "pcie" or len(cudas) < 2 or len(set(devices)) != len(devices):
            self.order_reason = "configured order" if self.config.gpu_order == "configured" else \
                "order kept (fewer than two distinct GPUs)"
            return list(devices)
        try:
            from . import topology

            res = topology.order_devices(list(devices), "pcie", topology.discover())
            self.order_reason = res.reason
            return list(res.devices)
        except Exception as exc:  # ordering must never break a run
            self.order_reason = f"configured order kept: PCIe probe failed ({exc})"
            log.warning(self.order_reason)
            return list(devices)

    def _build_arena(self) -> None:
        """Streamed experts: the host arena (pinned up to the limit) and a cache per stage."""
        cuda = any(d.type == "cuda" for d in self.devices)
        n_bytes = arena_bytes(self.expert_layouts, self.spec.n_experts)  # the experts as stored
        limit, note = resolve_pin_limit(self.config.pin_limit_gib, n_bytes, cuda)  # refuses before allocating
        self._progress("filling the host expert arena", 0.0)
        self.arena = HostArena(self.source, self.spec, range(self.spec.n_layers),
                               lambda frac: self._progress("filling the host expert arena", frac))
        self.arena.pin(limit, note)
        self.setup_notes.append(f"experts {self.expert_plan.reason}; arena {self.arena.nbytes / 2**30:.2f} GiB, "
                          f"{self.arena.pinned_bytes / 2**30:.2f} GiB page-locked ({self.arena.pin_note})")
        for st, n_slots in zip(self.stages, self.expert_plan.slots_per_stage):
            st.cache = self._alloc(f"an expert cache of {n_slots} slots", st.device,
                                   n_slots * self.arena.expert_bytes, "lower --expert-cache",
                                   lambda: ExpertCache(self.arena, st.device, n_slots, ExpertStats(st.index, st.name)))

    def _new_layer(self, i: int, st: "Stage", rope: Rope) -> Layer:
        streamed = self.arena is not None
        nbytes = self.spec.layer_params() * torch.empty((), dtype=self.dtypes[st.device]).element_size()
        w = self._alloc(f"the weights of layer {i}", st.device, nbytes,
                        "move layers to another device (--layer-split) or stream experts (--expert-cache GiB)",
                        lambda: load_layer_weights(self.source, i, st.device, self.dtypes[st.device],
                                                   experts=not streamed))
        layer = Layer(self.spec, i, w, rope, cache=st.cache if streamed else None)
        return layer

    def _load_weights(self) -> None:
        n = self.spec.n_layers
        ropes: dict[torch.device, Rope] = {}
        done = 0
        if self.expert_plan.streamed:
            self._build_arena()
        for st in self.stages:
            dt = self.dtypes[st.device]
            rope = ropes.setdefault(st.device, Rope(self.spec.head_dim, self.spec.rope_base,
                                                    self.spec.rope_style, st.device))
            for i in range(st.first, st.end):
                if self._load_cancel is not None and self._load_cancel.is_set():
                    raise Cancelled(f"loading cancelled before layer {i}")
                st.layers.append(self._new_layer(i, st, rope))
                done += 1
                self._progress(f"loading layer {i} to {st.name}", done / n)
            st.head = load_head(self.source, st.device, dt, embed=st.index == 0,
                                final=st.successor is None)
            for a, b in zip(st.layers, st.layers[1:]):
                a.prefetch_next = b.index

    def _choose_handoffs(self) -> None:
        want = self.config.handoff
        for a in self.stages[:-1]:
            b = a.successor
            if a.device == b.device:
                a.handoff = "same-device"
            elif a.device.type == "cuda" and b.device.type == "cuda":
                peer = torch.cuda.can_device_access_peer(a.device.index or 0, b.device.index or 0)
                if want == "peer" and not peer:
                    raise ConfigError("handoff", "peer", "auto or host",
                                      f"{a.name} cannot access {b.name} peer-to-peer")
                a.handoff = "peer" if (peer and want != "host") else "host"
            else:
                a.handoff = "host"

    @property
    def handoff_kind(self) -> str:
        kinds = [s.handoff for s in self.stages[:-1]]
        if not kinds:
            return "none (one stage)"
        return kinds[0] if len(set(kinds)) == 1 else ",".join(kinds)

    def stage_lanes(self) -> list[int]:
        """The device lane (position in the device order) of each stage: one lane per device,
        whatever the number of layer groups a device holds."""
        return [st.index % len(self.devices) for st in self.stages]

    def attention_kernels(self) -> str:
        """The attention kernel of each device of the split, e.g. "cuda:0 cuDNN prefix+diagonal split"."""
        s = self.spec
        return "; ".join(f"{d}: {kernel_for(d, s.n_heads, s.n_kv_heads, s.head_dim, self.dtypes[d]).describe()}"
                         for d in dict.fromkeys(st.device for st in self.stages))

    def _emit(self, ev: StageEvent) -> None:
        with self._events_lock:
            self.events.append(ev)
        if self.sink is not None:
            self.sink(ev)

    # ---------------------------------------------------------------- chunking
    def chunk_cost(self) -> chunking.ChunkCost:
        """Measure one layer on the main device: time per candidate chunk size at position 0,
        attention's extra time per (token x cached key), and host launch time per layer, the
        way a fixed-size chunk runs (CUDA graphs when `cuda_graphs` is on).

        Measured once per process for a (model shape, device kind, dtype, streaming): sessions of
        one benchmark or app then plan the same chunks, so their digests stay comparable."""
        if self._chunk_cost is None:
            st = self.stages[0]
            dev = torch.cuda.get_device_name(st.device) if st.device.type == "cuda" else "cpu"
            key = (repr(self.spec), dev, str(self.dtypes[st.device]), self.expert_plan.streamed,
                   self.config.cuda_graphs)
            with _MEASURED_LOCK:
                measured = _MEASURED.get(key)
                if measured is None:
                    measured = _MEASURED[key] = self._measure_layer()
            per_device: dict[int, int] = {}  # interleaved groups of a device all run on it
            for st, lane in zip(self.stages, self.stage_lanes()):
                per_device[lane] = per_device.get(lane, 0) + st.end - st.first
            depth = max(per_device.values())
            self._chunk_cost = chunking.ChunkCost(*measured, depth)
            log.info("chunk cost on %s: %s", st.name, self._chunk_cost)
        return self._chunk_cost

    def _measure_layer(self) -> tuple[dict[int, float], float, float]:
        st = self.stages[0]
        cuda = st.device.type == "cuda"
        sizes = chunking.GPU_CANDIDATES if cuda else chunking.CPU_CANDIDATES[2:6]
        probe = ChunkCostProbe(st.layers[0], st.device, self.dtypes[st.device],
                               graphs=cuda and self.config.cuda_graphs, reps=2 if cuda else 4)
        return probe.measure(sizes, prefix=8192 if cuda else 256, probe=2048 if cuda else 64).astuple()

    def choose_chunk(self, n_tokens: int) -> tuple[int, str]:
        c = self.choice(n_tokens)
        return c.chunk, c.reason

    def choice(self, n_tokens: int) -> chunking.Choice:
        """Chunk size and schedule from the prefill and chunk_schedule settings, with the
        modelled prefill time (auto: the option the model of `chunking` rates fastest)."""
        c, kind = self.config.chunk_tokens, self.config.chunk_schedule
        main_only = self.config.prefill_main
        n_dev = 1 if main_only else len(self.devices)
        v = 1 if main_only else self.interleave
        cuda = self.devices[0].type == "cuda"
        grain = BALANCED_GRAIN_CUDA if cuda else chunking.GRAIN
        hop = self.hop_s_per_token() if n_dev > 1 and (not isinstance(c, int) or kind != "fixed") else 0.0
        if isinstance(c, int):
            if kind in ("balanced", "auto") and c < n_tokens:
                cost = self.chunk_cost()
                if kind == "auto":  # a user's chunk size with schedule auto: the cheaper of the two
                    fixed = chunking.bounds_makespan(chunking.chunk_bounds(n_tokens, c), n_dev, cost, v, hop)
                    bal = chunking.bounds_makespan(chunking.schedule(n_tokens, c, "balanced", cost, grain,
                                                                     self._balanced_floor(c)), n_dev, cost, v, hop)
                    if fixed <= bal:
                        return chunking.Choice(c, "fixed", fixed, f"fixed {c} (schedule auto: balanced models "
                                                                  f"{bal * 1e3:.1f} ms, fixed {fixed * 1e3:.1f} ms)", v)
                bounds = chunking.schedule(n_tokens, c, "balanced", cost, grain, self._balanced_floor(c))
                est = chunking.bounds_makespan(bounds, n_dev, cost, v, hop)
                return chunking.Choice(c, "balanced", est, f"balanced from {c}-token chunks: equal modelled cost each", v)
            # a fixed size needs no measurement: modelled only when the costs are known already
            known = self._chunk_cost
            est = chunking.bounds_makespan(chunking.chunk_bounds(n_tokens, c), n_dev, known, v, hop) if known else 0.0
            return chunking.Choice(c, "fixed", est, f"fixed {c}", v)
        cands = self.chunk_cost().sizes if cuda else chunking.CPU_CANDIDATES  # the sizes that fit
        alts: tuple[int, ...] = ()
        if n_dev > 1 and (self.config.layer_split == "auto" or v > 1):
            alts = tuple(k for k in (1, 2, 3, 4) if n_dev * k <= self.spec.n_layers)
        kinds = ("fixed", "balanced") if kind == "auto" else (kind,)
        return chunking.choose(n_tokens, n_dev, self.chunk_cost(), cands, kinds, v, hop, grain, alts)

    def _balanced_floor(self, chunk: int) -> int:
        """The smallest balanced chunk from a user's chunk size: the efficient size, but never
        above the size the user asked for (they asked for that many chunks)."""
        return min(chunking.efficient_floor(self.chunk_cost()), chunk)

    def choose_schedule(self, n_tokens: int) -> tuple[int, str, str]:
        """(chunk size, fixed|balanced, why) from the prefill and chunk_schedule settings."""
        c = self.choice(n_tokens)
        return c.chunk, c.kind, c.reason

    def hop_s_per_token(self) -> float:
        """Seconds per token of a chunk to hand activations from the first device to the
        second, measured once per session with a copy the size of a 1024-token chunk."""
        if self._hop_s is None:
            a, b = self.stages[0].device, self.stages[1].device
            dt = self.dtypes[a]
            n = 1024
            x = torch.randn(n, self.spec.hidden, dtype=torch.float32).to(a, dt)
            dst = torch.empty(n, self.spec.hidden, device=b, dtype=dt)
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
            self._hop_s = best / n
        return self._hop_s

    def plan(self, n_tokens: int, decode_tokens: int = 0) -> RunPlan:
        choice = self.choice(n_tokens)
        chunk, kind = choice.chunk, choice.kind
        if kind == "balanced":
            cost = self.chunk_cost()
            grain = BALANCED_GRAIN_CUDA if self.devices[0].type == "cuda" else chunking.GRAIN
            floor = self._balanced_floor(self.config.chunk_tokens) if isinstance(self.config.chunk_tokens, int) \
                else chunking.efficient_floor(cost)
            bounds = chunking.schedule(n_tokens, chunk, kind, cost, grain, floor)
            chunk = max(n for _, n in bounds)  # buffers are sized by the largest chunk
        else:
            bounds = chunking.chunk_bounds(n_tokens, chunk)
        return RunPlan(
            run_id=self.run_id or "",
            stages=tuple(StagePlan(s.index, s.name, s.first, s.end) for s in self.stages),
            prompt_tokens=n_tokens, chunk=chunk, n_chunks=len(bounds),
            decode_tokens=decode_tokens, handoff=self.handoff_kind, prefill_main=self.config.prefill_main,
            pipeline_depth=self.config.pipeline_depth, chunk_reason=choice.reason, schedule=kind, interleave=self.interleave,
            bounds=tuple(bounds) if kind == "balanced" else (), modelled_s=choice.modelled_s)

    # --------------------------------------------------------------- per-run state
    def _alloc(self, what: str, device: torch.device | str, nbytes: int, advice: str, make: Callable):
        """Allocate through the fault hook; an out-of-memory becomes a DeviceMemoryError."""
        try:
            if self.hooks.before_alloc is not None:
                self.hooks.before_alloc(what, str(device), nbytes)
            return make()
        except (torch.OutOfMemoryError, MemoryError) as exc:
            raise DeviceMemoryError(str(device), what, nbytes, advice) from exc

    def _prepare(self, capacity: int, chunk: int) -> None:
        s = self.spec
        for st in self.stages:
            dt = self.dtypes[st.device]
            esize = torch.empty((), dtype=dt).element_size()
            if not st.kvs or st.kvs[0].capacity < capacity:
                st.kvs = []  # free before allocating the larger cache
                kv_bytes = 2 * capacity * s.n_kv_heads * s.head_dim * esize * len(st.layers)
                st.kvs = self._alloc(
                    f"KV for layers {st.first}-{st.end - 1} ({capacity} tokens)", st.device, kv_bytes,
                    "shorten the prompt or decode, or move layers to another device (--layer-split)",
                    lambda: [LayerKV(capacity, s.n_kv_heads, s.head_dim, st.device, dt) for _ in st.layers])
            for kv in st.kvs:
                kv.reset()
            buf_bytes = chunk * s.hidden * esize
            if st.index > 0 and (st.input_buf is None or st.input_buf.shape[0] < chunk):
                st.input_buf = self._alloc(
                    f"the chunk input buffer ({chunk} tokens)", st.device, buf_bytes, "lower the chunk size (--prefill)",
                    lambda: torch.empty(chunk, s.hidden, device=st.device, dtype=dt))
            if st.handoff == "host" and (st.host_buf is None or st.host_buf.shape[0] < chunk):
                st.host_buf = self._alloc(
                    f"the pinned hand-off buffer ({chunk} tokens)", "host", buf_bytes, "lower the chunk size (--prefill)",
                    lambda: torch.empty(chunk, s.hidden, dtype=dt, pin_memory=torch.cuda.is_available()))

    def _free_run_state(self) -> None:
        """After a failed run: drop per-run buffers so device memory returns to its level."""
        for st in self.stages:
            st.kvs, st.input_buf, st.host_buf = [], None, None
            st.drop_graphs()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _prepare_main(self, capacity: int) -> tuple[list[Layer], list[LayerKV]]:
        """Prefill-main: every later layer also on the main device, with main-device KV."""
        main = self.stages[0]
        dt = self.dtypes[main.device]
        if self._main_extra is None:
            rope = main.layers[0].rope
            self._main_extra = [self._new_layer(i, main, rope) for i in range(main.end, self.spec.n_layers)]
            for a, b in zip(self._main_extra, self._main_extra[1:]):
                a.prefetch_next = b.index
            last = self.stages[-1]
            self._main_head = main.head if last is main else load_head(self.source, main.device, dt, True, True)
        s = self.spec
        kv_bytes = 2 * capacity * s.n_kv_heads * s.head_dim * torch.empty((), dtype=dt).element_size()
        kvs = self._alloc(f"prefill-main KV for layers {main.end}-{s.n_layers - 1}", main.device,
                          kv_bytes * len(self._main_extra),
                          "turn prefill-main off or shorten the prompt",
                          lambda: [LayerKV(capacity, s.n_kv_heads, s.head_dim, main.device, dt)
                                   for _ in self._main_extra])
        return main.layers + self._main_extra, main.kvs + kvs

    # -------------------------------------------------------------------- running
    def run(self, prompt_ids: Sequence[int] | torch.Tensor, decode_tokens: int = 0,
            cancel: threading.Event | None = None, logits_all: bool = False,
            on_plan: Callable[[RunPlan], None] | None = None,
            sampler: "TelemetrySampler | None" = None) -> RunResult:
        """Prefill the prompt through the split, then greedily decode `decode_tokens` tokens.

        generated[0] comes from the prompt's last logits; each further token is one decode
        step through the split.  `sampler`: a GPU telemetry sampler the caller also reads
        (the app's live plot), used instead of the session's own so the report keeps exactly
        the samples that were shown; the session starts it if needed and stops it at the end."""
        ids = torch.as_tensor(list(prompt_ids) if not isinstance(prompt_ids, torch.Tensor) else prompt_ids,
                              dtype=torch.long).flatten()
        n = int(ids.numel())
        if n == 0:
            raise ConfigError("prompt", "", "at least one token")
        if decode_tokens < 0:
            raise ConfigError("decode_tokens", decode_tokens, "an integer >= 0")
        if ids.min() < 0 or ids.max() >= self.spec.vocab:
            raise ConfigError("prompt", f"token id {int(ids.max() if ids.max() >= self.spec.vocab else ids.min())}",
                              f"ids in 0..{self.spec.vocab - 1} (the model's vocabulary)")
        self.timer.flush()  # a failed run's late GPU timings land before its events are dropped
        self.run_id = uuid.uuid4().hex[:12]
        with self._events_lock:
            self.events = []
        self.notes = list(self.setup_notes)
        for st in self.stages:
            if st.cache is not None:
                st.cache.reset_stats()
        plan = self.plan(n, decode_tokens)
        # graphs for the run's chunk sizes (the fixed size and the remainder; a balanced
        # schedule's few sizes, multiples of its grain: the largest MAX_GRAPHED_SIZES) and for
        # decode steps; other sizes' graphs are freed.  A warm-up run of the same plan captures them.
        sizes = {k for _, k in plan.chunk_bounds()}
        sizes = (sizes if len(sizes) <= MAX_GRAPHED_SIZES else set(sorted(sizes, reverse=True)[:MAX_GRAPHED_SIZES])) | {1}
        self.graph_sizes = sizes if self.config.cuda_graphs else set()
        for st in self.stages:
            st.drop_graphs(keep=self.graph_sizes)
        if on_plan is not None:
            on_plan(plan)
        capacity = n + max(decode_tokens, 1)
        self._run_t0_ns = time.perf_counter_ns()  # a caller's sampler may hold earlier runs' samples
        sampler, telemetry_status = self._start_telemetry(sampler)
        try:
            return self._run(ids, n, plan, capacity, decode_tokens, cancel, logits_all, sampler, telemetry_status)
        finally:
            if sampler is not None:
                sampler.stop()

    def _start_telemetry(self, given: "TelemetrySampler | None" = None):
        """A GPU sampler for the run's CUDA devices (started and stopped with the run): the
        caller's when given, else the session's own at `telemetry_interval_s`."""
        if given is not None:
            if not given.running:
                given.start()
            return (given, "sampled") if given.available else (None, given.reason)
        gpus = sorted({d.index or 0 for d in self.devices if d.type == "cuda"})
        if not self.telemetry_interval_s:
            return None, "off"
        if not gpus:
            return None, "unavailable: CPU stages only"
        try:
            from .topology import TelemetrySampler

            sampler = TelemetrySampler(gpus, interval_s=self.telemetry_interval_s)
        except Exception as exc:  # telemetry must never break a run
            return None, f"unavailable: {exc}"
        if not sampler.available:
            return None, sampler.reason
        sampler.start()
        return sampler, "sampled"

    def _run(self, ids, n, plan, capacity, decode_tokens, cancel, logits_all, sampler,
             telemetry_status) -> RunResult:
        try:
            return self._run_inner(ids, n, plan, capacity, decode_tokens, cancel, logits_all, sampler,
                                   telemetry_status)
        except Cancelled:
            raise
        except BaseException:
            try:
                digest = getattr(self, "_digest", None)
                if digest is not None:
                    digest.close()  # its hashing thread, when decode failed after prefill
                self.timer.flush()  # the failed run's GPU timings reach the sink before run() raises
            except BaseException as exc:  # secondary: the original error is what surfaces
                log.debug("cleaning up after a failed run: %s", exc)
            self._free_run_state()
            raise

    def _run_inner(self, ids, n, plan, capacity, decode_tokens, cancel, logits_all, sampler,
                   telemetry_status) -> RunResult:
        with torch.inference_mode():
            self._prepare(capacity, plan.chunk)
            for d in set(self.devices):
                self.clock.anchor(d)
            t0 = time.perf_counter()
            cancelled = False
            try:
                last_logits, all_logits, hashing = self.prefill(ids, plan.chunk_bounds(), cancel, logits_all)
            except Cancelled:
                cancelled = True
                last_logits, all_logits, hashing = None, None, None
            if not cancelled:  # one reduction per run; re-run with the per-layer check only when it fails
                nonfinite.check_prefill(self, ids, plan, cancel, last_logits, all_logits)
            t1 = time.perf_counter()
            generated: list[int] = []
            if not cancelled and decode_tokens > 0:
                try:
                    generated = self.decode(int(last_logits.argmax()), decode_tokens, n, cancel)
                except Cancelled:
                    cancelled = True
            t2 = time.perf_counter()
        # bookkeeping after the clock stopped: the digest's hashing thread finishes the last chunk
        # (the prompt's KV and logits were ready at t1), and every GPU timing is delivered
        digest = hashing.hexdigest() if hashing is not None else ""
        self.timer.flush()
        expert_stats = []
        for st in self.stages:
            if st.cache is not None:
                st.cache.synchronize()
                st.emit_streams()
                expert_stats.append(st.cache.stats.as_dict())
            elif self.spec.is_moe:
                expert_stats.append(ExpertStats(st.index, st.name, resident=True,
                                                slots=(st.end - st.first) * self.spec.n_experts).as_dict())
        samples = []
        if sampler is not None:
            sampler.stop()
            samples = [dataclasses.asdict(x) for x in sampler.samples(since_ns=self._run_t0_ns)]
        steps = max(len(generated) - 1, 0)
        events = list(self.events)
        prefill_events = [e for e in events if e.kind != "decode"]
        hops = 0 if self.config.prefill_main else len(self.stages) - 1
        cost = handoff_cost(prefill_events, t1 - t0, hops)
        report = RunReport(
            run_id=self.run_id, plan=plan,
            prefill_tok_s=n / (t1 - t0) if not cancelled else 0.0,
            decode_tok_s=steps / (t2 - t1) if steps and t2 > t1 else 0.0,
            prefill_s=t1 - t0, decode_s=t2 - t1, digest=digest, generated=generated,
            per_stage=stage_totals(prefill_events, len(self.stages)),
            busy_histogram=busy_histogram(by_device(prefill_events, self.stage_lanes()), len(self.devices)),
            handoff=self.handoff_kind, device_order=list(self.device_order),
            order_reason=self.order_reason, cancelled=cancelled, notes=list(self.notes),
            expert_stats=expert_stats, attention=self.attention_kernels(),
            handoff_bytes=cost.nbytes, executor=self.config.executor, handoff_s=cost.seconds,
            handoff_gbps=cost.gbps, handoff_share=cost.share, cost_profile=planner.probe_dict(self._chunk_cost),
            telemetry=samples, telemetry_status=telemetry_status)
        if self.config.timing:
            log.info("prefill timing (run %s):\n%s", self.run_id, format_timing(report.per_stage))
        if cancelled:
            exc = Cancelled(f"run {self.run_id} cancelled at a chunk boundary; the split was drained")
            exc.report = report  # what ran before the stop, for a GUI to show
            raise exc
        return RunResult(report, all_logits, last_logits)

    def prefill(self, ids: torch.Tensor, bounds: list[tuple[int, int]], cancel: threading.Event | None,
                logits_all: bool) -> tuple[torch.Tensor, torch.Tensor | None, "_Digest"]:
        """Every chunk through the split; returns the last position's logits, all logits when
        asked, and the output digest (`hexdigest()` waits for its hashing thread)."""
        self.prompt_ids = ids.to(self.devices[0])
        self._digest = _Digest(self._digest_streams)
        self._logits: list[torch.Tensor] = []
        self._last_logits: torch.Tensor | None = None
        self._logits_all = logits_all
        self._n_prompt = int(ids.numel())
        for st in self.stages:
            st.done = st._prev_end = None
        if self.config.prefill_main and len(self.stages) > 1:
            try:
                self._prefill_main(bounds, cancel)
            except BaseException:
                self._guard()
                self._digest.close()
                raise
            self._drain_devices()
        else:
            self._start_workers()
            try:
                for c, (pos, n) in enumerate(bounds):
                    if cancel is not None and cancel.is_set():
                        raise Cancelled()
                    self.stages[0].run(c, pos, n)
                self.finish()
            except BaseException:
                self._guard()  # the finish guard: never return with chunks in flight
                self._digest.close()
                raise
            self._guard()
        logits = torch.cat(self._logits) if logits_all else None
        return self._last_logits, logits, self._digest

    def _finish_chunk(self, st: Stage, x: torch.Tensor, chunk: int, pos: int, n: int,
                      head: Head | None = None) -> None:
        """Last stage: final norm, digest (md5 of the normed hidden state bytes), logits."""
        head = head or st.head
        normed = head.final_norm(x)
        self._digest.add(normed)
        if self._logits_all:
            self._logits.append(head.logits(normed).cpu())
        if pos + n == self._n_prompt:
            self._last_logits = head.logits(normed[-1:]).cpu()[0]

    def _prefill_main(self, bounds: list[tuple[int, int]], cancel: threading.Event | None) -> None:
        main = self.stages[0]
        layers, kvs = self._prepare_main(self._n_prompt + 1)
        note = f"prefill-main: layers 0-{self.spec.n_layers - 1}"
        for c, (pos, n) in enumerate(bounds):
            if cancel is not None and cancel.is_set():
                raise Cancelled()
            prev = main.done
            x = main.head.embed_tokens(self.prompt_ids[pos:pos + n])
            x = main.compute(x, layers, kvs, pos, c, n, note=note)
            self._finish_chunk(main, x, c, pos, n, head=self._main_head)
            main.throttle(prev)
        # hand the KV of layers [K, n) to the stages that own them (peer copy where available)
        extra = kvs[len(main.layers):]
        for st in self.stages[1:]:
            t0 = time.perf_counter_ns()
            nbytes = 0
            for i, kv in zip(range(st.first, st.end), st.kvs):
                nbytes += kv.copy_from(extra[i - main.end])
            st._sync()
            if self.events_on:
                st._event(-1, "copy", t0, time.perf_counter_ns(), nbytes=nbytes,
                          note=f"kv layers {st.first}-{st.end - 1} from {main.name}")
        del extra, kvs

    def _start_workers(self) -> None:
        """One worker thread per stage after the first, kept from run to run until `close`: a
        fresh thread pays CUDA's per-thread set-up inside the first chunk (measured 50-70 ms of
        stage 1's first chunk on H200)."""
        for st in self.stages[1:]:
            if st.worker is None or not st.worker.thread.is_alive():
                st.worker = _Worker(f"strata-stage{st.index}")

    def finish(self) -> None:
        """Join the whole split: each stage reaps its outstanding job, first to last, then every
        device finishes what was queued (GPU timings are delivered by `timer.flush()`)."""
        for st in self.stages:
            st.finish()
        self._drain_devices()

    def _drain_devices(self) -> None:
        for d in dict.fromkeys(self.devices):
            if d.type == "cuda":
                torch.cuda.synchronize(d)

    def in_flight(self) -> int:
        """Chunks submitted and not yet reaped, or still running (0 whenever prefill returned)."""
        return sum((st.pending is not None) + (st.worker is not None and st.worker.busy.is_set())
                   for st in self.stages)

    def worker_threads(self) -> list[threading.Thread]:
        """The stage workers' threads (alive between runs, stopped by `close`)."""
        return [st.worker.thread for st in self.stages if st.worker is not None and st.worker.thread.is_alive()]

    def _guard(self) -> None:
        """Drain every in-flight chunk whatever happened; the idle workers stay for the next run."""
        for st in self.stages:
            try:
                st.finish()
            except BaseException as exc:  # already surfacing (or secondary): never leave chunks running
                log.debug("drained stage %d after error: %s", st.index, exc)
        try:
            self._drain_devices()
        except BaseException as exc:
            log.debug("draining devices after error: %s", exc)

    def _stop_workers(self) -> None:
        self._guard()
        for st in self.stages[1:]:
            if st.worker is not None:
                st.worker.stop()
                st.worker = None
        self.timer.stop()

    def decode(self, first_token: int, steps: int, pos: int, cancel: threading.Event | None) -> list[int]:
        """Greedy decode through the split; generated[0] = first_token."""
        out = [first_token]
        tok = first_token
        for st in self.stages:
            if st.cache is not None:
                st.cache.chunk = -1  # decode steps stream as chunk -1
        for i in range(1, steps):
            if cancel is not None and cancel.is_set():
                raise Cancelled()
            x: torch.Tensor | None = None
            for st in self.stages:
                t0 = time.perf_counter_ns()
                if st.index == 0:
                    x = st.head.embed_tokens(torch.tensor([tok]))
                else:
                    x = x.to(st.device)
                x = st.forward_layers(x, st.layers, st.kvs, pos, -1)  # decode steps run as chunk -1
                if st.successor is None:
                    tok = int(st.head.logits(st.head.final_norm(x)).argmax())
                if self.events_on:
                    st._sync()
                    st._event(i, "decode", t0, time.perf_counter_ns(), tokens=1)
            out.append(tok)
            pos += 1
        return out

    def close(self) -> None:
        """Stop the stage workers and free device memory held by this session."""
        self._stop_workers()
        for st in self.stages:
            st.drop_graphs()
            st.layers, st.kvs, st.head, st.input_buf, st.host_buf = [], [], None, None, None
        self._main_extra = None
        self._main_head = None
        if self.arena is not None:
            for st in self.stages:
                st.cache = None
            self.arena.close()
            self.arena = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
