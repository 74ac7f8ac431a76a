"""Before/after of two runs (no Qt): the settings that differ, and the figures as ratios.

`config_diff` lists exactly the settings whose values differ (the engine's names), then what the
engine resolved differently for the same settings (chunk size, layer ranges, hand-off, device
order).  `compare_reports` gives one row per figure: prefill and decode tok/s, prefill time, each
stage's wait, compute and wall time, and each bar of the busy histogram, with after / before.

Noise.  Each side of a comparison may carry a `SampleSet`: the run's repeats (one press of Run
with repeats > 1; every repeat is in the history), or, for a single run, the runs in the history
with exactly the same settings (`gather_samples`; cold runs left out).  A ratio then carries an
interval, [lowest after / highest before, highest after / lowest before]: when it holds 1 the
ratio is *within noise* and shown neutral, whatever its value.  With one value on each side and
nothing to pool, the noise is unknown and the ratio is not judged either.  A figure that no
differing setting can affect (decode for a prefill-only setting such as pipeline_depth) is flagged as
unaffected rather than judged.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.events import RunReport, StageTotals

from ..run.record_model import META_KEYS, RunRecord, ordered_keys
from ..run.spread_model import Spread

log = logging.getLogger(__name__)

# settings (and resolved facts) that shape the prefill only: decode does not depend on them
PREFILL_ONLY = frozenset({"pipeline_depth", "chunk_tokens", "chunk_schedule", "prefill_main", "chunk (resolved)",
                          "chunks"})
MIN_EFFECT = 0.01  # a ratio within 1% of 1 is never called better or worse


@dataclass(frozen=True)
class DiffRow:
    setting: str
    before: str
    after: str


@dataclass(frozen=True)
class SampleSet:
    """The runs that measure one side of a comparison: its repeats, or same-settings runs."""

    reports: tuple[RunReport, ...] = ()
    source: str = ""  # "repeats" | "same settings" | "" (the run alone)

    @property
    def n(self) -> int:
        return len(self.reports)


@dataclass(frozen=True)
class MetricRow:
    name: str
    unit: str
    before: float | None
    after: float | None
    better: str  # "higher" | "lower" | "" (neither)
    before_spread: Spread = field(default_factory=lambda: Spread(()))
    after_spread: Spread = field(default_factory=lambda: Spread(()))
    unaffected: str = ""  # why no differing setting can move this figure ("" : it can)

    @property
    def ratio(self) -> float | None:
        """after / before; None when either is missing or before is 0."""
        if self.before is None or self.after is None or self.before == 0:
            return None
        return self.after / self.before

    @property
    def interval(self) -> tuple[float, float] | None:
        """The ratios the two sides' values allow: (lowest after / highest before, highest after /
        lowest before); None when neither side has a spread (one value each)."""
        b, a = self.before_spread, self.after_spread
        if self.ratio is None or not (a.known or b.known):
            return None
        b_lo, b_hi = (b.lo, b.hi) if b.values else (self.before, self.before)
        a_lo, a_hi = (a.lo, a.hi) if a.values else (self.after, self.after)
        if not b_lo or not b_hi or b_lo <= 0:
            return None
        return a_lo / b_hi, a_hi / b_lo

    @property
    def noise(self) -> float | None:
        """Half the interval's width over the ratio (0.04 = ±4%); None when unknown."""
        iv, r = self.interval, self.ratio
        if iv is None or not r:
            return None
        return (iv[1] - iv[0]) / 2 / abs(r)

    @property
    def within_noise(self) -> bool | None:
        """True when the interval holds 1 (the sides' values overlap); None when noise is unknown."""
        iv = self.interval
        if iv is None:
            return None
        return iv[0] <= 1.0 <= iv[1]

    @property
    def verdict(self) -> str:
        """'better' or 'worse' only for a ratio beyond the noise of a figure the change can
        affect; '' otherwise (within noise, noise unknown, unaffected, within 1%, no direction)."""
        r = self.ratio
        if r is None or not self.better or abs(r - 1.0) < MIN_EFFECT or self.unaffected:
            return ""
        if self.within_noise is not False:
            return ""
        up = r > 1.0
        return "better" if up == (self.better == "higher") else "worse"

    @property
    def short_judgement(self) -> str:
        """`judgement` in a table cell's few words (the sentence goes to its tooltip): within noise
        ±5.2%, beyond noise ±38%, noise unknown, unaffected (a figure no changed setting can move)."""
        if self.ratio is None:
            return ""
        noise = self.noise
        band = f"±{noise * 100:.0f}%" if noise is not None and noise >= 0.1 else \
            f"±{noise * 100:.1f}%" if noise is not None else ""
        if self.unaffected:
            if noise is None:
                return "unaffected"
            return f"within noise {band}, unaffected" if self.within_noise else f"unaffected, beyond noise {band}"
        if noise is None:
            return "noise unknown"
        return f"within noise {band}" if self.within_noise else f"beyond noise {band}"

    @property
    def judgement(self) -> str:
        """What the ratio's colour (or its absence) means, in words."""
        if self.ratio is None:
            return ""
        noise = self.noise
        if self.unaffected:
            if noise is None:
                return self.unaffected
            if self.within_noise:
                return f"within noise (±{noise * 100:.1f}%); {self.unaffected}"
            return (f"{self.unaffected}, yet beyond the noise (±{noise * 100:.1f}%): something else differed "
                    "between the runs (machine load, clocks, a cold start)")
        if noise is None:
            return "noise unknown: single runs (use repeats, or run the same settings again)"
        if self.within_noise:
            return f"within noise (±{noise * 100:.1f}%)"
        return f"beyond noise (±{noise * 100:.1f}%)"


