"""The stage processes of one session, as the controller holds them (executor=processes).

A `StageJob` starts one process per stage (spawned here, or attached from elsewhere through
engine/pipeline/stage_rendezvous.py), hosts their rendezvous store, and talks to each through its pipe
or channel: every message is typed (engine/pipeline/stage_messages.py, or a `StageEvent`).  `pump` waits
for what the controller needs while it handles every report (events re-timed onto this
process's clock, notes, expert stats, progress).

Faults: every wait is bounded.  A stage process that dies ends the run at once; one that makes
no progress for `timeout_s` (STRATA_STAGE_TIMEOUT_S, default 60) ends it after that long.  The
message names the stage, its host, its pid and the last chunk it computed.  Every stage process
is then killed and joined (none is left behind) and the next run starts them again.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait as wait_any
from pathlib import Path
from typing import Any

import torch

from engine import settings_table
from engine.config import ConfigError, rendezvous_address
from engine.errors import Cancelled, NonFiniteError, StageError
from engine.events import StageEvent
from engine.models.experts import ExpertStats
from engine.pipeline import wire
from engine.pipeline.rendezvous_key import bind_host, controller_key
from engine.pipeline.stage_messages import (
    ArenaFilled,
    Assign,
    Computed,
    ExpertReport,
    Failure,
    Loaded,
    Measure,
    Measured,
    Note,
    Ping,
    Pong,
    PrefillDone,
    Ready,
    Returned,
    RunClosed,
    Stop,
    Token,
    Waiting,
)
from engine.pipeline.stage_process import LIBUV, SourceRef, StageSpec
from engine.pipeline.stage_rendezvous import wait_for_stages
from engine.sizes import size_text

log = logging.getLogger(__name__)

TIMEOUT_ENV = settings_table.row("stage_timeout_s").env
POLL_S = 0.2  # how often a wait looks at the stage processes' liveness and its deadline
PINGS = 7  # clock-offset exchanges per stage at start-up (the one of least round trip counts)
STOP_GRACE_S = 5.0  # a stopped stage process that has not exited by then is killed


class StageLost(RuntimeError):
    """A stage process died or stopped responding (the run ended; the job was torn down).
    What the machine did (a kill, the OOM killer, a hang), not a bug: its message says it all."""


class RemoteStageError(RuntimeError):
    """An unexpected exception inside a stage process; `remote_traceback` is its traceback."""

    def __init__(self, text: str, remote_traceback: str) -> None:
        super().__init__(text)
        self.remote_traceback = remote_traceback


def source_ref(source: Any) -> SourceRef:
    """How a stage process reopens the model source (never by pickling its tensors)."""
    from engine.io.gguf_model import LoadedModel
    from engine.io.synth import SyntheticSource

    if isinstance(source, LoadedModel):
        return SourceRef("gguf", path=str(source.path))
    if isinstance(source, SyntheticSource):
        return SourceRef("synthetic", recipe=source.recipe, device=str(source.device))
    raise ConfigError("executor", "processes", "threads for this model source",
                      f"a stage process reopens its model from a GGUF file or a synthetic recipe, "
                      f"not from a {type(source).__name__}")


@dataclass(frozen=True)
class StageExperts:
    """What the controller's expert plan gives one stage process (streamed experts)."""

    slots: int
    pin_bytes: int
    pin_note: str


class RemoteCache:
    """The controller's stand-in for a stage process's ExpertCache: the stats that stage last
    reported for the current run (the report reads `stats`, `synchronize()` first)."""

    chunk = -1

    def __init__(self, ex, stats: ExpertStats) -> None:
        self._ex = weakref.ref(ex)  # the ProcessExecutor
        self.stats = stats

    def update(self, values: dict) -> None:
        for f in dataclasses.fields(ExpertStats):
            if f.name in values:
                setattr(self.stats, f.name, values[f.name])

    def reset_stats(self) -> None:
        s = self.stats
        s.hits = s.misses = s.bytes_pinned = s.bytes_pageable = s.stream_ns = 0

    def synchronize(self) -> None:
        """Take in what the stage processes have sent (their stats precede the message the
        controller last waited for, so they are in the pipes by now)."""
        ex = self._ex()
        if ex is not None and ex._job is not None:
            ex._job.collect()

    def drain_timings(self, clock) -> list:
        return []  # stream events come from the stage process as events

    def expand(self, *args, **kwargs):  # pragma: no cover - the controller holds no layers
        raise RuntimeError("the controller holds no experts (they stream in the stage processes)")


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "stopped responding"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"died: killed by signal {-code} ({name})"
    return f"died: exit code {code}"


