"""How well the planner predicts recorded GPU runs (issue 22), as markdown tables.

1. One GPU -> two GPUs: a cost profile fitted to the ONE-GPU rows of a `two_stage.sh` log (their
   measured prefill times; chunk sizes no one-GPU row ran come from the run's chunk-cost probe,
   printed in the same log, scaled to agree) predicts every row of the log: the one-GPU rows
   themselves and the two-GPU join and overlap rows, which the fit never saw.
2. Trace -> trace: a profile fitted to one recorded trace's compute events predicts the others.

The machine's link figures come from a recorded trace's hand-off copies (peer GB/s and bytes per
token), as `strata-bench plan --from-run` does.

    python3 benchmarks/plan_check.py docs/bench/2026-11-29-two-stage-s3-x2.log \\
        --sections A,C,D --traces docs/bench/overlap2-fixed-*-s3.json.gz
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.plan import planner  # noqa: E402


@dataclass
class Row:
    section: str
    devices: list[str]
    depth: int
    prompt: int
    chunk: int
    n_chunks: int
    tok_s: float
    busy: list[float]


def read_log(path: Path, sections: set[str]) -> tuple[list[Row], planner.CostProfile | None]:
    rows: list[Row] = []
    probe = None
    section = ""
    for line in path.read_text().splitlines():
        m = re.match(r"# \[(\w+)\]", line)
        if m:
            section = m.group(1)
            continue
        if section not in sections:
            continue
        if "chunk cost on" in line:
            probe = planner.parse_chunk_cost_log(line) or probe
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 11 or not cells[0].startswith("devices="):
            continue
        arm = dict(kv.split("=", 1) for kv in cells[0].split())
        m = re.match(r"(\d+)x(\d+)$", cells[2])
        if not m:
            continue  # balanced schedules: not in this check
        rows.append(Row(section, arm["devices"].split(","), int(arm.get("pf_depth", 1)), int(cells[1]),
                        int(m.group(1)), int(m.group(2)), float(cells[4]),
                        [float(x) / 100 for x in cells[10].split("/")]))
    return rows, probe


def predict(profile: planner.CostProfile, machine: planner.Machine, r: Row) -> planner.Prediction:
    s = planner.PlanSettings(prompt_tokens=r.prompt, chunk_tokens=r.chunk, pipeline_depth=r.depth)
    return planner.simulate(profile, machine, s, devices=r.devices)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--sections", default="A,C,D", help="log sections ([A], [C], ...) measured on the same code")
    ap.add_argument("--layers", type=int, default=32, help="the model's layer count")
    ap.add_argument("--traces", nargs="*", type=Path, default=[])
    ap.add_argument("--compact", action="store_true", help="one line per prompt and chunk: 1 GPU, join, overlap")
    ns = ap.parse_args(argv)
    rows, probe = read_log(ns.log, set(ns.sections.split(",")))
    traces = [planner.load_trace_run(p) for p in ns.traces]
    link = planner.profile_from_run(traces[0]) if traces else None
    peer = planner.machine_of_run(traces[0], link).peer_gbs if traces else 0.0
    per_tok = link.handoff_bytes_per_token if link else 0
    one = [r for r in rows if len(r.devices) == 1]
    fit = planner.profile_from_totals([planner.MeasuredTotal(r.prompt, r.chunk, ns.layers, r.prompt / r.tok_s)
                                       for r in one], probe, source=f"the one-GPU rows of {ns.log.name}")
    fit = replace(fit, handoff_bytes_per_token=per_tok)
    machine = planner.Machine([planner.DeviceSpec("cuda:0"), planner.DeviceSpec("cuda:1")], peer_gbs=peer)
    print(f"Profile: {fit.fit_note}; attention {fit.attn_s_per_token_key:.3e} s per token x key; "
          f"host launch {fit.host_s_per_layer * 1e3:.3f} ms per layer (probe); hand-off {per_tok} B/token at "
          f"{peer:.0f} GB/s peer (from {traces[0].name if traces else 'nothing'})")
    print("layer_s (ms): " + ", ".join(f"{c}: {v * 1e3:.3f}" for c, v in sorted(fit.layer_s.items())))
    print()
    worst = {1: 0.0, 2: 0.0}
    preds = {}
    for r in rows:
        p = preds[id(r)] = predict(fit, machine, r)
        worst[min(len(r.devices), 2)] = max(worst[min(len(r.devices), 2)], abs(p.prefill_tok_s / r.tok_s - 1))

    def hist(h: list[float]) -> str:
        return "/".join(f"{x * 100:.0f}" for x in h)

    if ns.compact:  # one line per (log section, prompt, one-GPU chunk): 1 GPU, join, overlap
        print("| log | prompt | chunks (2 GPUs) | 1 GPU measured / predicted | join measured / predicted (error) "
              "| overlap measured / predicted (error) | overlap busy 0/1/2 % measured / predicted |")
        print("|---|---:|---|---|---|---|---|")
        i = 0
        while i + 2 < len(rows) + 0:
            one, join, over = rows[i:i + 3]
            if len(one.devices) != 1 or (join.depth, over.depth) != (0, 1):
                i += 1
                continue
            pj, po, p1 = preds[id(join)], preds[id(over)], preds[id(one)]
            print(f"| {one.section} | {one.prompt:,} | {over.chunk}x{over.n_chunks} | {one.tok_s:,.0f} / "
                  f"{p1.prefill_tok_s:,.0f} | {join.tok_s:,.0f} / {pj.prefill_tok_s:,.0f} "
                  f"({pj.prefill_tok_s / join.tok_s - 1:+.1%}) | {over.tok_s:,.0f} / {po.prefill_tok_s:,.0f} "
                  f"(**{po.prefill_tok_s / over.tok_s - 1:+.1%}**) | {hist(over.busy)} / {hist(po.busy_histogram)} |")
            i += 3
    else:
        print("| log | prompt | chunk | arm | measured tok/s | predicted tok/s | error "
              "| busy 0/1/2 % measured | predicted |")
        print("|---|---:|---|---|---:|---:|---:|---|---|")
        for r in rows:
            p = preds[id(r)]
            arm = "1 GPU" if len(r.devices) == 1 else f"2 GPUs, depth {r.depth}"
            print(f"| {r.section} | {r.prompt:,} | {r.chunk}x{r.n_chunks} | {arm} | {r.tok_s:,.0f} | "
                  f"{p.prefill_tok_s:,.0f} | {p.prefill_tok_s / r.tok_s - 1:+.1%} | {hist(r.busy)} | "
                  f"{hist(p.busy_histogram)} |")
    print()
    print(f"Largest error: one-GPU rows (the fit's own data) {worst[1]:.1%}; two-GPU rows (never fitted) "
          f"{worst[2]:.1%}")
    if len(traces) > 1:
        print()
        print("| profile from | predicted run | measured tok/s | predicted tok/s | error "
              "| busy histogram, largest gap |")
        print("|---|---|---:|---:|---:|---:|")
        for src in traces:
            prof = planner.profile_from_run(src)
            if probe is not None:  # the session's probe curve for the sizes the trace did not run
                src_curve = replace(src, cost_profile={"layer_s": probe.layer_s,
                                                       "host_s_per_layer": probe.host_s_per_layer})
                prof = planner.profile_from_run(src_curve)
            for dst in traces:
                pred = planner.predict_run(prof, dst, planner.machine_of_run(dst, prof))
                row = planner.ErrorRow(src.name, dst.name, planner.measured_tok_s(dst), pred.prefill_tok_s,
                                       dst.busy_histogram, pred.busy_histogram)
                print(f"| {src.name} | {dst.name} | {row.measured_tok_s:,.0f} | {row.predicted_tok_s:,.0f} | "
                      f"{row.error:+.1%} | {row.hist_points:.1f} points |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
