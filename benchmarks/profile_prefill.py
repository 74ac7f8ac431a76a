"""Where a prefill's GPU time goes: torch.profiler's top kernels, and time and MFU per part.

Parts: attention (cuDNN/flash/efficient kernels), expert GEMMs (grouped GEMM), dense GEMMs
(q/k/v, output projection, router), everything else (norms, RoPE, top-k, sort, gathers,
casts, copies). FLOPs per part are counted from the model's shapes and the run's chunks.

    python3 benchmarks/profile_prefill.py --layers 16 --tokens 32768 [--prefill auto|N] [--preset gpt-oss-20b]
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
from engine.io.prompt import synthetic, warmup_ids  # noqa: E402
from engine.io.synth import SyntheticSource, recipe_from_args  # noqa: E402

PARTS = ("attention", "expert GEMMs", "dense GEMMs", "everything else")


def part_of(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("cudnn", "flash", "fmha", "attention", "sdpa", "sm90_fprop")):
        return "attention"
    if "grouped" in n or "ptr_array" in n or "group" in n or "cutlass" in n:  # torch._grouped_mm: CUTLASS 3.x
        return "expert GEMMs"
    if any(k in n for k in ("gemm", "nvjet", "xmma", "cublas", "sm90_")):
        return "dense GEMMs"
    return "everything else"


def part_flops(spec, bounds: list[tuple[int, int]]) -> dict[str, float]:
    """FLOPs of each part over the run (all layers), from shapes and chunk bounds.  A hybrid's GDN
    layers (`spec.recurrent`) have no scores and their own projections; their delta rule, conv and
    norms count as "everything else" (no FLOPs given)."""
    L, d, H, KV, hd = spec.n_layers, spec.hidden, spec.n_heads, spec.n_kv_heads, spec.head_dim
    tokens = sum(n for _, n in bounds)
    window_of = getattr(spec, "window_of", lambda i: None)  # gpt-oss: a sliding layer sees its window
    recurrent = tuple(getattr(spec, "recurrent", ())) or (False,) * L

    def seen(p: int, n: int, window: int | None) -> float:  # keys per query, averaged over the chunk
        return p + (n + 1) / 2 if window is None else min(window, p + (n + 1) / 2)

    attn = sum(4.0 * H * hd * n * seen(p, n, window_of(i)) for i in range(L) if not recurrent[i] for p, n in bounds)
    router = d * spec.n_experts if spec.n_experts else 0
    shared = spec.shared_params() if spec.n_experts else 0  # a shared expert's three matrices
    qkvo = d * (H + 2 * KV) * hd + H * hd * d
    if any(recurrent):
        key, value = spec.linear_k_heads * spec.linear_head_k, spec.linear_v_heads * spec.linear_head_v
        gdn = d * (2 * key + 2 * value + 2 * spec.linear_v_heads) + value * d  # in-projections, out-projection
        qkvo += H * hd * d  # gated attention: the q projection also writes the output gate
    else:
        gdn = 0
    dense = sum(2.0 * tokens * ((gdn if recurrent[i] else qkvo) + router + shared) for i in range(L))
    experts = 2.0 * tokens * 3 * d * (spec.expert_ffn * spec.n_experts_used if spec.n_experts else spec.ffn)
    return {"attention": attn, "expert GEMMs": L * experts, "dense GEMMs": dense, "everything else": 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--prefill", default="auto", help="chunk size: auto or N")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--peak-tflops", type=float, default=794.0)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="an engine.io.synth preset")
    ap.add_argument("--quant", default=None, help="the preset's quant mix unless given (f16, q4_k_m, mxfp4, …)")
    ns = ap.parse_args()
    src = SyntheticSource(recipe_from_args(ns.preset, n_layers=ns.layers, quant=ns.quant), ns.device)
    from engine.pipeline.session import Session

    sess = Session(src, EngineConfig.from_sources({"devices": ns.device, "prefill": ns.prefill}))
    ids = synthetic(ns.tokens, src.spec.vocab)
    sess.run(warmup_ids(ns.tokens, src.spec.vocab))  # warm-up: kernels planned, graphs captured
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        res = sess.run(ids)
    rep = res.report
    bounds = list(rep.plan.chunk_bounds())
    print(f"prefill {rep.prefill_tok_s:,.0f} tok/s, {rep.plan.n_chunks} x {rep.plan.chunk} "
          f"({rep.plan.chunk_reason}); attention: {rep.attention}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=ns.top, max_name_column_width=70))
    by_part: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        by_part[part_of(e.key)] += us / 1e6
    flops = part_flops(src.spec, bounds)
    total = sum(by_part.values())
    print(f"\n| part | GPU s | share | TFLOP | TFLOP/s | MFU ({ns.peak_tflops:.0f}) |")
    print("|---|---:|---:|---:|---:|---:|")
    for p in PARTS:
        s, f = by_part.get(p, 0.0), flops[p]
        rate = f / s / 1e12 if s and f else 0.0
        print(f"| {p} | {s:.4f} | {s / total * 100 if total else 0:.1f}% | {f / 1e12:.2f} | "
              f"{rate:.0f} | {rate / ns.peak_tflops * 100:.1f}% |" if f else
              f"| {p} | {s:.4f} | {s / total * 100 if total else 0:.1f}% | — | — | — |")
    wall = rep.prefill_s
    print(f"| GPU kernels total | {total:.4f} | | {sum(flops.values()) / 1e12:.2f} | "
          f"{sum(flops.values()) / total / 1e12:.0f} | wall {wall:.4f} s, "
          f"MFU {sum(flops.values()) / wall / 1e12 / ns.peak_tflops * 100:.1f}% |")
    sess.close()


if __name__ == "__main__":
    main()
