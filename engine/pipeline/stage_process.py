"""One pipeline stage as a process of its own (the process side of `executor=processes`).

The controller (engine/pipeline/executor.py) starts one process per stage.  A stage process reopens the
model source itself (a GGUF path or a synthetic recipe: never pickled tensors), loads only its
layers onto its device, keeps its own KV, and joins a torch.distributed group with the other
stages (rank = stage index; gloo on CPU, NCCL between CUDA devices).

A `StageProcess` is the stage runtime (engine/pipeline/stage_runtime.py: layers, KV, forward, timing,
digest, decode step, prefill-main's receiving side: the threaded Stage's own code) with this
transport: a `PeerLink` to its neighbours and a command loop.  Control and results go through
one pipe per stage: commands in, reports out, each a typed message of engine/pipeline/stage_messages.py
or a `StageEvent` (events, progress, results, errors).  A pipe, not a shared queue: a stage
killed in the middle of a message cannot leave a lock held or a stream half-written for the
other stages.  Activations go stage to stage by send/recv, per hop with the seeds' semantics
and ONE input buffer per stage:

* before each message a stage takes from its predecessor it sends it a "ready" token: the
  predecessor's wait for it is the reap of its previous successor job (the successor has run
  the previous chunk and its input buffer is free), then it sends a header and the data;
* depth 1: a stage's run returns right after that hand-off; depth 0 (join): it returns only once
  the successor sent "done" for the chunk, i.e. after the whole chain below ran it;
* stage 0 takes its chunks from the controller, one command per chunk, and answers "returned"
  when its run returned, so the controller's loop is the root prefill's loop (cancel at a chunk
  boundary) and "end" drains the split (the finish guard).

Times of events are this process's `time.perf_counter_ns()`; the controller maps them onto its
clock with the offset measured at start-up by a ping exchange.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from engine import models
from engine.errors import StageError
from engine.hw.gpu_timing import DeviceClock
from engine.io.synth import ModelRecipe
from engine.models.experts import ExpertStats, HostArena
from engine.models.kv import LayerKV, receive_state, send_state
from engine.models.layers import Head, Layer, Rope
from engine.pipeline import wire
from engine.pipeline.stage_graphs import StageGraphs
from engine.pipeline.stage_messages import (
    ArenaFilled,
    Assign,
    BeginRun,
    Computed,
    DecodeStep,
    EndPrefill,
    EndRun,
    ExpertReport,
    Failure,
    Hello,
    Loaded,
    Measure,
    Measured,
    Note,
    Ping,
    Pong,
    PrefillDone,
    Ready,
    Refused,
    Returned,
    RunChunk,
    RunClosed,
    Stop,
    Token,
    Waiting,
    versions,
)
from engine.pipeline.stage_output import Digest, StageOutput
from engine.pipeline.stage_runtime import PipelineHooks, StageContext, StageRuntime, plain_alloc

wire.register(ModelRecipe)  # a synthetic source's recipe travels in a StageSpec

log = logging.getLogger(__name__)

# header kinds of a message from a predecessor: [kind, chunk, pos, n]
CHUNK, DECODE, KV, END_PREFILL, END_RUN = 0, 1, 2, 3, 4
TAG_READY, TAG_HEADER, TAG_DATA, TAG_DONE, TAG_KV = 1, 2, 3, 4, 5
CONNECT_RETRY_S = 0.5
# torch's Windows wheels are built without libuv: their TCPStore must be asked for the other backend
LIBUV = sys.platform != "win32"


@wire.register
@dataclass(frozen=True)
class SourceRef:
    """How a stage process reopens the model: a GGUF file, or a synthetic recipe."""

    kind: str  # "gguf" | "synthetic"
    path: str = ""
    recipe: Any = None
    device: str = "cpu"

    def open(self):
        if self.kind == "gguf":
            from engine.io.gguf_model import load

            return load(self.path)
        from engine.io.synth import SyntheticSource

        return SyntheticSource(self.recipe, self.device)


@wire.register
@dataclass(frozen=True)
class StageSpec:
    """Everything a stage process needs, picklable."""

    rank: int
    world: int
    device: str
    first: int
    end: int
    source: SourceRef
    dtype: str
    store_host: str
    store_port: int
    backend: str
    threads: int
    timeout_s: float
    parent_pid: int
    ranges: tuple[tuple[int, int], ...] = ()  # every stage's layer range (prefill-main's KV hand-off)
    hooks: Any = None  # a picklable PipelineHooks (test and fault seams), or None
    # streamed experts: this stage's ExpertCache slots from the controller's plan (0: every
    # expert resident), and the bytes of its own host arena to page-lock (its share of the
    # user's pin limit: the shares of all stages never add up to more than the limit)
    expert_slots: int = 0
    pin_bytes: int = 0
    pin_note: str = ""
    # spawned stages meet through a FileStore at this path (a private folder; no port opened);
    # attached ones through the controller's TCP store at store_host:store_port
    store_path: str = ""


@wire.register
@dataclass(frozen=True)
class RunOrder:
    """One run's parameters, sent to every stage before its first chunk."""

    run_id: str
    ids: list[int]
    bounds: list[tuple[int, int]]
    capacity: int
    chunk: int
    depth: int
    logits_all: bool
    events: bool
    check_nan: bool
    prefill_main: bool
    graph_sizes: tuple[int, ...] = ()  # chunk sizes to replay as CUDA graphs (engine/pipeline/stage_graphs.py)


