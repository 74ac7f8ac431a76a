"""One GPU, side by side in ONE process: HF transformers vs our engine on the same shapes.

HF: `Qwen3MoeForCausalLM` built from the synthetic preset's config (random bf16 weights, sdpa
attention) — or, with `--preset qwen3-next-80b-a3b` / `qwen3.5-35b-a3b`, `Qwen3NextForCausalLM` /
`Qwen3_5MoeForCausalLM` of those shapes (their GDN layers through flash-linear-attention where it
is installed, transformers' torch fallback otherwise: the table says which) — or, with
`--preset gpt-oss-20b` / `gpt-oss-120b`, `GptOssForCausalLM` holding OUR synthetic weights (the
preset's experts as bf16 instead of MXFP4, on both sides: benchmarks/hf_models.py fill_gpt_oss),
attention the first of --hf-attn that runs (flex_attention, then eager: the only two of
transformers' that apply the sinks; the table header says which); one forward of the
whole prompt with `logits_to_keep=1` (our engine also keeps the last position's logits only).
A size HF runs out of memory at (eager attention's scores at 32K: 64 heads x 32K x 32K) is
"OOM" in the table; the other sizes still run.
Ours: `Session.run` at chunk auto (or --prefill N), CUDA graphs on. Both: one unmeasured warm-up
at every size, then the best of --repeat; the same token ids. Prints one markdown table and MFU against --peak-tflops.

    python3 benchmarks/vs_hf.py --layers 16 --sizes 8192,32768,65536 --repeat 3
    python3 benchmarks/vs_hf.py --preset qwen3-next-80b-a3b --layers 16 --sizes 8192,32768,65536
    python3 benchmarks/vs_hf.py --preset gpt-oss-20b --layers 24 --sizes 4096,8192,32768 --repeat 3
"""
from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import hf_models  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.io import prompt as prompts  # noqa: E402
from engine.io.synth import ModelRecipe, SyntheticSource, recipe_from_args  # noqa: E402
from engine.pipeline.session import Session  # noqa: E402

PRESETS = ("qwen3-30b-a3b", "qwen3-next-80b-a3b", "qwen3.5-35b-a3b", "gpt-oss-20b", "gpt-oss-120b")
GPT_OSS = ("gpt-oss-20b", "gpt-oss-120b")


def bench_recipe(preset: str, n_layers: int) -> ModelRecipe:
    """The preset at `n_layers`, every large matrix stored as f16 (bf16 on the device): gpt-oss's
    MXFP4 experts too, so both sides run the same bf16 weights."""
    recipe = recipe_from_args(preset, n_layers=n_layers)
    return replace(recipe, quant="f16") if preset in GPT_OSS else recipe


