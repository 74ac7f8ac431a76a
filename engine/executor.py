"""Stages as processes (`executor=processes`): the controller side.

`ProcessSession` keeps the `Session` API and its report: `Session(source, config)` with
`config.executor == "processes"` builds one (see `Session.__new__`).  Instead of loading layers
into this process it starts one process per stage (engine/stage_process.py: the stage reopens
the model source and owns its device, layers and KV), joined in a torch.distributed group
whose rendezvous store this process hosts.  The controller drives the root prefill loop (one
chunk command to stage 0 at a time, cancel at a chunk boundary, "end" as the finish guard),
receives every stage's events through its pipe and re-times them onto its own clock, so the
sink, the report and the GUI see what the threaded executor gives them.

Faults: every wait is bounded.  A stage process that dies ends the run at once; one that makes
no progress for `timeout_s` (STRATA_STAGE_TIMEOUT_S, default 60) ends it after that long.  The
message names the stage, its host, its pid and the last chunk it computed.  Every stage process
is then killed and joined (none is left behind) and the next run starts them again.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import signal
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait as wait_any
from pathlib import Path
from typing import Any

import torch

from . import settings_table, wire
from .chunk_cost import Measured, ProbeShape
from .config import ConfigError, rendezvous_address
from .errors import Cancelled, NonFiniteError, StageError
from .events import StageEvent
from .experts import ExpertStats, arena_bytes, resolve_pin_limit
from .pipeline import Session
from .rendezvous_key import attach_commands, bind_host, controller_key, exposure_warning
from .sizes import size_text
from .stage import StageContext
from .stage_process import LIBUV, RunOrder, SourceRef, StageSpec, hello_fields, versions

log = logging.getLogger(__name__)

TIMEOUT_ENV = settings_table.row("stage_timeout_s").env
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0
POLL_S = 0.2  # how often a wait looks at the stage processes' liveness and its deadline
PINGS = 7  # clock-offset exchanges per stage at start-up (the one of least round trip counts)
STOP_GRACE_S = 5.0  # a stopped stage process that has not exited by then is killed
HANDSHAKE_S = 10.0  # an attaching connection proves the key and says hello within this
MAX_PENDING = 32  # connections in their handshake at once (more are closed at once)


class StageLost(RuntimeError):
    """A stage process died or stopped responding (the run ended; the job was torn down).
    What the machine did (a kill, the OOM killer, a hang), not a bug: its message says it all."""


class RemoteStageError(RuntimeError):
    """An unexpected exception inside a stage process; `remote_traceback` is its traceback."""

    def __init__(self, text: str, remote_traceback: str) -> None:
        super().__init__(text)
        self.remote_traceback = remote_traceback


def stage_timeout(env: dict | None = None) -> float:
    """Seconds without progress after which a stage counts as hung (validated like a setting)."""
    raw = settings_table.env_value("stage_timeout_s", env) or ""
    if raw.strip() == "":
        return DEFAULT_TIMEOUT_S
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not (0 < v <= MAX_TIMEOUT_S):  # NaN and inf fail too; a week is past any real wait (timedelta's range)
        raise ConfigError(TIMEOUT_ENV, raw, f"a number of seconds in (0, {MAX_TIMEOUT_S:g}]")
    return v


def source_ref(source: Any) -> SourceRef:
    """How a stage process reopens the model source (never by pickling its tensors)."""
    from .gguf_model import LoadedModel
    from .synth import SyntheticSource

    if isinstance(source, LoadedModel):
        return SourceRef("gguf", path=str(source.path))
    if isinstance(source, SyntheticSource):
        return SourceRef("synthetic", recipe=source.recipe, device=str(source.device))
    raise ConfigError("executor", "processes", "threads for this model source",
                      f"a stage process reopens its model from a GGUF file or a synthetic recipe, "
                      f"not from a {type(source).__name__}")


def split_pin_limit(limit: int, arena_sizes: list[int], pins: list[bool]) -> list[int]:
    """Each stage process's share of the pin limit: the stages that pin (CUDA devices) share it
    in proportion to their arenas' bytes, rounded down, so the page-locked total never exceeds
    `limit` whatever each arena makes of its share."""
    total = sum(b for b, p in zip(arena_sizes, pins) if p)
    if limit <= 0 or total <= 0:
        return [0] * len(arena_sizes)
    return [min(limit * b // total, b) if p else 0 for b, p in zip(arena_sizes, pins)]


@dataclass(frozen=True)
class StageExperts:
    """What the controller's expert plan gives one stage process (streamed experts)."""

    slots: int
    pin_bytes: int
    pin_note: str


