"""One run as the app keeps it (no Qt): the engine's report, its events, and the settings that
shaped it.

`RunRecord` is what the history stores, what compare and export read, and what an imported trace
becomes.  The settings are a flat dict with the engine's setting names (`chunk_tokens`, `pipeline_depth`, …)
plus the prompt, so a config diff between two runs names what a user knows.  `report_from_dict`
rebuilds the engine's `RunReport` from its JSON form (unknown keys of a newer engine are
dropped); `report_from_events` derives a report's figures from events alone, for traces that
carry no engine report.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig, migrate_keys
from engine.events import RunPlan, RunReport, StageEvent, StagePlan, StageTotals, busy_histogram, stage_totals

log = logging.getLogger(__name__)

SOURCES = ("run", "sweep", "import")
STATUSES = ("finished", "cancelled")

# the order a config diff lists settings in (anything else follows, sorted)
CONFIG_ORDER = ("model", "devices", "gpu_order", "layer_split", "chunk_tokens", "chunk_schedule", "pipeline_depth",
                "prefill_main", "cuda_graphs", "executor",
                "pin_limit_gib", "expert_cache", "handoff", "dtype", "timing", "check_nan", "prompt",
                "prompt_tokens", "decode_tokens")
# how a run was measured, not what it ran: recorded with its settings, never listed as a difference
# warmup: a warm-up pass ran first; cold: the first pass of its shape in a session (no warm-up);
# repeat / repeats / repeat_group: the k-th of n measured repeats of one press of Run
META_KEYS = ("warmup", "cold", "repeat", "repeats", "repeat_group")


@dataclass
class RunRecord:
    """A run with everything needed to show, compare and export it again."""

    report: RunReport
    events: list[StageEvent]
    config: dict[str, Any] = field(default_factory=dict)  # flat: setting name -> JSON-able value
    source: str = "run"  # run | sweep | import
    status: str = "finished"  # finished | cancelled
    label: str = ""
    created_at: float = field(default_factory=time.time)  # seconds since the epoch

    @property
    def telemetry(self) -> list[dict]:
        return self.report.telemetry

    @property
    def origin_ns(self) -> int:
        return run_origin(self.events)

    @property
    def stages(self) -> list[tuple[int, str, int, int]]:
        """(stage, device, first_layer, end_layer) per stage, as the Gantt wants them."""
        return [(s.stage, s.device, s.first_layer, s.end_layer) for s in self.report.plan.stages]


def run_origin(events: Iterable[StageEvent]) -> int:
    """The instant a run started, as its events show it: the earliest start (0 when none).

    Compare aligns runs here, and the Chrome trace uses the same instant as its time zero."""
    return min((e.start_ns for e in events), default=0)


# --------------------------------------------------------------------------- settings

def _flat(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return value


def record_config(config: EngineConfig, model: str, prompt: str, prompt_tokens: int,
                  decode_tokens: int, measure: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The settings of one run: the engine's (as `EngineConfig` resolved them), the model, the prompt.

    `prompt` says which prompt it was ("synthetic, nonce 0" or the text), so two runs with the same
    token count but different prompts do not look alike in a diff."""
    out: dict[str, Any] = {"model": model}
    out.update({k: _flat(v) for k, v in config.as_dict().items()})
    out.update({"prompt": prompt, "prompt_tokens": int(prompt_tokens), "decode_tokens": int(decode_tokens)})
    out.update({k: v for k, v in (measure or {}).items() if k in META_KEYS})
    return out


def config_from_dict(data: Mapping[str, Any]) -> dict[str, Any]:
    """A run's settings as a history row or a trace stored them; a run recorded before issue 16
    names two with the seeds' names (`prefill`, `pf_depth`): they are read as `chunk_tokens` and
    `pipeline_depth`."""
    if not isinstance(data, Mapping):
        raise ValueError(f"the settings are a {type(data).__name__}, not an object")
    return migrate_keys(data)


def config_from_report(report: RunReport) -> dict[str, Any]:
    """What a report alone says about the settings (a trace written by another tool)."""
    plan = report.plan
    return {"devices": ",".join(report.device_order or [s.device for s in plan.stages]),
            "chunk_tokens": plan.chunk, "pipeline_depth": plan.pipeline_depth, "prefill_main": plan.prefill_main,
            "handoff": report.handoff, "executor": report.executor, "prompt_tokens": plan.prompt_tokens,
            "decode_tokens": plan.decode_tokens}


def ordered_keys(keys: Iterable[str]) -> list[str]:
    keys = set(keys)
    known = [k for k in CONFIG_ORDER if k in keys]
    return known + sorted(keys - set(known))


# --------------------------------------------------------------------------- reports

def report_to_dict(report: RunReport, telemetry: bool = True) -> dict[str, Any]:
    d = report.to_dict()
    if not telemetry:
        d.pop("telemetry", None)
    return d


