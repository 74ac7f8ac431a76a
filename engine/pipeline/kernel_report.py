"""Which kernel each part of a layer runs on a session's devices, and one visible warning per
process when a fast (Triton) kernel is missing on CUDA, with the reason.

The parts: the GGUF dequantiser (`engine.quant.dequant_triton`), the MoE's SwiGLU and slot sum
(`engine.kernels.moe_kernels`), q/k-norm + RoPE (`engine.kernels.qk_rope`), a decode token's attention
(`engine.kernels.decode_attention`, split-K) — each Triton on CUDA where it can be defined, torch
otherwise — and attention (`engine.kernels.attention`, named per device in the report's
own `attention` field).  A model with GDN layers (Qwen3-Next, Qwen3.5-MoE) adds its chunked
delta rule (`engine.kernels.gated_delta_fla`): flash-linear-attention's Triton kernels on CUDA in
bf16/fp16 where the `gdn` extra is installed, torch otherwise.  Without Triton the first three
run at torch speed (Q4_K_M prefill at 0.39x/0.62x of F16 instead of 0.86x/0.97x,
docs/benchmarks.md), which used to happen silently:
`kernel_parts` says it, and `warnings` turns it into a note the run report, the CLI and the
app's summary show.  A part switched off on purpose (STRATA_DEQUANT / STRATA_MOE_KERNELS /
STRATA_QK_KERNEL / STRATA_DECODE_ATTENTION / STRATA_GDN_KERNEL=torch) is named, not warned about.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gguf import GGMLQuantizationType as T

log = logging.getLogger(__name__)

INSTALL_FIX = "install the cuda extra: pip install -e \".[cuda]\" (triton on Linux, triton-windows on Windows)"
FROZEN_FIX = "build the bundle with packaging/strata_gui.spec, which collects engine/ as source"
GDN_FIX = "install the gdn extra: pip install -e \".[cuda,gdn]\" (fla-core)"
GDN_PART = "GDN rule"
UNQUANTISED = frozenset({T.F32, T.F16, T.BF16})


@dataclass(frozen=True)
class PartKernel:
    part: str  # "dequant", "MoE", "q/k-norm+RoPE"
    kernel: str  # "Triton 3.8.0", "torch", "none"
    detail: str = ""  # the types it serves, or why torch serves
    missing: bool = False  # a fast kernel was expected here (a CUDA device) and is not there

    def describe(self) -> str:
        return f"{self.part}: {self.kernel}" + (f" ({self.detail})" if self.detail else "")


PARTS = ("dequant", "MoE", "q/k-norm+RoPE", "decode attention")


def _statuses() -> dict[str, Callable[[], tuple[str, str]]]:
    """Each part's status function; importing them imports triton, so only for a CUDA split."""
    from engine.kernels import decode_attention, moe_kernels, qk_rope
    from engine.quant import dequant_triton

    return {"dequant": dequant_triton.status, "MoE": moe_kernels.status, "q/k-norm+RoPE": qk_rope.status,
            "decode attention": decode_attention.status}


def _opted_out(why: str) -> bool:
    return why.endswith("=torch")


