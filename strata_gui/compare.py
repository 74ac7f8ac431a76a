"""Before/after of two runs (no Qt): the settings that differ, and the figures as ratios.

`config_diff` lists exactly the settings whose values differ (the engine's names), then what the
engine resolved differently for the same settings (chunk size, layer ranges, hand-off, device
order).  `compare_reports` gives one row per figure: prefill and decode tok/s, prefill time, each
stage's wait, compute and wall time, and each bar of the busy histogram, with after / before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from engine.events import RunReport, StageTotals

from .run_record import RunRecord, ordered_keys


@dataclass(frozen=True)
class DiffRow:
    setting: str
    before: str
    after: str


@dataclass(frozen=True)
class MetricRow:
    name: str
    unit: str
    before: float | None
    after: float | None
    better: str  # "higher" | "lower" | "" (neither)

    @property
    def ratio(self) -> float | None:
        """after / before; None when either is missing or before is 0."""
        if self.before is None or self.after is None or self.before == 0:
            return None
        return self.after / self.before

    @property
    def verdict(self) -> str:
        """'better', 'worse' or '' (same within 1%, or no direction)."""
        r = self.ratio
        if r is None or not self.better or abs(r - 1.0) < 0.01:
            return ""
        up = r > 1.0
        return "better" if up == (self.better == "higher") else "worse"


@dataclass(frozen=True)
class Comparison:
    before: RunRecord
    after: RunRecord
    diff: list[DiffRow]
    metrics: list[MetricRow]

    @property
    def same_output(self) -> bool | None:
        """Byte-identical outputs (same digest); None when a digest is missing or prompts differ."""
        a, b = self.before.report, self.after.report
        if not a.digest or not b.digest or a.cancelled or b.cancelled:
            return None
        if a.plan.prompt_tokens != b.plan.prompt_tokens or \
                self.before.config.get("prompt") != self.after.config.get("prompt"):
            return None
        return a.digest == b.digest

    def metric(self, name: str) -> MetricRow:
        for m in self.metrics:
            if m.name == name:
                return m
        raise KeyError(name)


def _text(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def resolved(report: RunReport) -> dict[str, str]:
    """What the engine decided for a run, beyond its settings."""
    plan = report.plan
    layers = ", ".join(f"{s.device} {s.first_layer}-{s.end_layer - 1}" if s.end_layer > s.first_layer else s.device
                       for s in plan.stages)
    return {"chunk (resolved)": str(plan.chunk), "chunks": str(plan.n_chunks), "stages": str(len(plan.stages)),
            "layers per stage": layers, "hand-off (resolved)": report.handoff,
            "device order": ",".join(report.device_order)}


def config_diff(before: Mapping[str, Any], after: Mapping[str, Any],
                before_report: RunReport | None = None, after_report: RunReport | None = None) -> list[DiffRow]:
    """Exactly the settings that differ; a setting only one run recorded shows '—' on the other side."""
    rows = []
    for key in ordered_keys(set(before) | set(after)):
        a, b = _text(before.get(key)), _text(after.get(key))
        if a != b:
            rows.append(DiffRow(key, a, b))
    if before_report is not None and after_report is not None:
        ra, rb = resolved(before_report), resolved(after_report)
        for key in ra:
            if ra[key] != rb[key]:
                rows.append(DiffRow(key, ra[key], rb[key]))
    return rows


def _stage(totals: list[StageTotals], s: int) -> StageTotals | None:
    for t in totals:
        if t.stage == s:
            return t
    return None


def compare_reports(before: RunReport, after: RunReport) -> list[MetricRow]:
    rows = [
        MetricRow("prefill tok/s", "tok/s", before.prefill_tok_s, after.prefill_tok_s, "higher"),
        MetricRow("decode tok/s", "tok/s", before.decode_tok_s if before.decode_tok_s else None,
                  after.decode_tok_s if after.decode_tok_s else None, "higher"),
        MetricRow("prefill time", "ms", before.prefill_s * 1e3, after.prefill_s * 1e3, "lower"),
    ]
    n = max(len(before.per_stage), len(after.per_stage))
    for s in range(n):
        a, b = _stage(before.per_stage, s), _stage(after.per_stage, s)
        for what, attr, better in (("wait", "wait_ns", "lower"), ("compute", "compute_ns", ""),
                                   ("wall", "wall_ns", "lower")):
            rows.append(MetricRow(f"stage {s} {what}", "ms", getattr(a, attr) / 1e6 if a else None,
                                  getattr(b, attr) / 1e6 if b else None, better))
    k_max = max(len(before.busy_histogram), len(after.busy_histogram))
    for k in range(k_max):
        a = before.busy_histogram[k] * 100 if k < len(before.busy_histogram) else None
        b = after.busy_histogram[k] * 100 if k < len(after.busy_histogram) else None
        full = k == k_max - 1 and k > 0
        rows.append(MetricRow(f"busy: {k} stage(s) computing", "% of wall", a, b, "higher" if full else ""))
    return rows


def unchanged(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """The settings both runs recorded with the same value."""
    return [k for k in ordered_keys(set(before) & set(after)) if _text(before[k]) == _text(after[k])]


def compare(before: RunRecord, after: RunRecord) -> Comparison:
    return Comparison(before, after, config_diff(before.config, after.config, before.report, after.report),
                      compare_reports(before.report, after.report))


def format_ratio(r: float | None) -> str:
    return "—" if r is None else f"{r:.3f}×"