def best_of(fn, repeat: int, device: str) -> float:
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def is_oom(exc: BaseException) -> bool:
    """Whether an error is the device running out of memory (torch's own, or one torch.compile's
    backend wrapped: flex_attention's kernels are compiled)."""
    while exc is not None:
        if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def time_hf(model, ids: dict[int, list[int]], repeat: int, dev: str) -> dict[int, float | None]:
    """HF's best of `repeat` per size (after a warm-up); None where the size ran out of memory
    (the memory is given back and the next size runs)."""
    out: dict[int, float | None] = {}
    with torch.inference_mode():
        for n, toks in ids.items():
            x = torch.tensor([toks], device=dev)
            run = lambda x=x: model(input_ids=x, logits_to_keep=1)  # noqa: E731
            try:
                run()  # warm-up at this size
                out[n] = best_of(run, repeat, dev)
            except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
                if not is_oom(exc):
                    raise
                out[n] = None
            del x, run
            gc.collect()
            torch.cuda.empty_cache()
            print(f"HF {n}: " + (f"{n / out[n]:,.0f} tok/s" if out[n] else "OOM"), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=PRESETS)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--sizes", default="8192,32768,65536")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prefill", default="auto", help="our chunk size: auto or N")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--peak-tflops", type=float, default=794.0, help="bf16 peak for MFU (H200 measured: 794)")
    ap.add_argument("--hf-attn", default=",".join(hf_models.GPT_OSS_ATTENTION),
                    help="gpt-oss: transformers attention implementations to try, in order")
    ap.add_argument("--skip-hf", action="store_true")
    ns = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sizes = [int(x) for x in ns.sizes.split(",")]
    recipe = bench_recipe(ns.preset, ns.layers)
    spec = recipe.spec()
    dev = ns.device
    torch.empty(1, device=dev)  # the device's allocator exists before its peak is reset (else "Invalid device argument")
    ids = {n: prompts.synthetic(n, spec.vocab, nonce=n) for n in sizes}

    hf_s: dict[int, float | None] = {}
    hf_version = "not run"
    hf_peak = 0.0
    if not ns.skip_hf:
        torch.cuda.reset_peak_memory_stats(dev)
        if ns.preset in GPT_OSS:
            # flex_attention is torch.compile'd once per shape: the probe and every size must not
            # exhaust dynamo's recompiles (past them flex runs uncompiled, scores materialised)
            torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
            model, version, impl, skipped = hf_models.hf_gpt_oss(SyntheticSource(recipe, dev), dev,
                                                                 attention=ns.hf_attn.split(","))
            hf_version = (f"{version}, GptOss on our weights, attention: {impl}, experts: "
                          f"{model.config._experts_implementation}" + "".join(f" ({s})" for s in skipped))
        elif ns.preset == "qwen3-30b-a3b":
            model, hf_version = hf_models.hf_qwen3moe(spec, dev)
        else:
            model, hf_version = hf_models.hf_hybrid(spec, dev)
        print(f"HF: transformers {hf_version}", flush=True)
        hf_s = time_hf(model, ids, ns.repeat, dev)
        hf_peak = torch.cuda.max_memory_allocated(dev) / 2**30
        del model
        gc.collect()
        torch.cuda.empty_cache()

    torch.cuda.reset_peak_memory_stats(dev)
    sess = Session(SyntheticSource(recipe, dev), EngineConfig.from_sources({"devices": dev, "prefill": ns.prefill}))
    ours: dict[int, float] = {}
    chunks: dict[int, str] = {}
    for n in sizes:
        sess.run(prompts.warmup_ids(n, spec.vocab), 0)
        best = None
        for _ in range(ns.repeat):
            r = sess.run(ids[n], 0).report
            if best is None or r.prefill_tok_s > best.prefill_tok_s:
                best = r
        ours[n] = n / best.prefill_tok_s
        chunks[n] = f"{best.plan.chunk}x{best.plan.n_chunks}"
        print(f"ours {n}: {best.prefill_tok_s:,.0f} tok/s ({chunks[n]})", flush=True)
    attention = sess.attention_kernels()
    sess.close()
    ours_peak = torch.cuda.max_memory_allocated(dev) / 2**30

    print(f"\n{ns.layers} layers of {ns.preset} shapes, bf16, {torch.cuda.get_device_name(dev)}, "
          f"torch {torch.__version__}, transformers {hf_version}; best of {ns.repeat} after a warm-up; "
          f"ours chunk {ns.prefill}; attention: {attention}; peak allocated: HF {hf_peak:.1f} GiB, "
          f"ours {ours_peak:.1f} GiB\n")
    print("| prompt | HF tok/s | ours tok/s | ours / HF | ours chunks | HF MFU | ours MFU |")
    print("|---:|---:|---:|---:|---|---:|---:|")
    for n in sizes:
        flops = spec.prefill_flops(n)
        mfu = lambda s, flops=flops: f"{flops / s / 1e12 / ns.peak_tflops * 100:.1f}%"  # noqa: E731
        h = hf_s.get(n)
        absent = "OOM" if n in hf_s else "—"
        print(f"| {n:,} | {f'{n / h:,.0f}' if h else absent} | {n / ours[n]:,.0f} | "
              f"{f'{h / ours[n]:.2f}' if h else absent} | {chunks[n]} | {mfu(h) if h else absent} | {mfu(ours[n])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