class _RemoteCache:
    """The controller's stand-in for a stage process's ExpertCache: the stats that stage last
    reported for the current run (the report reads `stats`, `synchronize()` first)."""

    chunk = -1

    def __init__(self, session: ProcessSession, stats: ExpertStats) -> None:
        self._session = weakref.ref(session)
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
        session = self._session()
        if session is not None:
            session._collect()

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


def _versions(v: dict[str, str]) -> str:
    return ", ".join(f"{k} {x}" for k, x in sorted(v.items()))


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


class _Job:
    """The stage processes of one session, their pipes and the rendezvous store."""

    def __init__(self, session: ProcessSession) -> None:
        import torch.multiprocessing as mp

        from . import stage_process

        self.session = session
        self.host = socket.gethostname()
        world = len(session.stages)
        self.backend = session.backend
        rendezvous = session.config.rendezvous
        self.store_dir: str | None = None
        self.store = None
        if rendezvous:  # stages elsewhere meet at a TCP store at the rendezvous port + 1, bound where asked
            controller_key()  # an empty or short key is refused before any port opens
            host, port = rendezvous_address(rendezvous)
            bind, store_port = bind_host(host), port + 1
            self.store = _tcp_store(bind, store_port, session.timeout_s, rendezvous)
            store_host = "" if host in ("", "0.0.0.0", "::") else host
        else:  # spawned stages meet through a file in a private folder: no port is opened
            self.store_dir = tempfile.mkdtemp(prefix="strata-store-")
            store_host, store_port = "", 0
        ref = source_ref(session.source)
        ranges = tuple((st.first, st.end) for st in session.stages)
        self.members: list[_Member] = []
        self.inbox = _Inbox()
        self.emit: Callable[[StageEvent], None] = lambda ev: None  # the current run's (set by its prefill)
        self.note: Callable[[str], None] = lambda text: None  # the current run's report notes
        self.run_id = ""  # the current run (stage stats and notes of another are dropped)
        self._finalizer = weakref.finalize(self, _kill_all, self.members, self.store_dir)

        experts = session.stage_experts

        def spec_of(st, parent_pid: int) -> StageSpec:
            ex = experts[st.index] if experts else StageExperts(0, 0, "")
            return StageSpec(rank=st.index, world=world, device=st.name, first=st.first, end=st.end,
                             source=ref, dtype=str(session.dtypes[st.device]).removeprefix("torch."),
                             store_host=store_host, store_port=store_port, backend=session.backend,
                             store_path=str(Path(self.store_dir) / "store") if self.store_dir else "",
                             threads=torch.get_num_threads(), timeout_s=session.timeout_s,
                             parent_pid=parent_pid, ranges=ranges, hooks=session.child_hooks,
                             expert_slots=ex.slots, pin_bytes=ex.pin_bytes, pin_note=ex.pin_note)

        try:
            if rendezvous:
                self.attach(rendezvous, spec_of)
            else:
                ctx = mp.get_context("spawn")
                for st in session.stages:
                    ours, theirs = ctx.Pipe(duplex=True)
                    proc = ctx.Process(target=stage_process.main, args=(spec_of(st, os.getpid()), theirs),
                                       daemon=True, name=f"strata-stage{st.index}")
                    proc.start()
                    theirs.close()  # ours reaches EOF when the stage process is gone
                    self.members.append(_Member(st.index, st.name, proc, ours, host=self.host))  # spawned here
            n_layers = session.spec.n_layers

            def progress() -> None:
                if session._load_cancel is not None and session._load_cancel.is_set():
                    raise Cancelled("loading cancelled while the stage processes started")
                session._progress("loading layers in the stage processes", min(self.inbox.loaded / max(n_layers, 1), 1.0))

            self.pump(lambda: len(self.inbox.ready) == world, "starting the stage processes", progress=progress)
            self.measure_clocks()
        except BaseException:
            self.kill()
            raise

    def attach(self, rendezvous: str, spec_of: Callable) -> None:
        """Wait for the stages started elsewhere (`strata-bench stage --rendezvous HOST:PORT`, one
        per rank) to connect and prove the key, check what they say about themselves, and hand
        each its spec.  Each connection is handled on its own thread under a deadline, so a stray,
        silent or hostile client never holds up the real stages."""
        import queue

        host, port = rendezvous_address(rendezvous)
        key = controller_key()
        world = len(self.session.stages)
        if self.session.child_hooks is not None:
            raise ConfigError("rendezvous", rendezvous, "no pipeline hooks with attached stages",
                              "hooks reach spawned stage processes only (they do not travel over the network)")
        try:
            listener = socket.create_server((bind_host(host), port),
                                            family=socket.AF_INET6 if ":" in bind_host(host) else socket.AF_INET)
        except OSError as exc:
            raise ConfigError("rendezvous", rendezvous, "a HOST:PORT this machine can listen on",
                              f"cannot listen: {exc.strerror or exc}") from None
        warning = exposure_warning(host)
        if warning:
            log.warning("%s", warning)
        commands = attach_commands(rendezvous, world, key.decode())
        log.warning("waiting for %d stage(s) at %s; start each with:\n  %s", world, rendezvous, "\n  ".join(commands))
        self.session._progress(f"waiting for {world} stage(s) to attach at {rendezvous}", 0.0)
        arrived: queue.SimpleQueue = queue.SimpleQueue()
        handshake_s = min(HANDSHAKE_S, self.timeout_s)
        pending = threading.BoundedSemaphore(MAX_PENDING)

        def greet(sock: socket.socket, peer: str) -> None:
            try:
                ch = wire.accept(sock, key, time.monotonic() + handshake_s, self.timeout_s)
                hello = hello_fields(ch.recv(timeout=handshake_s))
                arrived.put((ch, hello))
            except (OSError, EOFError, wire.WireError, ValueError) as exc:
                log.warning("refused a connection to %s from %s: %s", rendezvous, peer, exc or type(exc).__name__)
                sock.close()
            finally:
                pending.release()

        def accept() -> None:
            while True:
                try:
                    sock, addr = listener.accept()
                except OSError:  # the listener was closed: every stage is in, or the wait ended
                    return
                peer = f"{addr[0]}:{addr[1]}"
                if not pending.acquire(blocking=False):
                    log.warning("refused a connection to %s from %s: %d handshakes already pending",
                                rendezvous, peer, MAX_PENDING)
                    sock.close()
                    continue
                threading.Thread(target=greet, args=(sock, peer), daemon=True, name="strata-greet").start()

        threading.Thread(target=accept, daemon=True, name="strata-rendezvous").start()
        mine = versions()
        deadline = time.monotonic() + self.timeout_s
        by_rank: dict[int, _Member] = {}
        try:
            while len(by_rank) < world:
                left = deadline - time.monotonic()
                try:
                    conn, (rank, their_world, pid, host_name, theirs) = arrived.get(timeout=max(left, 0.01))
                except queue.Empty:
                    raise ConfigError("rendezvous", rendezvous, f"{world} stages attached",
                                      f"only ranks {sorted(by_rank) or 'none'} attached within {self.timeout_s:g} s; "
                                      f"start `{commands[0]}` with each rank") from None
                why = fatal = ""
                if theirs != mine:
                    fatal = (f"version mismatch between hosts: stage {rank} on host {host_name} runs "
                             f"{_versions(theirs)}, the controller on {self.host} {_versions(mine)}")
                elif their_world != world:
                    fatal = f"stage {rank} on host {host_name} expects {their_world} stages, this split has {world}"
                elif not 0 <= rank < world or rank in by_rank:
                    why = f"rank {rank} from host {host_name} is out of range or taken (ranks 0..{world - 1})"
                if why or fatal:
                    try:
                        conn.send(("refused", why or fatal))
                    except OSError:
                        pass
                    conn.close()
                    if fatal:
                        raise ConfigError("rendezvous", rendezvous, "stages of the same versions, one per rank", fatal)
                    log.warning("refused a stage at %s: %s", rendezvous, why)
                    continue
                st = self.session.stages[rank]
                by_rank[rank] = _Member(rank, st.name, _Attached(pid), conn, pid=pid, host=host_name)
                self.session._progress(f"waiting for {world} stage(s) to attach at {rendezvous}", len(by_rank) / world)
        except BaseException:
            for m in by_rank.values():
                m.conn.close()
            raise
        finally:
            listener.close()
        self.members.extend(by_rank[r] for r in range(world))
        # NCCL when every stage owns a GPU of its own (the same cuda:N on two hosts are two GPUs)
        owners = [(m.host, m.device) for m in self.members]
        cuda = all(d.startswith("cuda") for _, d in owners)
        self.session.backend = self.backend = ("nccl" if cuda and len(set(owners)) == len(owners)
                                               and torch.distributed.is_nccl_available() else "gloo")
        self.session._choose_handoffs()
        for m, st in zip(self.members, self.session.stages):
            m.conn.send(("spec", spec_of(st, 0)))

    @property
    def timeout_s(self) -> float:
        return self.session.timeout_s

    # ----------------------------------------------------------------- messages
    def send(self, rank: int, msg: tuple) -> None:
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

    def handle(self, m: _Member, msg: tuple) -> None:
        kind = msg[0]
        box = self.inbox
        if kind == "ev":
            _, rank, run_id, name, chunk, ev_kind, t0, t1, tokens, nbytes, note = msg
            off = m.offset_ns
            if ev_kind == "compute":
                m.last_chunk = max(m.last_chunk, chunk)
            self.emit(StageEvent(run_id, rank, name, chunk, ev_kind, t0 - off, t1 - off, tokens, nbytes, note))
        elif kind == "state":
            m.waiting_on, m.state_t = msg[2], time.monotonic()
        elif kind == "computed":
            m.last_chunk = msg[2]
        elif kind == "returned":
            box.returned = msg[2]
        elif kind == "prefill_done":
            box.prefill_done[m.rank] = msg[2:]
        elif kind == "token":
            box.tokens[msg[2]] = msg[3]
        elif kind == "run_closed":
            box.run_closed.add(m.rank)
        elif kind == "pong":
            box.pongs[m.rank] = msg[2]
        elif kind == "measured":
            box.measured = msg[2]
        elif kind == "loaded":
            box.loaded += 1
        elif kind == "experts":  # a stage's expert stats of the run so far
            _, rank, run_id, values = msg
            cache = self.session.stages[rank].cache
            if run_id == self.run_id and isinstance(cache, _RemoteCache):
                cache.update(values)
        elif kind == "note":  # for the run report (graph captures, fallbacks)
            _, rank, run_id, text = msg
            if run_id == self.run_id:
                self.note(text)
        elif kind == "arena":
            m.arena = msg[2:]
        elif kind == "ready":
            _, rank, m.pid, m.host, _device = msg
            box.ready.add(rank)
        elif kind == "error":
            self.remote_error(m, msg)

    # ------------------------------------------------------------------- faults
    def remote_error(self, m: _Member, msg: tuple) -> None:
        """An exception in a stage.  When another stage died just before (its peers' send/recv
        then fail), the dead one is the cause and is named instead."""
        _, rank, chunk, layer, type_name, text, tb = msg
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
        log.debug("stage %d failed:\n%s", rank, tb)
        cause: BaseException
        if type_name == "NonFiniteError":
            cause = NonFiniteError(text)
        elif type_name in ("OutOfMemoryError", "MemoryError"):
            cause = MemoryError(f"{text} (on host {m.host})")
        else:
            cause = RemoteStageError(f"{type_name}: {text} (in the stage process on host {m.host}, pid {m.pid})", tb)
            log.error("stage %d (pid %d on %s) failed:\n%s", rank, m.pid, m.host, tb)
        self.kill()
        raise StageError(rank, m.device, chunk if chunk is not None else m.last_chunk, layer, cause)

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
        self.session._job = None if self.session._job is self else self.session._job
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
                self.send(m.rank, ("ping",))
                self.pump(lambda: m.rank in self.inbox.pongs, f"measuring the clock of stage {m.rank}")  # noqa: B023  (called before the loop moves on)
                t1 = time.perf_counter_ns()
                cand = (t1 - t0, self.inbox.pongs[m.rank] - (t0 + t1) // 2)
                best = cand if best is None or cand[0] < best[0] else best
            m.rtt_ns, m.measured_offset_ns = best
            m.offset_ns = 0 if m.host == self.host else m.measured_offset_ns

    def notes(self) -> list[str]:
        out = [f"executor processes ({self.backend}): " + "; ".join(
            f"stage {m.rank} pid {m.pid} on {m.host}: clock offset {m.measured_offset_ns / 1e3:+.1f} us measured "
            f"(round trip {m.rtt_ns / 1e3:.0f} us), {m.offset_ns / 1e3:+.1f} us applied" for m in self.members)]
        arenas = [m for m in self.members if m.arena is not None]
        if arenas:
            plan = self.session.expert_plan
            out.append(f"executor processes: experts {plan.reason}; a host arena per stage process: " + "; ".join(
                f"stage {m.rank} {size_text(m.arena[0])}, {size_text(m.arena[1])} page-locked ({m.arena[2]})"
                for m in arenas) + f"; {size_text(sum(m.arena[1] for m in arenas))} page-locked in all")
        return out

    def collect(self) -> None:
        """Handle what every stage has already sent, without waiting."""
        for m in self.members:
            self.drain(m)

    # -------------------------------------------------------------------- runs
    def measure(self, sizes, prefix: int, probe: int, reps: int, graphs: bool = False) -> tuple:
        self.inbox.measured = None
        self.send(0, ("measure", tuple(sizes), prefix, probe, reps, graphs))
        self.pump(lambda: self.inbox.measured is not None, "measuring the chunk cost on stage 0")
        return self.inbox.measured

    def stop(self) -> None:
        """A clean exit: each stage leaves its group; any that does not in time is killed."""
        for m in self.members:
            try:
                m.conn.send(("stop",))
            except (OSError, EOFError):
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        for m in self.members:
            m.proc.join(max(deadline - time.monotonic(), 0.0))
        self.kill()


class ProcessSession(Session):
    """A `Session` whose stages run as processes (see the module doc)."""

    _job: _Job | None = None

    # ------------------------------------------------------------------- set-up
    def _load_weights(self) -> None:
        self.timeout_s = stage_timeout()
        source_ref(self.source)  # refused before any process starts
        self.stage_experts = self._plan_stage_experts()  # refuses a pin limit the machine cannot honour
        hooks = self.hooks
        self.child_hooks = hooks if (hooks.after_layer or hooks.before_alloc) else None
        if self.child_hooks is not None:
            try:
                pickle.dumps(self.child_hooks)
            except Exception as exc:
                raise ConfigError("executor", "processes", "threads for these hooks",
                                  f"pipeline hooks must be picklable to reach a stage process: {exc}") from None
        cuda = [st.device for st in self.stages if st.device.type == "cuda"]
        distinct = len(set(cuda)) == len(cuda) == len(self.stages)
        self.backend = "nccl" if distinct and torch.distributed.is_nccl_available() else "gloo"
        self._run_open = False
        self._in_flight = 0
        self._start_job()

    def _plan_stage_experts(self) -> list[StageExperts]:
        """Streamed experts: each stage process gets the slots the plan gives its stage and a
        share of the pin limit (resolved here as the threaded executor resolves it for its one
        arena); the controller shows each stage's stats through a `_RemoteCache`."""
        plan = self.expert_plan
        if not plan.streamed:
            return []
        cudas = [st.device.type == "cuda" for st in self.stages]
        sizes = [arena_bytes(self.expert_layouts[st.first:st.end], self.spec.n_experts) for st in self.stages]
        limit, note = resolve_pin_limit(self.config.pin_limit_gib, sum(sizes), any(cudas))
        shares = split_pin_limit(limit, sizes, cudas)
        out = []
        for st, slots, share, cuda in zip(self.stages, plan.slots_per_stage, shares, cudas):
            why = (f"{note}; its share {size_text(share)} of {size_text(limit)}, split by arena size" if cuda
                   else "pinning skipped: no CUDA device (host memory stays pageable)")
            out.append(StageExperts(slots, share, why))
            st.cache = _RemoteCache(self, ExpertStats(st.index, st.name, slots=slots))
        return out

    def _collect(self) -> None:
        if self._job is not None:
            self._job.collect()

    def _start_job(self) -> _Job:
        if self._load_cancel is not None and self._load_cancel.is_set():
            raise Cancelled("loading cancelled before the stage processes started")
        self._job = _Job(self)
        self.setup_notes = [n for n in self.setup_notes if not n.startswith("executor processes")]
        self.setup_notes += self._job.notes()
        self._run_open = False
        return self._job

    def _job_or_start(self) -> _Job:
        return self._job if self._job is not None else self._start_job()

    def _choose_handoffs(self) -> None:
        for a in self.stages[:-1]:
            a.handoff = self.backend

    def prepare(self, capacity: int, chunk: int, hooks=None) -> None:
        self._capacity, self._chunk = capacity, chunk  # the stage processes allocate at the run's start

    def _measure_layer(self, shape: ProbeShape) -> Measured:
        cuda = self.stages[0].device.type == "cuda"
        sizes_cost, per_key, launch = self._job_or_start().measure(*shape, graphs=cuda and self.config.cuda_graphs)
        return dict(sizes_cost), per_key, launch

    def stage_pids(self) -> list[int]:
        """The stage processes' pids (empty while none runs)."""
        return [m.pid for m in self._job.members] if self._job is not None else []

    def in_flight(self) -> int:
        return self._in_flight

    def worker_threads(self) -> list:
        return []

    # ------------------------------------------------------------------ running
    def _close_run(self, job: _Job) -> None:
        if not self._run_open:
            return
        job.inbox.run_closed = set()
        job.send(0, ("end_run",))
        job.pump(lambda: len(job.inbox.run_closed) == len(job.members), "closing the previous run")
        self._run_open = False

    def prefill(self, run, ctx: StageContext) -> None:
        """The stage processes run the prefill (hooks are theirs from the start: `Session(hooks=…)`);
        the digest and logits they computed become the run's."""
        ids, bounds, cancel = run.ids, run.plan.chunk_bounds(), run.cancel
        job = self._job_or_start()
        job.emit, job.note, job.run_id = ctx.emit, ctx.note, ctx.run_id
        try:
            self._close_run(job)
            if not hasattr(self, "_capacity"):
                self.prepare(int(ids.numel()) + 1, max(n for _, n in bounds))
            order = RunOrder(run_id=ctx.run_id, ids=[int(t) for t in ids.tolist()], bounds=list(bounds),
                             capacity=max(self._capacity, int(ids.numel()) + 1), chunk=max(n for _, n in bounds),
                             depth=ctx.pipeline_depth, logits_all=run.logits_all, events=ctx.events_on,
                             check_nan=ctx.check_nan, prefill_main=self.config.prefill_main,
                             graph_sizes=tuple(sorted(ctx.graph_sizes)))
            box = job.inbox
            box.prefill_done, box.returned, box.tokens = {}, -1, {}
            for m in job.members:
                m.last_chunk = -1
                job.send(m.rank, ("run", order))
            self._run_open = True
            try:
                for c in range(len(bounds)):
                    if cancel is not None and cancel.is_set():
                        raise Cancelled()
                    self._in_flight += 1
                    job.send(0, ("chunk", c))
                    job.pump(lambda: box.returned >= c, f"waiting for chunk {c} to return from stage 0")  # noqa: B023  (called before the loop moves on)
            finally:  # the finish guard: drain the split (unless the job was torn down)
                if self._job is job:
                    job.send(0, ("end",))
                    job.pump(lambda: len(box.prefill_done) == len(job.members), "draining the split")
                self._in_flight = 0
        except StageError:
            raise
        except Cancelled:
            raise
        except BaseException:
            job.kill()
            raise
        digest, last, logits = next(v for v in box.prefill_done.values() if v[0] is not None)
        run.hasher = _Done(digest)
        run.last_logits = torch.from_numpy(last) if last is not None else None
        run.logits = torch.from_numpy(logits) if logits is not None else None

    def decode(self, ctx: StageContext, first_token: int, steps: int, pos: int, cancel) -> list[int]:
        job = self._job_or_start()
        job.emit, job.note, job.run_id = ctx.emit, ctx.note, ctx.run_id
        out, tok = [first_token], first_token
        try:
            for i in range(1, steps):
                if cancel is not None and cancel.is_set():
                    raise Cancelled()
                job.send(0, ("decode", i, tok, pos))
                job.pump(lambda: i in job.inbox.tokens, f"waiting for decode step {i}")  # noqa: B023  (called before the loop moves on)
                tok = job.inbox.tokens.pop(i)
                out.append(tok)
                pos += 1
            job.collect()  # the stages' last stats and events of the run
        except (StageError, Cancelled):
            raise
        except BaseException:
            job.kill()
            raise
        return out

    def close(self) -> None:
        job, self._job = self._job, None
        if job is not None:
            try:
                self._job = job
                self._close_run(job)
            except BaseException as exc:  # closing: what matters is that no process is left
                log.debug("closing the stage processes: %s", exc)
            finally:
                self._job = None
                job.stop()
        super().close()


@dataclass
class _Done:
    """The digest a stage process computed (the `_Digest` interface of the threaded executor)."""

    hex: str

    def add(self, x: torch.Tensor) -> None:
        raise RuntimeError("a stage process's digest is complete")

    def hexdigest(self) -> str:
        return self.hex

    def close(self) -> None:
        pass
