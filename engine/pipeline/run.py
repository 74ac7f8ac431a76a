"""One run through a session's split: its plan, events, digest, logits, telemetry and report.

`Session.run(prompt_ids, ...)` makes a `Run` and executes it.  The run holds everything that
belongs to that one prompt — plan, CUDA graph sizes, events (and where they go), notes, hooks,
cancel, the telemetry sampler, the digest, the logits, the generated tokens and the report — so
the long-lived `Session` keeps only what lasts (devices, stages, weights, arena, workers, the
measured chunk cost).  The stages see the run through a `StageContext` (engine/pipeline/stage_runtime.py).

The run's order: validate the prompt, plan, size the buffers (reused from run to run by the
stages), prefill through the session's executor, one non-finite check of the logits, decode,
then the bookkeeping after the clock stopped (digest, GPU timings, expert statistics,
telemetry) and the report.  A cancel raises `Cancelled` with the report of what ran.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from engine.config import ConfigError
from engine.errors import Cancelled
from engine.events import (
    EventSink,
    RunPlan,
    RunReport,
    StageEvent,
    busy_histogram,
    by_device,
    format_timing,
    handoff_cost,
    stage_totals,
)
from engine.models.experts import ExpertStats
from engine.pipeline import nonfinite, stage_graphs
from engine.pipeline.stage import PipelineHooks, StageContext
from engine.pipeline.stage_output import Digest, StageOutput
from engine.plan import planner

if TYPE_CHECKING:
    from engine.hw.topology import TelemetrySampler
    from engine.pipeline.session import Session

log = logging.getLogger(__name__)



def prompt_tensor(prompt_ids: Sequence[int] | torch.Tensor, vocab: int) -> torch.Tensor:
    """The prompt as a flat long tensor, refused when empty or outside the vocabulary."""
    ids = torch.as_tensor(list(prompt_ids) if not isinstance(prompt_ids, torch.Tensor) else prompt_ids,
                          dtype=torch.long).flatten()
    if ids.numel() == 0:
        raise ConfigError("prompt", "", "at least one token")
    if ids.min() < 0 or ids.max() >= vocab:
        raise ConfigError("prompt", f"token id {int(ids.max() if ids.max() >= vocab else ids.min())}",
                          f"ids in 0..{vocab - 1} (the model's vocabulary)")
    return ids


class Run:
    """One prompt through a session: made and executed by `Session.run`.

    After a finished run: `report`, `logits` ([prompt_tokens, vocab] float32 on CPU when asked
    for), `last_logits` ([vocab] float32 on CPU), `events`, `plan`, `digest`."""

    def __init__(self, session: Session, prompt_ids: Sequence[int] | torch.Tensor, decode_tokens: int = 0, *,
                 sink: EventSink | None = None, hooks: PipelineHooks | None = None,
                 cancel: threading.Event | None = None, sampler: TelemetrySampler | None = None,
                 logits_all: bool = False, on_plan: Callable[[RunPlan], None] | None = None) -> None:
        self.session = session
        self.ids = prompt_tensor(prompt_ids, session.spec.vocab)
        self.n_prompt = int(self.ids.numel())
        if decode_tokens < 0:
            raise ConfigError("decode_tokens", decode_tokens, "an integer >= 0")
        self.decode_tokens = decode_tokens
        self.sink = sink
        self.hooks = hooks or PipelineHooks()
        self.cancel = cancel
        self.logits_all = logits_all
        self.on_plan = on_plan
        self.run_id = uuid.uuid4().hex[:12]
        self.events: list[StageEvent] = []
        self._events_lock = threading.Lock()
        self.notes: list[str] = []  # this run's own (graph captures); the report leads with the session's
        self.plan: RunPlan | None = None
        self.graph_sizes: frozenset[int] = frozenset()  # chunk sizes this run replays as CUDA graphs
        self.output: StageOutput | None = None  # the last prefill pass's: digest, logits (engine/pipeline/stage_output.py)
        self.logits: torch.Tensor | None = None
        self.last_logits: torch.Tensor | None = None
        self.digest = ""
        self.generated: list[int] = []
        self.report: RunReport | None = None
        self._given_sampler = sampler
        self.sampler: TelemetrySampler | None = None
        self.telemetry_status = ""
        self._t0_ns = 0
        self._prefilled = False  # the last prefill pass ran to its end

    # ------------------------------------------------------------ what stages call
    def emit(self, ev: StageEvent) -> None:
        with self._events_lock:
            self.events.append(ev)
        if self.sink is not None:
            self.sink(ev)

    @property
    def hasher(self) -> Digest | None:
        """The digest of the last prefill pass's output."""
        return self.output.digest if self.output is not None else None

    def context(self, check_nan: bool | None = None) -> StageContext:
        s = self.session
        return StageContext(self.run_id, self.emit, self.notes.append, s.timer, s.clock, s.events_on, self.hooks,
                            s.config.check_nan if check_nan is None else check_nan, s.config.pipeline_depth,
                            self.graph_sizes, output=self.output)

    # --------------------------------------------------------------------- running
    def execute(self) -> Run:
        s = self.session
        s.timer.flush()  # a failed run's late GPU timings reach its own events before this run's start
        for st in s.stages:
            if st.cache is not None:
                st.cache.reset_stats()
        plan = self.plan = s.plan(self.n_prompt, self.decode_tokens, run_id=self.run_id)
        # graphs for the run's chunk sizes (the fixed size and the remainder; a balanced
        # schedule's few sizes, multiples of its grain: the largest stage_graphs.MAX_GRAPHED_SIZES) and for
        # decode steps; other sizes' graphs are freed.  A warm-up run of the same plan captures them.
        self.graph_sizes = frozenset(stage_graphs.graph_sizes(plan.chunk_bounds(), s.config.cuda_graphs))
        for st in s.stages:
            st.graphs.plan(self.graph_sizes)  # these sizes replay; other sizes' graphs are freed
        if self.on_plan is not None:
            self.on_plan(plan)
        capacity = self.n_prompt + max(self.decode_tokens, 1)
        self._t0_ns = time.perf_counter_ns()  # a caller's sampler may hold earlier runs' samples
        self.sampler, self.telemetry_status = self._start_telemetry()
        try:
            self._execute(capacity)
        finally:
            if self.sampler is not None:
                self.sampler.stop()
        return self

    def _start_telemetry(self) -> tuple[TelemetrySampler | None, str]:
        """A GPU sampler for the run's CUDA devices (started and stopped with the run): the
        caller's when given (the app's live plot: the report keeps exactly the samples shown),
        else one of the run's own at the session's `telemetry_interval_s`."""
        given, s = self._given_sampler, self.session
        if given is not None:
            if not given.running:
                given.start()
            return (given, "sampled") if given.available else (None, given.reason)
        gpus = sorted({d.index or 0 for d in s.devices if d.type == "cuda"})
        if not s.telemetry_interval_s:
            return None, "off"
        if not gpus:
            return None, "unavailable: CPU stages only"
        try:
            from engine.hw.topology import TelemetrySampler

            sampler = TelemetrySampler(gpus, interval_s=s.telemetry_interval_s)
        except Exception as exc:  # telemetry must never break a run
            return None, f"unavailable: {exc}"
        if not sampler.available:
            return None, sampler.reason
        sampler.start()
        return sampler, "sampled"

    def _execute(self, capacity: int) -> None:
        try:
            self._measured(capacity)
        except Cancelled:
            raise
        except BaseException:
            try:
                if self.hasher is not None:
                    self.hasher.close()  # its hashing thread, when decode failed after prefill
                self.session.timer.flush()  # the failed run's GPU timings reach the sink before run() raises
            except BaseException as exc:  # secondary: the original error is what surfaces
                log.debug("cleaning up after a failed run: %s", exc)
            self.session.free_run_buffers()
            raise

    def _measured(self, capacity: int) -> None:
        s, plan = self.session, self.plan
        with torch.inference_mode():
            s.prepare(capacity, plan.chunk, self.hooks)
            for d in set(s.devices):
                s.clock.anchor(d)
            t0 = time.perf_counter()
            cancelled = False
            try:
                self.prefill()
            except Cancelled:
                cancelled = True
            if not cancelled:  # one reduction per run; re-run with the per-layer check only when it fails
                nonfinite.check_prefill(self)
            t1 = time.perf_counter()
            if not cancelled and self.decode_tokens > 0:
                try:
                    self.generated = s.decode(self.context(), int(self.last_logits.argmax()), self.decode_tokens,
                                              self.n_prompt, self.cancel)
                except Cancelled:
                    cancelled = True
            t2 = time.perf_counter()
        # bookkeeping after the clock stopped: the digest's hashing thread finishes the last chunk
        # (the prompt's KV and logits were ready at t1), and every GPU timing is delivered
        self.digest = self.hasher.hexdigest() if self._prefilled else ""
        s.timer.flush()
        self.report = self._report(t0, t1, t2, cancelled)
        if s.config.timing:
            log.info("prefill timing (run %s):\n%s", self.run_id, format_timing(self.report.per_stage))
        if cancelled:  # what ran before the stop, for a GUI to show
            raise Cancelled(f"run {self.run_id} cancelled at a chunk boundary; the split was drained", self.report,
                            list(self.events))

    def prefill(self, check_nan: bool | None = None) -> None:
        """Every chunk through the split (the session's executor); `check_nan` overrides the
        setting (the non-finite check's second pass)."""
        if self.output is not None:
            self.output.digest.close()
        self.output = StageOutput(Digest(self.session.digest_streams), self.n_prompt, self.logits_all)
        self.logits, self.last_logits, self._prefilled = None, None, False
        try:
            self.session.prefill(self, self.context(check_nan))
        except BaseException:
            self.output.digest.close()
            raise
        self.last_logits, self.logits = self.output.last_logits, self.output.logits
        self._prefilled = True

    def _report(self, t0: float, t1: float, t2: float, cancelled: bool) -> RunReport:
        s, ctx = self.session, self.context()
        expert_stats = []
        for st in s.stages:
            if st.cache is not None:
                st.cache.synchronize()
                st.emit_streams(ctx)
                expert_stats.append(st.cache.stats.as_dict())
            elif s.spec.is_moe:
                expert_stats.append(ExpertStats(st.index, st.name, resident=True,
                                                slots=s.spec.expert_layers(st.first, st.end) * s.spec.n_experts
                                                ).as_dict())
        samples = []
        if self.sampler is not None:
            self.sampler.stop()
            samples = [dataclasses.asdict(x) for x in self.sampler.samples(since_ns=self._t0_ns)]
        n, steps = self.n_prompt, max(len(self.generated) - 1, 0)
        prefill_events = [e for e in list(self.events) if e.kind != "decode"]
        hops = 0 if s.config.prefill_main else len(s.stages) - 1
        cost = handoff_cost(prefill_events, t1 - t0, hops)
        return RunReport(
            run_id=self.run_id, plan=self.plan,
            prefill_tok_s=n / (t1 - t0) if not cancelled else 0.0,
            decode_tok_s=steps / (t2 - t1) if steps and t2 > t1 else 0.0,
            prefill_s=t1 - t0, decode_s=t2 - t1, digest=self.digest, generated=list(self.generated),
            per_stage=stage_totals(prefill_events, len(s.stages)),
            busy_histogram=busy_histogram(by_device(prefill_events, s.stage_lanes()), len(s.devices)),
            handoff=s.handoff_kind, device_order=list(s.device_order),
            order_reason=s.order_reason, cancelled=cancelled, notes=list(s.setup_notes) + self.notes,
            expert_stats=expert_stats, attention=s.attention_kernels(), kernels=s.kernels(),
            handoff_bytes=cost.nbytes, executor=s.config.executor, handoff_s=cost.seconds,
            handoff_gbps=cost.gbps, handoff_share=cost.share,
            state_handoff_bytes=sum(e.nbytes for e in prefill_events if e.kind == "copy" and e.chunk < 0),
            cost_profile=planner.probe_dict(s.measured_chunk_cost),
            telemetry=samples, telemetry_status=self.telemetry_status)
