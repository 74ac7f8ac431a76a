"""MLA's attention against standard attention (issue 35): TFLOP/s, ms per chunk, KV bytes per token.

One attention block (attention only, not the FFN: RMSNorm, the projections, RoPE, the cache
append, attention over the cached prefix, the output projection) of DeepSeek-V3 shapes
(engine/io/synth.py PRESETS['deepseek-v3']) run through the engine's own layer objects with random
weights from `synth.SyntheticSource`: `mla.MLALayer.attention` over its `LatentCache` (the
expanded form for prefill chunks, the absorbed form where `mla.absorbed_wanted` picks it; the
table says which ran), and `layers.Layer` (qwen3moe-style GQA with q/k norm) over its `LayerKV`,
on the path `Layer.forward` takes there (on CUDA bf16 the fused q/k/v, q/k norm + RoPE and the
chosen attention kernel; elsewhere `Layer.attention`), with the same hidden size and heads and
kv_heads x head_dim as `--std` lists (default: MHA at MLA's v width and at its q/k width, and
GQA with 8 KV heads).

A prompt of T tokens is prefilled in chunks of C (a chunk of T: one chunk), timed with CUDA
events on CUDA (wall clock elsewhere), best of --repeat after a warm-up prefill.

FLOPs counted (2 per multiply-add; norms, RoPE and softmax left out), a chunk of n queries at
position p, L = p + n keys, pairs = n p + n (n + 1) / 2 (causal: each query sees the keys up to
its own, so about half of the score matrix of a first chunk):
  MLA projections  2 n (d q_lora + q_lora H (nope + rope) + d (kv_lora + rope) + H v d)
                   (no q LoRA: 2 n d H (nope + rope) in place of the q terms)
  MLA expanded     + 2 L kv_lora H (nope + v)     [the per-head k/v of every cached token, made each chunk]
                   + 2 pairs H ((nope + rope) + v) [QK^T and PV; v's padding to the q/k width not counted]
  MLA absorbed     + 2 n H nope kv_lora + 2 pairs H (kv_lora + rope) + 2 pairs H kv_lora + 2 n H kv_lora v
  standard         2 n d hd (2 H + 2 KV) + 2 pairs H (hd + hd)
KV bytes per token and layer come from the state object each variant ran with (`LayerState.nbytes`
over its capacity: MLA's (kv_lora + rope) x dtype bytes, standard's 2 x KV x hd x dtype bytes),
and are checked against `models.states_bytes` (the figure the memory plan and the allocator use).

    python3 benchmarks/mla_bench.py --device cuda:0                        # T 8192 and 32768, chunks 4096 and 8192
    python3 benchmarks/mla_bench.py --device cuda:0 --tokens 32768 --chunks 32768
    python3 benchmarks/mla_bench.py --device cpu --tokens 64 --chunks 32 --hidden 64 --heads 4 --q-lora 32 \\
        --kv-lora 16 --rope 8 --nope 8 --v 8 --std 4x8,2x8                # a CPU smoke run at tiny shapes
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import models  # noqa: E402
from engine.io import synth  # noqa: E402
from engine.kernels.attention import kernel_for  # noqa: E402
from engine.models import mla  # noqa: E402
from engine.models.kv import LayerState  # noqa: E402
from engine.models.layers import Rope, resolve_dtype  # noqa: E402
from engine.models.loading import load_layer_weights, new_layer  # noqa: E402


@dataclass(frozen=True)
class Variant:
    """One attention block to measure: its name, the recipe its weights come from, the layer."""

    name: str
    recipe: synth.ModelRecipe
    spec: Any
    layer: Any

    @property
    def is_mla(self) -> bool:
        return isinstance(self.layer, mla.MLALayer)


@dataclass(frozen=True)
class Row:
    variant: Variant
    form: str  # "expanded", "absorbed" (MLA, as absorbed_wanted picked; "mixed" when the chunks differ) or "GQA"/"MHA"
    tokens: int
    chunk: int
    chunks: int
    seconds: float  # the whole prefill, best of the repeats
    flops: float  # of the whole prefill, by the module docstring's formula
    kv_bytes_per_token: int  # per layer, from the state object
    plan_bytes_per_token: int  # per layer, models.states_bytes (the memory plan's figure)
    kernel: str

    @property
    def ms_per_chunk(self) -> float:
        return self.seconds * 1e3 / self.chunks

    @property
    def tflops(self) -> float:
        return self.flops / self.seconds / 1e12


def mla_recipe(ns: argparse.Namespace) -> synth.ModelRecipe:
    """The preset's MLA shapes (overrides from the flags), one layer with routed experts (never
    loaded: only the attention runs)."""
    base = synth.PRESETS[ns.preset]
    rope = ns.rope or base.rope_dim
    nope = ns.nope or base.head_dim - base.rope_dim
    heads = ns.heads or base.n_heads
    return replace(base, n_layers=1, dense_lead=0, hidden=ns.hidden or base.hidden, n_heads=heads, n_kv_heads=heads,
                   head_dim=nope + rope, rope_dim=rope, q_lora_rank=base.q_lora_rank if ns.q_lora is None else ns.q_lora,
                   kv_lora_rank=ns.kv_lora or base.kv_lora_rank, v_head_dim=ns.v or base.v_head_dim, quant="f16")


def std_recipe(m: synth.ModelRecipe, kv_heads: int, head_dim: int) -> synth.ModelRecipe:
    """A qwen3moe-style block of the MLA recipe's hidden size and heads (a few tiny experts, never loaded)."""
    return synth.ModelRecipe(arch="qwen3moe", n_layers=1, hidden=m.hidden, n_heads=m.n_heads, n_kv_heads=kv_heads,
                             head_dim=head_dim, n_experts=4, n_experts_used=2, expert_ffn=64, quant="f16",
                             rope_base=m.rope_base, context_length=m.context_length)


