"""The chunked gated delta rule of a GDN layer on flash-linear-attention's Triton kernels (the `gdn`
extra, `fla-core`), with the state carried in place from chunk to chunk.

`engine.models.gated_delta.gdn_mix` asks `serves` for each chunk: on a CUDA tensor in bf16/fp16 (dk <= 256),
where `fla` imports and STRATA_GDN_KERNEL is not `torch`, it calls `chunk_rule`; everywhere else
(CPU, fp32 activations, no fla, the switch) the torch chunked rule (`gated_delta.gated_delta`), the
reference that the CPU tests hold to transformers, serves.  fp32 stays on torch on purpose: fla's
`tl.dot`s run their fp32 operands as TF32, which would make a GPU fp32 run a worse reference.

What fla is given, against the torch rule's math (engine/models/gated_delta.py's module doc):

- q, k raw (after the conv), L2-normalised inside fla (`use_qk_l2norm_in_kernel`: x / sqrt(sum x^2
  + 1e-6), in fp32, rounded to the input dtype: the same formula and eps as `gated_delta.l2norm`);
  the dk^-1/2 on q is fla's `scale`, passed explicitly.
- the value heads' q/k head: fla's GVA reads value head h from q/k head h // (HV / H), which is
  transformers' grouping (Qwen3-Next's file), so q/k go in with their own n_k heads; Qwen3.5's
  tiled order (h % n_k) is repeated to the value heads first (`gated_delta.per_value_head`).
- g = log decay per token and value head (fla's `g` without `use_gate_in_kernel`), beta after the
  sigmoid, both fp32.
- the state [Hv, dk, dv] fp32 as `initial_state` [1, Hv, dk, dv] (fla's [N, HV, K, V] layout, not
  V-first); fla returns the final state in fp32, written back into it, so chunk c+1 starts where
  chunk c ended.  fla keeps its per-block states in the inputs' dtype (bf16) between its kernels;
  the final state is accumulated in fp32.

Not in a CUDA graph: a GDN layer is never captured (`GdnLayer.fast_ok` is False: its state's
position is checked on the host each chunk), so fla's autotuning on the first call of a shape runs
eagerly, as it must.  `calls` counts the chunks fla served (the CUDA tests' proof that it ran).
"""
from __future__ import annotations

import functools
import importlib.metadata
import logging
from collections.abc import Callable

import torch

from engine import settings_table

log = logging.getLogger(__name__)

ENV = settings_table.row("gdn_kernel").env  # "torch": never fla
DTYPES = (torch.bfloat16, torch.float16)
calls = 0  # chunks whose rule fla computed, in this process
conv_calls = 0  # chunks whose causal conv fla computed, in this process


@functools.cache
def _load() -> tuple[Callable | None, str]:
    """(fla's chunk_gated_delta_rule, "fla <version>") or (None, why it is not there)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:  # ImportError, or a GPU package that fails to set itself up on import
        return None, f"fla is not importable: {type(exc).__name__}: {exc}"
    try:
        version = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        version = getattr(__import__("fla"), "__version__", "?")
    return chunk_gated_delta_rule, f"fla {version}"


@functools.cache
def _load_conv() -> Callable | None:
    """fla's causal_conv1d (its Triton backend), or None where fla does not import."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception as exc:
        log.info("GDN conv on CUDA: grouped F.conv1d (fla's causal_conv1d does not import: %s)", exc)
        return None
    return causal_conv1d


def _switched_off() -> bool:
    return settings_table.env_text("gdn_kernel").lower() == "torch"


def status() -> tuple[str, str]:
    """("fla <version>", "") where fla serves CUDA bf16/fp16 chunks, else ("torch", why)."""
    if _switched_off():
        return "torch", f"{ENV}=torch"
    fn, what = _load()
    return (what, "") if fn is not None else ("torch", what)


MAX_HEAD_K = 256  # fla's state kernel asserts dk <= 256


def serves(x: torch.Tensor, head_k: int) -> bool:
    """Whether a chunk whose activations are `x`, of a layer with q/k heads of `head_k`, takes fla's
    rule (logged once per answer)."""
    if not (x.is_cuda and x.dtype in DTYPES and head_k <= MAX_HEAD_K):
        return False
    kernel, why = status()
    _say(kernel, why)
    return kernel != "torch"


@functools.cache
def _say(kernel: str, why: str) -> None:
    if kernel == "torch":
        log.info("GDN delta rule on CUDA: torch chunked rule (%s)", why)
    else:
        log.info("GDN delta rule on CUDA: %s chunk_gated_delta_rule", kernel)


def chunk_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, scale: float) -> torch.Tensor:
    """The gated delta rule over T tokens on fla: q, k [T, H, dk] not yet normalised (H divides
    Hv; value head h reads q/k head h // (Hv / H)), v [T, Hv, dv] in one half dtype, g (log
    decay) and beta [T, Hv]; `state` [Hv, dk, dv] float32, updated in place to the state after the
    last token.  Returns o [T, Hv, dv] in v's dtype."""
    global calls
    fn, _ = _load()
    o, final = fn(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.float().unsqueeze(0),
                  beta.float().unsqueeze(0), scale=scale, initial_state=state.unsqueeze(0),
                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    state.copy_(final[0])
    calls += 1
    return o[0]


def serves_conv(x: torch.Tensor) -> bool:
    """Whether a chunk's causal conv takes fla's kernel: where its rule does (CUDA, a half dtype,
    fla importable, STRATA_GDN_KERNEL not `torch`) and its conv imports."""
    return serves(x, 0) and _load_conv() is not None


def conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """SiLU of the depthwise causal conv of x [T, C] (any row stride) with weight [C, K], after the
    inputs in `state` [C, K-1] (x's dtype), on fla's Triton kernel: taps summed in fp32 with the
    SiLU, one rounding to x's dtype; `state` is updated in place to the last K-1 inputs.  fla's
    state is [1, C, K] holding the last K inputs (its first column is never read), so ours goes in
    behind a zero column and its last K-1 columns come back.  Every output depends on its K inputs
    alone, so any cut of the prompt into chunks gives the same bits."""
    global conv_calls
    fn = _load_conv()
    init = torch.cat([state.new_zeros(state.shape[0], 1), state], dim=1).unsqueeze(0)
    y, final = fn(x.unsqueeze(0), weight, initial_state=init, output_final_state=True, activation="silu")
    state.copy_(final[0, :, 1:])
    conv_calls += 1
    return y[0]
