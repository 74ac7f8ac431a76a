"""The layer-split prefill pipeline (seeds 000/001/002/004): a loaded model and its runs.

`Session` is what lasts: the devices (ordered by `topology.split_order`), the stages, the
executor that runs them (with their weights, the streamed-expert arena, the stage workers or
processes) and the measured chunk cost.
`Session.run(prompt_ids, ...)` returns a `Run` (engine/pipeline/run.py) that owns everything of that one
prompt: plan, events, notes, digest, logits, telemetry, report.

A stage's body (its layers, KV, ONE set of chunk buffers, forward, timing, digest, decode step)
is one class for both executors, `StageRuntime` (engine/pipeline/stage_runtime.py).  With threads, a
`Stage` (engine/pipeline/stage.py) adds one worker thread and its hand-offs.  `Stage.run(ctx, chunk)` computes its layers,
reaps its previous successor job (one outstanding job per successor), hands the activations over
and submits `successor.run(ctx, chunk)`.  With depth 1 ("overlap") it returns right away; with
depth 0 ("join") it returns only after the successor's run for the same chunk returned.  The
outermost prefill never returns with chunks in flight: a guard calls `finish()` on every path.

Stage 0 runs in the caller's thread (the root `prefill`), every later stage in its own worker.

On CUDA a stage's `run` launches its work and does not wait for the GPU: the hand-off to the
next GPU is ordered by CUDA events between streams (`Stage.hand_off`), GPU timings are resolved
by a helper thread (`gpu_timing`), and a stage keeps at most two chunks queued on its device
(`Stage.throttle`), so a cancel or an error still surfaces within a chunk.  Join (depth 0)
keeps its meaning: the last stage's run returns only once its GPU finished computing the chunk.

The session holds its executor: `ThreadExecutor` (engine/pipeline/thread_executor.py, the above) or, with
`executor=processes`, `ProcessExecutor` (engine/pipeline/executor.py: a process per stage, each a
`StageRuntime` with a torch.distributed transport), behind one interface.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from gguf import GGMLQuantizationType

from engine import models
from engine.config import EngineConfig
from engine.errors import Cancelled, DeviceMemoryError, NonFiniteError, StageError
from engine.events import EventSink, RunPlan, StageEvent
from engine.hw import nvtx, topology
from engine.hw.gpu_timing import DeferredTimer, DeviceClock
from engine.models.experts import (
    ExpertLayout,
    HostArena,
    expert_qtypes,
    physical_ram,
    plan_experts,
)
from engine.models.layers import WeightSource, resolve_dtype
from engine.pipeline import kernel_report
from engine.pipeline.executor import ProcessExecutor
from engine.pipeline.run import Run
from engine.pipeline.stage import PipelineHooks, Stage, StageContext, _Worker
from engine.pipeline.thread_executor import ThreadExecutor
from engine.plan import chunk_cost, chunking, run_plan
from engine.plan.layer_ranges import split_layers, stage_ranges

if TYPE_CHECKING:
    from engine.hw.topology import TelemetrySampler

__all__ = ["Cancelled", "DeviceMemoryError", "NonFiniteError", "PipelineHooks", "Run", "Session", "Stage",
           "StageContext", "StageError", "split_layers"]

log = logging.getLogger(__name__)



class Session:
    """A model split over devices, ready to run prompts: prefill, then decode through the split.

    `sink` and `hooks` given here are the defaults of every run (`run` takes its own); `hooks`
    also reach the weight loading (`before_alloc`) and, with executor=processes, the stage
    processes when they start."""

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
        self.digest_streams: dict[torch.device, torch.cuda.Stream] = {}  # a side stream per device, for life
        self.setup_notes: list[str] = []
        self._last_events: list[StageEvent] = []
        self._progress = progress or (lambda what, frac: None)
        self._chunk_cost: chunking.ChunkCost | None = None
        self._cost_limit: int | None = None  # the largest chunk size that measurement timed (None: any)
        self._hop_s: float | None = None  # hand-off seconds per token between the first two devices
        order, self.order_reason = topology.split_order(self.config.devices, self.config.gpu_order)
        self.device_order = order
        self.devices = [torch.device(d) for d in self.device_order]
        self.config.check_machine(torch.cuda.device_count() if torch.cuda.is_available() else 0, physical_ram())
        self.dtypes = {d: resolve_dtype(d, self.config.dtype) for d in self.devices}
        # interleave:V: V layer groups per device, each group a stage; a chunk visits the
        # devices V times over (group j on device j mod D)
        self.interleave = self.config.interleave
        counts = self.config.layer_split if isinstance(self.config.layer_split, list) else None
        self.stages = [Stage(i, d, a, b, self.dtypes[d])
                       for i, d, a, b in stage_ranges(self.spec.n_layers, self.devices, counts, self.interleave)]
        if self.interleave > 1:  # the Gantt's and the trace's names of layer groups, for NVTX ranges
            for st in self.stages:
                st.label = nvtx.stage_label(st.index, st.device, st.first, st.end, interleaved=True)
        for a, b in zip(self.stages, self.stages[1:]):
            a.successor = b
        self.expert_layouts = [ExpertLayout.of(source, self.spec, i) for i in range(self.spec.n_layers)] \
            if self.spec.is_moe else []
        self.expert_plan = plan_experts(self.config.expert_cache, self.spec, self.stages, self.dtypes,
                                        max((lay.row_bytes for lay in self.expert_layouts), default=None),
                                        expert_qtypes(self.expert_layouts))
        # which kernel each Triton-capable part runs, and a note when a fast one is missing on CUDA
        half = all(self.dtypes[d] in (torch.bfloat16, torch.float16) for d in self.devices if d.type == "cuda")
        self.kernel_parts = kernel_report.kernel_parts((d.type for d in self.devices), is_moe=self.spec.is_moe,
                                                       qtypes=self._weight_qtypes(),
                                                       gdn=any(getattr(self.spec, "recurrent", ())), half=half)
        self.setup_notes.extend(kernel_report.warnings(self.kernel_parts))
        # the executor: where the stages run (threads of this process, or processes of their own)
        self.executor: ThreadExecutor | ProcessExecutor = (
            ProcessExecutor(self) if self.config.executor == "processes" else ThreadExecutor(self))
        try:
            self.executor.load()
        except BaseException:
            self.close()  # free whatever was loaded: a failed or cancelled load keeps nothing
            raise
        self.executor.choose_handoffs()

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

    def _weight_qtypes(self) -> set:
        """The GGUF types the model's weights are stored in (a file's whole mix; else the experts')."""
        mix = getattr(self.source, "quant_mix", None)
        names = [name for name, _ in mix()] if callable(mix) else []
        known = {q for q in (getattr(GGMLQuantizationType, n, None) for n in names) if q is not None}
        return known | expert_qtypes(self.expert_layouts)

    def kernels(self) -> str:
        """The kernel of each Triton-capable part, e.g. "dequant: Triton 3.8.0 (Q4_K, Q6_K); MoE: …"."""
        return kernel_report.describe(self.kernel_parts)

    def attention_kernels(self) -> str:
        """The attention kernel of each device of the split, e.g. "cuda:0 cuDNN prefix+diagonal split"."""
        s = self.spec
        fam = models.family_of(s)  # a family with attention of its own names its kernel (gpt-oss)
        return "; ".join(f"{d}: {fam.attention_kernel(s, d, self.dtypes[d])}"
                         for d in dict.fromkeys(st.device for st in self.stages))

    @property
    def events(self) -> list[StageEvent]:
        """The latest run's events (a `Run` carries its own: prefer `run.events`)."""
        return self._last_events

    # ------------------------------------------------------ costs and planning
    def chunk_cost(self, n_tokens: int | None = None) -> chunking.ChunkCost:
        """One layer of the main device, measured once per process for a (model shape, device
        kind, dtype, streaming, graphs, expert types) key (engine/plan/chunk_cost.py), with this split's depth: the
        most layers one device runs per chunk.  For a prompt of `n_tokens` no size above it is
        timed (`chunk_cost.probe_shape`); a measurement that timed up to that length or beyond
        already serves as it is."""
        st = self.stages[0]
        shape = chunk_cost.probe_shape(st.device, n_tokens)
        limit = shape[0][-1]
        if self._chunk_cost is None or (self._cost_limit is not None and self._cost_limit < limit):
            key = chunk_cost.cost_key(self.spec, st.device, st.dtype, self.expert_plan.streamed,
                                      self.config.cuda_graphs, [q.name for q in expert_qtypes(self.expert_layouts)])
            measured, self._cost_limit = chunk_cost.measured(key, limit, lambda: self._measure_layer(shape))
            per_device: dict[int, int] = {}  # interleaved groups of a device all run on it
            for s, lane in zip(self.stages, self.stage_lanes()):
                per_device[lane] = per_device.get(lane, 0) + s.end - s.first
            self._chunk_cost = chunking.ChunkCost(*measured, max(per_device.values()))
            log.info("chunk cost on %s (sizes up to %d): %s", st.name, self._cost_limit, self._chunk_cost)
        return self._chunk_cost

    @property
    def measured_chunk_cost(self) -> chunking.ChunkCost | None:
        """The chunk cost when it has been measured (None: not yet; a fixed chunk needs none)."""
        return self._chunk_cost

    def _measure_layer(self, shape: chunk_cost.ProbeShape) -> chunk_cost.Measured:
        return self.executor.measure_layer(shape)

    def hop_s_per_token(self) -> float:
        """Seconds per token of a chunk to hand activations from the first device to the
        second, measured once per session with a copy the size of a 1024-token chunk."""
        if self._hop_s is None:
            a, b = self.stages[0], self.stages[1]
            self._hop_s = chunk_cost.measure_hop(a.device, b.device, a.dtype, self.spec.hidden)
        return self._hop_s

    def choice(self, n_tokens: int) -> chunking.Choice:
        """Chunk size and schedule for a prompt of n_tokens (engine/plan/run_plan.py)."""
        return run_plan.choice(self, n_tokens)

    def choose_chunk(self, n_tokens: int) -> tuple[int, str]:
        c = self.choice(n_tokens)
        return c.chunk, c.reason

    def plan(self, n_tokens: int, decode_tokens: int = 0, run_id: str = "") -> RunPlan:
        return run_plan.plan(self, n_tokens, decode_tokens, run_id)

    # ------------------------------------------------------------------ buffers
    def _alloc(self, what: str, device: torch.device | str, nbytes: int, advice: str, make: Callable,
               hooks: PipelineHooks | None = None):
        """Allocate through the fault hook (the run's, else the session's); an out-of-memory
        becomes a DeviceMemoryError."""
        hook = (hooks or self.hooks).before_alloc
        try:
            if hook is not None:
                hook(what, str(device), nbytes)
            return make()
        except (torch.OutOfMemoryError, MemoryError) as exc:
            raise DeviceMemoryError(str(device), what, nbytes, advice) from exc

    def prepare(self, capacity: int, chunk: int, hooks: PipelineHooks | None = None) -> None:
        """Every stage's KV for `capacity` tokens and buffers for `chunk`-token chunks."""
        self.executor.prepare(capacity, chunk, hooks)

    def free_run_buffers(self) -> None:
        """After a failed run: drop per-run buffers so device memory returns to its level."""
        self.executor.free_run_buffers()

    @property
    def arena(self) -> HostArena | None:
        """The host expert arena of streamed experts in this process (None: resident, or in
        the stage processes)."""
        return getattr(self.executor, "arena", None)

    # -------------------------------------------------------------------- running
    def run(self, prompt_ids: Sequence[int] | torch.Tensor, decode_tokens: int = 0, *,
            sink: EventSink | None = None, cancel: threading.Event | None = None,
            hooks: PipelineHooks | None = None, sampler: TelemetrySampler | None = None,
            logits_all: bool = False, on_plan: Callable[[RunPlan], None] | None = None) -> Run:
        """Prefill the prompt through the split, then greedily decode `decode_tokens` tokens.

        generated[0] comes from the prompt's last logits; each further token is one decode
        step through the split.  `sink` gets every event of this run and `hooks` are its seams
        (None: the session's).  `sampler`: a GPU telemetry sampler the caller also reads (the
        app's live plot), used instead of the run's own so the report keeps exactly the samples
        that were shown; the run starts it if needed and stops it at the end."""
        run = Run(self, prompt_ids, decode_tokens, sink=sink if sink is not None else self.sink,
                  hooks=hooks if hooks is not None else self.hooks, cancel=cancel, sampler=sampler,
                  logits_all=logits_all, on_plan=on_plan)
        self._last_events = run.events
        return run.execute()

    def prefill(self, run: Run, ctx: StageContext) -> None:
        """Every chunk of the run's plan through the executor; the last layer's output goes to
        `ctx.output`."""
        self.executor.prefill(run, ctx)

    def decode(self, ctx: StageContext, first_token: int, steps: int, pos: int,
               cancel: threading.Event | None) -> list[int]:
        """Greedy decode through the split; generated[0] = first_token."""
        return self.executor.decode(ctx, first_token, steps, pos, cancel)

    def finish(self) -> None:
        """Join the whole split (every stage's outstanding job, then every device)."""
        self.executor.finish()

    def in_flight(self) -> int:
        """Chunks submitted and not yet reaped, or still running (0 whenever prefill returned)."""
        return self.executor.in_flight()

    def worker_threads(self) -> list[threading.Thread]:
        """The stage workers' threads (alive between runs, stopped by `close`)."""
        return self.executor.worker_threads()

    def stage_pids(self) -> list[int]:
        """The stage processes' pids (empty with threads, or while none runs)."""
        return self.executor.stage_pids()

    def close(self) -> None:
        """Stop the stages (threads or processes) and free device memory held by this session."""
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.close()
        self.timer.stop()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
