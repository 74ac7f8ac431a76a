"""Stages as processes (`executor=processes`): the controller's executor.

`ProcessExecutor` is what a `Session` holds when its stages run as processes (the threaded one
is engine/pipeline/thread_executor.py; both have one interface).  Instead of loading layers into this
process it starts one process per stage (engine/pipeline/stage_process.py: the stage reopens the model
source and owns its device, layers and KV; engine/pipeline/stage_job.py holds the processes), joined in
a torch.distributed group whose rendezvous store this process hosts.  The controller drives
the root prefill loop (one `RunChunk` to stage 0 at a time, cancel at a chunk boundary,
`EndPrefill` as the finish guard), receives every stage's events through its pipe and re-times
them onto its own clock, so the sink, the report and the GUI see what the threaded executor
gives them.  Faults: see engine/pipeline/stage_job.py.
"""
from __future__ import annotations

import logging
import pickle
import threading
from typing import TYPE_CHECKING

import torch

from engine import settings_table
from engine.config import ConfigError
from engine.errors import Cancelled, StageError
from engine.models.experts import ExpertStats, arena_bytes, resolve_pin_limit
from engine.pipeline.stage import PipelineHooks, StageContext
from engine.pipeline.stage_job import (
    TIMEOUT_ENV,
    RemoteCache,
    RemoteStageError,
    StageExperts,
    StageJob,
    StageLost,
    job_notes,
    source_ref,
)
from engine.pipeline.stage_messages import BeginRun, DecodeStep, EndPrefill, EndRun, RunChunk
from engine.pipeline.stage_output import StageOutput
from engine.pipeline.stage_process import RunOrder
from engine.plan.chunk_cost import Measured, ProbeShape
from engine.sizes import size_text

if TYPE_CHECKING:
    from engine.pipeline.run import Run
    from engine.pipeline.session import Session