@dataclass
class _Member:
    """One stage process as the controller sees it."""

    rank: int
    device: str
    proc: Any
    conn: Any
    pid: int = 0
    host: str = ""
    offset_ns: int = 0  # its perf_counter minus ours (0 on this host: one monotonic clock)
    measured_offset_ns: int = 0
    rtt_ns: int = 0
    last_chunk: int = -1
    waiting_on: int = -1  # the peer stage it blocks on (-1: none: computing, or idle between runs)
    state_t: float = 0.0  # when it last said so
    closed: bool = False  # its pipe reached EOF
    arena: tuple[int, int, str] | None = None  # streamed experts: (bytes, page-locked bytes, pin note)

    def where(self) -> str:
        return f"stage {self.rank} ({self.device} on host {self.host or '?'}, pid {self.pid or self.proc.pid})"


@dataclass
class _Inbox:
    """What the stages reported during one wait."""

    ready: set = field(default_factory=set)
    returned: int = -1
    prefill_done: dict = field(default_factory=dict)
    tokens: dict = field(default_factory=dict)
    run_closed: set = field(default_factory=set)
    pongs: dict = field(default_factory=dict)
    measured: Any = None
    loaded: int = 0


class _Attached:
    """Stands for the Process of a stage started elsewhere: its connection is its life (closing
    it ends the stage, which exits when its controller's connection does)."""

    sentinel = None
    exitcode = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.gone = False

    def is_alive(self) -> bool:
        return not self.gone

    def kill(self) -> None:
        self.gone = True

    def join(self, timeout: float | None = None) -> None:
        pass


def _tcp_store(bind: str, port: int, timeout_s: float, rendezvous: str):
    """The process group's store for attached stages, listening only on `bind` (torch's TCPStore
    alone would listen on every interface: it is handed a socket bound here instead)."""
    import torch.distributed as dist

    try:
        sock = socket.create_server((bind, port), family=socket.AF_INET6 if ":" in bind else socket.AF_INET,
                                    backlog=64)
    except OSError as exc:
        raise ConfigError("rendezvous", rendezvous, "a HOST:PORT whose PORT+1 is free too",
                          f"cannot start the process group's store on {bind}:{port}: {exc.strerror or exc}") from None
    try:
        store = dist.TCPStore(bind, port, world_size=None, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.detach(),
                              use_libuv=LIBUV)
    except Exception as exc:  # torch raises DistNetworkError (a RuntimeError)
        raise ConfigError("rendezvous", rendezvous, "a HOST:PORT whose PORT+1 is free too",
                          f"cannot start the process group's store on {bind}:{port}: {exc}") from None
    return store


def _kill_all(members: list[_Member], store_dir: str | None = None) -> None:
    """Kill and join every stage process (also run by the session's finalizer)."""
    for m in members:
        if m.proc.is_alive():
            m.proc.kill()
    for m in members:
        m.proc.join(STOP_GRACE_S)
        try:
            m.conn.close()
        except OSError:
            pass
    if store_dir:
        shutil.rmtree(store_dir, ignore_errors=True)


def _remote_cause(m: _Member, type_name: str, text: str, tb: str) -> BaseException:
    """The exception a stage process reported, as the controller raises it (inside a StageError)."""
    if type_name == "NonFiniteError":
        return NonFiniteError(text)
    if type_name in ("OutOfMemoryError", "MemoryError"):
        return MemoryError(f"{text} (on host {m.host})")
    log.error("stage %d (pid %d on %s) failed:\n%s", m.rank, m.pid, m.host, tb)
    return RemoteStageError(f"{type_name}: {text} (in the stage process on host {m.host}, pid {m.pid})", tb)


def job_notes(job: StageJob, expert_plan) -> list[str]:
    """The report's lines about the stage processes: pids, hosts, clock offsets, host arenas."""
    out = [f"executor processes ({job.backend}): " + "; ".join(
        f"stage {m.rank} pid {m.pid} on {m.host}: clock offset {m.measured_offset_ns / 1e3:+.1f} us measured "
        f"(round trip {m.rtt_ns / 1e3:.0f} us), {m.offset_ns / 1e3:+.1f} us applied" for m in job.members)]
    arenas = [m for m in job.members if m.arena is not None]
    if arenas:
        out.append(f"executor processes: experts {expert_plan.reason}; a host arena per stage process: " + "; ".join(
            f"stage {m.rank} {size_text(m.arena[0])}, {size_text(m.arena[1])} page-locked ({m.arena[2]})"
            for m in arenas) + f"; {size_text(sum(m.arena[1] for m in arenas))} page-locked in all")
    return out


