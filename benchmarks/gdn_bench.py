"""One GDN layer of Qwen3-Next-80B-A3B (issue 34 item 3): the chunked gated delta rule, and the
whole mixer between the projections, on the torch rule against flash-linear-attention's kernels.

For each prompt length T the table gives, best of --repeat after a warm-up (CUDA events on a GPU):

- `rule`: the delta rule alone, as `gdn_mix` calls it — the torch rule (q/k L2-normed, scaled and
  repeated to the value heads first, engine/models/gated_delta.py) against fla's
  chunk_gated_delta_rule (normalising in its kernel, q/k heads grouped; engine/kernels/gated_delta_fla.py);
- `mix`: `gdn_mix` whole (conv, norms, gates, rule, gated RMSNorm), STRATA_GDN_KERNEL=torch
  against the default;
- `conv`: the causal conv alone: the fp32 shifted products (the CPU's and fp32's path) against
  the grouped bf16 `F.conv1d` (CUDA bf16 without fla, or with STRATA_GDN_KERNEL=torch);
- `conv fla`: that grouped `F.conv1d` against fla's causal_conv1d, which CUDA bf16 takes with fla.

    python3 benchmarks/gdn_bench.py                                  # cuda:0, T = 8192, 32768, 65536
    python3 benchmarks/gdn_bench.py --sizes 4096,16384 --repeat 10
    python3 benchmarks/gdn_bench.py --device cpu --sizes 256         # torch only (a smoke test)

Shapes from the preset's spec (16 q/k heads, 32 value heads, head 128, a 4-tap conv, hidden
2048); random activations in bf16 on CUDA (fp32 on CPU), the state carried from call to call.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.io import synth  # noqa: E402
from engine.kernels import gated_delta_fla  # noqa: E402
from engine.models import registry  # noqa: E402
from engine.models.gated_delta import (  # noqa: E402
    GdnShape,
    GdnState,
    causal_conv1d,
    gated_delta,
    gdn_mix,
    l2norm,
    per_value_head,
)


def _time(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Best of `repeat` calls after two warm-ups (fla autotunes on a shape's first call), in ms."""
    fn()
    fn()
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


class _Inputs:
    """Random activations of one chunk of T tokens for a layer of `shape`."""

    def __init__(self, shape: GdnShape, t: int, device: torch.device, dtype: torch.dtype) -> None:
        g = torch.Generator(device="cpu").manual_seed(t)
        hv = shape.n_v_heads

        def rnd(*size: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*size, generator=g) * scale).to(device, dtype)

        self.qkv, self.z, self.b, self.a = rnd(t, shape.conv_dim), rnd(t, shape.value_dim), rnd(t, hv), rnd(t, hv)
        self.weights = dict(ssm_a=-torch.rand(hv, generator=g).mul(2).exp().to(device), dt_bias=rnd(hv),
                            conv_weight=rnd(shape.conv_dim, shape.conv_kernel, scale=0.5),
                            norm_weight=1 + rnd(shape.head_v, scale=0.1))
        self.state = GdnState(shape, device, dtype)
        q, k, v = torch.split(self.qkv, [shape.key_dim, shape.key_dim, shape.value_dim], dim=-1)
        self.q, self.k = (x.reshape(t, shape.n_k_heads, shape.head_k).contiguous() for x in (q, k))
        self.v = v.reshape(t, hv, shape.head_v).contiguous()
        self.g = self.weights["ssm_a"] * F.softplus(self.a.float() + self.weights["dt_bias"].float())
        self.beta = torch.sigmoid(self.b.float())


def _parts(shape: GdnShape, x: _Inputs, fla: bool) -> dict[str, tuple[Callable[[], object], Callable[[], object] | None]]:
    """part -> (the torch way, the fast way or None)."""
    scale = shape.head_k ** -0.5

    def rule_torch() -> object:
        q, k = per_value_head(l2norm(x.q.float()) * scale, l2norm(x.k.float()), shape)
        return gated_delta(q, k, x.v, x.g, x.beta, x.state.recurrent)

    def rule_fla() -> object:
        q, k = per_value_head(x.q, x.k, shape) if shape.v_tiled else (x.q, x.k)
        return gated_delta_fla.chunk_rule(q, k, x.v, x.g, x.beta, x.state.recurrent, scale=scale)

    def mix(kernel: str) -> Callable[[], object]:
        def go() -> object:
            os.environ[gated_delta_fla.ENV] = kernel
            return gdn_mix(x.qkv, x.z, x.b, x.a, shape=shape, state=x.state, eps=1e-6, **x.weights)
        return go

    wide = x.qkv.float()
    conv_state32 = x.state.conv.float()
    parts: dict[str, tuple[Callable[[], object], Callable[[], object] | None]] = {
        "rule": (rule_torch, rule_fla if fla else None),
        "mix": (mix("torch"), mix("") if fla else None),
    }
    if x.qkv.is_cuda and x.qkv.dtype != torch.float32:
        def conv(kernel: str) -> Callable[[], object]:
            def go() -> object:
                os.environ[gated_delta_fla.ENV] = kernel
                return causal_conv1d(x.qkv, x.weights["conv_weight"], x.state.conv)
            return go
        parts["conv"] = (lambda: causal_conv1d(wide, x.weights["conv_weight"], conv_state32), conv("torch"))
        if fla:
            parts["conv fla"] = (conv("torch"), conv(""))
    return parts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", default="8192,32768,65536", help="prompt lengths T, comma-separated")
    ap.add_argument("--repeat", type=int, default=5, help="timed calls per cell (the best is shown)")
    ap.add_argument("--preset", default="qwen3-next-80b-a3b", help="an engine.io.synth preset of a GDN family")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    recipe = synth.PRESETS[args.preset]
    shape = registry.family(recipe.arch).spec_from_recipe(recipe).gdn()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernel, why = gated_delta_fla.status() if device.type == "cuda" else ("torch", "CPU")
    fla = kernel != "torch"
    saved = os.environ.get(gated_delta_fla.ENV)
    print(f"# GDN layer of {args.preset}: {shape}, {dtype} on {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}); fast rule: "
          f"{kernel}{f' ({why})' if why else ''}; best of {args.repeat}")
    print()
    print("| T | part | torch ms | fast ms | torch / fast |")
    print("|---:|---|---:|---:|---:|")
    try:
        with torch.inference_mode():
            for t in (int(s) for s in args.sizes.split(",")):
                x = _Inputs(shape, t, device, dtype)
                for part, (slow, fast) in _parts(shape, x, fla).items():
                    ms = _time(slow, device, args.repeat)
                    fast_ms = _time(fast, device, args.repeat) if fast is not None else None
                    cells = (f"{fast_ms:.2f}", f"{ms / fast_ms:.2f}x") if fast_ms else ("-", "-")
                    print(f"| {t} | {part} | {ms:.2f} | {cells[0]} | {cells[1]} |", flush=True)
                del x
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        if saved is None:
            os.environ.pop(gated_delta_fla.ENV, None)
        else:
            os.environ[gated_delta_fla.ENV] = saved
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