__all__ = ["ProcessExecutor", "RemoteStageError", "StageLost", "split_pin_limit", "stage_timeout"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0


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


def split_pin_limit(limit: int, arena_sizes: list[int], pins: list[bool]) -> list[int]:
    """Each stage process's share of the pin limit: the stages that pin (CUDA devices) share it
    in proportion to their arenas' bytes, rounded down, so the page-locked total never exceeds
    `limit` whatever each arena makes of its share."""
    total = sum(b for b, p in zip(arena_sizes, pins) if p)
    if limit <= 0 or total <= 0:
        return [0] * len(arena_sizes)
    return [min(limit * b // total, b) if p else 0 for b, p in zip(arena_sizes, pins)]


class ProcessExecutor:
    """The stages of a session as processes (see the module doc)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._job: StageJob | None = None
        self._run_open = False
        self._in_flight = 0
        self.timeout_s = DEFAULT_TIMEOUT_S
        self.stage_experts: list[StageExperts] = []
        self.child_hooks: PipelineHooks | None = None
        self.backend = "gloo"

    # ------------------------------------------------------------------- set-up
    def load(self) -> None:
        """Check what the stage processes need (source, pin limit, hooks), then start them."""
        s = self.session
        self.timeout_s = stage_timeout()
        source_ref(s.source)  # refused before any process starts
        self.stage_experts = self._plan_stage_experts()  # refuses a pin limit the machine cannot honour
        hooks = s.hooks
        self.child_hooks = hooks if (hooks.after_layer or hooks.before_alloc) else None
        if self.child_hooks is not None:
            try:
                pickle.dumps(self.child_hooks)
            except Exception as exc:
                raise ConfigError("executor", "processes", "threads for these hooks",
                                  f"pipeline hooks must be picklable to reach a stage process: {exc}") from None
        cuda = [st.device for st in s.stages if st.device.type == "cuda"]
        distinct = len(set(cuda)) == len(cuda) == len(s.stages)
        self.backend = "nccl" if distinct and torch.distributed.is_nccl_available() else "gloo"
        self._start_job()

    def _plan_stage_experts(self) -> list[StageExperts]:
        """Streamed experts: each stage process gets the slots the plan gives its stage and a
        share of the pin limit (resolved here as the threaded executor resolves it for its one
        arena); the controller shows each stage's stats through a `RemoteCache`."""
        s = self.session
        plan = s.expert_plan
        if not plan.streamed:
            return []
        cudas = [st.device.type == "cuda" for st in s.stages]
        sizes = [arena_bytes(s.expert_layouts[st.first:st.end], s.spec.n_experts) for st in s.stages]
        limit, note = resolve_pin_limit(s.config.pin_limit_gib, sum(sizes), any(cudas))
        shares = split_pin_limit(limit, sizes, cudas)
        out = []
        for st, slots, share, cuda in zip(s.stages, plan.slots_per_stage, shares, cudas):
            why = (f"{note}; its share {size_text(share)} of {size_text(limit)}, split by arena size" if cuda
                   else "pinning skipped: no CUDA device (host memory stays pageable)")
            out.append(StageExperts(slots, share, why))
            st.cache = RemoteCache(self, ExpertStats(st.index, st.name, slots=slots))
        return out

    def _start_job(self) -> StageJob:
        s = self.session
        if s._load_cancel is not None and s._load_cancel.is_set():
            raise Cancelled("loading cancelled before the stage processes started")
        self._job = StageJob(self)
        s.setup_notes = [n for n in s.setup_notes if not n.startswith("executor processes")]
        s.setup_notes += job_notes(self._job, s.expert_plan)
        self._run_open = False
        return self._job

    def _job_or_start(self) -> StageJob:
        return self._job if self._job is not None else self._start_job()

    def choose_handoffs(self) -> None:
        for a in self.session.stages[:-1]:
            a.handoff = self.backend

    def prepare(self, capacity: int, chunk: int, hooks: PipelineHooks | None = None) -> None:
        self._capacity, self._chunk = capacity, chunk  # the stage processes allocate at the run's start

    def free_run_buffers(self) -> None:
        """Nothing to free here: the stage processes hold the buffers (a failed run ends them)."""

    def measure_layer(self, shape: ProbeShape) -> Measured:
        cuda = self.session.stages[0].device.type == "cuda"
        return self._job_or_start().measure(*shape, graphs=cuda and self.session.config.cuda_graphs)

    def stage_pids(self) -> list[int]:
        """The stage processes' pids (empty while none runs)."""
        return [m.pid for m in self._job.members] if self._job is not None else []

    def in_flight(self) -> int:
        return self._in_flight

    def worker_threads(self) -> list[threading.Thread]:
        return []

    def finish(self) -> None:
        """Nothing in flight between calls: every prefill drains the split before it returns."""

    # ------------------------------------------------------------------ running
    def _close_run(self, job: StageJob) -> None:
        if not self._run_open:
            return
        job.inbox.run_closed = set()
        job.send(0, EndRun())
        job.pump(lambda: len(job.inbox.run_closed) == len(job.members), "closing the previous run")
        self._run_open = False

    def _order(self, run: Run, ctx: StageContext) -> RunOrder:
        ids, bounds = run.ids, run.plan.chunk_bounds()
        if not hasattr(self, "_capacity"):
            self.prepare(int(ids.numel()) + 1, max(n for _, n in bounds))
        return RunOrder(run_id=ctx.run_id, ids=[int(t) for t in ids.tolist()], bounds=list(bounds),
                        capacity=max(self._capacity, int(ids.numel()) + 1), chunk=max(n for _, n in bounds),
                        depth=ctx.pipeline_depth, logits_all=run.logits_all, events=ctx.events_on,
                        check_nan=ctx.check_nan, prefill_main=self.session.config.prefill_main,
                        graph_sizes=tuple(sorted(ctx.graph_sizes)))

    def prefill(self, run: Run, ctx: StageContext) -> None:
        """The stage processes run the prefill (hooks are theirs from the start: `Session(hooks=…)`);
        the digest and logits they computed become the run's output."""
        cancel, n_chunks = run.cancel, len(run.plan.chunk_bounds())
        job = self._job_or_start()
        job.emit, job.note, job.run_id = ctx.emit, ctx.note, ctx.run_id
        box = job.inbox
        try:
            self._close_run(job)
            order = self._order(run, ctx)
            box.prefill_done, box.returned, box.tokens = {}, -1, {}
            for m in job.members:
                m.last_chunk = -1
                job.send(m.rank, BeginRun(order))
            self._run_open = True
            try:
                for c in range(n_chunks):
                    if cancel is not None and cancel.is_set():
                        raise Cancelled()
                    self._in_flight += 1
                    job.send(0, RunChunk(c))
                    job.pump(lambda: box.returned >= c, f"waiting for chunk {c} to return from stage 0")  # noqa: B023  (called before the loop moves on)
            finally:  # the finish guard: drain the split (unless the job was torn down)
                if self._job is job:
                    job.send(0, EndPrefill())
                    job.pump(lambda: len(box.prefill_done) == len(job.members), "draining the split")
                self._in_flight = 0
        except (StageError, Cancelled):
            raise
        except BaseException:
            job.kill()
            raise
        done = next(v for v in box.prefill_done.values() if v.digest is not None)
        run.output = StageOutput.received(
            done.digest, torch.from_numpy(done.last_logits) if done.last_logits is not None else None,
            torch.from_numpy(done.logits) if done.logits is not None else None)

    def decode(self, ctx: StageContext, first_token: int, steps: int, pos: int,
               cancel: threading.Event | None) -> list[int]:
        job = self._job_or_start()
        job.emit, job.note, job.run_id = ctx.emit, ctx.note, ctx.run_id
        out, tok = [first_token], first_token
        try:
            for i in range(1, steps):
                if cancel is not None and cancel.is_set():
                    raise Cancelled()
                job.send(0, DecodeStep(i, tok, pos))
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
        job = self._job
        if job is not None:
            try:
                self._close_run(job)
            except BaseException as exc:  # closing: what matters is that no process is left
                log.debug("closing the stage processes: %s", exc)
            finally:
                self._job = None
                job.stop()
        for st in self.session.stages:
            st.release()