class StageJob:
    """The stage processes of one session, their pipes and the rendezvous store (see the module
    doc); `ex` is the `ProcessExecutor` that owns it."""

    def __init__(self, ex) -> None:
        self.ex = ex
        session = ex.session
        self.host = socket.gethostname()
        self.world = len(session.stages)
        self.backend = ex.backend
        rendezvous = session.config.rendezvous
        self.store_dir: str | None = None
        self.store = None
        if rendezvous:  # stages elsewhere meet at a TCP store at the rendezvous port + 1, bound where asked
            controller_key()  # an empty or short key is refused before any port opens
            host, port = rendezvous_address(rendezvous)
            bind, store_port = bind_host(host), port + 1
            self.store = _tcp_store(bind, store_port, ex.timeout_s, rendezvous)
            store_host = "" if host in ("", "0.0.0.0", "::") else host
        else:  # spawned stages meet through a file in a private folder: no port is opened
            self.store_dir = tempfile.mkdtemp(prefix="strata-store-")
            store_host, store_port = "", 0
        self._store_at = (store_host, store_port)
        self.members: list[_Member] = []
        self.inbox = _Inbox()
        self.emit: Callable[[StageEvent], None] = lambda ev: None  # the current run's (set by its prefill)
        self.note: Callable[[str], None] = lambda text: None  # the current run's report notes
        self.run_id = ""  # the current run (stage stats and notes of another are dropped)
        self._finalizer = weakref.finalize(self, _kill_all, self.members, self.store_dir)
        try:
            if rendezvous:
                self.attach(rendezvous)
            else:
                self.spawn()
            self.pump(lambda: len(self.inbox.ready) == self.world, "starting the stage processes",
                      progress=self._load_progress)
            self.measure_clocks()
        except BaseException:
            self.kill()
            raise

    def spec_of(self, st, parent_pid: int) -> StageSpec:
        """What stage `st`'s process needs to reopen the model, load its layers and join the group."""
        ex, session = self.ex, self.ex.session
        experts = ex.stage_experts[st.index] if ex.stage_experts else StageExperts(0, 0, "")
        store_host, store_port = self._store_at
        return StageSpec(rank=st.index, world=self.world, device=st.name, first=st.first, end=st.end,
                         source=source_ref(session.source),
                         dtype=str(session.dtypes[st.device]).removeprefix("torch."),
                         store_host=store_host, store_port=store_port, backend=ex.backend,
                         store_path=str(Path(self.store_dir) / "store") if self.store_dir else "",
                         threads=torch.get_num_threads(), timeout_s=ex.timeout_s,
                         parent_pid=parent_pid, ranges=tuple((s.first, s.end) for s in session.stages),
                         hooks=ex.child_hooks, expert_slots=experts.slots, pin_bytes=experts.pin_bytes,
                         pin_note=experts.pin_note)

    def spawn(self) -> None:
        """One process per stage on this machine, each with its end of a duplex pipe."""
        import torch.multiprocessing as mp

        from engine.pipeline import stage_process

        ctx = mp.get_context("spawn")
        for st in self.ex.session.stages:
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=stage_process.main, args=(self.spec_of(st, os.getpid()), theirs),
                               daemon=True, name=f"strata-stage{st.index}")
            proc.start()
            theirs.close()  # ours reaches EOF when the stage process is gone
            self.members.append(_Member(st.index, st.name, proc, ours, host=self.host))  # spawned here

    def attach(self, rendezvous: str) -> None:
        """Wait for the stages started elsewhere (`strata-bench stage --rendezvous HOST:PORT`, one
        per rank; engine/pipeline/stage_rendezvous.py), choose the backend from where they run, and hand
        each its spec."""
        ex, session = self.ex, self.ex.session
        if ex.child_hooks is not None:
            raise ConfigError("rendezvous", rendezvous, "no pipeline hooks with attached stages",
                              "hooks reach spawned stage processes only (they do not travel over the network)")
        by_rank = wait_for_stages(rendezvous, self.world, ex.timeout_s, self.host, session._progress)
        for r in range(self.world):
            conn, hello = by_rank[r]
            self.members.append(_Member(r, session.stages[r].name, _Attached(hello.pid), conn, pid=hello.pid,
                                        host=hello.host))
        # NCCL when every stage owns a GPU of its own (the same cuda:N on two hosts are two GPUs)
        owners = [(m.host, m.device) for m in self.members]
        cuda = all(d.startswith("cuda") for _, d in owners)
        ex.backend = self.backend = ("nccl" if cuda and len(set(owners)) == len(owners)
                                     and torch.distributed.is_nccl_available() else "gloo")
        ex.choose_handoffs()
        for m, st in zip(self.members, session.stages):
            m.conn.send(Assign(self.spec_of(st, 0)))

    def _load_progress(self) -> None:
        session = self.ex.session
        if session._load_cancel is not None and session._load_cancel.is_set():
            raise Cancelled("loading cancelled while the stage processes started")
        n_layers = session.spec.n_layers
        session._progress("loading layers in the stage processes", min(self.inbox.loaded / max(n_layers, 1), 1.0))

    @property
    def timeout_s(self) -> float:
        return self.ex.timeout_s

    # ----------------------------------------------------------------- messages
    def send(self, rank: int, msg) -> None:
        m = self.members[rank]
        try:
            m.conn.send(msg)
        except (OSError, EOFError):
            self.lost(m)

    def pump(self, done: Callable[[], bool], what: str, progress: Callable[[], None] | None = None) -> None:
        """Handle messages until `done()`; a dead stage or `timeout_s` without any message ends it."""
        deadline = time.monotonic() + self.timeout_s
        by_conn = {m.conn: m for m in self.members}
        by_sentinel = {m.proc.sentinel: m for m in self.members if m.proc.sentinel is not None}
        while not done():
            conns = [m.conn for m in self.members if not m.closed]
            ready = wait_any(conns + list(by_sentinel), timeout=POLL_S)
            got = False
            for obj in ready:
                m = by_conn.get(obj)
                if m is None:
                    continue
                try:
                    msg = m.conn.recv()
                except (EOFError, OSError, wire.WireError):
                    m.closed = True
                    self.lost(m)
                got = True
                self.handle(m, msg)
                if done():
                    return
            for obj in ready:
                m = by_sentinel.get(obj)
                if m is not None:
                    self.drain(m)
                    self.lost(m)
            if got:
                deadline = time.monotonic() + self.timeout_s
                if progress is not None:
                    progress()
            elif time.monotonic() > deadline:
                self.hung(what)

    def drain(self, m: _Member) -> None:
        """The messages a dead stage sent before it died (its error, its last events)."""
        while not m.closed:
            try:
                if not m.conn.poll():
                    return
                msg = m.conn.recv()
            except (EOFError, OSError, wire.WireError):
                m.closed = True
                return
            self.handle(m, msg)

    def handle(self, m: _Member, msg) -> None:
        box = self.inbox
        if isinstance(msg, StageEvent):  # onto this process's clock
            off = m.offset_ns
            if msg.kind == "compute":
                m.last_chunk = max(m.last_chunk, msg.chunk)
            self.emit(dataclasses.replace(msg, start_ns=msg.start_ns - off, end_ns=msg.end_ns - off))
        elif isinstance(msg, Waiting):
            m.waiting_on, m.state_t = msg.peer, time.monotonic()
        elif isinstance(msg, Computed):
            m.last_chunk = msg.chunk
        elif isinstance(msg, Returned):
            box.returned = msg.chunk
        elif isinstance(msg, PrefillDone):
            box.prefill_done[m.rank] = msg
        elif isinstance(msg, Token):
            box.tokens[msg.step] = msg.token
        elif isinstance(msg, RunClosed):
            box.run_closed.add(m.rank)
        elif isinstance(msg, Pong):
            box.pongs[m.rank] = msg.t_ns
        elif isinstance(msg, Measured):
            box.measured = msg
        elif isinstance(msg, Loaded):
            box.loaded += 1
        elif isinstance(msg, ExpertReport):  # a stage's expert stats of the run so far
            cache = self.ex.session.stages[msg.rank].cache
            if msg.run_id == self.run_id and isinstance(cache, RemoteCache):
                cache.update(msg.stats)
        elif isinstance(msg, Note):  # for the run report (graph captures, fallbacks)
            if msg.run_id == self.run_id:
                self.note(msg.text)
        elif isinstance(msg, ArenaFilled):
            m.arena = (msg.nbytes, msg.pinned_bytes, msg.pin_note)
        elif isinstance(msg, Ready):
            m.pid, m.host = msg.pid, msg.host
            box.ready.add(msg.rank)
        elif isinstance(msg, Failure):
            self.remote_error(m, msg)

    # ------------------------------------------------------------------- faults
    def remote_error(self, m: _Member, msg: Failure) -> None:
        """An exception in a stage.  When another stage died just before (its peers' send/recv
        then fail), the dead one is the cause and is named instead."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for o in self.members:
                if o is not m and isinstance(o.proc, _Attached) and not o.closed:
                    self.drain(o)  # an attached stage has no exit code: its closed connection says it died
            dead = [o for o in self.members if o is not m and (
                (o.proc.exitcode is not None and o.proc.exitcode < 0) or (isinstance(o.proc, _Attached) and o.closed))]
            if dead:
                self.lost(dead[0])
            time.sleep(0.05)
        log.debug("stage %d failed:\n%s", msg.rank, msg.traceback)
        cause = _remote_cause(m, msg.type_name, msg.text, msg.traceback)
        self.kill()
        raise StageError(msg.rank, m.device, msg.chunk if msg.chunk is not None else m.last_chunk, msg.layer, cause)

    def lost(self, m: _Member) -> None:
        m.proc.join(1.0)
        reason = ("closed its connection (its process ended or its host went away)" if isinstance(m.proc, _Attached)
                  else _exit_reason(m.proc.exitcode))
        self.fail(m, f"{m.where()} {reason}")

    def hung(self, what: str) -> None:
        """No message for timeout_s: blame the stage at the end of the chain of waits from stage
        0 (the one that blocks on nobody); in a cycle of waits (a stage stopped inside its
        wait), the one whose state is oldest."""
        m, seen = self.members[0], []
        while m.waiting_on >= 0 and m not in seen and m.waiting_on < len(self.members):
            seen.append(m)
            m = self.members[m.waiting_on]
        if m in seen:
            m = min(seen, key=lambda x: x.state_t)
        self.fail(m, f"{m.where()} made no progress for {self.timeout_s:g} s while {what} ({TIMEOUT_ENV})")

    def fail(self, m: _Member, text: str) -> None:
        last = f"C{m.last_chunk}" if m.last_chunk >= 0 else "none"
        self.kill()
        raise StageError(m.rank, f"{m.device} on {m.host or '?'}", m.last_chunk, None, StageLost(
            f"{text}; its last chunk computed: {last}. Every stage process was stopped; the next run "
            f"starts them again"))

    def kill(self) -> None:
        self.ex._job = None if self.ex._job is self else self.ex._job
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
        else:
            _kill_all(self.members)
        self.store = None

    # ------------------------------------------------------------------ clocks
    def measure_clocks(self) -> None:
        """Each stage's perf_counter offset from ours: the ping of least round trip.  On this host
        the clock is one (CLOCK_MONOTONIC / QueryPerformanceCounter), so the offset applied is 0
        and the measured one is a check; on another host the measured offset is applied."""
        for m in self.members:
            best: tuple[int, int] | None = None
            for _ in range(PINGS):
                self.inbox.pongs.pop(m.rank, None)
                t0 = time.perf_counter_ns()
                self.send(m.rank, Ping())
                self.pump(lambda: m.rank in self.inbox.pongs, f"measuring the clock of stage {m.rank}")  # noqa: B023  (called before the loop moves on)
                t1 = time.perf_counter_ns()
                cand = (t1 - t0, self.inbox.pongs[m.rank] - (t0 + t1) // 2)
                best = cand if best is None or cand[0] < best[0] else best
            m.rtt_ns, m.measured_offset_ns = best
            m.offset_ns = 0 if m.host == self.host else m.measured_offset_ns

    def collect(self) -> None:
        """Handle what every stage has already sent, without waiting."""
        for m in self.members:
            self.drain(m)

    # -------------------------------------------------------------------- runs
    def measure(self, sizes, prefix: int, probe: int, reps: int, graphs: bool = False) -> tuple:
        """Stage 0's chunk-cost probe: ({size: seconds}, attention seconds per key, launch seconds)."""
        self.inbox.measured = None
        self.send(0, Measure(tuple(sizes), prefix, probe, reps, graphs))
        self.pump(lambda: self.inbox.measured is not None, "measuring the chunk cost on stage 0")
        m: Measured = self.inbox.measured
        return dict(m.layer_s), m.attn_s, m.host_s

    def stop(self) -> None:
        """A clean exit: each stage leaves its group; any that does not in time is killed."""
        for m in self.members:
            try:
                m.conn.send(Stop())
            except (OSError, EOFError):
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        for m in self.members:
            m.proc.join(max(deadline - time.monotonic(), 0.0))
        self.kill()