def build(name: str, recipe: synth.ModelRecipe, device: torch.device, dtype: torch.dtype) -> Variant:
    """The engine's layer 0 of `recipe` with its random weights on `device` (experts left out)."""
    src = synth.SyntheticSource(recipe, str(device))
    spec = src.spec
    w = load_layer_weights(src, 0, device, dtype, experts=False)
    return Variant(name, recipe, spec, new_layer(spec, 0, w, Rope.for_spec(spec, device)))


def variants(ns: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[Variant]:
    m = mla_recipe(ns)
    out = [build(f"MLA {m.n_heads}h q/k {m.head_dim} v {m.v_head_dim or m.head_dim - m.rope_dim}, "
                 f"latent {m.kv_lora_rank}+{m.rope_dim}", m, device, dtype)]
    std = ns.std or f"{m.n_heads}x{m.v_head_dim},{m.n_heads}x{m.head_dim}" + (
        f",8x{m.v_head_dim}" if m.n_heads > 8 and m.n_heads % 8 == 0 else "")  # MHA at v's and q/k's width, GQA-8
    for item in std.split(","):
        kv, hd = (int(v) for v in item.lower().split("x"))
        kind = "MHA" if kv == m.n_heads else "GQA"
        out.append(build(f"{kind} {m.n_heads}h/{kv}kv x {hd}", std_recipe(m, kv, hd), device, dtype))
    return out


def attend(v: Variant, x: torch.Tensor, state: LayerState, pos: int) -> torch.Tensor:
    """The block's attention output (before the residual) on the path the engine's forward takes."""
    layer = v.layer
    if v.is_mla:
        return layer.attention(x, state, pos)
    if layer.fast_ok(x):  # Layer.forward's GPU path, its FFN half left out
        cos, sin = layer.rope.lowp_tables(pos, x.shape[0], x.dtype)
        q, k, val = layer.pre_attention(x, cos, sin)
        keys, values = state.append(k, val, pos)
        return F.linear(layer._attend(q, keys, values, x.shape[0], pos), layer.w.wo)
    return layer.attention(x, state, pos)


def chunk_flops(s: Any, mla_layer: bool, n: int, pos: int) -> tuple[float, str]:
    """FLOPs of one chunk of n queries at `pos` (the module docstring's formula) and the form it runs."""
    pairs = n * pos + n * (n + 1) / 2
    d, H = s.hidden, s.n_heads
    if not mla_layer:
        kind = "MHA" if s.n_kv_heads == H else "GQA"
        return 2.0 * n * d * s.head_dim * (2 * H + 2 * s.n_kv_heads) + 2.0 * pairs * H * 2 * s.head_dim, kind
    r, rope, nope, dv, dqk = s.kv_lora_rank, s.rope_dim, s.qk_nope_dim, s.v_head_dim, s.head_dim
    q = d * s.q_lora_rank + s.q_lora_rank * H * dqk if s.q_lora_rank else d * H * dqk
    proj = 2.0 * n * (q + d * (r + rope) + H * dv * d)
    if mla.absorbed_wanted(s, n):
        return proj + 2.0 * n * H * nope * r + 2.0 * pairs * H * (2 * r + rope) + 2.0 * n * H * r * dv, "absorbed"
    return proj + 2.0 * (pos + n) * r * H * (nope + dv) + 2.0 * pairs * H * (dqk + dv), "expanded"


def _prefill(v: Variant, x: torch.Tensor, state: LayerState, chunk: int) -> torch.Tensor:
    state.reset()
    out = None
    for p in range(0, x.shape[0], chunk):
        out = attend(v, x[p:p + chunk], state, p)
    return out


def _timed(fn, device: torch.device) -> float:
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def measure(v: Variant, tokens: int, chunk: int, device: torch.device, dtype: torch.dtype, repeat: int) -> Row:
    """One prefill of `tokens` random hidden states in chunks of `chunk`, warmed up, best of `repeat`."""
    s = v.spec
    state = models.new_states(s, [0], tokens, device, dtype)[0]
    g = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, s.hidden, device=device, dtype=dtype, generator=g)
    with torch.inference_mode():
        out = _prefill(v, x, state, chunk)  # warm-up (and the attention kernel's first-call choice)
        if not bool(torch.isfinite(out).all()):
            raise RuntimeError(f"{v.name}: non-finite attention output at {tokens} tokens, chunks of {chunk}")
        best = min(_timed(lambda: _prefill(v, x, state, chunk), device) for _ in range(repeat))
    flops, forms = 0.0, set()
    for p in range(0, tokens, chunk):
        f, form = chunk_flops(s, v.is_mla, min(chunk, tokens - p), p)
        flops += f
        forms.add(form)
    kernel = kernel_for(device, s.n_heads, s.n_kv_heads, s.head_dim, dtype).describe()
    return Row(v, forms.pop() if len(forms) == 1 else "mixed", tokens, chunk, -(-tokens // chunk), best, flops,
               state.nbytes // state.capacity, models.states_bytes(s, [0], tokens, dtype) // tokens, kernel)


def device_of(name: str) -> torch.device:
    """The device, with its index (the attention kernel's choice is kept per device name)."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def run(ns: argparse.Namespace) -> list[Row]:
    device = device_of(ns.device)
    dtype = resolve_dtype(device, ns.dtype)
    vs = variants(ns, device, dtype)
    rows = []
    for tokens in (int(t) for t in ns.tokens.split(",")):
        for chunk in sorted({min(int(c), tokens) for c in ns.chunks.split(",")}):
            for v in vs:
                rows.append(measure(v, tokens, chunk, device, dtype, ns.repeat))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def render(rows: list[Row], device: str, dtype: torch.dtype, repeat: int) -> str:
    """The markdown table (llama-bench style), a line per variant, T and chunk size."""
    lines = [f"# one attention block (attention only) on {device}, {str(dtype).removeprefix('torch.')}, "
             f"best of {repeat} after a warm-up; FLOPs and KV bytes as benchmarks/mla_bench.py's docstring states",
             "| attention | form | T | chunk | chunks | ms/chunk | TFLOP/s | KV B/token/layer | KV × MLA | time × MLA |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ref = {(r.tokens, r.chunk): r for r in rows if r.variant.is_mla}
    for r in rows:
        m = ref.get((r.tokens, r.chunk))
        kv_ratio = f"{r.kv_bytes_per_token / m.kv_bytes_per_token:.2f}" if m else "—"
        t_ratio = f"{r.seconds / m.seconds:.2f}" if m else "—"
        lines.append(f"| {r.variant.name} | {r.form} | {r.tokens} | {r.chunk} | {r.chunks} | {r.ms_per_chunk:.2f} | "
                     f"{r.tflops:.3g} | {r.kv_bytes_per_token} | {kv_ratio} | {t_ratio} |")
    kernels = {}
    for r in rows:
        kernels.setdefault(r.variant.name, r.kernel)
    lines += [f"attention kernel, {name}: {k}" for name, k in kernels.items()]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, float32 elsewhere")
    ap.add_argument("--tokens", default="8192,32768", help="prompt lengths T, comma-separated")
    ap.add_argument("--chunks", default="4096,8192", help="chunk sizes, comma-separated (each capped at T)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--preset", default="deepseek-v3", choices=[k for k, r in synth.PRESETS.items()
                                                                if r.arch == "deepseek2"])
    ap.add_argument("--std", default="", help="standard blocks as KVxHD, comma-separated (default: heads x v, "
                                              "heads x (nope+rope), and 8 x v where 8 divides the heads)")
    for flag in ("hidden", "heads", "kv-lora", "rope", "nope", "v"):
        ap.add_argument(f"--{flag}", type=int, default=0, help="override the preset's size (tiny smoke runs)")
    ap.add_argument("--q-lora", type=int, default=None, help="override the q LoRA rank (0: a plain q projection)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    rows = run(ns)
    bad = [r for r in rows if r.kv_bytes_per_token != r.plan_bytes_per_token]
    if bad:
        raise RuntimeError(f"state bytes differ from the memory plan's figure: {bad[0].variant.name}")
    device = device_of(ns.device)
    print(render(rows, str(device), resolve_dtype(device, ns.dtype), ns.repeat))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