@dataclass(frozen=True)
class Comparison:
    before: RunRecord
    after: RunRecord
    diff: list[DiffRow]
    metrics: list[MetricRow]
    before_samples: SampleSet = SampleSet()
    after_samples: SampleSet = SampleSet()

    @property
    def cold(self) -> tuple[bool, bool]:
        """(before, after): measured without a warm-up, on a shape the session had not run."""
        return bool(self.before.config.get("cold")), bool(self.after.config.get("cold"))

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
    for key in ordered_keys((set(before) | set(after)) - set(META_KEYS)):
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


Figure = tuple[str, str, str, Callable[[RunReport], "float | None"]]  # name, unit, better, value


def figures(before: RunReport, after: RunReport) -> list[Figure]:
    """Every figure a comparison shows, as (name, unit, better, value of a report)."""
    out: list[Figure] = [
        ("prefill tok/s", "tok/s", "higher", lambda r: r.prefill_tok_s if not r.cancelled else None),
        ("decode tok/s", "tok/s", "higher", lambda r: r.decode_tok_s if r.decode_tok_s else None),
        ("prefill time", "ms", "lower", lambda r: r.prefill_s * 1e3 if not r.cancelled else None),
    ]
    n = max(len(before.per_stage), len(after.per_stage))
    for s in range(n):
        for what, attr, better in (("wait", "wait_ns", "lower"), ("compute", "compute_ns", ""),
                                   ("wall", "wall_ns", "lower")):
            out.append((f"stage {s} {what}", "ms", better,
                        lambda r, s=s, attr=attr: getattr(t, attr) / 1e6 if (t := _stage(r.per_stage, s)) else None))
    k_max = max(len(before.busy_histogram), len(after.busy_histogram))
    for k in range(k_max):
        full = k == k_max - 1 and k > 0
        out.append((f"busy: {k} stage(s) computing", "% of wall", "higher" if full else "",
                    lambda r, k=k: r.busy_histogram[k] * 100 if k < len(r.busy_histogram) else None))
    return out


def _side(value: Callable[[RunReport], float | None], own: RunReport,
          samples: SampleSet) -> tuple[float | None, Spread]:
    """A side's figure (the median of its repeats, else the run's own value) and its spread."""
    spread = Spread.of(value(r) for r in samples.reports) if samples.n >= 2 else Spread(())
    if samples.source == "repeats" and spread.values:
        return spread.median, spread
    return value(own), spread


