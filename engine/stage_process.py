"""One pipeline stage as a process of its own (the process side of `executor=processes`).

The controller (engine/executor.py) starts one process per stage.  A stage process reopens the
model source itself (a GGUF path or a synthetic recipe: never pickled tensors), loads only its
layers onto its device, keeps its own KV, and joins a torch.distributed group with the other
stages (rank = stage index; gloo on CPU, NCCL between CUDA devices).

Control and results go through one pipe per stage: commands in, messages out (events, progress,
results, errors).  A pipe, not a shared queue: a stage killed in the middle of a message cannot
leave a lock held or a stream half-written for the other stages.  Activations go stage to stage by send/recv, per hop with the
seeds' semantics and ONE input buffer per stage:

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
import hashlib
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

from . import nvtx, wire
from .kv import receive_state, send_state
from .synth import ModelRecipe

wire.register(ModelRecipe)  # a synthetic source's recipe travels in a StageSpec

log = logging.getLogger(__name__)

# header kinds of a message from a predecessor: [kind, chunk, pos, n]
CHUNK, DECODE, KV, END_PREFILL, END_RUN = 0, 1, 2, 3, 4
TAG_READY, TAG_HEADER, TAG_DATA, TAG_DONE, TAG_KV = 1, 2, 3, 4, 5
CONNECT_RETRY_S = 0.5
# torch's Windows wheels are built without libuv: their TCPStore must be asked for the other backend
LIBUV = sys.platform != "win32"


def versions() -> dict[str, str]:
    """What must match between the controller and every stage (hosts run the same code)."""
    from importlib import metadata

    try:
        strata = metadata.version("strata-gui")
    except metadata.PackageNotFoundError:
        strata = "source"
    return {"strata": strata, "torch": torch.__version__.split("+")[0],
            "python": f"{sys.version_info.major}.{sys.version_info.minor}"}


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
            from .gguf_model import load

            return load(self.path)
        from .synth import SyntheticSource

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
    graph_sizes: tuple[int, ...] = ()  # chunk sizes to replay as CUDA graphs (engine/stage_graphs.py)


class StageFailure(RuntimeError):
    """An error inside a stage process, with where it happened (sent to the controller)."""

    def __init__(self, chunk: int, layer: int | None, cause: BaseException) -> None:
        self.chunk, self.layer, self.cause = chunk, layer, cause
        super().__init__(str(cause))


def _watch_parent() -> None:
    """Exit when the controller is gone (killed without tearing its stages down): no orphans.
    Waits on the parent's sentinel (a pipe that closes on POSIX, its process handle on Windows,
    where os.getppid() keeps naming a dead parent)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    parent.join()
    os._exit(3)


def hello_fields(msg) -> tuple[int, int, int, str, dict]:
    """(rank, world, pid, host, versions) of a stage's hello, or ValueError naming what is off."""
    if not (isinstance(msg, tuple) and len(msg) == 6 and msg[0] == "hello"):
        raise ValueError("the first message was not a stage's hello")
    _, rank, world, pid, host, vers = msg
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, world, pid))
    if not (ints and isinstance(host, str) and len(host) <= 255 and isinstance(vers, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in vers.items())):
        raise ValueError("a malformed hello")
    return rank, world, pid, host, vers


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
        chunk = getattr(exc, "chunk", -1)
        layer = getattr(exc, "layer", None)
        cause = getattr(exc, "cause", exc)
        try:
            out.send(("error", spec.rank, chunk, layer, type(cause).__name__, str(cause),
                     traceback.format_exc()))
        finally:
            os._exit(1)


class AttachError(RuntimeError):
    """A stage could not attach to its controller (unreachable, refused, version mismatch)."""


