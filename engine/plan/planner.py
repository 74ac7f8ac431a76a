"""A what-if planner: predict a pipeline run from measured costs (issue 22).

`simulate(profile, machine, settings)` predicts one run: its stages come from the layer-range
rule the Session loads by (engine/plan/layer_ranges.py), its chunks from `run_plan.choice` (the
engine's own choice, asked of a `WhatIf` in place of a Session), its events and times from the
pipeline model (engine/plan/pipeline_sim.py, held to `chunking.bounds_makespan` where both apply by
tests/test_sim_closed_form.py).  `predict_run` predicts a recorded run's own configuration,
`error_rows` how far predictions land from the runs that exist, `sweep` ranks settings.

The parts, each a module: what a prediction is asked for and computed from
(engine/plan/plan_inputs.py), a recorded run as read from a trace or the history
(engine/plan/measured_run.py), cost profiles fitted to measurements (engine/plan/profile_fit.py).  Their
names are re-exported here: `planner.X` is the planner's one interface (`strata-bench plan` in
engine/cli/plan_cli.py, the app's Plan tab in strata_gui/plan/).
"""
from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from engine.config import EngineConfig
from engine.events import RunPlan, StageEvent, StagePlan, StageTotals, busy_histogram, stage_totals
from engine.plan import chunking, layer_ranges, run_plan
from engine.plan.measured_run import (
    REPORT_REPR_MAX,
    MeasuredRun,
    load_history_run,
    load_trace_run,
    measured_from_report,
    measured_tok_s,
)
from engine.plan.pipeline_sim import IDLE_MIN_NS, Sim, Timeline, handoff
from engine.plan.plan_inputs import CostProfile, DeviceSpec, Machine, PlanError, PlanSettings
from engine.plan.profile_fit import (
    MeasuredTotal,
    parse_chunk_cost_log,
    probe_dict,
    profile_from_run,
    profile_from_totals,
)

__all__ = ["IDLE_MIN_NS", "REPORT_REPR_MAX", "Candidate", "CostProfile", "DeviceSpec", "ErrorRow", "Machine",
           "MeasuredRun", "MeasuredTotal", "PlanError", "PlanSettings", "Prediction", "Timeline", "WhatIf",
           "bottleneck", "error_rows", "handoff", "load_history_run", "load_trace_run", "machine_of_run",
           "measured_from_report", "measured_tok_s", "parse_chunk_cost_log", "parse_link", "plan_stages",
           "predict_run", "probe_dict", "profile_from_run", "profile_from_totals", "settings_of_run", "simulate",
           "sweep"]

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- stages

def plan_stages(n_layers: int, devices: Sequence[str], layer_split: Sequence[int] | None = None,
                interleave: int = 1) -> list[StagePlan]:
    """The stages a run of these settings loads (engine/plan/layer_ranges.py), as the events name them."""
    try:
        return [StagePlan(*r) for r in layer_ranges.stage_ranges(n_layers, devices, layer_split, interleave)]
    except layer_ranges.LayerSplitError as exc:
        raise PlanError(str(exc)) from None


# --------------------------------------------------------------------------- prediction

@dataclass
class Prediction:
    settings: PlanSettings
    stages: list[StagePlan]
    events: list[StageEvent]
    prefill_s: float
    decode_s: float
    prompt_tokens: int
    chunk: int
    bounds: list[tuple[int, int]]
    busy_histogram: list[float]
    per_stage: list[StageTotals]
    bottleneck: str
    handoff: str
    notes: list[str] = field(default_factory=list)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        steps = max(self.settings.decode_tokens - 1, 0)
        return steps / self.decode_s if steps and self.decode_s > 0 else 0.0

    def plan(self, run_id: str = "predicted") -> RunPlan:
        s = self.settings
        return RunPlan(run_id=run_id, stages=tuple(self.stages), prompt_tokens=self.prompt_tokens, chunk=self.chunk,
                       n_chunks=len(self.bounds), decode_tokens=s.decode_tokens, handoff=self.handoff,
                       prefill_main=s.prefill_main, pipeline_depth=s.pipeline_depth,
                       chunk_reason="predicted by engine.plan.planner", schedule=s.schedule,
                       bounds=tuple(self.bounds) if s.schedule == "balanced" else ())


@dataclass(frozen=True)
class _Kind:
    type: str  # as torch.device.type: cuda or cpu


