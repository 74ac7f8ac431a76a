"""The event contract between engine and GUI, and the statistics every consumer shares.

A `StageEvent` is one interval of one stage: computing a chunk, waiting (a GPU idle between
its chunks; a CPU stage's thread waiting on its successor), copying activations, streaming
experts, or a decode step.  Times are host
`time.perf_counter_ns()`; GPU work is mapped onto that clock (see `pipeline`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from engine.config import old_names_accepted

KINDS = ("compute", "wait", "copy", "stream", "decode")



def chunk_bounds(n_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """(start, length) of each chunk of a prompt cut into chunks of `chunk` tokens."""
    if n_tokens <= 0:
        return []
    return [(s, min(chunk, n_tokens - s)) for s in range(0, n_tokens, chunk)]

@dataclass(frozen=True, slots=True)
class StageEvent:
    run_id: str
    stage: int
    device: str
    chunk: int
    kind: str
    start_ns: int
    end_ns: int
    tokens: int = 0
    nbytes: int = 0
    note: str = ""
    predicted: bool = False  # True for the planner's events (engine.plan.planner), never for a run's

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns


EventSink = Callable[[StageEvent], None]


@dataclass(frozen=True)
class StagePlan:
    stage: int
    device: str
    first_layer: int
    end_layer: int  # exclusive

    @property
    def n_layers(self) -> int:
        return self.end_layer - self.first_layer


@old_names_accepted
@dataclass(frozen=True)
class RunPlan:
    """What a run is about to do: known before the first chunk, so a GUI can size its progress."""

    run_id: str
    stages: tuple[StagePlan, ...]
    prompt_tokens: int
    chunk: int
    n_chunks: int
    decode_tokens: int
    handoff: str
    prefill_main: bool
    pipeline_depth: int  # 1 overlap, 0 join (the seeds' pf_depth)
    chunk_reason: str = ""
    schedule: str = "fixed"  # fixed or balanced (see engine.plan.chunking)
    bounds: tuple[tuple[int, int], ...] = ()  # (start, tokens) of every chunk; () = fixed cuts of `chunk`
    interleave: int = 1  # layer groups per device: stages are groups, stage j on device j mod D
    modelled_s: float = 0.0  # the prefill time chunking's model predicted for this plan (0: none)

    @property
    def pf_depth(self) -> int:
        """The seeds' name of `pipeline_depth` (read-only; for code written before issue 16)."""
        return self.pipeline_depth

    @property
    def n_lanes(self) -> int:
        """Device lanes: one per entry of the device list (stages / interleave)."""
        return max(len(self.stages) // max(self.interleave, 1), 1)

    def lane_of(self, stage: int) -> int:
        """The device lane of a stage: stage j runs on device j mod D."""
        return stage % self.n_lanes if self.interleave > 1 else stage

    def stage_names(self) -> dict[int, str]:
        """How traces and tables name each stage: `stage 1 · cuda:1 (layers 12-23)`, or for
        interleaved layer groups `g2 · cuda:0 (layers 16-23)`."""
        names = {}
        for s in self.stages:
            who = f"g{s.stage}" if self.interleave > 1 else f"stage {s.stage}"
            layers = f" (layers {s.first_layer}-{s.end_layer - 1})" if s.end_layer > s.first_layer else ""
            names[s.stage] = f"{who} · {s.device}{layers}"
        return names

    def chunk_bounds(self) -> list[tuple[int, int]]:
        if self.bounds:
            return [tuple(b) for b in self.bounds]
        return chunk_bounds(self.prompt_tokens, self.chunk)


@dataclass
class StageTotals:
    stage: int
    device: str
    wall_ns: int = 0
    compute_ns: int = 0
    wait_ns: int = 0
    copy_ns: int = 0
    stream_ns: int = 0
    chunks: int = 0


@dataclass
class RunReport:
    run_id: str
    plan: RunPlan
    prefill_tok_s: float
    decode_tok_s: float
    prefill_s: float
    decode_s: float
    digest: str
    generated: list[int]
    per_stage: list[StageTotals]
    busy_histogram: list[float]
    handoff: str
    device_order: list[str]
    order_reason: str = ""
    cancelled: bool = False
    expert_stats: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    telemetry: list[dict] = field(default_factory=list)  # GPU samples on the event clock
    telemetry_status: str = ""
    attention: str = ""  # the attention kernel per device (engine/kernels/attention.py)
    kernels: str = ""  # the kernel of dequant, MoE, q/k-norm+RoPE (engine/pipeline/kernel_report.py)
    handoff_bytes: int = 0  # activations handed between stages during prefill (all hops)
    # the chunk-cost probe's figures (engine.plan.planner.probe_dict) when the run measured them: what the
    # planner prices chunk sizes the run did not execute from
    cost_profile: dict = field(default_factory=dict)
    executor: str = "threads"  # threads | processes (engine/pipeline/executor.py)
    handoff_s: float = 0.0  # seconds the prefill's hand-offs took, summed over hops
    handoff_gbps: float = 0.0  # handoff_bytes / handoff_s
    handoff_share: float = 0.0  # the mean hop's busy share of the prefill wall (handoff_s / hops / prefill_s)
    # prefill-main: the KV and recurrent state rows handed from the main device to the other stages
    # (their copy events at chunk -1; 0 where there was no hand-over or events were off)
    state_handoff_bytes: int = 0

    def to_dict(self) -> dict:
        from dataclasses import asdict

        d = asdict(self)
        return d


def stage_totals(events: Iterable[StageEvent], n_stages: int | None = None,
                 kinds: Sequence[str] = ("compute", "wait", "copy", "stream")) -> list[StageTotals]:
    """Per stage: wall (first start to last end of its prefill events) and time per kind."""
    by_stage: dict[int, StageTotals] = {}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    chunks: dict[int, set[int]] = {}
    for ev in events:
        if ev.kind not in kinds:
            continue
        t = by_stage.get(ev.stage)
        if t is None:
            t = by_stage[ev.stage] = StageTotals(ev.stage, ev.device)
            first[ev.stage], last[ev.stage] = ev.start_ns, ev.end_ns
            chunks[ev.stage] = set()
        first[ev.stage] = min(first[ev.stage], ev.start_ns)
        last[ev.stage] = max(last[ev.stage], ev.end_ns)
        setattr(t, f"{ev.kind}_ns", getattr(t, f"{ev.kind}_ns") + ev.dur_ns)
        if ev.kind == "compute":
            chunks[ev.stage].add(ev.chunk)
    out = []
    count = n_stages if n_stages is not None else (max(by_stage) + 1 if by_stage else 0)
    for s in range(count):
        t = by_stage.get(s, StageTotals(s, ""))
        if s in first:
            t.wall_ns = last[s] - first[s]
            t.chunks = len(chunks[s])
        out.append(t)
    return out


def by_device(events: Iterable[StageEvent], lanes: Sequence[int]) -> list[StageEvent]:
    """The events with each stage replaced by its device lane (`lanes[stage]`): with interleaved
    layer groups a device holds several stages, and the busy histogram counts devices."""
    if list(lanes) == list(range(len(lanes))):
        return list(events)
    return [dataclasses.replace(ev, stage=lanes[ev.stage]) if 0 <= ev.stage < len(lanes) else ev for ev in events]


def busy_histogram(events: Iterable[StageEvent], n_stages: int) -> list[float]:
    """Share of wall time with exactly k stages computing, k = 0..n_stages.

    Wall runs from the first compute start to the last compute end.  Overlapping compute
    intervals of the SAME stage (which the pipeline never produces) count once.
    """
    marks: list[tuple[int, int, int]] = []  # (time, +1/-1, stage)
    for ev in events:
        if ev.kind == "compute" and ev.end_ns > ev.start_ns:
            marks.append((ev.start_ns, 1, ev.stage))
            marks.append((ev.end_ns, -1, ev.stage))
    hist = [0.0] * (n_stages + 1)
    if not marks:
        return hist
    marks.sort()  # by time, ends (-1) before starts (+1); no key list: half the memory on a big import
    active: dict[int, int] = {}
    t_prev = marks[0][0]
    t_end = max(m[0] for m in marks)
    durations = [0] * (n_stages + 1)
    for t, delta, stage in marks:
        k = min(len(active), n_stages)
        durations[k] += t - t_prev
        t_prev = t
        n = active.get(stage, 0) + delta
        if n <= 0:
            active.pop(stage, None)
        else:
            active[stage] = n
    wall = t_end - marks[0][0]
    if wall <= 0:
        return hist
    return [d / wall for d in durations]


def format_timing(totals: Sequence[StageTotals]) -> str:
    """The STRATA_PREFILL_TIMING report: per-stage wall, compute and wait."""
    lines = ["stage  device    wall ms  compute ms  wait ms  copy ms  chunks"]
    for t in totals:
        lines.append(
            f"{t.stage:>5}  {t.device:<8} {t.wall_ns / 1e6:>8.1f}  {t.compute_ns / 1e6:>10.1f}"
            f"  {t.wait_ns / 1e6:>7.1f}  {t.copy_ns / 1e6:>7.1f}  {t.chunks:>6}"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class HandoffCost:
    """What a run's activation hand-offs cost (copy events of prompt chunks, all hops)."""

    seconds: float
    nbytes: int
    gbps: float
    share: float  # the mean hop's busy share of the wall


def handoff_cost(events: Iterable[StageEvent], wall_s: float, hops: int) -> HandoffCost:
    """Hand-off time and bytes from the copy events of prompt chunks (not prefill-main's KV copy)."""
    copies = [e for e in events if e.kind == "copy" and e.chunk >= 0]
    seconds = sum(e.dur_ns for e in copies) / 1e9
    nbytes = sum(e.nbytes for e in copies)
    gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    share = seconds / hops / wall_s if hops > 0 and wall_s > 0 else 0.0
    return HandoffCost(seconds, nbytes, gbps, share)