def kernel_parts(device_types: Iterable[str], *, is_moe: bool, qtypes: Iterable[T | int] = (), gdn: bool = False,
                 half: bool = True) -> list[PartKernel]:
    """The kernel of each Triton-capable part for a split over devices of these types ("cuda",
    "cpu"), a model that is MoE or not, with weights stored in `qtypes`; `gdn`: the model has GDN
    layers, `half`: its CUDA devices compute in bf16/fp16 (fla's rule serves only those)."""
    cuda = "cuda" in set(device_types)
    quant = sorted({T(q) for q in qtypes} - UNQUANTISED, key=lambda q: q.name)
    statuses = _statuses() if cuda else {}
    out = []
    for part in PARTS:
        if part == "MoE" and not is_moe:
            out.append(PartKernel(part, "none", "a dense model"))
            continue
        if part == "dequant" and not quant:
            out.append(PartKernel(part, "none", "no quantised weights"))
            continue
        if not cuda:
            out.append(PartKernel(part, "torch", "CPU"))
            continue
        kernel, why = statuses[part]()
        if kernel == "torch":
            out.append(PartKernel(part, "torch", why, missing=not _opted_out(why)))
        elif part == "dequant":
            from engine.quant import dequant_triton

            fast = [q.name for q in quant if q in dequant_triton.TYPES]
            slow = [q.name for q in quant if q not in dequant_triton.TYPES]
            detail = ", ".join(fast) + (f"; torch for {', '.join(slow)}" if slow else "")
            out.append(PartKernel(part, kernel if fast else "torch", detail if fast else f"no kernel for {', '.join(slow)}"))
        else:
            out.append(PartKernel(part, kernel))
    if gdn:
        out.append(_gdn_part(cuda, half))
    return out


def _gdn_part(cuda: bool, half: bool) -> PartKernel:
    """The GDN layers' delta rule: fla on CUDA in a half dtype where it imports, else torch."""
    if not cuda:
        return PartKernel(GDN_PART, "torch", "CPU")
    if not half:
        return PartKernel(GDN_PART, "torch", "fp32 (fla serves bf16/fp16)")
    from engine.kernels import gated_delta_fla

    kernel, why = gated_delta_fla.status()
    return PartKernel(GDN_PART, kernel, why, missing=kernel == "torch" and not _opted_out(why))


def describe(parts: Iterable[PartKernel]) -> str:
    """One line for the run report: "dequant: Triton 3.8.0 (Q4_K, Q6_K); MoE: torch (…); …"."""
    return "; ".join(p.describe() for p in parts)


def warnings(parts: Iterable[PartKernel]) -> list[str]:
    """One note per reason a fast kernel is missing (naming the parts it stops); each is logged
    as a warning once per process."""
    by_reason: dict[str, list[str]] = {}
    for p in parts:
        if p.missing:
            by_reason.setdefault(p.detail, []).append(p.part)
    notes = []
    for why, names in by_reason.items():
        fix = FROZEN_FIX if "cannot read the source" in why else GDN_FIX if names == [GDN_PART] else INSTALL_FIX
        note = (f"fast kernel missing: {', '.join(names)} {'runs' if len(names) == 1 else 'run'} on torch on CUDA "
                f"(slower): {why}; {fix}")
        _warn_once(note)
        notes.append(note)
    return notes


@functools.cache
def _warn_once(note: str) -> None:
    log.warning("%s", note)


def exercise(device: str = "cuda") -> tuple[bool, str]:
    """Run one Triton kernel (the MoE SwiGLU) on `device` against its torch expression: the frozen
    self-test's proof that a bundle's Triton works (compiler, backends, engine sources).  Without
    CUDA there is nothing to run (ok).  On CUDA: not ok when triton is there but cannot define the
    kernels (a bundle without engine sources) or the kernel's result is wrong; ok, with the reason,
    when the build simply has no triton."""
    import torch
    import torch.nn.functional as F

    from engine.kernels import moe_kernels

    if not torch.cuda.is_available():
        return True, "no CUDA device: Triton kernels not exercised"
    kernel, why = moe_kernels.status()
    if kernel == "torch":
        return "cannot read the source" not in why, f"Triton kernels not available: {why}"
    g = torch.Generator(device="cpu").manual_seed(0)
    gu = torch.randn(37, 2 * 96, generator=g).to(device)
    got = moe_kernels.swiglu(gu, 96)
    want = F.silu(gu[:, :96]) * gu[:, 96:]
    err = float((got - want).abs().max())
    ok = err <= 1e-5 * max(1.0, float(want.abs().max()))
    return ok, f"{kernel}: MoE SwiGLU on {device} {'matches' if ok else 'DIFFERS from'} torch (max abs diff {err:.2g})"