def _watch_parent() -> None:
    """Exit when the controller is gone (killed without tearing its stages down): no orphans.
    Waits on the parent's sentinel (a pipe that closes on POSIX, its process handle on Windows,
    where os.getppid() keeps naming a dead parent)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    parent.join()
    os._exit(3)


def _gloo_loopback() -> None:
    """Stages on one machine: gloo's pair sockets on the loopback interface, not on whatever
    address the host name resolves to (unless the user chose an interface)."""
    if "GLOO_SOCKET_IFNAME" in os.environ or not sys.platform.startswith("linux"):
        return
    names = {name for _, name in socket.if_nameindex()}
    if "lo" in names:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"


def main(spec: StageSpec, conn) -> None:
    """The entry point of a stage process (torch.multiprocessing spawn target); `conn` is its
    end of a duplex pipe to the controller: commands in, messages out."""
    ctl = out = conn
    logging.basicConfig(level=logging.WARNING)
    if spec.parent_pid:  # a spawned stage; an attached one ends when its connection does
        threading.Thread(target=_watch_parent, daemon=True, name="strata-parent-watch").start()
    try:
        torch.set_num_threads(spec.threads)
        stage = StageProcess(spec, out)
        stage.serve(ctl)
    except BaseException as exc:  # report, then exit non-zero: the controller tears the job down
        if isinstance(exc, StageError):
            chunk, layer, cause = exc.chunk, exc.layer, exc.__cause__ or exc
        else:
            chunk, layer, cause = -1, None, exc
        try:
            out.send(Failure(spec.rank, chunk, layer, type(cause).__name__, str(cause), traceback.format_exc()))
        finally:
            os._exit(1)


class AttachError(RuntimeError):
    """A stage could not attach to its controller (unreachable, refused, version mismatch)."""


def attach(rendezvous: str, rank: int, world: int, timeout_s: float, key_file: str | None = None) -> int:
    """`strata-bench stage`: connect to the controller at HOST:PORT (retrying until timeout_s),
    prove the key and check that the controller proves it too, introduce this stage (rank,
    world, pid, host, versions), take its StageSpec and serve.  Returns when the controller stops
    the job; raises AttachError with the reason otherwise (never later than timeout_s)."""
    from engine.config import ConfigError, rendezvous_address
    from engine.pipeline.rendezvous_key import stage_key

    addr = rendezvous_address(rendezvous)
    if addr is None or not addr[0]:
        raise ConfigError("--rendezvous", rendezvous, "HOST:PORT of the controller")
    key = stage_key(key_file)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection(addr, timeout=max(deadline - time.monotonic(), 0.01))
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise AttachError(f"cannot reach the controller at {rendezvous} within {timeout_s:g} s: "
                                  f"{exc}") from None
            time.sleep(CONNECT_RETRY_S)
    try:
        conn = wire.connect(sock, key, deadline, timeout_s)
        conn.send(Hello(rank, world, os.getpid(), socket.gethostname(), versions()))
        reply = conn.recv(timeout=max(deadline - time.monotonic(), 0.01))
    except TimeoutError:
        sock.close()
        raise AttachError(f"the controller at {rendezvous} did not answer within {timeout_s:g} s") from None
    except EOFError:
        sock.close()
        raise AttachError(f"the controller at {rendezvous} closed the connection: wrong key "
                          f"(STRATA_RENDEZVOUS_KEY), or it is not waiting for stages") from None
    except (OSError, wire.WireError) as exc:
        sock.close()
        raise AttachError(f"the controller at {rendezvous} failed the handshake: {exc}") from None
    if isinstance(reply, Refused):
        raise AttachError(f"the controller at {rendezvous} refused stage {rank}: {reply.reason}")
    if not (isinstance(reply, Assign) and isinstance(reply.spec, StageSpec)):
        raise AttachError(f"the controller at {rendezvous} sent no stage spec")
    spec: StageSpec = reply.spec
    if not spec.store_host:  # the controller listens on every interface: its store is where we reached it
        spec = dataclasses.replace(spec, store_host=addr[0])
    main(spec, conn)
    return 0


class PeerLink:
    """A stage process's transport to its neighbours: its torch.distributed group (a FileStore
    for spawned stages, the controller's TCP store for attached ones), control tokens and
    activations by send/recv, and the `Waiting` reports that let a hang be blamed right."""

    def __init__(self, spec: StageSpec, device: torch.device, out) -> None:
        import torch.distributed as dist

        self.dist, self.out, self.rank = dist, out, spec.rank
        if spec.store_path:  # spawned on this machine: a file in the controller's private folder
            _gloo_loopback()
            store = dist.FileStore(spec.store_path, spec.world)
        else:
            store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False,
                                  timeout=timedelta(seconds=spec.timeout_s), use_libuv=LIBUV)
        dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world,
                                timeout=timedelta(seconds=spec.timeout_s))
        # NCCL moves CUDA tensors only (control tokens too); gloo moves host tensors, so a CUDA
        # stage on gloo stages its activations through host memory
        self.ctl_device = device if spec.backend == "nccl" else torch.device("cpu")
        self.host_staged = spec.backend != "nccl" and device.type == "cuda"
        self._ready_work = None

    def small(self, value: int = 0, n: int = 1) -> torch.Tensor:
        return torch.full((n,), value, dtype=torch.long, device=self.ctl_device)

    def send_t(self, t: torch.Tensor, dst: int, tag: int) -> None:
        self.dist.send(t.cpu() if self.host_staged else t.contiguous(), dst, tag=tag)

    def recv_t(self, t: torch.Tensor, src: int, tag: int) -> None:
        if self.host_staged:
            tmp = torch.empty(t.shape, dtype=t.dtype)
            self.dist.recv(tmp, src, tag=tag)
            t.copy_(tmp)
        else:
            self.dist.recv(t, src, tag=tag)

    def recv_int(self, src: int, tag: int) -> int:
        t = self.small()
        self.dist.recv(t, src, tag=tag)
        return int(t[0])  # NCCL: the recv is on a stream; reading it waits for its arrival

    def recv_token(self, src: int, tag: int) -> None:
        with self.waiting_on(src):
            self.recv_int(src, tag)

    def send_small(self, tag: int, dst: int, value: int = 1) -> None:
        self.dist.send(self.small(value), dst, tag=tag)

    @contextlib.contextmanager
    def waiting_on(self, peer: int):
        """Tell the controller whom this stage blocks on (so a hang is blamed on the right stage)."""
        self.out.send(Waiting(self.rank, peer))
        try:
            yield
        finally:
            self.out.send(Waiting(self.rank, -1))

    def send_ready(self) -> None:
        self.wait_ready_sent()
        self._ready = self.small(1)
        self._ready_work = self.dist.isend(self._ready, self.rank - 1, tag=TAG_READY)

    def wait_ready_sent(self) -> None:
        if self._ready_work is not None:
            self._ready_work.wait()
            self._ready_work = None

    def close(self) -> None:
        self.dist.destroy_process_group()


class StageProcess(StageRuntime):
    """A stage runtime in a process of its own: its layers, KV and input buffer on its device,
    the `PeerLink` to its neighbours and its side of the protocol (see the module doc)."""

    host_timed = True  # a compute is timed on the host after a device sync

    def __init__(self, spec: StageSpec, out) -> None:
        device = torch.device(spec.device)
        super().__init__(spec.rank, device, spec.first, spec.end, getattr(torch, spec.dtype), name=spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.spec, self.out, self.world = spec, out, spec.world
        self.host = socket.gethostname()
        self.src = spec.source.open()
        self.model = self.src.spec
        self.rope = Rope.for_spec(self.model, device)  # the file's RoPE scaling, as the threaded stages
        self.clock = DeviceClock()  # CUDA event times of expert copies onto this process's clock
        self.run_id = ""
        self.order: RunOrder | None = None
        self.ctx: StageContext | None = None
        self.digest_streams: dict = {}
        # streamed experts: this stage's own host arena (its layers only) and its ExpertCache
        self.streamed = spec.expert_slots > 0 and self.model.is_moe
        self.arena: HostArena | None = None
        if self.streamed:
            self._build_cache(range(spec.first, spec.end))
            out.send(ArenaFilled(self.index, self.arena.nbytes, self.arena.pinned_bytes, self.arena.pin_note))
        self.layers = self.load_layers(self.src, self.rope, range(spec.first, spec.end), self.streamed, plain_alloc,
                                       after=lambda i: out.send(Loaded(self.index, i)))
        self.root, self.last = self.index == 0, self.index == self.world - 1
        self.head = self.load_head(self.src, embed=self.root, final=self.last)
        self.main_extra: list[Layer] | None = None  # prefill-main: the later layers on stage 0 as well
        self.main_head: Head | None = None
        self.main_kvs: list[LayerKV] = []
        self.graphs = StageGraphs(device, self.name, self.note)  # CUDA graphs per chunk size
        self.link = PeerLink(spec, device, out)
        out.send(Ready(self.index, os.getpid(), self.host, spec.device))

    # ------------------------------------------------------------------ helpers
    def note(self, text: str) -> None:
        """A line for the run report's notes (a graph capture, a fallback to eager)."""
        self.out.send(Note(self.index, self.run_id, text))

    def _build_cache(self, layers: range) -> None:
        """This stage's host arena over `layers` (page-locked up to its share of the pin limit)
        and its ExpertCache of the planned slot count.  Built again over every layer when
        prefill-main first runs on stage 0 (its cache then serves the whole model, as the
        threaded executor's main device does); the stats carry over."""
        stats = self.cache.stats if self.cache is not None else ExpertStats(self.index, self.name)
        if self.arena is not None:
            self.cache = None
            self.arena.close()
            self.arena = None
        arena = HostArena(self.src, self.model, layers)
        if self.device.type == "cuda" and self.spec.pin_bytes > 0:
            arena.pin(self.spec.pin_bytes, self.spec.pin_note)
        else:
            arena.pin_note = self.spec.pin_note or arena.pin_note
        self.arena = arena
        self.use_cache(arena, self.spec.expert_slots, stats, plain_alloc)

    def report_experts(self) -> None:
        """Every copy's timing in, then the run's expert stats to the controller (sent before the
        message the controller waits for, so it has them when that arrives)."""
        if self.cache is None or self.ctx is None:
            return
        self.cache.synchronize()
        self.emit_streams(self.ctx)
        self.out.send(ExpertReport(self.index, self.run_id, self.cache.stats.as_dict()))

    def compute(self, ctx: StageContext, x: torch.Tensor, layers, kvs, pos: int, chunk: int, tokens: int,
                note: str = "") -> torch.Tensor:
        x = super().compute(ctx, x, layers, kvs, pos, chunk, tokens, note)
        self.out.send(Computed(self.index, chunk))
        return x

    def measure(self, cmd: Measure) -> Measured:
        """The chunk-cost probe of the first layer of each kind (engine/plan/chunk_cost.py), for the
        controller's plan; with graphs it times graph replays, as a run with cuda_graphs on executes."""
        from engine.plan.chunk_cost import measure_layers

        with torch.inference_mode():
            layer_s, attn_s, host_s = measure_layers(self.layers, self.device, self.dtype, cmd.graphs,
                                                     (tuple(cmd.sizes), cmd.prefix, cmd.probe, cmd.reps))
        return Measured(self.index, tuple(sorted(layer_s.items())), attn_s, host_s)

    def close(self) -> None:
        """Free graphs and unregister the arena's page-locked memory (before leaving the group)."""
        self.graphs.drop()
        self.cache = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    # ---------------------------------------------------------------- the protocol
    def serve(self, ctl) -> None:
        """Commands until `Stop`: pings (clock offset), runs, measurements."""
        while True:
            cmd = ctl.recv()
            if isinstance(cmd, Ping):
                self.out.send(Pong(self.index, time.perf_counter_ns()))
            elif isinstance(cmd, BeginRun):
                self.begin(cmd.order)
                if self.root:
                    self.serve_root(ctl)
                else:
                    self.serve_stage()
                self.out.send(RunClosed(self.index))
            elif isinstance(cmd, Measure):
                self.out.send(self.measure(cmd))
            elif isinstance(cmd, Stop):
                self.close()
                self.link.close()
                return

    def begin(self, order: RunOrder) -> None:
        """A run's context (events, notes, hooks, checks, graph sizes, its output) and buffers."""
        s = self.model
        self.run_id = order.run_id
        emit = self.out.send if order.events else (lambda ev: None)
        self.ctx = StageContext(order.run_id, emit, self.note, None, self.clock, order.events,
                                self.spec.hooks or PipelineHooks(), order.check_nan, order.depth,
                                frozenset(order.graph_sizes), torch.tensor(order.ids, dtype=torch.long),
                                StageOutput(Digest(self.digest_streams), len(order.ids), order.logits_all))
        self.order = order
        self.graphs.plan(order.graph_sizes)  # other sizes' graphs are freed
        if self.cache is not None:
            self.cache.reset_stats()
        if self.device.type == "cuda":
            self.clock.anchor(self.device)
        self.prepare_kv(order.capacity, s.n_kv_heads, s.head_dim, plain_alloc)
        self.prepare_input(order.chunk, s.hidden, plain_alloc)

    @property
    def ids(self) -> torch.Tensor:
        return self.ctx.prompt_ids

    def serve_root(self, ctl) -> None:
        """Stage 0: one command per chunk or decode step from the controller."""
        main = self.order.prefill_main and self.world > 1
        with torch.inference_mode():
            while True:
                cmd = ctl.recv()
                if isinstance(cmd, RunChunk):
                    c = cmd.chunk
                    pos, n = self.order.bounds[c]
                    if main:
                        self.run_main(c, pos, n)
                    else:
                        x = self.head.embed_tokens(self.ids[pos:pos + n].to(self.device))
                        self.run_chunk(x, c, pos, n)
                    self.out.send(Returned(self.index, c))
                elif isinstance(cmd, EndPrefill):
                    if main:
                        self.send_kv()
                    self.pass_on(END_PREFILL, -1, 0, 0)
                    self.prefill_done()
                elif isinstance(cmd, DecodeStep):
                    self.decode(self.head.embed_tokens(torch.tensor([cmd.token], device=self.device)),
                                cmd.step, cmd.pos)
                elif isinstance(cmd, EndRun):
                    self.pass_on(END_RUN, -1, 0, 0)
                    self.link.wait_ready_sent()
                    return

    def serve_stage(self) -> None:
        """A later stage: messages from the predecessor until the run ends."""
        link = self.link
        header = link.small(0, 4)
        prev = self.index - 1
        with torch.inference_mode():
            while True:
                link.send_ready()
                with link.waiting_on(prev):
                    link.dist.recv(header, prev, tag=TAG_HEADER)
                kind, c, pos, n = (int(v) for v in header.tolist())
                if kind in (CHUNK, DECODE):
                    x = self.input_buf[:n]
                    link.recv_t(x, prev, TAG_DATA)
                    if kind == DECODE:
                        self.decode(x, c, pos)
                        continue
                    self.run_chunk(x, c, pos, n)
                    if self.order.depth == 0:  # join: the predecessor returns once this chain ran c
                        link.send_small(TAG_DONE, prev)
                elif kind == KV:
                    self.recv_kv()
                    self.pass_on(KV, -1, 0, 0)
                elif kind == END_PREFILL:
                    self.pass_on(END_PREFILL, -1, 0, 0)
                    self.prefill_done()
                elif kind == END_RUN:
                    self.pass_on(END_RUN, -1, 0, 0)
                    link.wait_ready_sent()
                    return

    def run_chunk(self, x: torch.Tensor, c: int, pos: int, n: int) -> None:
        """Compute, then (not last) reap + hand off, and at depth 0 wait for the chain."""
        ctx = self.ctx
        x = self.compute(ctx, x, self.layers, self.kvs, pos, c, n)
        if self.last:
            self.finish_chunk(ctx, x, pos, n)
            return
        self.hand_off(x, c, pos, n)
        if self.order.depth == 0:
            t0 = time.perf_counter_ns()
            self.link.recv_token(self.index + 1, TAG_DONE)
            self.event(ctx, c, "wait", t0, time.perf_counter_ns(), note="join")

    def pass_on(self, kind: int, c: int, pos: int, n: int, data: torch.Tensor | None = None) -> int:
        """Reap (the successor's ready token), then send the header and the data; returns the
        reap's end (the copy's start)."""
        if self.last:
            return time.perf_counter_ns()
        link, succ = self.link, self.index + 1
        t0 = time.perf_counter_ns()
        link.recv_token(succ, TAG_READY)
        t1 = time.perf_counter_ns()
        if kind == CHUNK:
            self.event(self.ctx, c, "wait", t0, t1, note="reap")
        link.dist.send(torch.tensor([kind, c, pos, n], dtype=torch.long, device=link.ctl_device), succ,
                       tag=TAG_HEADER)
        if data is not None:
            with link.waiting_on(succ):
                link.send_t(data, succ, TAG_DATA)
        return t1

    def hand_off(self, x: torch.Tensor, c: int, pos: int, n: int) -> None:
        t1 = self.pass_on(CHUNK, c, pos, n, x)
        self.event(self.ctx, c, "copy", t1, time.perf_counter_ns(), tokens=n, nbytes=x.numel() * x.element_size(),
                   note=self.spec.backend)

    def prefill_done(self) -> None:
        self.report_experts()
        holder = self.last if not (self.order.prefill_main and self.world > 1) else self.root
        if not holder:
            self.out.send(PrefillDone(self.index))
            return
        out = self.ctx.output
        logits = out.logits.numpy() if self.order.logits_all and out.logits is not None else None
        last = out.last_logits.numpy() if out.last_logits is not None else None
        self.out.send(PrefillDone(self.index, out.digest.hexdigest(), last, logits))

    def decode(self, x: torch.Tensor, step: int, pos: int) -> None:
        x, tok = self.decode_step(self.ctx, x, pos, step)
        self.report_experts()
        if tok is not None:
            self.out.send(Token(self.index, step, tok))
        else:
            self.pass_on(DECODE, step, pos, 1, x)

    # ------------------------------------------------------------- prefill-main
    def run_main(self, c: int, pos: int, n: int) -> None:
        """Prefill-main on stage 0: every layer of the model on the main device."""
        s = self.model
        if self.main_extra is None:
            if self.cache is not None:  # the main cache serves every layer: an arena of them all
                self._build_cache(range(s.n_layers))
                self.note(f"prefill-main: stage 0's host arena now holds the experts of layers 0-{s.n_layers - 1} "
                          f"({self.arena.nbytes / 2**30:.2f} GiB, {self.arena.pinned_bytes / 2**30:.2f} GiB page-locked)")
            self.main_extra = self.load_layers(self.src, self.rope, range(self.end, s.n_layers), self.streamed,
                                               plain_alloc)
            self.main_head = self.load_head(self.src, True, True)
        if c == 0:
            cap = self.order.capacity
            self.main_kvs = models.new_states(s, range(self.spec.end, s.n_layers), cap, self.device, self.dtype)
        note = f"prefill-main: layers 0-{s.n_layers - 1}"
        x = self.head.embed_tokens(self.ids[pos:pos + n].to(self.device))
        x = self.compute(self.ctx, x, self.layers + self.main_extra, self.kvs + self.main_kvs, pos, c, n, note=note)
        self.finish_chunk(self.ctx, x, pos, n, self.main_head)

    def send_kv(self) -> None:
        """Prefill-main's KV hand-off: layers [K, n) to the stage that owns each (a KV header
        travels down the chain; each stage then takes its layers' KV from stage 0)."""
        self.pass_on(KV, -1, 0, 0)
        link, offset = self.link, self.spec.end
        for r, (first, end) in enumerate(self.spec.ranges):
            if r == 0:
                continue
            for i in range(first, end):  # each layer's state as its family hands it off (engine/models/kv.py)
                send_state(self.main_kvs[i - offset], lambda n: link.send_small(TAG_KV, r, n),  # noqa: B023
                           lambda t: link.send_t(t, r, TAG_KV))  # noqa: B023
        self.main_kvs = []

    def recv_kv(self) -> None:
        link = self.link

        def fill(i: int, kv: LayerKV) -> int:
            return receive_state(kv, link.recv_int(0, TAG_KV), lambda t: link.recv_t(t, 0, TAG_KV))

        self.receive_kv(self.ctx, fill, f"stage 0 ({self.spec.backend})")
