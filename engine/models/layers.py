"""The transformer in plain torch: one `Layer` per block, each callable on its own.

A layer takes a chunk of hidden states at a position, appends its keys/values to its own
`LayerKV` and returns the new hidden states, so layers can live on different devices.
What a family's layers hold (q/k norm, q/k/v biases, experts or a dense FFN, the RoPE pairing)
comes from its `ModelSpec` and its module in `engine/models/`; this module branches on those
features, never on the architecture's name.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from engine.kernels import moe_kernels
from engine.kernels.attention import chunk_attention, kernel_for
from engine.kernels.decode_attention import decode_attention
from engine.kernels.qk_rope import qk_norm_rope
from engine.models import routed_experts, routed_matvec, routing
from engine.models.decode_pos import DevicePos
from engine.models.experts import EXPAND_SCRATCH_BYTES
from engine.models.gguf_keys import RopeScaling
from engine.models.kv import LayerKV
from engine.models.spec import ModelSpec
from engine.quant.host_scratch import HostScratch
from engine.quant.qtensor import QTensor, has_blocks

if TYPE_CHECKING:
    from engine.models.experts import ExpertCache

log = logging.getLogger(__name__)


class WeightSource(Protocol):
    """Anything that yields a model's spec and its float32 tensors by GGUF name.

    Sources that also expose their blocks (`raw`, `qtype`, `shape`, `nbytes`, as `LoadedModel`
    and `SyntheticSource` do) keep MoE experts in their stored type up to the GEMM, and expand
    dense weights on the device (`tensor(name, device=, dtype=)`)."""

    spec: ModelSpec

    def tensor(self, name: str) -> torch.Tensor: ...


def dense_weight(src: WeightSource, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A weight expanded once on its device (from the stored blocks where the source has them)."""
    if has_blocks(src):
        return src.tensor(name, device=device, dtype=dtype).contiguous()
    return src.tensor(name).to(device=device, dtype=dtype).contiguous()


def _float_stored(src: WeightSource, name: str) -> bool:
    """Whether a tensor is stored as plain floats (nothing to gain from keeping it as stored)."""
    return not has_blocks(src) or src.qtype(name).name in ("F32", "F16", "BF16")


