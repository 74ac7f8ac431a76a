"""Where expanding only the routed experts stops paying: one MoE layer, full vs compact expansion.

For chunks of 1, 2, 4, ... tokens, one layer's MoE (router, expert expansion, expert FFN) is
timed with every expert expanded (the full path) and with only the routed experts gathered into
a compact scratch (engine/models/routed_experts.py), best of --repeat after a warm-up.  The table
shows the experts the chunk used (distinct; on CUDA the static bound min(n*k, E) decides), both
times and their ratio, and on CUDA the stored-block matrix-vector products of
engine/models/routed_matvec.py (decode's path; its switch point is `MATVEC_MAX_ROWS`, the rows
n*k up to which it is fastest).  The last line names the first chunk where compact is not
faster: the switch point to put into `routed_experts.COMPACT_MAX_FRACTION` for that device type.

    python3 benchmarks/routed_experts_bench.py                       # CPU: issue 33's 129 MiB file's shapes
    python3 benchmarks/routed_experts_bench.py --device cuda:0       # Qwen3-30B-A3B shapes, bf16 grouped GEMMs
    python3 benchmarks/routed_experts_bench.py --quant q6_k --tokens 1,8,64

Random valid blocks of a llama.cpp mix (synthetic source), random hidden states.  Timed eagerly:
inside decode's CUDA graphs the compact path's few extra small kernels (the slot remap) cost less
than here, so the switch point this prints for CUDA is on the conservative side.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.io import synth  # noqa: E402
from engine.models import routed_experts, routed_matvec  # noqa: E402
from engine.models.layers import Layer, Rope, _grouped_mm_ok  # noqa: E402
from engine.models.loading import load_layer_weights  # noqa: E402

CPU_SHAPES = dict(hidden=1024, n_heads=8, n_kv_heads=4, head_dim=128, n_experts=16, n_experts_used=4, expert_ffn=512)
CUDA_SHAPES = dict(hidden=2048, n_heads=32, n_kv_heads=4, head_dim=128, n_experts=128, n_experts_used=8,
                   expert_ffn=768)


def _time(fn, device: torch.device, repeat: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quant", default="q4_k_m", help="llama.cpp mix of the experts (default q4_k_m)")
    ap.add_argument("--tokens", default="", help="chunk sizes, comma-separated (default 1,2,4,... up to 4E/k)")
    ap.add_argument("--repeat", type=int, default=3)
    ns = ap.parse_args(argv)
    device = torch.device(ns.device)
    shapes = CUDA_SHAPES if device.type == "cuda" else CPU_SHAPES
    recipe = synth.recipe_from_args("demo", quant=ns.quant, n_layers=1, **shapes)
    spec = recipe.spec()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    src = synth.SyntheticSource(recipe, str(device))
    w = load_layer_weights(src, 0, device, dtype)
    layer = Layer(spec, 0, w, Rope(spec.head_dim, spec.rope_base, spec.rope_style, device))
    E, k = spec.n_experts, spec.n_experts_used
    h0 = torch.randn(1, spec.hidden, device=device, dtype=dtype)
    layer.use_grouped_mm = _grouped_mm_ok(h0)
    path = "grouped GEMMs" if layer.use_grouped_mm else "reference (one expert at a time)"
    sizes = [int(t) for t in ns.tokens.split(",")] if ns.tokens else [2 ** i for i in range(0, 12) if 2 ** i <= 4 * E // k]
    fractions = routed_experts.COMPACT_MAX_FRACTION
    print(f"# one MoE layer on {device}: {E} experts of {spec.expert_ffn}, top-{k}, hidden {spec.hidden}, "
          f"experts {ns.quant} ({w.gate_exps.qtype.name}/{w.down_exps.qtype.name}), {str(dtype)[6:]} compute, {path}; "
          f"best of {ns.repeat}")
    stored = routed_matvec.wanted(w, 1, h0)  # the stored-block products (decode's path) apply here
    print("| tokens | experts used | bound min(n·k,E) | full ms | compact ms | compact/full | stored-block ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator(device=device).manual_seed(0)
    switch = None
    saved, saved_rows = dict(fractions), routed_matvec.MATVEC_MAX_ROWS
    try:
        for n in sizes:
            h = torch.randn(n, spec.hidden, device=device, dtype=dtype, generator=g) * 0.5
            probs = torch.softmax(torch.nn.functional.linear(h.float(), w.router.float()), -1)
            used = int(torch.topk(probs, k, -1).indices.unique().numel())
            times = {}
            routed_matvec.MATVEC_MAX_ROWS = 0  # the gather-and-GEMM paths
            for compact in (False, True):
                fractions[device.type] = 2.0 if compact else 0.0
                times[compact] = _time(lambda h=h: layer.moe(h), device, ns.repeat)
            routed_matvec.MATVEC_MAX_ROWS = n * k
            mv = f"{_time(lambda h=h: layer.moe(h), device, ns.repeat) * 1e3:.2f}" if stored else "—"
            ratio = times[True] / times[False]
            if switch is None and ratio >= 1.0:
                switch = (n, used)
            print(f"| {n} | {used} | {routed_experts.slot_bound(n, k, E)} | {times[False] * 1e3:.2f} | "
                  f"{times[True] * 1e3:.2f} | {ratio:.2f} | {mv} |")
    finally:
        fractions.clear()
        fractions.update(saved)
        routed_matvec.MATVEC_MAX_ROWS = saved_rows
    now = fractions.get(device.type, routed_experts.DEFAULT_FRACTION)
    if switch is None:
        print(f"compact was faster at every size measured: a threshold above the largest fraction measured "
              f"fits (now {now:g} of E for {device.type})")
    else:
        n, used = switch
        used_rule = used if device.type == "cpu" else routed_experts.slot_bound(n, k, E)
        print(f"compact stops paying at {n} tokens ({used_rule} of {E} experts by the {device.type} rule: "
              f"{used_rule / E:.2f} of E; now {now:g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
