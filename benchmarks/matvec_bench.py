"""Decode's routed matrix-vector kernels from stored blocks (engine/quant/qmatvec_triton.py) against
the device's memory bandwidth, at several launch shapes (rows a program, warps, blocks a step): issue 32's next
step.

Session 18's decode profile (one H100, 16 layers of Qwen3-30B-A3B, Q4_K_M) had these kernels at
1.1 of a step's 2.8 ms of kernel time: 48 calls of ~23 µs, each reading ~7 MB of routed weights,
which the card's bandwidth would move in ~2 µs.  This times one call per (type, projection, launch
shape) for a decode token's k routed experts, as decode runs it: --calls calls captured in one
CUDA graph, best of --repeat replays by CUDA events, divided by --calls (timed eagerly, a call
is Triton's host-side launch, ~40 µs, not the kernel), and prints the
weight bytes it read, the GB/s that makes, the share of the device's bandwidth
(engine.plan.roofline.cuda_bandwidth, as the run report's roofline column) and, per projection, which shape was fastest.
Each launch shape is tried by swapping the kernel table's (rows, warps, blocks) entry for the run; the
engine's own table (`qmatvec_triton._TABLE`) is restored afterwards and printed beside the best.

    python3 benchmarks/matvec_bench.py                                   # cuda:0, Qwen3-30B-A3B's shapes
    python3 benchmarks/matvec_bench.py --launch 2:1:8,4:1:8,8:2:4,16:4:1 --tokens 1,4
    python3 benchmarks/matvec_bench.py --device cpu --repeat 1 --launch 16:4:1   # Triton's interpreter (smoke)

Random valid blocks (tests' dequant_support), random bf16 activations; outputs are checked against
the engine's own launch shape, so a shape that computes something else is reported, not timed.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dequant_support import random_blocks  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

from engine.plan.roofline import cuda_bandwidth  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gdn_bench import _time  # noqa: E402  (best of N by CUDA events, in ms)

from engine.quant import qmatvec_triton  # noqa: E402

# (projection, stored type, N rows, K values a row) of one Qwen3-30B-A3B layer in a Q4_K_M file
# (gate/up Q4_K, down Q6_K), and the other types the kernels serve at gate/up's shape (Q5_K_M
# and Q8_0 files)
PROJECTIONS = (("gate/up", T.Q4_K, 768, 2048), ("down", T.Q6_K, 2048, 768), ("gate/up", T.Q5_K, 768, 2048),
               ("gate/up", T.Q8_0, 768, 2048))
DEFAULT_LAUNCH = ("16:4:1,8:4:1,4:2:1,1:1:8,1:2:8,2:1:8,2:2:8,2:4:8,4:2:8,4:4:8,8:4:8,1:1:4,2:1:4,2:2:4,4:2:4,4:4:4,"
                  "8:4:4,2:2:2,4:2:2,8:4:2")


def _graph_time(fn: Callable[[], object], device: torch.device, repeat: int, calls: int) -> float:
    """ms a call of `fn` takes replayed from a CUDA graph of `calls` calls (eager on CPU)."""
    if device.type != "cuda":
        return _time(fn, device, repeat)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # compile and warm outside the capture
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return _time(graph.replay, device, repeat) / calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--experts", type=int, default=128, help="experts a layer stores")
    ap.add_argument("--top-k", type=int, default=8, help="experts a token routes to")
    ap.add_argument("--tokens", default="1", help="decode tokens a call serves (rows = tokens x top-k), comma-separated")
    ap.add_argument("--launch", default=DEFAULT_LAUNCH, help="rows a program:warps:blocks a step, comma-separated")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--calls", type=int, default=20, help="calls a CUDA graph holds (CUDA only)")
    ap.add_argument("--scale", type=int, default=1, help="divide N and K by this (a quick smoke test on CPU)")
    ns = ap.parse_args(argv)
    if not qmatvec_triton.available():
        print(f"the stored-block kernels need Triton: {qmatvec_triton.UNAVAILABLE}")
        return 2
    device = torch.device(ns.device)
    dtype = torch.bfloat16
    launches = [tuple(int(v) for v in s.split(":")) for s in ns.launch.split(",") if s]
    bw, how = cuda_bandwidth(device)
    peak = (bw or 0.0) / 1e9
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton's interpreter)"
    how_timed = f"{ns.calls} calls a CUDA graph, best of {ns.repeat}" if device.type == "cuda" else f"best of {ns.repeat}"
    print(f"# stored-block matvec on {device} ({name}), {ns.experts} experts, top-{ns.top_k}, {str(dtype)[6:]} "
          f"activations; {how_timed}; bandwidth {peak:.0f} GB/s ({how})")
    print()
    print("| projection | type | N x K | rows | launch (rows:warps:blocks) | µs | MB read | GB/s | of bandwidth |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    best_lines = []
    for proj, qtype, n_rows, k_vals in PROJECTIONS:
        N, K = n_rows // ns.scale, max(256, k_vals // ns.scale)
        bs, ts = GGML_QUANT_SIZES[qtype]
        raw_np, _ = random_blocks(qtype, ns.experts * N, K // bs, seed=1, finite=True)
        raw = torch.from_numpy(raw_np.reshape(-1).copy()).to(device)
        kernel, own_bn, own_warps, own_bk = qmatvec_triton._TABLE[qtype]
        for tokens in (int(t) for t in ns.tokens.split(",")):
            m = tokens * ns.top_k
            experts = torch.from_numpy(np.random.default_rng(m).choice(ns.experts, m, replace=m > ns.experts)).to(device)
            x = (torch.randn(m, K, generator=g) * 0.5).to(device, dtype)
            read_mb = m * N * (K // bs * ts) / 1e6
            want = qmatvec_triton.matvec(raw, qtype, (ns.experts, N, K), x, experts)
            results = []
            for bn, warps, bk in launches:
                qmatvec_triton._TABLE[qtype] = (kernel, bn, warps, bk)
                try:
                    got = qmatvec_triton.matvec(raw, qtype, (ns.experts, N, K), x, experts)
                    if not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
                        print(f"| {proj} | {qtype.name} | {N}x{K} | {m} | {bn}:{warps}:{bk} | differs from the engine's "
                              f"shape | | | |")
                        continue
                    s = _graph_time(lambda raw=raw, qtype=qtype, shape=(ns.experts, N, K), x=x, experts=experts:
                                        qmatvec_triton.matvec(raw, qtype, shape, x, experts),
                                        device, ns.repeat, ns.calls) / 1e3
                except Exception as exc:  # a shape this Triton or GPU refuses (too many registers, …)
                    print(f"| {proj} | {qtype.name} | {N}x{K} | {m} | {bn}:{warps}:{bk} | failed: "
                          f"{type(exc).__name__} | | | |")
                    continue
                finally:
                    qmatvec_triton._TABLE[qtype] = (kernel, own_bn, own_warps, own_bk)
                gbs = read_mb / 1e3 / s
                share = f"{gbs / peak * 100:.1f}%" if peak else "—"
                mark = " (engine's)" if (bn, warps, bk) == (own_bn, own_warps, own_bk) else ""
                print(f"| {proj} | {qtype.name} | {N}x{K} | {m} | {bn}:{warps}:{bk}{mark} | {s * 1e6:.1f} | {read_mb:.2f} | "
                      f"{gbs:.0f} | {share} |", flush=True)
                results.append((s, bn, warps, bk))
            if results:
                s, bn, warps, bk = min(results)
                best_lines.append(f"{proj} {qtype.name}, {m} rows: fastest {bn}:{warps}:{bk} at {s * 1e6:.1f} µs "
                                  f"(the engine's table: {own_bn}:{own_warps}:{own_bk})")
    print()
    for line in best_lines:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
