"""The layer-split prefill pipeline (seeds 000/001/002/004): a loaded model and its runs.

`Session` is what lasts: the devices (ordered by `topology.split_order`), the stages with their
weights, the streamed-expert arena, the stage workers and the measured chunk cost.
`Session.run(prompt_ids, ...)` returns a `Run` (engine/run.py) that owns everything of that one
prompt: plan, events, notes, digest, logits, telemetry, report.

A `Stage` (engine/stage.py) owns a contiguous layer range on one device, the KV of those layers,
ONE set of chunk buffers and one worker thread.  `Stage.run(ctx, chunk)` computes its layers,
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

`executor=processes` runs the stages as processes behind the same API (engine/executor.py).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from gguf import GGMLQuantizationType

from . import chunk_cost, chunking, kernel_report, models, nvtx, run_plan, topology
from .attention import kernel_for
from .config import ConfigError, EngineConfig
from .errors import Cancelled, DeviceMemoryError, NonFiniteError, StageError
from .events import EventSink, RunPlan, StageEvent
from .experts import (
    ExpertCache,
    ExpertLayout,
    ExpertStats,
    HostArena,
    arena_bytes,
    expert_qtypes,
    physical_ram,
    plan_experts,
    resolve_pin_limit,
)
from .gpu_timing import DeferredTimer, DeviceClock
from .kv import LayerKV
from .model import Head, Layer, Rope, WeightSource, load_head, load_layer_weights, resolve_dtype
from .run import Run, _Digest
from .split import Split
from .stage import IDLE_MIN_NS, PipelineHooks, Stage, StageContext, _Worker
from .stage_graphs import MAX_GRAPHED_SIZES

if TYPE_CHECKING:
    from .topology import TelemetrySampler

__all__ = ["Cancelled", "DeviceMemoryError", "NonFiniteError", "PipelineHooks", "Run", "RunResult", "Session",
           "Stage", "StageContext", "StageError", "split_layers", "IDLE_MIN_NS", "MAX_GRAPHED_SIZES", "_Digest",
           "_Worker"]

log = logging.getLogger(__name__)

RunResult = Run  # what `Session.run` returns: report, logits, last_logits (and the run's events, plan…)


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


class Session:
    """A model split over devices, ready to run prompts: prefill, then decode through the split.

    `sink` and `hooks` given here are the defaults of every run (`run` takes its own); `hooks`
    also reach the weight loading (`before_alloc`) and, with executor=processes, the stage
    processes when they start."""

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
        groups = len(self.devices) * self.interleave
        split = "auto" if self.interleave > 1 else self.config.layer_split
        ranges = split_layers(self.spec.n_layers, groups, split)
        stage_devices = [self.devices[j % len(self.devices)] for j in range(groups)]
        self.stages = [Stage(i, d, a, b, self.dtypes[d]) for i, (d, (a, b)) in enumerate(zip(stage_devices, ranges))]
        if self.interleave > 1:  # the Gantt's and the trace's names of layer groups, for NVTX ranges
            for st in self.stages:
                st.label = nvtx.stage_label(st.index, st.device, st.first, st.end, interleaved=True)
        for a, b in zip(self.stages, self.stages[1:]):
            a.successor = b
        self.split = Split(self.stages, self.devices)
        self.expert_layouts = [ExpertLayout.of(source, self.spec, i) for i in range(self.spec.n_layers)] \
            if self.spec.is_moe else []
        self.expert_plan = plan_experts(self.config.expert_cache, self.spec, self.stages, self.dtypes,
                                        max((lay.row_bytes for lay in self.expert_layouts), default=None),
                                        expert_qtypes(self.expert_layouts))
        # which kernel each Triton-capable part runs, and a note when a fast one is missing on CUDA
        self.kernel_parts = kernel_report.kernel_parts((d.type for d in self.devices), is_moe=self.spec.is_moe,
                                                       qtypes=self._weight_qtypes())
        self.setup_notes.extend(kernel_report.warnings(self.kernel_parts))
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
                                   lambda: ExpertCache(self.arena, st.device, n_slots, ExpertStats(st.index, st.name)))  # noqa: B023  (_alloc calls it now)

    def _new_layer(self, i: int, st: Stage, rope: Rope, hooks: PipelineHooks | None = None) -> Layer:
        streamed = self.arena is not None
        nbytes = self.spec.layer_params() * torch.empty((), dtype=st.dtype).element_size()
        w = self._alloc(f"the weights of layer {i}", st.device, nbytes,
                        "move layers to another device (--layer-split) or stream experts (--expert-cache GiB)",
                        lambda: load_layer_weights(self.source, i, st.device, st.dtype, experts=not streamed), hooks)
        return Layer(self.spec, i, w, rope, cache=st.cache if streamed else None)

    def _load_shares(self) -> tuple[dict[int, int], int, int]:
        """Bytes of each layer in the file (its experts left out when they stream), of the token
        embedding and of the output head as expanded (dequantised at load): the load's progress is
        the share of these done, so a big embedding or head (151,936 x 2,048 in Qwen3, tens of
        seconds to dequantise on a CPU) is a named step of its size, not a stall after the last
        layer's percentage."""
        nbytes = getattr(self.source, "nbytes", None)
        names = list(self.source.tensor_names()) if hasattr(self.source, "tensor_names") else []
        if nbytes is None or not names:
            return {i: 1 for i in range(self.spec.n_layers)}, 0, 0
        streamed = self.expert_plan.streamed
        layer = dict.fromkeys(range(self.spec.n_layers), 0)
        for name in names:
            head, _, rest = name.partition(".")
            if head == "blk" and rest.split(".")[0].isdigit() and not (streamed and "_exps" in name):
                i = int(rest.split(".")[0])
                if i in layer:
                    layer[i] += nbytes(name)
        def expanded(name: str) -> int:  # the heads are dequantised at load: that, not the read, is their cost
            return max(nbytes(name), 4 * math.prod(self.source.shape(name)))

        embed = expanded("token_embd.weight") if "token_embd.weight" in names else 0
        out = expanded("output.weight") if "output.weight" in names else embed
        return layer, embed, out

    def _load_weights(self) -> None:
        ropes: dict[torch.device, Rope] = {}
        if self.expert_plan.streamed:
            self._build_arena()
        layer_bytes, embed_bytes, out_bytes = self._load_shares()
        total = max(1, sum(layer_bytes.values()) + embed_bytes + out_bytes)
        done = 0
        for st in self.stages:
            rope = ropes.setdefault(st.device, Rope.for_spec(self.spec, st.device))
            for i in range(st.first, st.end):
                if self._load_cancel is not None and self._load_cancel.is_set():
                    raise Cancelled(f"loading cancelled before layer {i}")
                self._progress(f"loading layer {i} to {st.name}", done / total)
                st.layers.append(self._new_layer(i, st, rope))
                done += layer_bytes.get(i, 0)
            parts = [p for p, on in (("the token embedding", st.index == 0 and embed_bytes),
                                     ("the output head", st.successor is None and out_bytes)) if on]
            if parts:
                self._progress(f"loading {' and '.join(parts)} to {st.name}", done / total)
            st.head = load_head(self.source, st.device, st.dtype, embed=st.index == 0,
                                final=st.successor is None)
            done += (embed_bytes if st.index == 0 else 0) + (out_bytes if st.successor is None else 0)
            self._progress(f"loaded the layers of {st.name}", done / total)
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
        return "; ".join(f"{d}: {kernel_for(d, s.n_heads, s.n_kv_heads, s.head_dim, self.dtypes[d]).describe()}"
                         for d in dict.fromkeys(st.device for st in self.stages))

    @property
    def events(self) -> list[StageEvent]:
        """The latest run's events (a `Run` carries its own: prefer `run.events`)."""
        return self._last_events

    # ------------------------------------------------------ costs and planning
    def chunk_cost(self, n_tokens: int | None = None) -> chunking.ChunkCost:
        """One layer of the main device, measured once per process for a (model shape, device
        kind, dtype, streaming, graphs, expert types) key (engine/chunk_cost.py), with this split's depth: the
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
        st = self.stages[0]
        return chunk_cost.measure_layer(st.layers[0], st.device, st.dtype, self.config.cuda_graphs, shape)

    def hop_s_per_token(self) -> float:
        """Seconds per token of a chunk to hand activations from the first device to the
        second, measured once per session with a copy the size of a 1024-token chunk."""
        if self._hop_s is None:
            a, b = self.stages[0], self.stages[1]
            self._hop_s = chunk_cost.measure_hop(a.device, b.device, a.dtype, self.spec.hidden)
        return self._hop_s

    def choice(self, n_tokens: int) -> chunking.Choice:
        """Chunk size and schedule for a prompt of n_tokens (engine/run_plan.py)."""
        return run_plan.choice(self, n_tokens)

    def choose_chunk(self, n_tokens: int) -> tuple[int, str]:
        c = self.choice(n_tokens)
        return c.chunk, c.reason

    def choose_schedule(self, n_tokens: int) -> tuple[int, str, str]:
        """(chunk size, fixed|balanced, why) from the prefill and chunk_schedule settings."""
        c = self.choice(n_tokens)
        return c.chunk, c.kind, c.reason

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
        s = self.spec

        def alloc(what: str, device: torch.device | str, nbytes: int, advice: str, make: Callable):
            return self._alloc(what, device, nbytes, advice, make, hooks)

        for st in self.stages:
            st.prepare(capacity, chunk, s.n_kv_heads, s.head_dim, s.hidden, alloc)

    def free_run_buffers(self) -> None:
        """After a failed run: drop per-run buffers so device memory returns to its level."""
        for st in self.stages:
            st.free_buffers()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _prepare_main(self, capacity: int, hooks: PipelineHooks) -> tuple[list[Layer], list[LayerKV]]:
        """Prefill-main: every later layer also on the main device, with main-device KV."""
        main = self.stages[0]
        dt = main.dtype
        if self._main_extra is None:
            rope = main.layers[0].rope
            self._main_extra = [self._new_layer(i, main, rope, hooks) for i in range(main.end, self.spec.n_layers)]
            for a, b in zip(self._main_extra, self._main_extra[1:]):
                a.prefetch_next = b.index
            last = self.stages[-1]
            self._main_head = main.head if last is main else load_head(self.source, main.device, dt, True, True)
        s = self.spec
        idx = range(main.end, s.n_layers)
        kvs = self._alloc(f"prefill-main KV for layers {main.end}-{s.n_layers - 1}", main.device,
                          models.states_bytes(s, idx, capacity, dt),
                          "turn prefill-main off or shorten the prompt",
                          lambda: models.new_states(s, idx, capacity, main.device, dt), hooks)
        return main.layers + self._main_extra, main.kvs + kvs

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
        """The threaded executor (engine/split.py): every chunk of the run's plan through the
        stages, or through the main device with prefill-main; the last stage's output goes to
        `ctx.finish_chunk`."""
        bounds = run.plan.chunk_bounds()
        ctx = dataclasses.replace(ctx, prompt_ids=run.ids.to(self.devices[0]))
        self.split.reset()
        if self.config.prefill_main and len(self.stages) > 1:
            layers, kvs = self._prepare_main(run.n_prompt + 1, run.hooks)
            self.split.prefill_main(ctx, bounds, run.cancel, layers, kvs, self._main_head)
        else:
            self.split.prefill(ctx, bounds, run.cancel)

    def decode(self, ctx: StageContext, first_token: int, steps: int, pos: int,
               cancel: threading.Event | None) -> list[int]:
        """Greedy decode through the split; generated[0] = first_token."""
        return self.split.decode(ctx, first_token, steps, pos, cancel)

    def finish(self) -> None:
        """Join the whole split (every stage's outstanding job, then every device)."""
        self.split.finish()

    def in_flight(self) -> int:
        """Chunks submitted and not yet reaped, or still running (0 whenever prefill returned)."""
        return self.split.in_flight()

    def worker_threads(self) -> list[threading.Thread]:
        """The stage workers' threads (alive between runs, stopped by `close`)."""
        return self.split.worker_threads()

    def close(self) -> None:
        """Stop the stage workers and free device memory held by this session."""
        self.split.stop()
        self.timer.stop()
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