@dataclass(frozen=True)
class _Shape:
    n_layers: int


class WhatIf:
    """A run of these settings on this machine as `run_plan.choice` reads a Session: the config
    it would run with, its stages' devices and layer groups, the profile's costs (one layer; the
    most layers a device runs per chunk, as `Session.chunk_cost`) and the hand-off between the
    first two stages (as `Session.hop_s_per_token`).  So a prediction chunks a prompt the way
    the engine's run of the same settings would (auto, balanced, a user's size)."""

    def __init__(self, profile: CostProfile, machine: Machine, settings: PlanSettings, devices: Sequence[str],
                 stages: Sequence[StagePlan]) -> None:
        c = settings.chunk_tokens
        if isinstance(c, str) and c.isdigit():
            c = int(c)
        if isinstance(c, int) and c <= 0:
            raise PlanError(f"chunk {c}: a positive number of tokens or auto")
        if not isinstance(c, int) and c != "auto":
            raise PlanError(f"chunk {c!r}: a number of tokens or auto")
        split: str | list[int] = list(settings.layer_split) if settings.layer_split else (
            f"interleave:{settings.interleave}" if settings.interleave > 1 else "auto")
        self.config = EngineConfig(devices=list(devices), chunk_tokens=c, chunk_schedule=settings.schedule,
                                   pipeline_depth=settings.pipeline_depth, prefill_main=settings.prefill_main,
                                   layer_split=split)
        self.devices = [_Kind(machine.device(d).kind) for d in devices]
        self.interleave = max(1, settings.interleave)
        self.spec = _Shape(profile.n_layers)
        per_device: dict[int, int] = {}  # interleaved groups of a device all run on it
        for st in stages:
            lane = st.stage % len(devices)
            per_device[lane] = per_device.get(lane, 0) + st.n_layers
        self._cost = replace(profile.cost(), layers_per_stage=max(per_device.values()))
        self._hop = 0.0
        if len(stages) > 1:
            da, db = machine.device(stages[0].device), machine.device(stages[1].device)
            self._hop = handoff(profile, machine, da, db, profile.handoff_bytes_per_token)[0]

    @property
    def measured_chunk_cost(self) -> chunking.ChunkCost:
        return self._cost

    def chunk_cost(self, n_tokens: int | None = None) -> chunking.ChunkCost:
        return self._cost

    def hop_s_per_token(self) -> float:
        return self._hop


def simulate(profile: CostProfile, machine: Machine, settings: PlanSettings,
             devices: Sequence[str] | None = None, run_id: str = "predicted") -> Prediction:
    """Predict one run: its events (marked predicted), prefill time, busy histogram, bottleneck."""
    if settings.prompt_tokens <= 0:
        raise PlanError("prompt tokens: at least one")
    if settings.pipeline_depth not in (0, 1):
        raise PlanError(f"pipeline_depth {settings.pipeline_depth}: 0 (join) or 1 (overlap); one buffer set per stage")
    if profile.n_layers <= 0:
        raise PlanError("the profile does not say how many layers the model has")
    names = list(devices) if devices is not None else [d.name for d in machine.devices]
    stages = plan_stages(profile.n_layers, names, settings.layer_split, settings.interleave)
    chosen = run_plan.choice(WhatIf(profile, machine, settings, names, stages), settings.prompt_tokens)
    bounds = list(chosen.bounds)
    chunk = max(n for _, n in bounds)
    settings = replace(settings, chunk_tokens=min(chosen.chunk, settings.prompt_tokens), schedule=chosen.kind)
    sim = Sim(profile, machine, settings, stages, run_id)
    prefill_s = sim.prefill(bounds)
    decode_s = sim.decode(prefill_s, settings.decode_tokens)
    pre = [e for e in sim.events if e.kind != "decode"]
    hist = busy_histogram(pre, len(stages))
    totals = stage_totals(pre, len(stages))
    kinds = sorted(set(sim.handoffs))
    handoff = "none (one stage)" if not kinds else ",".join(kinds)
    pred = Prediction(settings, stages, sorted(sim.events, key=lambda e: (e.start_ns, e.stage)), prefill_s,
                      decode_s, settings.prompt_tokens, chunk, bounds, hist, totals, "", handoff, sim.notes)
    pred.bottleneck = bottleneck(pred, sim)
    return pred