def unaffected_reason(name: str, diff: Sequence[DiffRow]) -> str:
    """Why no setting that differs can move this figure ("" : one can)."""
    if not diff:
        return "no setting differs"
    changed = [d.setting for d in diff]
    if name.startswith("decode") and all(c in PREFILL_ONLY for c in changed):
        shown = ", ".join(c for c in changed if c not in ("chunk (resolved)", "chunks")) or "the chunking"
        return f"not affected by {shown} (prefill only)"
    return ""


def compare_reports(before: RunReport, after: RunReport, before_samples: SampleSet = SampleSet(),
                    after_samples: SampleSet = SampleSet(), diff: Sequence[DiffRow] | None = None) -> list[MetricRow]:
    rows = []
    for name, unit, better, value in figures(before, after):
        b, bs = _side(value, before, before_samples)
        a, as_ = _side(value, after, after_samples)
        rows.append(MetricRow(name, unit, b, a, better, bs, as_,
                              unaffected_reason(name, diff) if diff is not None else ""))
    return rows


def unchanged(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """The settings both runs recorded with the same value."""
    return [k for k in ordered_keys((set(before) & set(after)) - set(META_KEYS))
            if _text(before[k]) == _text(after[k])]


def compare(before: RunRecord, after: RunRecord, before_samples: SampleSet = SampleSet(),
            after_samples: SampleSet = SampleSet()) -> Comparison:
    diff = config_diff(before.config, after.config, before.report, after.report)
    return Comparison(before, after, diff,
                      compare_reports(before.report, after.report, before_samples, after_samples, diff),
                      before_samples, after_samples)


# ------------------------------------------------------------------- samples from the history

class HistoryLike(Protocol):
    def list_runs(self, text: str = "", source: str | None = None, limit: int = 2000) -> list: ...
    def get(self, run: int) -> RunRecord: ...
    def report(self, run: int) -> RunReport: ...


# settings whose values have no spaces: a first filter in the history's query, the full
# settings are compared afterwards
_FILTER_KEYS = ("pipeline_depth", "chunk_tokens", "devices", "prompt_tokens", "decode_tokens", "chunk_schedule",
                "layer_split", "prefill_main", "cuda_graphs")
POOL_LIMIT = 12


def same_settings(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    keys = (set(a) | set(b)) - set(META_KEYS)
    return all(_text(a.get(k)) == _text(b.get(k)) for k in keys)


def gather_samples(history: HistoryLike | None, run: int | None, record: RunRecord) -> SampleSet:
    """The run's repeats from the history (one press of Run with repeats > 1), else the finished,
    warm runs with exactly its settings (the run itself included); the run alone when neither
    gives a second value."""
    if history is None or run is None or record.status != "finished":
        return SampleSet((record.report,))
    try:
        group = record.config.get("repeat_group")
        if group:
            rows = [r for r in history.list_runs(f"repeat_group={group}") if r.status == "finished"]
            if len(rows) >= 2:
                return SampleSet(tuple(history.report(r.id) for r in sorted(rows, key=lambda r: r.id)), "repeats")
        words = [f"{k}={_filter_value(record.config[k])}" for k in _FILTER_KEYS if k in record.config]
        reports = [record.report]
        for row in history.list_runs(" ".join(words), limit=POOL_LIMIT * 3):
            if row.id == run or row.status != "finished" or len(reports) >= POOL_LIMIT:
                continue
            other = history.get(row.id)
            if other.config.get("cold") or not same_settings(record.config, other.config):
                continue
            reports.append(other.report)
    except Exception:  # a history that cannot be read makes the noise unknown, never a failed compare
        log.exception("gathering same-settings runs for run #%s failed", run)
        return SampleSet((record.report,))
    return SampleSet(tuple(reports), "same settings" if len(reports) >= 2 else "")


def _filter_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return _text(value)


def format_ratio(r: float | None) -> str:
    return "—" if r is None else f"{r:.3f}×"
