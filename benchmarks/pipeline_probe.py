"""Where a 2-stage overlap loses time: per-chunk gaps, the first chunk, host latency.

Runs the synthetic Qwen3-30B-A3B-shaped model split over cuda:0,cuda:1 and prints, per variant,
prefill tok/s, each stage's compute sum (every variant but the last starts a fresh stage
thread per run, as the engine did before it kept them), the last stage's idle time split into
  fill   (waiting for stage 0's first chunk),
  delta  (stage 0's chunk c+1 costs more than stage 1's chunk c: attention grows with position),
  host   (stage 0's compute of c ended -> stage 1's compute of c starts: hand-off + thread wake),
and stage 1's first-chunk compute next to its second.

    python3 benchmarks/pipeline_probe.py --tokens 32768 --chunk 2048
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

sys.path.insert(0, ".")
from engine.cli.bench import open_model  # noqa: E402
from engine.config import EngineConfig, parse_setting  # noqa: E402
from engine.io.prompt import synthetic  # noqa: E402
from engine.pipeline.session import Session  # noqa: E402


def analyse(events, n_stages: int) -> dict[str, float]:
    comp = {s: sorted((e for e in events if e.kind == "compute" and e.stage == s), key=lambda e: e.chunk)
            for s in range(n_stages)}
    a, b = comp[0], comp[n_stages - 1] if n_stages > 1 else comp[0]
    out = {"s0_ms": sum(e.dur_ns for e in a) / 1e6, "s_last_ms": sum(e.dur_ns for e in b) / 1e6}
    if n_stages < 2:
        return out
    host, delta = [], []
    for c in range(1, len(b)):
        ready = a[c].end_ns  # stage 0 finished chunk c
        free = b[c - 1].end_ns  # stage 1 finished chunk c-1
        host.append(b[c].start_ns - max(ready, free))
        delta.append(max(ready - free, 0))
    out.update(fill_ms=(b[0].start_ns - a[0].start_ns) / 1e6, delta_ms=sum(delta) / 1e6,
               host_ms=sum(host) / 1e6, host_med_ms=statistics.median(host) / 1e6,
               first_ms=b[0].dur_ns / 1e6, second_ms=b[1].dur_ns / 1e6 if len(b) > 1 else 0.0)
    return out


class FreshWorkers(Session):
    """The pipeline as it was before workers were kept: a new stage thread for every run."""

    def _guard(self) -> None:
        super()._guard()
        for st in self.stages[1:]:
            if st.worker is not None:
                st.worker.stop()
                st.worker = None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:qwen3-30b-a3b:n_layers=32")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", default="2048")
    ap.add_argument("--devices", default="cuda:0,cuda:1")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--decode", type=int, default=0, help="also time this many decode steps, graphs on/off")
    ns = ap.parse_args()
    devices = ns.devices.split(",")
    chunk = parse_setting("prefill", ns.chunk)
    model = open_model(ns.model, devices[0])
    ids = synthetic(ns.tokens, model.spec.vocab, nonce=1)
    variants = {
        "overlap (thread per run)": dict(),
        "overlap, no graphs": dict(cuda_graphs=False),
        "overlap, switch 0.2 ms": dict(_switch=0.0002),
        "overlap, no telemetry": dict(_telemetry=None),
        "stage worker kept between runs (the engine's way)": dict(_kept=True),
    }
    print("| variant | tok/s | s0 ms | s1 ms | fill ms | delta ms | host ms (median) | s1 chunk 0 / 1 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name, kw in variants.items():
        switch = kw.pop("_switch", None)
        tel = kw.pop("_telemetry", 0.2)
        cls = Session if kw.pop("_kept", False) else FreshWorkers
        old = sys.getswitchinterval()
        if switch:
            sys.setswitchinterval(switch)
        sess = cls(model, EngineConfig(devices=devices, gpu_order="configured", prefill=chunk, **kw),
                   telemetry_interval_s=tel)
        sess.run(synthetic(min(4096, ns.tokens), model.spec.vocab, nonce=-1))  # warm-up
        rows = []
        for _ in range(ns.repeat):
            res = sess.run(ids)
            rows.append((res.report.prefill_tok_s, analyse(sess.events, 2)))
        tok, a = max(rows, key=lambda r: r[0])
        print(f"| {name} | {tok:,.0f} | {a['s0_ms']:.1f} | {a['s_last_ms']:.1f} | {a['fill_ms']:.1f} | "
              f"{a['delta_ms']:.1f} | {a['host_ms']:.1f} ({a['host_med_ms']:.2f}) | "
              f"{a['first_ms']:.1f} / {a['second_ms']:.1f} |", flush=True)
        sess.close()
        sys.setswitchinterval(old)
    if ns.decode:
        print("\n| decode (1 GPU) | tok/s |\n|---|---|")
        for graphs in (False, True):
            sess = Session(model, EngineConfig(devices=devices[:1], prefill=chunk, cuda_graphs=graphs))
            sess.run(synthetic(512, model.spec.vocab, nonce=-1), 4)
            res = sess.run(synthetic(512, model.spec.vocab, nonce=2), ns.decode)
            print(f"| cuda_graphs={int(graphs)} | {res.report.decode_tok_s:.1f} |", flush=True)
            sess.close()
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
