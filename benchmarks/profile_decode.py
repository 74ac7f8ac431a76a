"""Where a decode step's GPU time goes (issue 32): torch.profiler's kernels over a greedy decode,
per step, against the step's wall time and the weight bytes a token reads.

A graphed step (the default) is one graph launch a stage; CUPTI still records each kernel the
graph runs, so the table says whether a step is bound by its kernels' own time (slow kernels) or
by the gaps between them (their count).  `--no-graph` profiles the eager static step instead.

    python3 benchmarks/profile_decode.py --layers 16 --quant q4_k_m --steps 64 [--prompt 16]
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from engine.io.prompt import synthetic  # noqa: E402
from engine.io.synth import SyntheticSource, recipe_from_args  # noqa: E402


def kind_of(name: str) -> str:
    n = name.lower()
    if "_mv_" in n:
        return "routed matvec (stored blocks)"
    if "decode_partial" in n or "decode_combine" in n:
        return "decode attention"
    if any(k in n for k in ("gemm", "nvjet", "xmma", "cublas", "sm90_", "gemv", "cutlass")):
        return "dense GEMM/GEMV"
    if "topk" in n or "sort" in n:
        return "top-k / sort"
    if "memcpy" in n or "memset" in n or "copy" in n:
        return "copies"
    return "elementwise / norms / other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="an engine.io.synth preset")
    ap.add_argument("--quant", default="q4_k_m", help="the quant mix (bf16 for none)")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--no-graph", action="store_true", help="profile the eager static step")
    ap.add_argument("--top", type=int, default=20)
    ns = ap.parse_args()
    quant = None if ns.quant in ("bf16", "none") else ns.quant
    src = SyntheticSource(recipe_from_args(ns.preset, n_layers=ns.layers, quant=quant), ns.device)
    from engine.pipeline.session import Session

    settings = {"devices": ns.device, "expert_cache": "all"}
    if ns.no_graph:
        settings["cuda_graphs"] = False
    sess = Session(src, EngineConfig.from_sources(settings))
    ids = synthetic(ns.prompt, src.spec.vocab)
    sess.run(ids, ns.steps)  # warm-up: kernels compiled, the step's graphs captured
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        res = sess.run(ids, ns.steps)
    rep = res.report
    steps = max(ns.steps - 1, 1)  # the first token comes from the prefill
    wall_ms = rep.decode_s / steps * 1e3
    print(f"decode {rep.decode_tok_s:,.1f} tok/s: {wall_ms:.3f} ms a step over {steps} steps "
          f"({'eager' if ns.no_graph else 'graphed'}, {ns.layers} layers, {ns.quant})")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=ns.top, max_name_column_width=70))
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        by_kind[kind_of(e.key)][0] += us
        by_kind[kind_of(e.key)][1] += e.count
    # the prefill's kernels are in the profile too: a kind's share per step is an upper bound
    total = sum(v[0] for v in by_kind.values())
    print("\n| kind | GPU ms a step | kernels a step | share |")
    print("|---|---:|---:|---:|")
    for k, (us, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"| {k} | {us / steps / 1e3:.3f} | {n / steps:.0f} | {us / total * 100 if total else 0:.1f}% |")
    print(f"| all kernels | {total / steps / 1e3:.3f} | {sum(v[1] for v in by_kind.values()) / steps:.0f} | "
          f"wall {wall_ms:.3f} ms a step |")
    sess.close()


if __name__ == "__main__":
    main()
