"""A real out-of-memory on a GPU, then a VRAM soak (issue 10; run on the device machine).

    python3 benchmarks/gpu_faults.py [--device cuda:0] [--soak-runs 30]

1. Fill the GPU but ~1 GiB, ask for a run whose KV needs more: the engine must refuse with a
   message naming the device, what it allocated and what to change; allocated memory must be
   back to its level before the run; after freeing the filler the next run succeeds.
2. Soak: consecutive runs; torch's allocated VRAM and the process RSS must stay flat.
"""
from __future__ import annotations

import argparse
import sys
import threading

import torch

from engine.config import EngineConfig
from engine.io.prompt import synthetic
from engine.io.synth import SyntheticSource, recipe_from_args
from engine.pipeline.session import DeviceMemoryError, Session


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--soak-runs", type=int, default=30)
    ns = ap.parse_args()
    dev = torch.device(ns.device)
    src = SyntheticSource(recipe_from_args("qwen3-30b-a3b", n_layers=4), ns.device)
    sess = Session(src, EngineConfig(devices=[ns.device], prefill=4096))
    clean = sess.run(synthetic(8192, src.spec.vocab, nonce=1), 4).report
    print(f"clean run: {clean.prefill_tok_s:.0f} tok/s, digest {clean.digest}")
    ok = True

    torch.cuda.empty_cache()  # what the allocator keeps cached would otherwise absorb the request
    free, _ = torch.cuda.mem_get_info(dev)
    filler = torch.empty(free - (1 << 30), dtype=torch.uint8, device=dev)
    before = torch.cuda.memory_allocated(dev)
    tokens = 2_000_000  # KV: 4 layers x 2 x 4 heads x 128 x 2 bytes x 2M = 15 GiB > 1 GiB free
    try:
        sess.run(synthetic(tokens, src.spec.vocab, nonce=2), 1)
        print("FAIL: the oversized run did not run out of memory")
        ok = False
    except DeviceMemoryError as exc:
        print(f"refused: {exc}")
        ok &= ns.device in str(exc) and "KV for layers" in str(exc) and "shorten" in str(exc)
    after = torch.cuda.memory_allocated(dev)
    print(f"allocated before the run {before / 2**20:.0f} MiB, after the failed run {after / 2**20:.0f} MiB")
    ok &= after <= before
    ok &= not [t for t in threading.enumerate() if t.name.startswith("strata-")]
    del filler
    torch.cuda.empty_cache()
    again = sess.run(synthetic(8192, src.spec.vocab, nonce=1), 4).report
    print(f"next run: digest {again.digest} ({'same' if again.digest == clean.digest else 'DIFFERENT'})")
    ok &= again.digest == clean.digest

    rows = []
    for i in range(1, ns.soak_runs + 1):
        sess.run(synthetic(8192, src.spec.vocab, nonce=i), 4)
        if i in (3, ns.soak_runs // 2, ns.soak_runs):
            rows.append((i, torch.cuda.memory_allocated(dev) / 2**20, rss_mib(), threading.active_count()))
    print("| run | CUDA allocated MiB | RSS MiB | threads |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.0f} | {r[2]:.0f} | {r[3]} |")
    flat = rows[-1][1] <= rows[0][1] * 1.05 and rows[-1][2] <= rows[0][2] * 1.05 and rows[-1][3] <= rows[0][3]
    print(f"VRAM/RSS/threads {'flat' if flat else 'GROWING'}; faults {'ok' if ok else 'FAILED'}")
    return 0 if ok and flat else 1


if __name__ == "__main__":
    sys.exit(main())