def attach(rendezvous: str, rank: int, world: int, timeout_s: float, key_file: str | None = None) -> int:
    """`strata-bench stage`: connect to the controller at HOST:PORT (retrying until timeout_s),
    prove the key and check that the controller proves it too, introduce this stage (rank,
    world, pid, host, versions), take its StageSpec and serve.  Returns when the controller stops
    the job; raises AttachError with the reason otherwise (never later than timeout_s)."""
    from .config import ConfigError, rendezvous_address
    from .rendezvous_key import stage_key

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
        conn.send(("hello", rank, world, os.getpid(), socket.gethostname(), versions()))
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
    if isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "refused":
        raise AttachError(f"the controller at {rendezvous} refused stage {rank}: {reply[1]}")
    if not (isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "spec" and isinstance(reply[1], StageSpec)):
        raise AttachError(f"the controller at {rendezvous} sent no stage spec")
    spec: StageSpec = reply[1]
    if not spec.store_host:  # the controller listens on every interface: its store is where we reached it
        spec = dataclasses.replace(spec, store_host=addr[0])
    main(spec, conn)
    return 0


class StageProcess:
    """A stage's layers, KV and input buffer on its device, and its side of the protocol."""

    def __init__(self, spec: StageSpec, out) -> None:
        import torch.distributed as dist

        from .gpu_timing import DeviceClock
        from .kv import LayerKV  # noqa: F401  (imported here: the child's import cost is paid once)
        from .model import Layer, Rope, load_head, load_layer_weights
        from .stage_graphs import StageGraphs

        self.spec, self.out, self.dist = spec, out, dist
        self.rank, self.world = spec.rank, spec.world
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.name = spec.device
        self.host = socket.gethostname()
        self.dtype = getattr(torch, spec.dtype)
        self.src = spec.source.open()
        self.model = self.src.spec
        self.hooks = spec.hooks
        rope = Rope.for_spec(self.model, self.device)  # the file's RoPE scaling, as the threaded stages
        self.rope = rope
        self.order: RunOrder | None = None
        self.clock = DeviceClock()  # CUDA event times of expert copies onto this process's clock
        # streamed experts: this stage's own host arena (its layers only) and its ExpertCache
        self.streamed = spec.expert_slots > 0 and self.model.is_moe
        self.arena = None
        self.cache = None
        if self.streamed:
            self._build_cache(range(spec.first, spec.end))
            out.send(("arena", self.rank, self.arena.nbytes, self.arena.pinned_bytes, self.arena.pin_note))
        self.layers = []
        for i in range(spec.first, spec.end):
            w = load_layer_weights(self.src, i, self.device, self.dtype, experts=not self.streamed)
            self.layers.append(Layer(self.model, i, w, rope, cache=self.cache))
            out.send(("loaded", self.rank, i))
        for a, b in zip(self.layers, self.layers[1:]):
            a.prefetch_next = b.index
        self.first, self.last = self.rank == 0, self.rank == self.world - 1
        self.head = load_head(self.src, self.device, self.dtype, embed=self.first, final=self.last)
        self.kvs: list = []
        self.input_buf: torch.Tensor | None = None
        self.main_extra: list | None = None  # prefill-main: the later layers on stage 0 as well
        self.main_head = None
        self.main_kvs: list = []
        self.graphs = StageGraphs(self.device, self.name, self.note)  # CUDA graphs per chunk size
        self.pending_done = False
        self._ready_work = None
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
        self.ctl_device = self.device if spec.backend == "nccl" else torch.device("cpu")
        self.host_staged = spec.backend != "nccl" and self.device.type == "cuda"
        out.send(("ready", self.rank, os.getpid(), self.host, spec.device))

    # ------------------------------------------------------------------ helpers
    def event(self, chunk: int, kind: str, t0: int, t1: int, tokens: int = 0, nbytes: int = 0,
              note: str = "") -> None:
        if self.order is not None and self.order.events:
            self.out.send(("ev", self.rank, self.order.run_id, self.name, chunk, kind, t0, t1, tokens, nbytes, note))

    def note(self, text: str) -> None:
        """A line for the run report's notes (a graph capture, a fallback to eager)."""
        self.out.send(("note", self.rank, self.order.run_id if self.order is not None else "", text))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _build_cache(self, layers: range) -> None:
        """This stage's host arena over `layers` (page-locked up to its share of the pin limit)
        and its ExpertCache of the planned slot count.  Built again over every layer when
        prefill-main first runs on stage 0 (its cache then serves the whole model, as the
        threaded executor's main device does); the stats carry over."""
        from .experts import ExpertCache, ExpertStats, HostArena

        stats = self.cache.stats if self.cache is not None else ExpertStats(self.rank, self.name)
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
        self.cache = ExpertCache(arena, self.device, self.spec.expert_slots, stats)

    def emit_streams(self) -> None:
        """Stream events for the expert copies that have finished (the threaded Stage's)."""
        if self.cache is None:
            return
        for layer, chunk, t0, t1, pinned, pageable in self.cache.drain_timings(self.clock):
            self.event(chunk, "stream", t0, t1, nbytes=pinned + pageable,
                       note=f"layer {layer}: {pinned / 2**20:.1f} MiB pinned, {pageable / 2**20:.1f} MiB pageable")

    def report_experts(self) -> None:
        """Every copy's timing in, then the run's expert stats to the controller (sent before the
        message the controller waits for, so it has them when that arrives)."""
        if self.cache is None or self.order is None:
            return
        self.cache.synchronize()
        self.emit_streams()
        self.out.send(("experts", self.rank, self.order.run_id, self.cache.stats.as_dict()))

    def forward(self, x: torch.Tensor, layers, kvs, pos: int, chunk: int) -> torch.Tensor:
        """The layers in order, replaying their CUDA graphs at the run's graph sizes (captured
        after the first eager pass of a size), with the test hook and the NaN check."""
        hook = self.hooks.after_layer if self.hooks is not None else None
        check = self.order is not None and self.order.check_nan
        graphed, capture = self.graphs.lookup(x, layers)
        for i, (layer, kv) in enumerate(zip(layers, kvs)):
            try:
                x = graphed.forward(i, x, kv, pos) if graphed is not None else layer(x, kv, pos)
                if hook is not None:
                    hook(self.rank, layer.index, chunk)
                if check and not bool(torch.isfinite(x).all()):
                    from .errors import NonFiniteError

                    raise NonFiniteError(f"non-finite value after layer {layer.index}")
            except Exception as exc:
                raise StageFailure(chunk, layer.index, exc) from exc
        if capture:  # graphability is known after a first pass (each layer picks its expert GEMM)
            try:
                self.graphs.after_eager(layers, x)
            except Exception as exc:
                raise StageFailure(chunk, None, exc) from exc
        return x

    def compute(self, x, layers, kvs, pos: int, chunk: int, n: int, note: str = "") -> torch.Tensor:
        if self.cache is not None:
            self.cache.chunk = chunk
        t0 = time.perf_counter_ns()
        label = nvtx.stage_label(self.rank, self.name, layers[0].index, layers[-1].index + 1)
        with nvtx.span(self.device, f"{label} C{chunk} compute" if chunk >= 0 else f"{label} decode"):
            x = self.forward(x, layers, kvs, pos, chunk)
        self._sync()
        self.event(chunk, "compute", t0, time.perf_counter_ns(), tokens=n, note=note)
        self.emit_streams()
        self.out.send(("computed", self.rank, chunk))
        return x

    def measure(self, sizes, prefix: int, probe: int, reps: int, graphs: bool = False) -> tuple:
        """The chunk-cost probe of the first layer (engine/chunk_cost.py), for the controller's
        plan; with graphs it times graph replays, as a run with cuda_graphs on executes."""
        from .chunk_cost import ChunkCostProbe

        with torch.inference_mode():
            p = ChunkCostProbe(self.layers[0], self.device, self.dtype,
                               graphs=graphs and self.device.type == "cuda", reps=reps)
            return p.measure(sizes, prefix=prefix, probe=probe).astuple()

    def close(self) -> None:
        """Free graphs and unregister the arena's page-locked memory (before leaving the group)."""
        self.graphs.drop()
        self.cache = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    # ---------------------------------------------------------------- the protocol
    def serve(self, ctl) -> None:
        """Commands until "stop": pings (clock offset), then runs."""
        while True:
            cmd = ctl.recv()
            kind = cmd[0]
            if kind == "ping":
                self.out.send(("pong", self.rank, time.perf_counter_ns()))
            elif kind == "run":
                self.begin(cmd[1])
                if self.first:
                    self.serve_root(ctl)
                else:
                    self.serve_stage()
                self.out.send(("run_closed", self.rank))
            elif kind == "measure":
                self.out.send(("measured", self.rank, self.measure(*cmd[1:])))
            elif kind == "stop":
                self.close()
                self.dist.destroy_process_group()
                return

    def begin(self, order: RunOrder) -> None:
        from . import models

        s = self.model
        self.order = order
        self.graphs.plan(order.graph_sizes)  # other sizes' graphs are freed
        if self.cache is not None:
            self.cache.reset_stats()
        if self.device.type == "cuda":
            self.clock.anchor(self.device)
        if not self.kvs or self.kvs[0].capacity < order.capacity:
            self.kvs = []
            self.kvs = models.new_states(s, [layer.index for layer in self.layers], order.capacity, self.device,
                                         self.dtype)
        for kv in self.kvs:
            kv.reset()
        if not self.first and (self.input_buf is None or self.input_buf.shape[0] < order.chunk):
            self.input_buf = torch.empty(order.chunk, s.hidden, device=self.device, dtype=self.dtype)
        self.md5 = hashlib.md5()
        self.logits: list[torch.Tensor] = []
        self.last_logits: torch.Tensor | None = None
        self.ids = torch.tensor(order.ids, dtype=torch.long)

    def serve_root(self, ctl) -> None:
        """Stage 0: one command per chunk or decode step from the controller."""
        with torch.inference_mode():
            while True:
                cmd = ctl.recv()
                kind = cmd[0]
                if kind == "chunk":
                    c = cmd[1]
                    pos, n = self.order.bounds[c]
                    if self.order.prefill_main and self.world > 1:
                        self.run_main(c, pos, n)
                    else:
                        x = self.head.embed_tokens(self.ids[pos:pos + n].to(self.device))
                        self.run_chunk(x, c, pos, n)
                    self.out.send(("returned", self.rank, c))
                elif kind == "end":
                    if self.order.prefill_main and self.world > 1:
                        self.send_kv()
                    self.pass_on(END_PREFILL, -1, 0, 0)
                    self.prefill_done()
                elif kind == "decode":
                    _, step, tok, pos = cmd
                    self.decode_step(self.head.embed_tokens(torch.tensor([tok], device=self.device)), step, pos)
                elif kind == "end_run":
                    self.pass_on(END_RUN, -1, 0, 0)
                    self.wait_ready_sent()
                    return

    def serve_stage(self) -> None:
        """A later stage: messages from the predecessor until the run ends."""
        dist = self.dist
        header = self.small(0, 4)
        prev = self.rank - 1
        with torch.inference_mode():
            while True:
                self.send_ready()
                with self.waiting_on(prev):
                    dist.recv(header, prev, tag=TAG_HEADER)
                kind, c, pos, n = (int(v) for v in header.tolist())
                if kind == CHUNK:
                    x = self.input_buf[:n]
                    self.recv_t(x, prev, TAG_DATA)
                    self.run_chunk(x, c, pos, n)
                    if self.order.depth == 0:  # join: the predecessor returns once this chain ran c
                        self.send_small(TAG_DONE, prev)
                elif kind == DECODE:
                    x = self.input_buf[:1]
                    self.recv_t(x, prev, TAG_DATA)
                    self.decode_step(x, c, pos)
                elif kind == KV:
                    self.recv_kv()
                    self.pass_on(KV, -1, 0, 0)
                elif kind == END_PREFILL:
                    self.pass_on(END_PREFILL, -1, 0, 0)
                    self.prefill_done()
                elif kind == END_RUN:
                    self.pass_on(END_RUN, -1, 0, 0)
                    self.wait_ready_sent()
                    return

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

    def recv_token(self, src: int, tag: int) -> None:
        t = self.small()
        with self.waiting_on(src):
            self.dist.recv(t, src, tag=tag)
            int(t[0])  # NCCL: the recv is on a stream; reading it waits for its arrival

    @contextlib.contextmanager
    def waiting_on(self, peer: int):
        """Tell the controller whom this stage blocks on (so a hang is blamed on the right stage)."""
        self.out.send(("state", self.rank, peer))
        try:
            yield
        finally:
            self.out.send(("state", self.rank, -1))

    def send_ready(self) -> None:
        self.wait_ready_sent()
        self._ready = self.small(1)
        self._ready_work = self.dist.isend(self._ready, self.rank - 1, tag=TAG_READY)

    def wait_ready_sent(self) -> None:
        if self._ready_work is not None:
            self._ready_work.wait()
            self._ready_work = None

    def send_small(self, tag: int, dst: int) -> None:
        self.dist.send(self.small(1), dst, tag=tag)

    def run_chunk(self, x: torch.Tensor, c: int, pos: int, n: int) -> None:
        """Compute, then (not last) reap + hand off, and at depth 0 wait for the chain."""
        x = self.compute(x, self.layers, self.kvs, pos, c, n)
        if self.last:
            self.finish_chunk(x, pos, n, self.head)
            return
        self.hand_off(x, c, pos, n)
        if self.order.depth == 0:
            t0 = time.perf_counter_ns()
            self.recv_token(self.rank + 1, TAG_DONE)
            self.event(c, "wait", t0, time.perf_counter_ns(), note="join")

    def pass_on(self, kind: int, c: int, pos: int, n: int, data: torch.Tensor | None = None) -> int:
        """Reap (the successor's ready token), then send the header and the data; returns the
        reap's end (the copy's start)."""
        if self.last:
            return time.perf_counter_ns()
        dist = self.dist
        t0 = time.perf_counter_ns()
        self.recv_token(self.rank + 1, TAG_READY)
        t1 = time.perf_counter_ns()
        if kind == CHUNK:
            self.event(c, "wait", t0, t1, note="reap")
        dist.send(torch.tensor([kind, c, pos, n], dtype=torch.long, device=self.ctl_device), self.rank + 1,
                  tag=TAG_HEADER)
        if data is not None:
            with self.waiting_on(self.rank + 1):
                self.send_t(data, self.rank + 1, TAG_DATA)
        return t1

    def hand_off(self, x: torch.Tensor, c: int, pos: int, n: int) -> None:
        t1 = self.pass_on(CHUNK, c, pos, n, x)
        self.event(c, "copy", t1, time.perf_counter_ns(), tokens=n, nbytes=x.numel() * x.element_size(),
                   note=self.spec.backend)

    def finish_chunk(self, x: torch.Tensor, pos: int, n: int, head) -> None:
        """The last layer's output: final norm, digest bytes (the threaded executor's), logits."""
        normed = head.final_norm(x)
        self.md5.update(normed.detach().contiguous().cpu().view(torch.uint8).numpy())
        if self.order.logits_all:
            self.logits.append(head.logits(normed).cpu())
        if pos + n == len(self.order.ids):
            self.last_logits = head.logits(normed[-1:]).cpu()[0]

    def prefill_done(self) -> None:
        self.report_experts()
        holder = self.last if not (self.order.prefill_main and self.world > 1) else self.first
        if holder:
            logits = torch.cat(self.logits).numpy() if self.order.logits_all and self.logits else None
            last = self.last_logits.numpy() if self.last_logits is not None else None
            self.out.send(("prefill_done", self.rank, self.md5.hexdigest(), last, logits))
        else:
            self.out.send(("prefill_done", self.rank, None, None, None))

    def decode_step(self, x: torch.Tensor, step: int, pos: int) -> None:
        if self.cache is not None:
            self.cache.chunk = -1  # decode steps stream as chunk -1
        t0 = time.perf_counter_ns()
        x = self.forward(x, self.layers, self.kvs, pos, -1)
        if self.last:
            tok = int(self.head.logits(self.head.final_norm(x)).argmax())
            self._sync()
            self.event(step, "decode", t0, time.perf_counter_ns(), tokens=1)
            self.report_experts()
            self.out.send(("token", self.rank, step, tok))
            return
        self._sync()
        self.event(step, "decode", t0, time.perf_counter_ns(), tokens=1)
        self.report_experts()
        self.pass_on(DECODE, step, pos, 1, x)

    # ------------------------------------------------------------- prefill-main
    def run_main(self, c: int, pos: int, n: int) -> None:
        """Prefill-main on stage 0: every layer of the model on the main device."""
        from . import models
        from .model import Layer, load_head, load_layer_weights

        s = self.model
        if self.main_extra is None:
            if self.cache is not None:  # the main cache serves every layer: an arena of them all
                self._build_cache(range(s.n_layers))
                for layer in self.layers:
                    layer.cache = self.cache
                self.note(f"prefill-main: stage 0's host arena now holds the experts of layers 0-{s.n_layers - 1} "
                          f"({self.arena.nbytes / 2**30:.2f} GiB, {self.arena.pinned_bytes / 2**30:.2f} GiB page-locked)")
            self.main_extra = [Layer(s, i, load_layer_weights(self.src, i, self.device, self.dtype,
                                                              experts=not self.streamed), self.rope, cache=self.cache)
                               for i in range(self.spec.end, s.n_layers)]
            for a, b in zip(self.main_extra, self.main_extra[1:]):
                a.prefetch_next = b.index
            self.main_head = load_head(self.src, self.device, self.dtype, True, True)
        if c == 0:
            cap = self.order.capacity
            self.main_kvs = models.new_states(s, range(self.spec.end, s.n_layers), cap, self.device, self.dtype)
        note = f"prefill-main: layers 0-{s.n_layers - 1}"
        x = self.head.embed_tokens(self.ids[pos:pos + n].to(self.device))
        x = self.compute(x, self.layers + self.main_extra, self.kvs + self.main_kvs, pos, c, n, note=note)
        self.finish_chunk(x, pos, n, self.main_head)

    def send_kv(self) -> None:
        """Prefill-main's KV hand-off: layers [K, n) to the stage that owns each (a KV header
        travels down the chain; each stage then takes its layers' KV from stage 0)."""
        self.pass_on(KV, -1, 0, 0)
        offset = self.spec.end
        for r, (first, end) in enumerate(self.spec.ranges):
            if r == 0:
                continue
            for i in range(first, end):  # each layer's state as its family hands it off (engine/kv.py)
                send_state(self.main_kvs[i - offset], lambda n: self.dist.send(self.small(n), r, tag=TAG_KV),  # noqa: B023
                           lambda t: self.send_t(t, r, TAG_KV))  # noqa: B023
        self.main_kvs = []

    def recv_kv(self) -> None:
        t0 = time.perf_counter_ns()
        nbytes = 0
        for kv in self.kvs:
            n = self.small()
            self.dist.recv(n, 0, tag=TAG_KV)
            nbytes += receive_state(kv, int(n[0]), lambda t: self.recv_t(t, 0, TAG_KV))
        self._sync()
        self.event(-1, "copy", t0, time.perf_counter_ns(), nbytes=nbytes,
                   note=f"kv layers {self.spec.first}-{self.spec.end - 1} from stage 0 ({self.spec.backend})")