def bottleneck(pred: Prediction, sim: Sim | None = None) -> str:
    """What sets the pace, in words, from the predicted events."""
    wall = pred.prefill_s
    if wall <= 0:
        return "nothing ran"
    if sim is not None and sim.host.total() >= 0.9 * wall:
        return f"host launches: the interpreter launches every stage's layers ({sim.host.total() / wall:.0%} of wall)"
    busiest = max(pred.per_stage, key=lambda t: t.compute_ns, default=None)
    if busiest is None:
        return "nothing ran"
    share = busiest.compute_ns / 1e9 / wall
    streamed = sum(t.stream_ns for t in pred.per_stage if t.stage == busiest.stage) / 1e9
    copy = sum(t.copy_ns for t in pred.per_stage) / 1e9
    what = f"stage {busiest.stage} ({busiest.device}) computes {share:.0%} of wall"
    if streamed >= 0.8 * busiest.compute_ns / 1e9 and streamed > 0:
        what += ", bound by streaming experts over its link"
    if copy >= 0.2 * wall:
        what += f"; hand-offs take {copy / wall:.0%} of wall"
    n = len(pred.stages)
    if n > 1 and pred.busy_histogram and pred.busy_histogram[-1] < 0.7 and not pred.settings.prefill_main:
        fill = (n - 1) / (len(pred.bounds) + n - 1) if pred.bounds else 0
        what += f"; all {n} stages compute together {pred.busy_histogram[-1]:.0%} of wall (fill/drain bound {1 - fill:.0%})"
    return what


def machine_of_run(run: MeasuredRun, profile: CostProfile, link_gbs: float = 0.0, peer_gbs: float = 0.0) -> Machine:
    """The machine a run ran on, as far as its events tell (links from its copies and streams)."""
    devs, seen = [], set()
    for s in run.plan.stages:
        if s.device not in seen:
            seen.add(s.device)
            devs.append(DeviceSpec(s.device, link_gbs=link_gbs))
    peer = peer_gbs
    if not peer and "peer" in run.plan.handoff:
        copies = [e for e in run.events if e.kind == "copy" and e.chunk >= 0 and e.nbytes > 0]
        dur = sum(e.dur_ns for e in copies)
        peer = sum(e.nbytes for e in copies) / dur if dur > 0 else 0.0
    return Machine(devs, peer_gbs=peer)


