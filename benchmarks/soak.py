"""Soak: many consecutive runs through the engine API; RSS, threads and open files must stay flat.

    python benchmarks/soak.py --runs 100 [--devices cpu,cpu] [--model demo]

Prints one row per 10 runs and a verdict: RSS (and CUDA allocated memory where present)
within 5% of its level after the warm-up runs, no growth in threads or open files.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import torch

from engine.cli.bench import open_model
from engine.config import EngineConfig
from engine.io.prompt import synthetic
from engine.pipeline.session import Session


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--devices", default="cpu,cpu")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--new-session-every", type=int, default=10, help="close and rebuild the session (0: never)")
    ns = ap.parse_args()
    model = open_model(ns.model, ns.devices.split(",")[0])
    cfg = EngineConfig.from_sources({"devices": ns.devices, "prefill": "64"})
    cuda = torch.cuda.is_available() and "cuda" in ns.devices
    sess = Session(model, cfg)
    rows, base = [], None
    t0 = time.perf_counter()
    for i in range(1, ns.runs + 1):
        if ns.new_session_every and i % ns.new_session_every == 0:
            sess.close()
            sess = Session(model, cfg)
        sess.run(synthetic(ns.tokens, model.spec.vocab, nonce=i), decode_tokens=4)
        sample = (i, rss_mib(), threading.active_count(), open_files(),
                  torch.cuda.memory_allocated() / 2**20 if cuda else 0.0)
        if i == ns.warmup:
            base = sample
        if i % 10 == 0 or i == ns.warmup:
            rows.append(sample)
    sess.close()
    print(f"soak: {ns.runs} runs of {ns.tokens} tokens + 4 decode on {ns.devices}, model {ns.model}, "
          f"{time.perf_counter() - t0:.1f} s, session rebuilt every {ns.new_session_every} runs")
    print("| run | RSS MiB | threads | open files | CUDA allocated MiB |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1f} | {r[2]} | {r[3]} | {r[4]:.1f} |")
    last = rows[-1]
    rss_growth = (last[1] - base[1]) / base[1]
    ok = abs(rss_growth) <= 0.05 and last[2] <= base[2] and last[3] <= base[3]
    if cuda:
        ok = ok and last[4] <= base[4] * 1.05 + 1
    print(f"RSS after run {ns.warmup}: {base[1]:.1f} MiB, after run {last[0]}: {last[1]:.1f} MiB "
          f"({rss_growth * 100:+.1f}%); threads {base[2]} -> {last[2]}; open files {base[3]} -> {last[3]}: "
          f"{'flat' if ok else 'GROWING'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
