"""Every run of a size, one line each: is a slow run the first, a missing CUDA graph, or clocks?

    python3 benchmarks/run_probe.py --layers 16 --sizes 8192,65536 --repeat 5 --prefill auto,32768

For each (chunk setting, size): one warm-up, then `--repeat` runs on one Session, each printed
with its prefill ms, tok/s, the modelled ms, the chunks, the GPU's SM clock and power just before
and just after (pynvml), and which CUDA-graph notes the run wrote.  Prints a table per setting.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.io import prompt as prompts  # noqa: E402
from engine.io.synth import SyntheticSource, recipe_from_args  # noqa: E402
from engine.pipeline.session import Session  # noqa: E402


def clocks() -> str:
    """SM clock (MHz) and power (W) of GPU 0, or '' where NVML is missing."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        sm = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
        w = pynvml.nvmlDeviceGetPowerUsage(h) / 1000
        return f"{sm} MHz {w:.0f} W"
    except Exception:  # a probe line without clocks is still a probe line
        return ""


def gaps(sess: Session, ids: list[int]) -> None:
    """One profiled run: kernel time against the wall (is the run host-bound?) and the host
    ops that took longest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = sess.run(ids, 0).report
    avgs = prof.key_averages()
    gpu_us = sum(getattr(e, "self_device_time_total", 0.0) for e in avgs
                 if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    print(f"\nprofiled run: prefill {r.prefill_s * 1e3:.1f} ms, GPU kernels {gpu_us / 1e3:.1f} ms "
          f"({gpu_us / 1e6 / r.prefill_s * 100:.0f}% of the wall; profiler overhead included)")
    print(avgs.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--sizes", default="8192,65536")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--prefill", default="auto", help="comma-separated chunk settings: auto or N")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gaps", action="store_true",
                    help="profile one more run per size: GPU busy share of the wall and the top host ops")
    ns = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sizes = [int(s) for s in ns.sizes.split(",")]
    recipe = recipe_from_args("qwen3-30b-a3b", n_layers=ns.layers)
    spec = recipe.spec()
    for setting in ns.prefill.split(","):
        t = time.perf_counter()
        sess = Session(SyntheticSource(recipe, ns.device),
                       EngineConfig.from_sources({"devices": ns.device, "prefill": setting}))
        print(f"\n## prefill={setting}: session ready in {time.perf_counter() - t:.1f} s; "
              f"attention {sess.attention_kernels()}", flush=True)
        print("| size | run | prefill ms | tok/s | modelled ms | chunks | clocks before | clocks after | graph notes |")
        print("|---:|---|---:|---:|---:|---|---|---|---|")
        for n in sizes:
            ids = prompts.synthetic(n, spec.vocab, nonce=n)
            for k in range(ns.repeat + 1):
                before = clocks()
                r = sess.run(ids if k else prompts.warmup_ids(n, spec.vocab), 0).report
                after = clocks()
                graphs = "; ".join(x for x in r.notes if "graph" in x.lower())[:160]
                chunks = f"{r.plan.chunk}x{r.plan.n_chunks}" + (" bal" if r.plan.schedule == "balanced" else "")
                print(f"| {n} | {'warm-up' if k == 0 else k} | {r.prefill_s * 1e3:.1f} | {r.prefill_tok_s:,.0f} | "
                      f"{r.plan.modelled_s * 1e3:.1f} | {chunks} | {before} | {after} | {graphs} |", flush=True)
            if ns.gaps:
                gaps(sess, ids)
        sess.close()
        del sess
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