def resolve_dtype(device: torch.device, name: str = "auto") -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with fp32 accumulation (weight is kept fp32); returns x's dtype.

    On CUDA the fused kernel replaces five elementwise launches per norm."""
    if x.device.type == "cuda":
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


class Rope:
    """Cos/sin tables for one device, grown on demand.

    `scaling` (the file's linear or YaRN rope scaling, `gguf_keys.RopeScaling`) changes only the
    frequencies and, for YaRN, multiplies cos and sin by its attention factor: every path that
    takes these tables (eager, CUDA graphs, the Triton q/k-norm+RoPE kernel) applies it unchanged."""

    def __init__(self, head_dim: int, base: float, style: str, device: torch.device,
                 scaling: RopeScaling | None = None, rot_dim: int = 0) -> None:
        rot = rot_dim or head_dim  # partial rotary: the first `rot` dimensions turn, the rest pass
        if head_dim % 2 or rot % 2 or rot > head_dim:
            raise ValueError(f"RoPE needs an even head dimension and rotary part, not {head_dim} / {rot}")
        self.head_dim, self.base, self.style, self.device = head_dim, base, style, device
        self.rot = rot
        self.scaling = scaling
        if scaling is None:  # frequencies over the rotated part (llama.cpp's n_rot, transformers' dim)
            inv = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
            self.mscale = 1.0
        else:
            inv = torch.from_numpy(scaling.inv_freq(rot, base))
            self.mscale = scaling.attention_factor
        self.inv_freq = inv.to(device)
        self.cos = torch.empty(0, rot // 2, device=device)
        self.sin = torch.empty(0, rot // 2, device=device)

    @classmethod
    def for_spec(cls, spec: ModelSpec, device: torch.device) -> Rope:
        """The tables a model's layers need on `device` (its head size, rotary part, base, style
        and scaling)."""
        return cls(spec.head_dim, spec.rope_base, spec.rope_style, device, spec.rope_scaling, spec.rope_dim)

    def _ensure(self, n: int) -> None:
        if n <= self.cos.shape[0]:
            return
        cap = max(n, 2 * self.cos.shape[0], 256)
        t = torch.arange(cap, dtype=torch.float64, device=self.device)
        ang = torch.outer(t, self.inv_freq)
        self.cos, self.sin = (ang.cos() * self.mscale).float(), (ang.sin() * self.mscale).float()

    def lowp_tables(self, pos: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions pos..pos+n-1 in `dtype`, shaped [n, 1, rotary dims] (neox)."""
        if isinstance(pos, DevicePos):  # a static-shape decode step: the row its device tensor names
            cos, sin = self.lowp_tables(0, pos.span, dtype)
            return pos.row(cos), pos.row(sin)
        self._ensure(pos + n)
        key = (dtype, self.cos.shape[0])
        if getattr(self, "_lowp_key", None) != key:
            self._cos_full = torch.cat((self.cos, self.cos), -1).to(dtype)[:, None, :]
            self._sin_full = torch.cat((self.sin, self.sin), -1).to(dtype)[:, None, :]
            self._lowp_key = key
        return self._cos_full[pos:pos + n], self._sin_full[pos:pos + n]

    def apply(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x: [n, heads, head_dim] at positions pos..pos+n-1 (partial rotary: the first `rot`
        dimensions turn, paired within them; the others are returned as they are)."""
        if self.rot < x.shape[-1]:
            return torch.cat((self.apply(x[..., :self.rot], pos), x[..., self.rot:]), dim=-1)
        n = x.shape[0]
        if isinstance(pos, DevicePos):  # a static-shape decode step: the row its device tensor names
            self._ensure(pos.span)
            cos, sin = pos.row(self.cos)[:, None, :], pos.row(self.sin)[:, None, :]
        else:
            self._ensure(pos + n)
            cos = self.cos[pos:pos + n, None, :]
            sin = self.sin[pos:pos + n, None, :]
        xf = x.float()
        if self.style == "neox":
            x1, x2 = xf.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:  # "norm": adjacent pairs (2i, 2i+1), as llama GGUF files store q/k
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return out.to(x.dtype)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    ffn_norm: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    router: torch.Tensor | None = None  # [E, d]
    router_bias: torch.Tensor | None = None  # [E]: selects experts, weighs nothing (engine/models/routing.py)
    # resident experts: QTensor (as stored; expanded per call) or expanded tensors
    gate_exps: torch.Tensor | QTensor | None = None  # [E, f, d]
    up_exps: torch.Tensor | QTensor | None = None  # [E, f, d]
    down_exps: torch.Tensor | QTensor | None = None  # [E, d, f]
    gate: torch.Tensor | None = None
    up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    # the shared expert (spec.shared_ffn) and its sigmoid gate [1, d] (spec.shared_gate)
    gate_shexp: torch.Tensor | None = None
    up_shexp: torch.Tensor | None = None
    down_shexp: torch.Tensor | None = None
    gate_inp_shexp: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes
                   for t in vars(self).values() if isinstance(t, (torch.Tensor, QTensor)))


def _grouped_mm_ok(x: torch.Tensor) -> bool:
    return (x.device.type == "cuda" and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


@dataclass
class FusedWeights:
    """The GPU path's weights: q/k/v as one matrix, q/k norms as one per-head table, norms and
    router in the compute dtype, resident experts' gate and up as one grouped matrix."""

    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [H + KV, head_dim]
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    router: torch.Tensor | None
    gate_up_exps: torch.Tensor | None  # [E, 2f, d]


def fuse_weights(spec: ModelSpec, w: LayerWeights) -> FusedWeights:
    """Build the fused tensors once; the originals become views of them (no extra memory)."""
    dt = w.wq.dtype
    wqkv = torch.cat((w.wq, w.wk, w.wv))
    q, kv = w.wq.shape[0], w.wk.shape[0]
    w.wq, w.wk, w.wv = wqkv[:q], wqkv[q:q + kv], wqkv[q + kv:]
    bqkv = None
    if w.bq is not None:
        bqkv = torch.cat((w.bq, w.bk, w.bv))
    qk_norm = None
    if w.q_norm is not None:
        qk_norm = torch.cat((w.q_norm.expand(spec.n_heads, -1), w.k_norm.expand(spec.n_kv_heads, -1))).to(dt)
    gate_up = None
    if isinstance(w.gate_exps, torch.Tensor):
        f = spec.expert_ffn
        gate_up = torch.cat((w.gate_exps, w.up_exps), dim=1)
        w.gate_exps, w.up_exps = gate_up[:, :f], gate_up[:, f:]
    return FusedWeights(wqkv=wqkv, bqkv=bqkv, qk_norm=qk_norm, attn_norm=w.attn_norm.to(dt),
                        ffn_norm=w.ffn_norm.to(dt), router=None if w.router is None else w.router.to(dt),
                        gate_up_exps=gate_up)


class Layer:
    """One transformer block on one device."""

    weights_type = LayerWeights  # what `loading.load_layer_weights` fills from the kind's parts

    def __init__(self, spec: ModelSpec, index: int, weights: LayerWeights, rope: Rope,
                 cache: ExpertCache | None = None) -> None:
        self.spec, self.index, self.w, self.rope = spec, index, weights, rope
        self.cache = cache  # streamed experts (None: resident in self.w)
        self.prefetch_next: int | None = None  # the layer whose experts to fetch while this one computes
        self.use_grouped_mm: bool | None = None  # decided on first call
        self.fused: FusedWeights | None = None  # the GPU path's weights, built on its first call
        self.scratch: HostScratch | None = None  # the CPU stage's expansion buffer (None: fresh tensors)

    # ------------------------------------------------------------- the GPU path
    # Stage threads share one interpreter, so every kernel launch costs all stages: the GPU
    # path launches about a third fewer kernels per layer than the reference path below.
    # Its numerics follow HF's bf16 path (norms round before the weight, RoPE and the router
    # in bf16, softmax in fp32); the CPU keeps the fp32 reference path.
    def fast_ok(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and self.spec.rope_style == "neox")

    def pre_attention(self, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """attn norm, fused q/k/v, q/k norm and RoPE of a chunk: q [n, H, hd], k and v [n, KV, hd].

        Depends on the position only through the cos/sin tables, so `engine.models.graphs` can
        capture it once per chunk size."""
        s = self.spec
        if self.fused is None:
            self.fused = fuse_weights(s, self.w)
        fw = self.fused
        n, H, KV, hd = x.shape[0], s.n_heads, s.n_kv_heads, s.head_dim
        h = F.rms_norm(x, (s.hidden,), fw.attn_norm, s.rms_eps)
        qkv = F.linear(h, fw.wqkv, fw.bqkv)
        qk = qkv[:, : (H + KV) * hd].view(n, H + KV, hd)
        q, k = qk_norm_rope(qk, fw.qk_norm, cos, sin, s.rms_eps, H)  # one pass where Triton runs
        v = qkv[:, (H + KV) * hd:].view(n, KV, hd)
        return q, k, v

    def post_attention(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, FFN norm, experts (resident) or dense FFN, residual."""
        x = x + F.linear(o, self.w.wo)
        h = F.rms_norm(x, (self.spec.hidden,), self.fused.ffn_norm, self.spec.rms_eps)
        return x + self.ffn(h)

    def graphable(self, x: torch.Tensor) -> bool:
        """Whether this layer's GPU path holds no host synchronisation (streamed experts do)."""
        return self.fast_ok(x) and self.cache is None and (not self.spec.is_moe or bool(self.use_grouped_mm))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n: int, pos: int) -> torch.Tensor:
        """Causal attention of the chunk's queries over keys/values [0, pos+n): [n, H*hd], on
        the kernel chosen for this device (engine/kernels/attention.py)."""
        if isinstance(pos, DevicePos):  # a static-shape decode step: keys [0, span), masked past it
            return decode_attention(q, keys, values, pos.masked, pos.index)
        s = self.spec
        return chunk_attention(q, keys, values, pos, kernel_for(q.device, s.n_heads, s.n_kv_heads, s.head_dim, q.dtype))

    # ------------------------------------------------------------------ attention
    def attention(self, x: torch.Tensor, kv: LayerKV, pos: int) -> torch.Tensor:
        s, w = self.spec, self.w
        n = x.shape[0]
        h = rms_norm(x, w.attn_norm, s.rms_eps)
        q = F.linear(h, w.wq, w.bq).view(n, s.n_heads, s.head_dim)
        k = F.linear(h, w.wk, w.bk).view(n, s.n_kv_heads, s.head_dim)
        v = F.linear(h, w.wv, w.bv).view(n, s.n_kv_heads, s.head_dim)
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, s.rms_eps)
            k = rms_norm(k, w.k_norm, s.rms_eps)
        q = self.rope.apply(q, pos)
        k = self.rope.apply(k, pos)
        keys, values = kv.append(k, v, pos)
        return F.linear(self._attend(q, keys, values, n, pos), w.wo)

    # ------------------------------------------------------------------------ FFN
    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        """The FFN of the normed h: routed experts plus the shared expert where the spec has one,
        or the dense SwiGLU."""
        if not self.spec.is_moe:
            return self.dense(h)
        return self.moe(h) + self.shared_expert(h) if self.spec.shared_ffn else self.moe(h)

    def shared_expert(self, h: torch.Tensor) -> torch.Tensor:
        """The shared expert's SwiGLU, scaled per token by sigmoid(gate_inp_shexp . h) where gated."""
        w = self.w
        y = F.linear(F.silu(F.linear(h, w.gate_shexp)) * F.linear(h, w.up_shexp), w.down_shexp)
        return y if w.gate_inp_shexp is None else y * torch.sigmoid(F.linear(h, w.gate_inp_shexp))

    def moe(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 router scores -> top-k (engine/models/routing.py) -> SiLU-gated experts, weighted sum.

        Only experts that received tokens are computed.  Tokens are sorted by expert once; the
        per-(token, slot) outputs are put back in order and summed over slots, which keeps the
        result deterministic (no atomic adds)."""
        s, w = self.spec, self.w
        n, k = h.shape[0], s.n_experts_used
        fast = self.fused is not None
        # the GPU's softmax router in bf16 as HF runs qwen3moe's (scores in fp32); a sigmoid router
        # in fp32 as GLM-4.5's and llama.cpp's: its bias picks between close scores
        if fast and s.expert_gating == "softmax":
            logits = F.linear(h, self.fused.router)
        else:
            logits = F.linear(h.float(), w.router)
        top_w, top_i = routing.route(logits, s, w.router_bias)
        flat = top_i.reshape(-1)
        if self.use_grouped_mm is None:
            self.use_grouped_mm = _grouped_mm_ok(h)
        if self.cache is None and self.use_grouped_mm and routed_matvec.wanted(w, flat.numel(), h):
            return self._unsorted_matvec_experts(h, flat, top_w, fast)  # decode: from the stored blocks
        order = torch.argsort(flat, stable=True)
        token_of = order // k
        xs = h[token_of]
        # scatter-add, not bincount: bincount syncs the host with the GPU to size its output
        counts = torch.zeros(s.n_experts, dtype=torch.int64, device=h.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        if self.cache is not None:
            ys = self._streamed_experts(xs, counts)
        elif self.use_grouped_mm:
            if fast and self.fused.gate_up_exps is not None:  # float experts: no expansion to save
                offs = torch.cumsum(counts, 0, dtype=torch.int32)
                f = s.expert_ffn
                gu = torch._grouped_mm(xs, self.fused.gate_up_exps.transpose(-2, -1), offs=offs)
                a = moe_kernels.swiglu(gu, f)
                down = w.down_exps
            else:
                gate, up, down, offs = self._grouped_experts(flat, order, counts, n, h.dtype)
                g = torch._grouped_mm(xs, gate.transpose(-2, -1), offs=offs)
                u = torch._grouped_mm(xs, up.transpose(-2, -1), offs=offs)
                a = F.silu(g) * u
            ys = torch._grouped_mm(a, down.transpose(-2, -1), offs=offs)
        else:
            ys = self._reference_experts(xs, counts, h.dtype)
        # back to (token, slot) order by a gather through the inverse permutation: the same values
        # as a scatter (index_copy_) of ys, at a third of its GPU time (measured on H200)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        if fast:  # gather, weight and sum over slots in one pass where Triton runs (moe_kernels)
            return moe_kernels.combine(ys, inv, top_w)
        y = ys[inv]
        y = y.view(n, k, s.hidden).float() * top_w.unsqueeze(-1)
        return y.sum(1).to(h.dtype)

    def _unsorted_matvec_experts(self, h: torch.Tensor, flat: torch.Tensor, top_w: torch.Tensor,
                                 fast: bool) -> torch.Tensor:
        """Decode's routed experts from their stored blocks (routed_matvec), the rows left in
        (token, slot) order: each row's product is its own program's, the same bits wherever
        the row sits, so the sort, the gather by it, the counts and the inverse permutation the
        grouped GEMMs need (about ten kernels a layer, a decode step's time inside its graph) are
        not made; the sum over slots is the sorted path's, in the same order."""
        n, k, hidden = h.shape[0], self.spec.n_experts_used, self.spec.hidden
        xs = h.unsqueeze(1).expand(n, k, hidden).reshape(n * k, hidden)  # row t*k + j: token t
        ys = routed_matvec.experts(self.w, xs, flat)
        if fast:
            return moe_kernels.combine(ys, torch.arange(n * k, device=h.device), top_w)
        y = ys.view(n, k, hidden).float() * top_w.unsqueeze(-1)
        return y.sum(1).to(h.dtype)

    def _resident_experts(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's experts in `dtype`: stored ones expanded into a scratch now, on their
        device (no host synchronisation, so a CUDA graph can hold it)."""
        w = self.w
        if isinstance(w.gate_exps, QTensor):
            return w.gate_exps.dequantize(dtype), w.up_exps.dequantize(dtype), w.down_exps.dequantize(dtype)
        return w.gate_exps, w.up_exps, w.down_exps

    def _grouped_experts(self, flat: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, n: int,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate, up, down and the group offsets for the grouped GEMMs over rows sorted by expert.

        Few tokens (engine/models/routed_experts.py's rule on the bound min(n*k, E)): the routed
        experts gathered into a compact scratch, groups remapped to its slots.  Otherwise every
        expert, one group each.  Neither synchronises with the host (CUDA graphs hold both; the
        choice depends on the chunk size only)."""
        s, w = self.spec, self.w
        slots = routed_experts.slot_bound(n, s.n_experts_used, s.n_experts)
        if isinstance(w.gate_exps, QTensor) and routed_experts.compact_wanted(slots, s.n_experts, flat.device.type):
            cr = routed_experts.compact_routing(flat[order], slots, distinct=n == 1)
            return (w.gate_exps.gather(cr.experts, dtype), w.up_exps.gather(cr.experts, dtype),
                    w.down_exps.gather(cr.experts, dtype), cr.offsets)
        gate, up, down = self._resident_experts(dtype)
        return gate, up, down, torch.cumsum(counts, 0, dtype=torch.int32)

    def _reference_experts(self, xs: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Expert FFN one expert at a time over rows sorted by expert (CPU, or a GPU without
        grouped GEMMs).  Stored experts are expanded in batches that fit
        `routed_experts.REFERENCE_SCRATCH_BYTES`: only the experts the chunk routes to where
        they are few (`routed_experts.compact_wanted` on the distinct count), else every expert
        in consecutive slices.  Each expert's arithmetic is the same either way."""
        w = self.w
        counts_host = counts.tolist()
        starts = [0]
        for c in counts_host:
            starts.append(starts[-1] + c)
        used = [e for e, c in enumerate(counts_host) if c]
        ys = torch.empty_like(xs)

        def run(e: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
            seg = xs[starts[e]:starts[e + 1]]
            a = F.silu(F.linear(seg, gate)) * F.linear(seg, up)
            ys[starts[e]:starts[e + 1]] = F.linear(a, down)

        if not isinstance(w.gate_exps, QTensor):
            for e in used:
                run(e, w.gate_exps[e], w.up_exps[e], w.down_exps[e])
            return ys
        for batch, (gate, up, down) in self._expanded_batches(used, dtype, xs.device):
            for j, e in enumerate(batch):
                if counts_host[e]:
                    run(e, gate[j], up[j], down[j])
        return ys

    def _expanded_batches(self, used: list[int], dtype: torch.dtype,
                          device: torch.device) -> Iterator[tuple[list[int], tuple[torch.Tensor, ...]]]:
        """(experts, (gate, up, down) of them in `dtype`) for the stored experts `used`, expanded
        in batches within `routed_experts.REFERENCE_SCRATCH_BYTES`: only the used ones where they
        are few, else consecutive slices of every expert.  On the CPU, in a stage, each batch
        lands in the stage's `HostScratch` (valid until the next batch); a GPU's caching allocator
        already keeps the memory."""
        s, w = self.spec, self.w
        parts = (w.gate_exps, w.up_exps, w.down_exps)
        per_expert = 3 * s.expert_ffn * s.hidden * torch.empty((), dtype=dtype).element_size()
        compact = routed_experts.compact_wanted(len(used), s.n_experts, device.type)
        for batch in routed_experts.batches(used if compact else list(range(s.n_experts)), per_expert):
            outs = (self.scratch.carve([(len(batch), *t.shape[1:]) for t in parts], dtype)
                    if self.scratch is not None and device.type == "cpu" else (None, None, None))
            if compact:
                idx = torch.tensor(batch, dtype=torch.int64, device=device)
                yield batch, tuple(t.gather(idx, dtype, out=o) for t, o in zip(parts, outs))
            else:  # consecutive experts: a slice of the stored bytes, no gather
                yield batch, tuple(t.experts(batch[0], batch[-1] + 1).dequantize(dtype, out=o)
                                   for t, o in zip(parts, outs))

    def _streamed_experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert FFN with weights from the device's ExpertCache, in batches the cache can hold.

        Rows of xs are sorted by expert, so a batch of consecutive experts owns one contiguous
        range of rows.  The cache holds experts as stored; a batch is expanded into a scratch
        in the compute dtype right before its grouped GEMM.  Per-row arithmetic is the
        resident path's."""
        s, cache = self.spec, self.cache
        counts_host = counts.tolist()  # which experts a chunk touches decides what to stream
        starts = [0]
        for c in counts_host:
            starts.append(starts[-1] + c)
        needed = [e for e, c in enumerate(counts_host) if c]
        ys = torch.empty_like(xs)
        seq = cache.begin_layer()
        expanded = 3 * s.expert_ffn * s.hidden * xs.element_size()
        step = max(1, min(cache.n_slots, s.n_experts, EXPAND_SCRATCH_BYTES // expanded))
        # few rows: the stored-block products, as the resident path takes them (one digest)
        stored = self.use_grouped_mm and routed_matvec.cache_wanted(cache, self.index, xs.shape[0], xs)
        for b0 in range(0, len(needed), step):
            batch = needed[b0:b0 + step]
            slots = cache.ensure(self.index, batch, cache.chunk)
            if stored:  # each row's product on its own: the same bits whatever the batches
                lo, hi = starts[batch[0]], starts[batch[-1] + 1]
                row_slots = [slot for e, slot in zip(batch, slots) for _ in range(counts_host[e])]
                ys[lo:hi] = routed_matvec.cache_experts(cache, self.index, xs[lo:hi],
                                                        torch.tensor(row_slots).to(xs.device))
            elif self.use_grouped_mm:
                gate, up, down = cache.expand(self.index, slots, xs.dtype)
                lo, hi = starts[batch[0]], starts[batch[-1] + 1]
                offs = torch.tensor([starts[e + 1] - lo for e in batch], dtype=torch.int32).to(xs.device)
                seg = xs[lo:hi]
                g = torch._grouped_mm(seg, gate.transpose(-2, -1), offs=offs)
                u = torch._grouped_mm(seg, up.transpose(-2, -1), offs=offs)
                ys[lo:hi] = torch._grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs=offs)
            else:  # one expert at a time: the scratch stays one expert's size
                for e, slot in zip(batch, slots):
                    gate, up, down = cache.expand(self.index, [slot], xs.dtype)
                    seg = xs[starts[e]:starts[e + 1]]
                    a = F.silu(F.linear(seg, gate[0])) * F.linear(seg, up[0])
                    ys[starts[e]:starts[e + 1]] = F.linear(a, down[0])
        cache.end_layer(seq)
        # a big chunk touches most experts: fetch the next layer's while this one computes
        if (self.prefetch_next is not None and cache.n_slots >= 2 * s.n_experts
                and xs.shape[0] >= 2 * s.n_experts):
            cache.ensure(self.prefetch_next, range(s.n_experts), cache.chunk, prefetch=True)
        return ys

    def dense(self, h: torch.Tensor) -> torch.Tensor:
        w = self.w
        return F.linear(F.silu(F.linear(h, w.gate)) * F.linear(h, w.up), w.down)

    def forward(self, x: torch.Tensor, kv: LayerKV, pos: int) -> torch.Tensor:
        if self.fast_ok(x):
            cos, sin = self.rope.lowp_tables(pos, x.shape[0], x.dtype)
            q, k, v = self.pre_attention(x, cos, sin)
            keys, values = kv.append(k, v, pos)
            return self.post_attention(x, self._attend(q, keys, values, x.shape[0], pos))
        x = x + self.attention(x, kv, pos)
        h = rms_norm(x, self.w.ffn_norm, self.spec.rms_eps)
        return x + self.ffn(h)

    __call__ = forward


@dataclass
class Head:
    """Embedding (first stage) or final norm + LM head (last stage), on one device."""

    embed: torch.Tensor | None
    norm: torch.Tensor | None
    out: torch.Tensor | None
    eps: float

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.embed is not None
        return F.embedding(ids.to(self.embed.device), self.embed)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        assert self.norm is not None
        return rms_norm(x, self.norm, self.eps)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        assert self.out is not None
        return F.linear(normed, self.out).float()


def load_head(src: WeightSource, device: torch.device, dtype: torch.dtype,
              embed: bool, final: bool) -> Head:
    s = src.spec
    emb = dense_weight(src, "token_embd.weight", device, dtype) if (embed or (final and s.tied_embeddings)) else None
    norm = out = None
    if final:
        norm = dense_weight(src, "output_norm.weight", device, torch.float32)
        out = emb if s.tied_embeddings else dense_weight(src, "output.weight", device, dtype)
    return Head(embed=emb if embed else None, norm=norm, out=out, eps=s.rms_eps)
