"""Issue 17's stream-bound figures in one process: the pinned host->device peak of this machine,
then `strata-bench run` with experts streamed through a fixed cache (whole arena page-locked)
for each quant, with the peak VRAM the run took.

    python3 benchmarks/stream_bench.py                        # f16 and q4_k_m, 16 layers
    python3 benchmarks/stream_bench.py --quants f16,q4_k_m --layers 16 --cache-gib 4

Prints the pinned peak (best of 10 copies of 1 GiB), then per quant the bench's own table
(prefill tok/s, streamed GiB, H2D GB/s) and `peak VRAM: allocated / reserved` from torch's
allocator statistics of the same process, and the H2D rate against the peak.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.cli import bench  # noqa: E402

GiB = 1 << 30


def pinned_peak(device: torch.device, nbytes: int = GiB, repeat: int = 10) -> float:
    """Best GB/s of a page-locked host buffer copied to `device`."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = 0.0
    for _ in range(repeat + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dev.copy_(host, non_blocking=True)
        b.record()
        b.synchronize()
        best = max(best, nbytes / (a.elapsed_time(b) / 1e3) / 1e9)
    del host, dev
    torch.cuda.empty_cache()
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quants", default="f16,q4_k_m")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--cache-gib", default="4")
    ap.add_argument("--prompt-tokens", default="8192,32768")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (streaming is measured on the GPU machine)")
    device = torch.device("cuda:0")
    peak = pinned_peak(device)
    print(f"pinned host->device peak on {torch.cuda.get_device_name(device)}: {peak:.1f} GB/s (1 GiB, best of 10)")
    rc = 0
    for q in [x.strip() for x in args.quants.split(",") if x.strip()]:
        print(f"\n## streamed experts, {q}: {args.cache_gib} GiB cache, whole arena pinned\n", flush=True)
        torch.cuda.reset_peak_memory_stats(device)
        rc |= bench.main(["run", "--model", f"synthetic:qwen3-30b-a3b:n_layers={args.layers},quant={q}",
                          "--devices", "cuda:0", "--expert-cache", args.cache_gib, "--pin-limit-gib", "100",
                          "--prompt-tokens", args.prompt_tokens, "--repeat", str(args.repeat), "--peak-tflops", "794"])
        print(f"\npeak VRAM ({q}): {torch.cuda.max_memory_allocated(device) / GiB:.1f} GiB allocated, "
              f"{torch.cuda.max_memory_reserved(device) / GiB:.1f} GiB reserved by torch", flush=True)
        torch.cuda.empty_cache()
    return rc


if __name__ == "__main__":
    sys.exit(main())
