"""GGUF dequantisation throughput: the Triton kernels (engine/quant/dequant_triton.py) vs the torch path.

On CUDA: one Qwen3-30B-A3B layer's experts (128 x gate [768, 2048], up [768, 2048], down
[2048, 768]) expanded into bf16 as the engine does before its grouped GEMMs, per type; the
time of the three tensors together, CUDA-event timed, best of --repeat after --warmup.  Prints
a markdown table per type: ms per layer, GB/s of output written and of blocks read, and whether
the two paths give the same bits.  Random blocks with finite scales (the arithmetic's cost does
not depend on the values).

On a CPU (no CUDA) it runs tiny shapes through the torch path only, and says so: a smoke test.
With `--cpu-steps`, a CPU instead times one layer of the CPU benchmark file's experts (16 x gate
[512, 1024], up, down; benchmarks/cpu_targets.sh) at each number of values a step
(`dequant.CHUNK_VALUES`), written into buffers kept between calls as the engine's host scratch
does, and once more into fresh ones (each page-faulted in again, as before the scratch).

    python3 benchmarks/dequant_bench.py                     # every type with a kernel
    python3 benchmarks/dequant_bench.py --types Q4_K,Q6_K,Q8_0 --repeat 20
    python3 benchmarks/dequant_bench.py --types Q4_K --launch 8:4,16:8   # blocks per program : warps
    python3 benchmarks/dequant_bench.py --types low-bit     # IQ1/IQ2/IQ3, MXFP4, NVFP4, TQ only
    python3 benchmarks/dequant_bench.py --device cpu --dtype float32 --types Q4_K,Q6_K,Q5_K,Q8_0 \
        --cpu-steps 262144,1048576,4194304,16777216

A `fill` row writes the same output bytes with torch's fill_: the device's write ceiling for
this output, against which the kernels' GB/s read.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.quant import dequant, dequant_triton  # noqa: E402

# byte offsets of the float16 scale fields in a block (made finite: a NaN scale is atypical)
SCALES = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q5_0: (0,), T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.Q4_1: (0, 2),
          T.Q5_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q6_K: (208,),
          T.IQ3_XXS: (0,), T.IQ3_S: (0,), T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ1_S: (0,),
          T.TQ1_0: (52,), T.TQ2_0: (64,)}
# the lattice / 4-bit-float / ternary types (kernels gathering gguf's code books): `--types low-bit`
LOW_BIT_TYPES = "IQ3_XXS,IQ3_S,IQ2_XXS,IQ2_XS,IQ2_S,IQ1_S,IQ1_M,MXFP4,NVFP4,TQ1_0,TQ2_0"
DEFAULT_TYPES = "Q4_K,Q6_K,Q5_K,Q8_0,Q4_0,Q5_0,Q4_1,Q5_1,Q2_K,Q3_K,IQ4_NL,IQ4_XS," + LOW_BIT_TYPES


def layer_shapes(cuda: bool, cpu_file: bool = False) -> list[tuple[int, ...]]:
    """gate, up, down of one layer's experts (torch order); tiny on a CPU unless `cpu_file`
    (the CPU benchmark file's layer)."""
    if cuda:
        return [(128, 768, 2048), (128, 768, 2048), (128, 2048, 768)]
    if cpu_file:
        return [(16, 512, 1024), (16, 512, 1024), (16, 1024, 512)]
    return [(4, 256, 512), (4, 256, 512), (4, 512, 256)]


def random_raw(qtype: T, shape: tuple[int, ...], device: torch.device, gen: torch.Generator) -> torch.Tensor:
    bs, ts = GGML_QUANT_SIZES[qtype]
    n_blocks = torch.Size(shape).numel() // bs
    raw = torch.randint(0, 256, (n_blocks, ts), dtype=torch.uint8, device=device, generator=gen)
    for off in SCALES.get(qtype, ()):
        s = torch.randn(n_blocks, device=device, generator=gen) * 1e-3
        raw[:, off:off + 2] = s.to(torch.float16).view(torch.uint8).view(n_blocks, 2)
    return raw.reshape(-1)


def set_path(path: str) -> None:
    """Choose the dequantiser the engine's dispatcher uses (STRATA_DEQUANT, read once)."""
    if path == "torch":
        os.environ[dequant_triton.ENV] = "torch"
    else:
        os.environ.pop(dequant_triton.ENV, None)
    dequant_triton._kernels.cache_clear()


def best_time(fn: Callable[[], object], cuda: bool, warmup: int, repeat: int) -> float:
    """Best seconds of fn over `repeat` timed calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(times)


def bench_type(qtype: T, device: torch.device, paths: list[str], warmup: int, repeat: int,
               dtype: torch.dtype, launches: list[tuple[int, int]], cpu_steps: list[int] = ()) -> None:
    cuda = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = layer_shapes(cuda, bool(cpu_steps))
    raws = [random_raw(qtype, s, device, gen) for s in shapes]
    in_bytes = sum(r.numel() for r in raws)
    out_bytes = sum(torch.Size(s).numel() for s in shapes) * torch.empty((), dtype=dtype).element_size()

    def layer() -> list[torch.Tensor]:
        return [dequant.dequantize(r, qtype, s, dtype) for r, s in zip(raws, shapes)]

    rows, outs = [], {}
    if cpu_steps:  # the torch path's step on a CPU, into kept buffers, then fresh ones
        kept = [torch.empty(sh, dtype=dtype) for sh in shapes]
        step0 = dequant.CHUNK_VALUES
        for step in cpu_steps:
            dequant.CHUNK_VALUES = step
            t = best_time(lambda: [dequant.dequantize(r, qtype, sh, dtype, out=o)
                                   for r, sh, o in zip(raws, shapes, kept)], cuda, warmup, repeat)
            rows.append((f"torch, {step} values a step{' (default)' if step == step0 else ''}", t))
        dequant.CHUNK_VALUES = step0
        rows.append((f"torch, {step0} values a step, fresh output", best_time(layer, cuda, warmup, repeat)))
        paths = []
    for path in paths:
        set_path(path)
        used = dequant.backend(device, qtype, dtype)
        if used != path:
            rows.append(f"| {path} | — | — | — | not available here ({used} would run) |")
            continue
        if path == "triton" and launches:  # each shape compiles once: keep the list short
            kernel, r0, w0 = dequant_triton._TABLE[qtype]
            for r, w in launches:
                dequant_triton._TABLE[qtype] = (kernel, r, w)
                rows.append((f"triton R={r} warps={w}", best_time(layer, cuda, warmup, repeat)))
            dequant_triton._TABLE[qtype] = (kernel, r0, w0)
        t = best_time(layer, cuda, warmup, repeat)
        outs[path] = layer()
        rows.append((path, t))
    if cuda:
        fills = [torch.empty(s, dtype=dtype, device=device) for s in shapes]
        rows.append(("fill", best_time(lambda: [f.fill_(1.0) for f in fills], cuda, warmup, repeat)))
        fills = None  # noqa: F841
    set_path("triton")
    same = ""
    if len(outs) == 2:
        eq = all(bool(((a == b) | (a.isnan() & b.isnan())).all()) for a, b in zip(outs["triton"], outs["torch"]))
        same = "yes" if eq else "NO"
    timed = [r for r in rows if isinstance(r, tuple)]
    base = next((r[1] for r in timed if "(default)" in r[0]), None) or next(
        (r[1] for r in timed if r[0].startswith("torch")), None)
    if cuda and dequant_triton._TABLE.get(qtype):
        _, r0, w0 = dequant_triton._TABLE[qtype]
        rows = [(f"triton (R={r0} warps={w0})", r[1]) if isinstance(r, tuple) and r[0] == "triton" else r
                for r in rows]
    bs, ts = GGML_QUANT_SIZES[qtype]
    print(f"\n### {qtype.name} ({ts * 8 / bs:.2f} bits/value; {len(shapes)} tensors "
          f"{', '.join('x'.join(map(str, s)) for s in shapes)} -> {str(dtype).removeprefix('torch.')})\n")
    print(f"| path | ms / layer | output GB/s | input GB/s | {'vs the default' if cpu_steps else 'vs torch'} |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        if isinstance(r, str):
            print(r)
            continue
        path, t = r
        vs = f"{base / t:.2f}x" if base else "—"
        print(f"| {path} | {t * 1e3:.3f} | {gbps(out_bytes, t)} | {gbps(in_bytes, t)} | {vs} |")
    if same:
        print(f"\nsame bits (Triton vs torch): {same}")
    raws = outs = None  # noqa: F841  (free the device memory before the next type)
    if cuda:
        torch.cuda.empty_cache()


def gbps(nbytes: int, seconds: float) -> str:
    rate = nbytes / seconds / 1e9
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default=DEFAULT_TYPES, help=f"comma-separated GGML types (default {DEFAULT_TYPES})")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                    help="cuda:N or cpu (default: cuda:0 where there is one)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="output dtype (default bfloat16, the engine's GPU compute dtype)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    ap.add_argument("--repeat", type=int, default=10, help="timed calls; the best is shown (default 10)")
    ap.add_argument("--launch", default="", help="extra Triton launch shapes to time, as blocks:warps,... "
                                                  "(each compiles separately: a few at a time)")
    ap.add_argument("--cpu-steps", default="", help="CPU only: values a step to time the torch path at, "
                                                     "comma-separated, on the CPU benchmark file's layer")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this torch sees no CUDA device")
    dtype = getattr(torch, args.dtype)
    launches = [tuple(int(x) for x in item.split(":")) for item in args.launch.split(",") if item.strip()]
    cpu_steps = [int(x) for x in args.cpu_steps.split(",") if x.strip()]
    if cpu_steps and (device.type != "cpu" or min(cpu_steps) < 1):
        ap.error("--cpu-steps: positive value counts, with --device cpu (a GPU steps by blocks)")
    if any(len(x) != 2 or x[0] < 1 or x[0] & (x[0] - 1) or x[1] not in (1, 2, 4, 8, 16) for x in launches):
        ap.error(f"--launch {args.launch}: give blocks:warps pairs, blocks a power of two, warps 1-16")
    names = LOW_BIT_TYPES if args.types.strip().lower() == "low-bit" else args.types
    types = [T[name.strip().upper()] for name in names.split(",") if name.strip()]
    if device.type == "cuda":
        tv = dequant_triton.triton.__version__ if dequant_triton.triton is not None else "not importable"
        print(f"# GGUF dequantisation on {torch.cuda.get_device_name(device)} (torch {torch.__version__}, "
              f"triton {tv}); one Qwen3-30B-A3B layer's experts, best of {args.repeat} after {args.warmup}")
        paths = ["triton", "torch"]
    elif cpu_steps:
        print(f"# GGUF dequantisation on CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
              f"load average {os.getloadavg()[0]:.2f}): the torch path by values a step, one layer of the "
              f"CPU benchmark file's experts, best of {args.repeat} after {args.warmup}")
        paths = ["torch"]
    else:
        print(f"# GGUF dequantisation on CPU: tiny shapes, torch path only (the Triton kernels need CUDA); "
              f"best of {args.repeat} after {args.warmup} — a smoke test, not a measurement of the GPU path")
        paths = ["torch"]
    for qtype in types:
        bench_type(qtype, device, paths, args.warmup, args.repeat, dtype, launches, cpu_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
