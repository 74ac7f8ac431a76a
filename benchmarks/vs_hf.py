"""One GPU, side by side in ONE process: HF transformers vs our engine on the same shapes.

HF: `Qwen3MoeForCausalLM` built from the synthetic preset's config (random bf16 weights, sdpa
attention) — or, with `--preset qwen3-next-80b-a3b` / `qwen3.5-35b-a3b`, `Qwen3NextForCausalLM` /
`Qwen3_5MoeForCausalLM` of those shapes (their GDN layers through flash-linear-attention where it
is installed, transformers' torch fallback otherwise: the table says which); one forward of the
whole prompt with `logits_to_keep=1` (our engine also keeps the last position's logits only).
Ours: `Session.run` at chunk auto (or --prefill N), CUDA graphs on. Both: one unmeasured warm-up
at every size, then the best of --repeat; the same token ids. Prints one markdown table and MFU against --peak-tflops.

    python3 benchmarks/vs_hf.py --layers 16 --sizes 8192,32768,65536 --repeat 3
    python3 benchmarks/vs_hf.py --preset qwen3-next-80b-a3b --layers 16 --sizes 8192,32768,65536
"""
from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from engine.io import prompt as prompts  # noqa: E402
from engine.io.synth import SyntheticSource, recipe_from_args  # noqa: E402
from engine.pipeline.session import Session  # noqa: E402


def hf_qwen3moe(spec, device: str):
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads, head_dim=spec.head_dim,
        moe_intermediate_size=spec.expert_ffn, num_experts=spec.n_experts, num_experts_per_tok=spec.n_experts_used,
        norm_topk_prob=True, rope_theta=spec.rope_base, rms_norm_eps=spec.rms_eps,
        max_position_embeddings=max(spec.context_length, 131072), decoder_sparse_step=1, mlp_only_layers=[],
        intermediate_size=6144, tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    return model, transformers.__version__


def _hybrid_config(cls, spec, **extra):
    """A transformers config of a hybrid spec (engine/models/qwen3next.py HybridSpec)."""
    return cls(
        vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads, head_dim=spec.head_dim,
        linear_conv_kernel_dim=spec.conv_kernel, linear_key_head_dim=spec.linear_head_k,
        linear_value_head_dim=spec.linear_head_v, linear_num_key_heads=spec.linear_k_heads,
        linear_num_value_heads=spec.linear_v_heads, moe_intermediate_size=spec.expert_ffn,
        shared_expert_intermediate_size=spec.shared_ffn, num_experts=spec.n_experts,
        num_experts_per_tok=spec.n_experts_used, rms_norm_eps=spec.rms_eps,
        max_position_embeddings=max(spec.context_length, 131072), tie_word_embeddings=False,
        layer_types=["linear_attention" if r else "full_attention" for r in spec.recurrent],
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_base,
                         "partial_rotary_factor": spec.rotary_dim / spec.head_dim, **extra},
        attn_implementation="sdpa")


def hf_hybrid(spec, device: str):
    """Qwen3-Next or Qwen3.5-MoE (whichever family the spec's value-head order is)."""
    import transformers

    if spec.v_tiled:
        from engine.models.qwen35moe import mrope_sections

        cfg = _hybrid_config(transformers.Qwen3_5MoeTextConfig, spec, mrope_section=mrope_sections(spec.rotary_dim)[:3],
                             mrope_interleaved=True)
        cls = transformers.Qwen3_5MoeForCausalLM
    else:
        cfg = _hybrid_config(transformers.Qwen3NextConfig, spec)
        cfg.norm_topk_prob, cfg.decoder_sparse_step, cfg.mlp_only_layers = True, 1, []
        cls = transformers.Qwen3NextForCausalLM
    with torch.device(device):
        model = cls(cfg).to(torch.bfloat16).eval()
    try:
        import fla  # noqa: F401

        gdn = "flash-linear-attention"
    except ImportError:
        gdn = "torch fallback (no flash-linear-attention)"
    return model, f"{transformers.__version__}, GDN: {gdn}"


def best_of(fn, repeat: int, device: str) -> float:
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b",
                    choices=("qwen3-30b-a3b", "qwen3-next-80b-a3b", "qwen3.5-35b-a3b"))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--sizes", default="8192,32768,65536")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prefill", default="auto", help="our chunk size: auto or N")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--peak-tflops", type=float, default=794.0, help="bf16 peak for MFU (H200 measured: 794)")
    ap.add_argument("--skip-hf", action="store_true")
    ns = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sizes = [int(x) for x in ns.sizes.split(",")]
    recipe = recipe_from_args(ns.preset, n_layers=ns.layers)
    spec = recipe.spec()
    dev = ns.device
    ids = {n: prompts.synthetic(n, spec.vocab, nonce=n) for n in sizes}

    hf_s: dict[int, float] = {}
    hf_version = "not run"
    if not ns.skip_hf:
        model, hf_version = hf_qwen3moe(spec, dev) if ns.preset == "qwen3-30b-a3b" else hf_hybrid(spec, dev)
        with torch.inference_mode():
            for n in sizes:
                x = torch.tensor([ids[n]], device=dev)
                run = lambda x=x: model(input_ids=x, logits_to_keep=1)  # noqa: E731
                run()  # warm-up at this size
                hf_s[n] = best_of(run, ns.repeat, dev)
                print(f"HF {n}: {n / hf_s[n]:,.0f} tok/s", flush=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()

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

    print(f"\n{ns.layers} layers of {ns.preset} shapes, bf16, {torch.cuda.get_device_name(dev)}, "
          f"torch {torch.__version__}, transformers {hf_version}; best of {ns.repeat} after a warm-up; "
          f"ours chunk {ns.prefill}; attention: {attention}\n")
    print("| prompt | HF tok/s | ours tok/s | ours / HF | ours chunks | HF MFU | ours MFU |")
    print("|---:|---:|---:|---:|---|---:|---:|")
    for n in sizes:
        flops = spec.prefill_flops(n)
        mfu = lambda s, flops=flops: f"{flops / s / 1e12 / ns.peak_tflops * 100:.1f}%"  # noqa: E731
        h = hf_s.get(n)
        print(f"| {n:,} | {f'{n / h:,.0f}' if h else '—'} | {n / ours[n]:,.0f} | "
              f"{f'{h / ours[n]:.2f}' if h else '—'} | {chunks[n]} | {mfu(h) if h else '—'} | {mfu(ours[n])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
