"""The Plan tab's state and arithmetic (no Qt): a saved run's measured costs, the machine and
settings a user asks about, the predicted run, its error on the runs that exist, and the
recommendation for the detected machine.  The simulation is `engine.plan.planner`'s."""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from engine.events import RunReport, stage_totals
from engine.hw.topology import Topology
from engine.plan import planner

from ..run.record_model import RunRecord
from ..run.settings_model import RunSettings

log = logging.getLogger(__name__)

PCIE_CHOICES = ("gen5x16", "gen5x8", "gen4x16", "gen4x8", "gen4x4", "gen3x16", "gen3x8", "gen3x4")


@dataclass
class GpuRow:
    """One GPU of the machine asked about, as the user typed it."""

    name: str
    vram_gib: float = 0.0  # 0: unknown
    link: str = ""  # genGxW or GB/s; "": as measured in the source run
    speed: float = 1.0

    def spec(self) -> planner.DeviceSpec:
        link = planner.parse_link(self.link) if self.link.strip() else 0.0
        return planner.DeviceSpec(self.name, link_gbs=link, vram_gib=self.vram_gib, speed=self.speed)


@dataclass
class PlanInputs:
    gpus: list[GpuRow]
    peer: str = "as measured"  # "as measured", "none" or GB/s
    chunk_tokens: str = "as measured"  # "as measured", "auto" or tokens
    schedule: str = "fixed"
    pipeline_depth: int = 1
    prefill_main: bool = False
    pin_limit_gib: float | None = None
    prompt_tokens: int = 0  # 0: as measured


@dataclass
class ErrorLine:
    what: str  # "own" or "cross"
    row: planner.ErrorRow


@dataclass
class PlanResult:
    prediction: planner.Prediction
    predicted: RunRecord  # the prediction as a run, for the Gantt and the figures
    measured: RunRecord
    own: planner.ErrorRow  # the source run's own configuration from its own profile
    errors: list[ErrorLine] = field(default_factory=list)
    caution: str = ""

    @property
    def headline(self) -> str:
        p, m = self.prediction, self.measured.report
        return (f"Predicted {p.prefill_tok_s:,.0f} tok/s ({p.settings.describe()}, {len(p.stages)} stage(s)) · "
                f"measured run {m.prefill_tok_s:,.0f} tok/s · predicted / measured "
                f"{p.prefill_tok_s / m.prefill_tok_s:.2f}x" if m.prefill_tok_s > 0 else
                f"Predicted {p.prefill_tok_s:,.0f} tok/s")


def measured_run(record: RunRecord, name: str = "") -> planner.MeasuredRun:
    return planner.measured_from_report(name or record.report.run_id, record.report.to_dict(), list(record.events))


def predicted_record(pred: planner.Prediction, run_id: str = "predicted") -> RunRecord:
    """A prediction in the shape of a saved run (report and events), for views made for runs."""
    report = RunReport(run_id=run_id, plan=pred.plan(run_id), prefill_tok_s=pred.prefill_tok_s,
                       decode_tok_s=pred.decode_tok_s, prefill_s=pred.prefill_s, decode_s=pred.decode_s, digest="",
                       generated=[], per_stage=stage_totals([e for e in pred.events if e.kind != "decode"],
                                                            len(pred.stages)),
                       busy_histogram=list(pred.busy_histogram), handoff=pred.handoff,
                       device_order=list(dict.fromkeys(s.device for s in pred.stages)),
                       notes=["predicted by engine.plan.planner"] + list(pred.notes))
    s = pred.settings
    config = {"devices": ",".join(report.device_order), "chunk_tokens": pred.chunk, "chunk_schedule": s.schedule,
              "pipeline_depth": s.pipeline_depth, "prefill_main": s.prefill_main, "prompt_tokens": pred.prompt_tokens}
    return RunRecord(report, list(pred.events), config, source="import", label="predicted")


