"""The planner against real CPU runs of the demo model with the deterministic sleep hook (the
same set-up as tests/test_planner.py), as a markdown table.

A profile fitted to one 2-stage overlap run predicts 1, 2 and 3 stages at depth 0 and 1, and the
interleaved mode (3 groups on one device) against the contiguous run on cpu,cpu,cpu.  Each
configuration is measured best of `--repeat` on one Session.

    python3 benchmarks/plan_cpu_check.py --sleep 0.03 --tokens 96 --chunk 16
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.io import gguf_model, synth  # noqa: E402
from engine.io.prompt import synthetic  # noqa: E402
from engine.pipeline.session import PipelineHooks, Session  # noqa: E402
from engine.plan import planner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sleep", type=float, default=0.03, help="seconds per layer and chunk")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    demo = gguf_model.load(synth.demo_model_path())

    def hook(stage: int, layer: int, chunk: int) -> None:
        time.sleep(ns.sleep)

    def measure(devices: list[str], depth: int) -> planner.MeasuredRun:
        sess = Session(demo, EngineConfig(devices=devices, pf_depth=depth, prefill=ns.chunk),
                       hooks=PipelineHooks(after_layer=hook), telemetry_interval_s=None)
        best = None
        try:
            for _ in range(ns.repeat):
                rep = sess.run(synthetic(ns.tokens, demo.spec.vocab, nonce=3)).report
                run = planner.measured_from_report(f"{len(devices)} stage(s), depth {depth}", rep.to_dict(),
                                                   list(sess.events))
                best = run if best is None or run.prefill_s < best.prefill_s else best
        finally:
            sess.close()
        return best

    measure(["cpu"], 1)  # warm-up
    source = measure(["cpu", "cpu"], 1)
    prof = planner.profile_from_run(source)
    print(f"profile from {source.name}: {prof.fit_note}")
    print()
    print("| predicted run | measured ms | predicted ms | error | busy % measured | predicted | largest gap |")
    print("|---|---:|---:|---:|---|---|---:|")

    def row(name: str, run: planner.MeasuredRun, pred: planner.Prediction) -> None:
        e = planner.ErrorRow(source.name, name, run.prefill_tok_s, pred.prefill_tok_s, run.busy_histogram,
                             pred.busy_histogram)
        h = lambda v: "/".join(f"{x * 100:.0f}" for x in v)  # noqa: E731
        print(f"| {name} | {run.prefill_s * 1e3:,.1f} | {pred.prefill_s * 1e3:,.1f} | "
              f"{pred.prefill_s / run.prefill_s - 1:+.1%} | {h(run.busy_histogram)} | {h(pred.busy_histogram)} | "
              f"{e.hist_points:.1f} pts |")

    for n in (1, 2, 3):
        for depth in (0, 1):
            run = measure(["cpu"] * n, depth)
            row(run.name, run, planner.predict_run(prof, run))
    run = measure(["cpu"] * 3, 1)
    pred = planner.simulate(prof, planner.Machine([planner.DeviceSpec("cpu")]),
                            planner.PlanSettings(prompt_tokens=ns.tokens, chunk_tokens=ns.chunk, pipeline_depth=1,
                                                 interleave=3))
    row("interleave:3 on one cpu vs cpu,cpu,cpu", run, pred)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
