"""Cost profiles from measurements: a recorded run's own events (`profile_from_run`), one-stage
prefill totals (`profile_from_totals`), the chunk-cost probe's log line; and the probe's costs
as a run's report carries them (`probe_dict`)."""
from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine.events import StageEvent
from engine.plan import chunking
from engine.plan.measured_run import MeasuredRun, layers_of
from engine.plan.plan_inputs import CostProfile, PlanError


def probe_dict(cost: chunking.ChunkCost | None) -> dict[str, Any]:
    """A run's chunk-cost probe as JSON for `RunReport.cost_profile` ({} when it measured none).

    The hook for engine/pipeline/session.py: `cost_profile=planner.probe_dict(self._chunk_cost)` in the
    RunReport of `Session._run_inner`."""
    if cost is None:
        return {}
    return {"layer_s": {str(k): v for k, v in cost.layer_s.items()},
            "attn_s_per_token_key": cost.attn_s_per_token_key, "host_s_per_layer": cost.host_s_per_layer}


def profile_from_run(run: MeasuredRun) -> CostProfile:
    """Fit a cost profile to a run's own compute events.

    Each compute event of a chunk of n tokens at position p over L layers gives one layer's time
    y = dur / L = t0(n) + e x n x p; e is fitted across every chunk size at once (pooled least
    squares within sizes), t0(n) per size.  Sizes the run did not execute come from the probe's
    curve the run saved (scaled to agree at the measured sizes), else from `ChunkCost.t0`'s
    interpolation.  Copies give the hand-off bytes and rate, stream events the expert bytes per
    layer and chunk, decode events one decode step per layer."""
    plan = run.plan
    groups, firsts, kind = _compute_points(run)
    attn = _attention_slope(groups)
    fitted = {n: max(sum(y - attn * x for x, y in pts) / len(pts), 1e-9) for n, pts in groups.items()}
    layer_s = dict(fitted)
    note = f"fitted to {sum(len(p) for p in groups.values())} compute events at {sorted(fitted)} tokens"
    extras = sorted(y - (fitted[n] + attn * x) for n, x, y in firsts if n in fitted)
    first_extra = max(extras[(len(extras) - 1) // 2], 0.0) if extras else 0.0  # the lower median
    if first_extra > 0:
        note += f"; a stage's first chunk {first_extra * 1e3:.3f} ms more per layer (warm-up)"
    probe = run.cost_profile
    if probe.get("layer_s"):
        curve = {int(k): float(v) for k, v in probe["layer_s"].items()}
        common = [n for n in fitted if n in curve and curve[n] > 0]
        ratio = (sum(fitted[n] / curve[n] for n in common) / len(common)) if common else 1.0
        for n, v in curve.items():
            layer_s.setdefault(n, v * ratio)
        note += f"; other sizes from the run's probe curve x {ratio:.3f}"
    host = float(probe.get("host_s_per_layer", 0.0)) if kind == "cuda" else 0.0
    if kind == "cuda" and not probe:
        note += "; host launch time unknown (0)"
    copies = [e for e in run.events if e.kind == "copy" and e.chunk >= 0 and e.tokens > 0]
    per_tok = int(round(sum(e.nbytes for e in copies) / sum(e.tokens for e in copies))) if copies else 0
    cdur = sum(e.dur_ns for e in copies)
    copy_gbs = sum(e.nbytes for e in copies) / cdur if cdur > 0 else 0.0  # bytes/ns = GB/s
    stream_layer_chunk, stream_gbs = _streaming(run)
    dispatch = root_gap = 0.0
    if kind == "cpu":
        dispatch, root_gap, cpu_note = _cpu_gaps(run, copies)
        note += cpu_note
    return CostProfile(layer_s=layer_s, attn_s_per_token_key=attn, host_s_per_layer=host,
                       n_layers=max((s.end_layer for s in plan.stages), default=0),
                       device_kind=kind, handoff_bytes_per_token=per_tok,
                       copy_gbs=copy_gbs if kind == "cpu" else (stream_gbs or 0.0),
                       stream_bytes_per_layer_chunk=stream_layer_chunk,
                       expert_layer_bytes=stream_layer_chunk, kv_bytes_per_token_layer=_kv_per_token_layer(run),
                       decode_s_per_layer=_decode_per_layer(run), dispatch_s=dispatch,
                       first_chunk_s_per_layer=first_extra, root_gap_s=root_gap, source=f"measured: {run.name}",
                       fit_note=note, fitted_sizes=tuple(sorted(fitted)))


Points = dict[int, list[tuple[float, float]]]  # chunk tokens -> (tokens x position, seconds per layer)


def _compute_points(run: MeasuredRun) -> tuple[Points, list[tuple[int, float, float]], str]:
    """The compute events as fit points per chunk size, the stages' first chunks apart (they
    also pay a warm-up), and the kind of device they ran on."""
    plan = run.plan
    bounds = plan.chunk_bounds()
    starts = {c: b[0] for c, b in enumerate(bounds)}
    groups: Points = {}
    firsts: list[tuple[int, float, float]] = []
    kind = "cpu"
    for e in run.events:
        if e.kind != "compute" or e.chunk < 0 or e.chunk not in starts:
            continue
        L = layers_of(e, plan)
        if L <= 0 or e.dur_ns <= 0:
            continue
        if e.device.startswith("cuda"):
            kind = "cuda"
        n = e.tokens or bounds[e.chunk][1]
        point = (n * starts[e.chunk], e.dur_ns / 1e9 / L)
        if e.chunk == 0:
            firsts.append((n, *point))  # a stage's first chunk also pays its warm-up: fitted apart
        else:
            groups.setdefault(n, []).append(point)
    if not groups:  # one chunk only: its cost is all there is
        for n, x, y in firsts:
            groups.setdefault(n, []).append((x, y))
        firsts = []
    if not groups:
        raise PlanError(f"{run.name}: no compute events to fit costs to")
    return groups, firsts, kind


def _attention_slope(groups: Points) -> float:
    """e of y = t0(n) + e x n x p: least squares pooled within each chunk size (0 if unseen)."""
    sxy = sxx = 0.0
    for pts in groups.values():
        if len(pts) < 2:
            continue
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        sxy += sum((x - mx) * (y - my) for x, y in pts)
        sxx += sum((x - mx) ** 2 for x, _ in pts)
    return max(sxy / sxx, 0.0) if sxx > 0 else 0.0


def _streaming(run: MeasuredRun) -> tuple[float, float]:
    """(expert bytes streamed per layer and chunk, the streams' GB/s) from the stream events."""
    streams = [e for e in run.events if e.kind == "stream"]
    stream_layer_chunk = 0.0
    if streams:
        by_stage: dict[int, set[int]] = {}
        for e in streams:
            by_stage.setdefault(e.stage, set()).add(e.chunk)
        n_lc = 0
        for stage, chunks in by_stage.items():
            ev0 = next(e for e in run.events if e.kind == "compute" and e.stage == stage)
            n_lc += layers_of(ev0, run.plan) * len([c for c in chunks if c >= 0])
        stream_layer_chunk = sum(e.nbytes for e in streams if e.chunk >= 0) / max(n_lc, 1)
    sdur = sum(e.dur_ns for e in streams)
    return stream_layer_chunk, (sum(e.nbytes for e in streams) / sdur if sdur > 0 else 0.0)


def _kv_per_token_layer(run: MeasuredRun) -> float:
    """Prefill-main's KV copies: bytes per prompt token and layer (0 without them)."""
    kv_copies = [e for e in run.events if e.kind == "copy" and e.chunk < 0 and e.note.startswith("kv layers")]
    if not kv_copies:
        return 0.0
    layers = sum(layers_of(e, run.plan) for e in kv_copies)
    return sum(e.nbytes for e in kv_copies) / max(layers * run.plan.prompt_tokens, 1)


def _cpu_gaps(run: MeasuredRun, copies: list[StageEvent]) -> tuple[float, float, str]:
    """CPU stages: (a hand-off's end to the successor's compute start, the root's own time
    between its chunks, what the note says of them), medians of the run's gaps."""
    dispatch, root_gap, note = 0.0, 0.0, ""
    if copies:
        comp = {(e.stage, e.chunk): e for e in run.events if e.kind == "compute"}
        gaps = sorted((comp[(e.stage + 1, e.chunk)].start_ns - e.end_ns) / 1e9 for e in copies
                      if (e.stage + 1, e.chunk) in comp)
        if gaps:
            dispatch = max(gaps[len(gaps) // 2], 0.0)
            note += f"; hand-off to successor start {dispatch * 1e3:.2f} ms (median of {len(gaps)})"
    # stage 0 never waits for input: what its events leave out between chunks is its own
    comp0 = sorted((e for e in run.events if e.kind == "compute" and e.stage == 0 and e.chunk >= 0),
                   key=lambda e: e.chunk)
    other0 = [e for e in run.events if e.stage == 0 and e.kind in ("wait", "copy", "stream")]
    gaps = []
    for a, b in zip(comp0, comp0[1:]):
        covered = sum(min(o.end_ns, b.start_ns) - max(o.start_ns, a.end_ns) for o in other0
                      if o.end_ns > a.end_ns and o.start_ns < b.start_ns)
        gaps.append(max(b.start_ns - a.end_ns - covered, 0) / 1e9)
    if gaps:
        root_gap = sorted(gaps)[len(gaps) // 2]
        note += f"; the root's own time between chunks {root_gap * 1e3:.2f} ms (median of {len(gaps)})"
    return dispatch, root_gap, note


def _decode_per_layer(run: MeasuredRun) -> float:
    """One decode step's time per layer, from the decode events (0 without them)."""
    dec = [e for e in run.events if e.kind == "decode"]
    if not dec:
        return 0.0
    layers_total = sum(layers_of(e, run.plan) for e in dec)
    return sum(e.dur_ns for e in dec) / 1e9 / max(layers_total, 1)


@dataclass(frozen=True)
class MeasuredTotal:
    """One measured one-stage prefill: prompt tokens, fixed chunk, layers, seconds."""

    prompt_tokens: int
    chunk: int
    n_layers: int
    prefill_s: float


def profile_from_totals(points: Sequence[MeasuredTotal], probe: CostProfile | None = None,
                        source: str = "measured totals") -> CostProfile:
    """Fit t0(chunk) per chunk size and one attention slope e to one-stage prefill times.

    A one-stage prefill of chunks (p_i, n_i) over L layers takes L x sum_i (t0(n_i) + e n_i p_i):
    linear in the unknowns, solved by least squares (normal equations).  A remainder chunk costs
    t0 of its own size, taken from the full size's per-token rate when unmeasured.  Sizes not
    measured come from `probe`'s curve scaled to agree at the measured ones."""
    sizes = sorted({p.chunk for p in points})
    if not sizes:
        raise PlanError("no measurements to fit")
    idx = {c: i for i, c in enumerate(sizes)}
    k = len(sizes) + 1
    rows, ys = [], []
    for p in points:
        if p.prefill_s <= 0 or p.n_layers <= 0:
            continue
        row = [0.0] * k
        for pos, n in chunking.chunk_bounds(p.prompt_tokens, p.chunk):
            row[idx[p.chunk]] += n / p.chunk  # a remainder chunk at the full size's rate per token
            row[-1] += n * pos
        rows.append(row)
        ys.append(p.prefill_s / p.n_layers)
    if len(rows) < k:
        raise PlanError(f"{len(rows)} measurements for {k} unknowns: measure more prompt sizes")
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(k)]
    sol = _solve(ata, aty)
    layer_s = {c: max(sol[idx[c]], 1e-9) for c in sizes}
    attn = max(sol[-1], 0.0)
    note = f"fitted to {len(rows)} one-stage prefill times at {sizes} tokens"
    base = probe or CostProfile(layer_s={})
    if probe is not None and probe.layer_s:
        common = [c for c in sizes if c in probe.layer_s]
        ratio = sum(layer_s[c] / probe.layer_s[c] for c in common) / len(common) if common else 1.0
        for c, v in probe.layer_s.items():
            layer_s.setdefault(c, v * ratio)
        note += f"; other sizes from the probe curve x {ratio:.3f}"
    return replace(base, layer_s=layer_s, attn_s_per_token_key=attn, n_layers=points[0].n_layers,
                   source=source, fit_note=note, fitted_sizes=tuple(sizes))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (small dense systems)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = [max(abs(v) for v in row[:n]) or 1.0 for row in m]
    m = [[v / s for v in row] for row, s in zip(m, scale)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            raise PlanError("the measurements cannot separate the costs (a singular fit)")
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def parse_chunk_cost_log(text: str) -> CostProfile | None:
    """The probe's costs from a log line `chunk cost on DEV: ChunkCost(layer_s={...}, ...)`."""
    m = re.search(r"chunk cost on (\S+): ChunkCost\(layer_s=(\{[^}]*\}), attn_s_per_token_key=([0-9.e+-]+), "
                  r"host_s_per_layer=([0-9.e+-]+), layers_per_stage=(\d+)", text)
    if not m:
        return None
    dev = m.group(1).rstrip(":")
    return CostProfile(layer_s={int(k): float(v) for k, v in ast.literal_eval(m.group(2)).items()},
                       attn_s_per_token_key=float(m.group(3)), host_s_per_layer=float(m.group(4)),
                       device_kind="cuda" if dev.startswith("cuda") else "cpu",
                       source=f"probe on {dev}", fit_note="the chunk-cost probe's own figures")
