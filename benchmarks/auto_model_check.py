"""Auto's model against CPU runs whose cost is known (the set-up of tests/test_auto_model.py), as
a markdown table: the demo's shapes with float weights, a sleep hook adding a fixed, a per-token
and a per-(token x cached key) cost per layer and chunk; best of 3 after a warm-up.

    python3 benchmarks/auto_model_check.py

The issue's bar is 5%, which this prints against on a quiet machine; the test asserts no time
(issue 37), only that the run runs the plan it modelled.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_auto_model import modelled_session  # noqa: E402  (the test's own set-up)

from engine.io import gguf_model, synth  # noqa: E402
from engine.io.prompt import synthetic  # noqa: E402


def main() -> int:
    with tempfile.TemporaryDirectory() as d:
        demo = gguf_model.load(synth.write_model(Path(d) / "m.gguf",
                                                 synth.recipe_from_args("demo", arch="qwen3moe", quant="f32")))
        print("| devices, split | auto's plan | modelled ms | measured ms (best of 3) | error |")
        print("|---|---|---:|---:|---:|")
        for devices, split in (("cpu", "auto"), ("cpu,cpu", "auto"), ("cpu,cpu", "interleave:2")):
            sess, plan_bounds = modelled_session(demo, devices, split)
            ids = synthetic(256, demo.spec.vocab, nonce=3)
            sess.run(ids[:32], 0)  # warm-up
            measured = []
            for _ in range(3):
                res = sess.run(ids, 0, on_plan=lambda p, b=plan_bounds: b.__setitem__(slice(None), p.chunk_bounds()))
                measured.append(res.report.prefill_s)
            p = res.report.plan
            best = min(measured)
            print(f"| {devices} {split} | {p.chunk}x{p.n_chunks} | {p.modelled_s * 1e3:.0f} | {best * 1e3:.0f} | "
                  f"{(best / p.modelled_s - 1) * 100:+.1f}% |", flush=True)
            sess.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
