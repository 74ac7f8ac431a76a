"""Where one chunk's time goes on a GPU: torch.profiler's top CUDA ops for a prefill.

    python3 benchmarks/profile_prefill.py --layers 4 --tokens 4096
"""
from __future__ import annotations

import argparse

from torch.profiler import ProfilerActivity, profile

from engine.config import EngineConfig
from engine.pipeline import Session
from engine.prompt import synthetic
from engine.synth import SyntheticSource, recipe_from_args


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--device", default="cuda:0")
    ns = ap.parse_args()
    src = SyntheticSource(recipe_from_args("qwen3-30b-a3b", n_layers=ns.layers), ns.device)
    sess = Session(src, EngineConfig(devices=[ns.device], prefill=ns.tokens))
    ids = synthetic(ns.tokens, src.spec.vocab)
    sess.run(ids)  # warm-up
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        res = sess.run(ids)
    print(f"prefill {res.report.prefill_tok_s:.0f} tok/s")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