def gpus_of_run(run: planner.MeasuredRun) -> list[GpuRow]:
    return [GpuRow(d) for d in dict.fromkeys(run.devices)]


def gpus_of_topology(topo: Topology | None, fallback: Sequence[str] = ("cpu", "cpu")) -> list[GpuRow]:
    """The detected machine: each GPU's VRAM and its measured (else its link class) host GB/s."""
    if topo is None or not topo.devices:
        return [GpuRow(d) for d in dict.fromkeys(fallback)] if len(set(fallback)) == len(fallback) else \
            [GpuRow(d) for d in fallback[:1]]
    rows = []
    for g in topo.devices:
        link = g.h2d_gbs or g.link_class_gbs
        rows.append(GpuRow(g.torch_name, (g.vram_total or 0) / 2**30, f"{link:.1f}" if link else ""))
    return rows


class PlanModel:
    """Start from a saved run, change the machine and the settings, read the prediction."""

    def __init__(self) -> None:
        self.record: RunRecord | None = None
        self.run: planner.MeasuredRun | None = None
        self.profile: planner.CostProfile | None = None
        self.others: list[planner.MeasuredRun] = []  # further saved runs: the cross-run errors
        self.inputs = PlanInputs([])

    def set_source(self, record: RunRecord, name: str = "", others: Iterable[tuple[str, RunRecord]] = ()) -> None:
        self.record = record
        self.run = measured_run(record, name)
        self.profile = planner.profile_from_run(self.run)
        self.others = []
        for other_name, rec in others:
            try:
                m = measured_run(rec, other_name)
                if m.plan.stages and planner.profile_from_run(m).n_layers == self.profile.n_layers:
                    self.others.append(m)
            except (planner.PlanError, KeyError, ValueError) as exc:
                log.debug("run %s left out of the error table: %s", other_name, exc)
        s = planner.settings_of_run(self.run)
        self.inputs = PlanInputs(gpus_of_run(self.run), chunk_tokens="as measured", schedule=s.schedule,
                                 pipeline_depth=s.pipeline_depth,
                                 prefill_main=s.prefill_main)

    # ------------------------------------------------------------------ the question
    def machine(self) -> planner.Machine:
        assert self.run is not None and self.profile is not None
        base = planner.machine_of_run(self.run, self.profile)
        peer = self.inputs.peer.strip().lower()
        if peer in ("", "as measured"):
            peer_gbs = base.peer_gbs
        elif peer in ("none", "host", "0"):
            peer_gbs = 0.0
        else:
            peer_gbs = planner.parse_link(peer)
        if not self.inputs.gpus:
            raise planner.PlanError("at least one GPU (or cpu)")
        return planner.Machine([g.spec() for g in self.inputs.gpus], peer_gbs=peer_gbs)

    def settings(self) -> planner.PlanSettings:
        assert self.run is not None
        s = planner.settings_of_run(self.run)
        i = self.inputs
        same_devices = [g.name for g in i.gpus] == list(dict.fromkeys(self.run.devices))
        if not same_devices or len(set(self.run.devices)) != len(self.run.devices):
            s = replace(s, layer_split=None)
        chunk = i.chunk_tokens.strip().lower()
        if chunk not in ("", "as measured"):
            s = replace(s, chunk_tokens="auto" if chunk == "auto" else int(chunk))
        return replace(s, schedule=i.schedule, pipeline_depth=i.pipeline_depth, prefill_main=i.prefill_main,
                       pin_limit_gib=i.pin_limit_gib, prompt_tokens=i.prompt_tokens or s.prompt_tokens)

    def devices(self) -> list[str]:
        assert self.run is not None
        names = [g.name for g in self.inputs.gpus]
        if names == list(dict.fromkeys(self.run.devices)):
            return list(self.run.devices)  # the run's own stages (also when several share a device)
        return names

    def predict(self) -> PlanResult:
        if self.run is None or self.profile is None or self.record is None:
            raise planner.PlanError("pick a saved run to start from")
        pred = planner.simulate(self.profile, self.machine(), self.settings(), devices=self.devices())
        own_pred = planner.predict_run(self.profile, self.run)
        own = planner.ErrorRow(self.run.name, self.run.name, planner.measured_tok_s(self.run), own_pred.prefill_tok_s,
                               self.run.busy_histogram, own_pred.busy_histogram)
        errors = [ErrorLine("own", own)]
        for other in self.others:
            try:
                p = planner.predict_run(self.profile, other)
                errors.append(ErrorLine("cross", planner.ErrorRow(self.run.name, other.name,
                                                                   planner.measured_tok_s(other), p.prefill_tok_s,
                                                                   other.busy_histogram, p.busy_histogram)))
                q = planner.predict_run(planner.profile_from_run(other), self.run)
                errors.append(ErrorLine("cross", planner.ErrorRow(other.name, self.run.name, own.measured_tok_s,
                                                                   q.prefill_tok_s, self.run.busy_histogram,
                                                                   q.busy_histogram)))
            except planner.PlanError as exc:
                log.debug("no cross prediction with %s: %s", other.name, exc)
        guessed = sorted({n for _, n in pred.bounds if self.profile.extrapolated(n)})
        caution = (f"chunk size(s) {guessed} are priced from other sizes: the run measured "
                   f"{list(self.profile.fitted_sizes)}" if guessed else "")
        return PlanResult(pred, predicted_record(pred), self.record, own, errors, caution)

    def recommend(self, gpus: list[GpuRow], base: RunSettings,
                  base_devices: Sequence[str] = ()) -> tuple[RunSettings, planner.Candidate]:
        """The best predicted settings for these GPUs (the detected machine), as Run tab settings.
        `base_devices`: the Run tab's stages when they only name these devices (cpu,cpu on a
        machine without GPUs), so stages sharing a device stay a choice."""
        if self.run is None or self.profile is None:
            raise planner.PlanError("pick a saved run to start from")
        keep = self.inputs.gpus
        try:
            self.inputs.gpus = gpus
            machine, settings = self.machine(), self.settings()
        finally:
            self.inputs.gpus = keep
        settings = replace(settings, layer_split=None)
        names = [g.name for g in gpus]
        stages = list(base_devices) if base_devices and set(base_devices) <= set(names) else names
        ranked = planner.sweep(self.profile, machine, settings, devices=stages)
        if not ranked:
            raise planner.PlanError("no setting could be predicted for this machine")
        best = ranked[0]
        s = best.settings
        return replace(base, devices=",".join(best.devices), split_mode="auto", chunk_mode="fixed",
                       chunk_tokens=str(best.prediction.chunk if s.schedule == "fixed" else s.chunk_tokens),
                       chunk_schedule=s.schedule, pipeline_depth=s.pipeline_depth, prefill_main=s.prefill_main,
                       prompt_tokens=s.prompt_tokens), best


SETTING_LABELS = {"devices": "devices", "split_mode": "layer split", "split_counts": "split counts",
                  "chunk_mode": "chunk mode", "chunk_tokens": "chunk tokens", "chunk_schedule": "chunk schedule",
                  "pipeline_depth": "pipeline depth", "prefill_main": "prefill-main",
                  "prompt_tokens": "prompt tokens"}


def settings_changes(before: RunSettings, after: RunSettings) -> list[str]:
    """What Recommend changed in the Run tab, one 'label old → new' a setting, in the form's order
    (empty: it kept every setting)."""
    old, new = before.to_dict(), after.to_dict()
    out = []
    for key, value in new.items():
        if old.get(key) != value:
            show = (lambda v: "on" if v else "off") if isinstance(value, bool) else str
            out.append(f"{SETTING_LABELS.get(key, key.replace('_', ' '))} {show(old.get(key))} → {show(value)}")
    return out