def _pick(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def report_from_dict(data: Mapping[str, Any]) -> RunReport:
    """The `RunReport` whose `to_dict()` gave `data`.  Raises ValueError naming what is wrong."""
    if not isinstance(data, Mapping):
        raise ValueError(f"the report is a {type(data).__name__}, not an object")
    try:
        plan_d = migrate_keys(data["plan"])  # pf_depth: a report written before issue 16
        plan_d["stages"] = tuple(StagePlan(**_pick(StagePlan, s)) for s in plan_d.get("stages", ()))
        plan_d["bounds"] = tuple((int(a), int(n)) for a, n in plan_d.get("bounds", ()))
        plan = RunPlan(**_pick(RunPlan, plan_d))
        per_stage = [StageTotals(**_pick(StageTotals, t)) for t in data.get("per_stage", [])]
        fields = _pick(RunReport, data)
        fields.update(plan=plan, per_stage=per_stage)
        fields["busy_histogram"] = [float(x) for x in fields.get("busy_histogram", [])]
        fields["generated"] = [int(x) for x in fields.get("generated", [])]
        return RunReport(**fields)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # AttributeError: a stage that is not an object
        raise ValueError(f"the report cannot be read: {type(exc).__name__}: {exc}") from None


def report_from_events(events: Sequence[StageEvent], run_id: str = "", note: str = "") -> RunReport:
    """A report whose figures come from the events alone (a trace without the engine's report).

    Prompt tokens are the tokens the last stage computed; prefill time is the span of the prefill
    events; decode steps are the last stage's decode events.  What events cannot tell (layer
    ranges, depth, digest) is left unknown: layers 0-0, depth -1, an empty digest."""
    prefill = [e for e in events if e.kind != "decode"]
    decode = [e for e in events if e.kind == "decode"]
    n_stages = max((e.stage for e in events), default=-1) + 1
    devices = {}
    for e in events:
        devices.setdefault(e.stage, e.device)
    last = n_stages - 1
    computes = [e for e in prefill if e.kind == "compute" and e.chunk >= 0]
    finisher = [e for e in computes if e.stage == last] or computes
    seen: dict[int, int] = {}
    for e in finisher:
        seen.setdefault(e.chunk, e.tokens)
    tokens = sum(seen.values())
    p0 = min((e.start_ns for e in prefill), default=0)
    p1 = max((e.end_ns for e in prefill), default=0)
    prefill_s = max(p1 - p0, 0) / 1e9
    steps = sorted({e.chunk for e in decode if e.stage == last})
    d0 = min((e.start_ns for e in decode), default=0)
    d1 = max((e.end_ns for e in decode), default=0)
    decode_s = max(d1 - d0, 0) / 1e9
    stages = tuple(StagePlan(s, devices.get(s, ""), 0, 0) for s in range(n_stages))
    chunk = max(seen.values(), default=0)
    plan = RunPlan(run_id=run_id, stages=stages, prompt_tokens=tokens, chunk=chunk, n_chunks=len(seen),
                   decode_tokens=len(steps) + 1 if steps else 0, handoff="unknown", prefill_main=False,
                   pipeline_depth=-1, chunk_reason="unknown (derived from the trace's events)")
    notes = [note] if note else []
    return RunReport(run_id=run_id, plan=plan,
                     prefill_tok_s=tokens / prefill_s if prefill_s > 0 else 0.0,
                     decode_tok_s=len(steps) / decode_s if steps and decode_s > 0 else 0.0,
                     prefill_s=prefill_s, decode_s=decode_s, digest="", generated=[],
                     per_stage=stage_totals(prefill, n_stages), busy_histogram=busy_histogram(prefill, n_stages),
                     handoff="unknown", device_order=[devices[s] for s in sorted(devices)], notes=notes)


def describe(record: RunRecord) -> str:
    """A one-line description of a run for lists and titles."""
    r = record.report
    plan = r.plan
    depth = {0: "depth 0 (join)", 1: "depth 1 (overlap)"}.get(plan.pipeline_depth, "depth ?")
    devs = ",".join(r.device_order) or ",".join(s.device for s in plan.stages)
    parts = [f"{plan.prompt_tokens:,} tok", f"{len(plan.stages)} stage(s) {devs}", depth,
             f"chunk {plan.chunk}", "prefill — (stopped)" if r.cancelled else f"{r.prefill_tok_s:,.0f} tok/s"]
    if record.status != "finished":
        parts.append(record.status)
    repeats = record.config.get("repeats")
    if isinstance(repeats, int) and repeats > 1:
        parts.append(f"repeat {record.config.get('repeat', '?')} of {repeats}")
    if record.config.get("cold"):
        parts.append("cold (no warm-up)")
    return " · ".join(parts)
