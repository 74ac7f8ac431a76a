"""A recorded run as the planner reads it: its plan (stages, layer ranges, chunks), figures and
events, from a trace file or the app's history (read-only), never unpickled or evaluated."""
from __future__ import annotations

import ast
import json
import re
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.events import RunPlan, StageEvent, StagePlan
from engine.plan.plan_inputs import PlanError


@dataclass
class MeasuredRun:
    """What the planner needs of a recorded run: its plan, its figures and its events."""

    name: str
    plan: RunPlan
    prefill_s: float
    prefill_tok_s: float
    busy_histogram: list[float]
    events: list[StageEvent]
    expert_stats: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cost_profile: dict = field(default_factory=dict)  # the probe's ChunkCost when the run saved it

    @property
    def devices(self) -> list[str]:
        return [s.device for s in self.plan.stages]


def _plan_from(d: dict[str, Any]) -> RunPlan:
    stages = tuple(StagePlan(int(s["stage"]), str(s["device"]), int(s["first_layer"]), int(s["end_layer"]))
                   for s in d["stages"])
    return RunPlan(run_id=str(d.get("run_id", "")), stages=stages, prompt_tokens=int(d["prompt_tokens"]),
                   chunk=int(d["chunk"]), n_chunks=int(d["n_chunks"]), decode_tokens=int(d.get("decode_tokens", 0)),
                   handoff=str(d.get("handoff", "")), prefill_main=bool(d.get("prefill_main", False)),
                   pipeline_depth=int(d.get("pipeline_depth", d.get("pf_depth", 1))),
                   chunk_reason=str(d.get("chunk_reason", "")),
                   schedule=str(d.get("schedule", "fixed")),
                   bounds=tuple((int(a), int(n)) for a, n in d.get("bounds", ()) or ()))


REPORT_REPR_MAX = 1 << 20  # characters of an older trace's report repr the planner parses


def _report_dict(meta_report: Any) -> dict[str, Any]:
    """A trace's report: a dict, or (older exports) its Python repr; the fields the planner reads."""
    if isinstance(meta_report, dict):
        return meta_report
    text = str(meta_report)
    if len(text) > REPORT_REPR_MAX:  # literal_eval only reads literals, but its parse is not bounded
        raise PlanError(f"the trace's report text is {len(text)} characters (at most {REPORT_REPR_MAX} are read)")
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, RecursionError, MemoryError, TypeError):
        pass
    out: dict[str, Any] = {}
    m = re.search(r"'plan': (\{.*?'chunk_reason': '(?:[^'\\]|\\.)*'[^}]*\})", text)
    if m:
        out["plan"] = ast.literal_eval(m.group(1))
    for key in ("prefill_s", "prefill_tok_s"):
        m = re.search(rf"'{key}': ([0-9.e+-]+)", text)
        if m:
            out[key] = float(m.group(1))
    m = re.search(r"'busy_histogram': (\[[^\]]*\])", text)
    if m:
        out["busy_histogram"] = ast.literal_eval(m.group(1))
    m = re.search(r"'expert_stats': (\[[^\]]*\])", text)
    if m:
        try:
            out["expert_stats"] = ast.literal_eval(m.group(1))
        except (ValueError, SyntaxError):
            pass
    if "plan" not in out:
        raise PlanError("the trace's report has no readable plan (stages and layer ranges)")
    return out


def measured_from_report(name: str, report: dict[str, Any], events: list[StageEvent]) -> MeasuredRun:
    plan = _plan_from(report["plan"])
    return MeasuredRun(name, plan, float(report.get("prefill_s", 0.0)), float(report.get("prefill_tok_s", 0.0)),
                       [float(x) for x in report.get("busy_histogram", [])], events,
                       list(report.get("expert_stats", []) or []), list(report.get("notes", []) or []),
                       dict(report.get("cost_profile", {}) or {}))


def load_trace_run(path: Path | str) -> MeasuredRun:
    from engine.io import trace

    events, meta = trace.load(path)
    if "report" not in meta:
        raise PlanError(f"{path}: the trace carries no engine report (layer ranges unknown)")
    return measured_from_report(Path(path).name, _report_dict(meta["report"]), events)


def load_history_run(db: Path | str, run: int) -> MeasuredRun:
    """A run of the app's history file (read-only; the schema of strata_gui/history.py)."""
    path = Path(db)
    if not path.exists():
        raise PlanError(f"no history file at {path}")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT report_json FROM runs WHERE id = ?", (int(run),)).fetchone()
        if row is None:
            raise PlanError(f"no run #{run} in {path}")
        rows = conn.execute("SELECT run_id, stage, device, chunk, kind, start_ns, end_ns, tokens, nbytes, note "
                            "FROM events WHERE run = ? ORDER BY seq", (int(run),)).fetchall()
    finally:
        conn.close()
    return measured_from_report(f"run #{run}", json.loads(row[0]), [StageEvent(*r) for r in rows])


def layers_of(ev: StageEvent, plan: RunPlan) -> int:
    """The layers an event's stage ran (prefill-main: every layer its note names)."""
    m = re.match(r"prefill-main: layers (\d+)-(\d+)", ev.note)
    if m:
        return int(m.group(2)) - int(m.group(1)) + 1
    for s in plan.stages:
        if s.stage == ev.stage:
            return s.n_layers
    return 0



def measured_tok_s(run: MeasuredRun) -> float:
    if run.prefill_tok_s > 0:
        return run.prefill_tok_s
    pre = [e for e in run.events if e.kind != "decode"]
    span = (max(e.end_ns for e in pre) - min(e.start_ns for e in pre)) / 1e9 if pre else 0
    return run.plan.prompt_tokens / span if span > 0 else 0.0