def settings_of_run(run: MeasuredRun) -> PlanSettings:
    """The settings a recorded run ran with: its layer ranges, chunks, depth, prefill-main."""
    p = run.plan
    chunk = p.chunk if p.schedule == "fixed" else -(-p.prompt_tokens // max(p.n_chunks, 1))
    return PlanSettings(prompt_tokens=p.prompt_tokens, chunk_tokens=chunk, schedule=p.schedule,
                        pipeline_depth=max(p.pipeline_depth, 0),
                        prefill_main=p.prefill_main, decode_tokens=p.decode_tokens,
                        layer_split=[s.n_layers for s in p.stages])


def predict_run(profile: CostProfile, run: MeasuredRun, machine: Machine | None = None) -> Prediction:
    """Predict `run`'s own configuration (its stages and devices, chunks, depth) from `profile`."""
    machine = machine or machine_of_run(run, profile)
    return simulate(profile, machine, settings_of_run(run), devices=run.devices)


# --------------------------------------------------------------------------- honesty

@dataclass
class ErrorRow:
    profile_from: str
    predicted: str
    measured_tok_s: float
    predicted_tok_s: float
    measured_hist: list[float]
    predicted_hist: list[float]

    @property
    def error(self) -> float:
        return self.predicted_tok_s / self.measured_tok_s - 1 if self.measured_tok_s > 0 else float("nan")

    @property
    def hist_points(self) -> float:
        """The largest difference of the two busy histograms, in percentage points."""
        n = max(len(self.measured_hist), len(self.predicted_hist))
        a = list(self.measured_hist) + [0.0] * (n - len(self.measured_hist))
        b = list(self.predicted_hist) + [0.0] * (n - len(self.predicted_hist))
        return 100 * max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def error_rows(runs: Sequence[MeasuredRun], cross: bool = True) -> list[ErrorRow]:
    """Each run predicted from its own profile, and (cross) from every other run of the same model."""
    profiles = {}
    for r in runs:
        try:
            profiles[r.name] = profile_from_run(r)
        except PlanError as exc:
            log.info("no profile from %s: %s", r.name, exc)
    out = []
    for src in runs:
        prof = profiles.get(src.name)
        if prof is None:
            continue
        for dst in runs:
            if dst is not src and (not cross or profiles.get(dst.name) is None
                                   or profiles[dst.name].n_layers != prof.n_layers
                                   or profiles[dst.name].device_kind != prof.device_kind):
                continue
            machine = machine_of_run(dst, prof)
            pred = predict_run(prof, dst, machine)
            hist = dst.busy_histogram or busy_histogram([e for e in dst.events if e.kind != "decode"],
                                                        len(dst.plan.stages))
            out.append(ErrorRow(src.name, dst.name, measured_tok_s(dst), pred.prefill_tok_s, hist, pred.busy_histogram))
    return out


# --------------------------------------------------------------------------- sweep

@dataclass
class Candidate:
    settings: PlanSettings
    devices: list[str]
    prediction: Prediction

    def describe(self) -> str:
        return f"{self.settings.describe()}, devices {','.join(self.devices)}"


def sweep(profile: CostProfile, machine: Machine, base: PlanSettings, chunks: Iterable[int] | None = None,
          orders: bool = True, pin_limits: Sequence[float | None] = (),
          devices: Sequence[str] | None = None) -> list[Candidate]:
    """Every combination of chunk, schedule, depth, prefill-main, pin limit and device order,
    best predicted prefill first.  `devices`: the stages' devices (default: one stage per device
    of the machine; a name may repeat, e.g. cpu,cpu: stages sharing a device)."""
    n = base.prompt_tokens
    # only sizes the profile prices from a measurement (its fit or a probe curve), never a blind extrapolation
    priced = sorted(profile.layer_s)
    sizes = sorted({min(c, n) for c in (chunks or priced) if c > 0})
    schedules = ("fixed", "balanced") if len(priced) >= 3 else ("fixed",)  # balancing needs a cost curve
    names = list(devices) if devices else [d.name for d in machine.devices]
    perms = [list(p) for p in itertools.permutations(names)] if orders and len(names) <= 4 else [names]
    seen_orders = []
    for p in perms:  # orders that differ only between identical devices are one order
        key = [(machine.device(d).link_gbs, machine.device(d).vram_gib, machine.device(d).speed) for d in p]
        if key not in [k for k, _ in seen_orders]:
            seen_orders.append((key, p))
    pins = list(pin_limits) or [base.pin_limit_gib]
    out: list[Candidate] = []
    for (_, order), c, sched, depth, pm, pin in itertools.product(seen_orders, sizes, schedules, (0, 1),
                                                                  (False, True), pins):
        if len(order) == 1 and (pm or depth == 0 or sched == "balanced"):
            continue
        if pm and (depth == 0 or sched == "balanced"):
            continue  # prefill-main runs one stage: depth and balancing do nothing there
        if sched == "balanced" and c >= n:
            continue
        s = replace(base, chunk_tokens=c, schedule=sched, pipeline_depth=depth, prefill_main=pm, pin_limit_gib=pin,
                    layer_split=None if base.layer_split is None else base.layer_split)
        try:
            pred = simulate(profile, machine, s, devices=order)
        except PlanError:
            continue
        out.append(Candidate(s, order, pred))
    out.sort(key=lambda k: k.prediction.prefill_s)
    return out


def parse_link(text: str) -> float:
    """GB/s per direction: a number, or PCIe as genGxW (gen4x4), the link class of topology."""
    t = str(text).strip().lower()
    m = re.fullmatch(r"(?:pcie\s*)?gen\s*(\d)\s*x\s*(\d+)", t)
    if m:
        from engine.hw.topology import link_class_gbs

        gbs = link_class_gbs(int(m.group(1)), int(m.group(2)))
        if gbs is None:
            raise PlanError(f"link {text!r}: PCIe gen 1-6")
        return gbs
    try:
        v = float(t.removesuffix("gb/s").strip())
    except ValueError:
        raise PlanError(f"link {text!r}: GB/s (e.g. 5.3) or PCIe genGxW (e.g. gen4x4)") from None
    if v <= 0:
        raise PlanError(f"link {text!r}: more than 0 GB/s")
    return v
