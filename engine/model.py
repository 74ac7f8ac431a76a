"""The transformer in plain torch: one `Layer` per block, each callable on its own.

A layer takes a chunk of hidden states at a position, appends its keys/values to its own
`LayerKV` and returns the new hidden states, so layers can live on different devices.
Architectures: qwen3moe (MoE, q/k norm), qwen3 (dense, q/k norm), qwen2 (dense, qkv bias),
llama (dense, GGUF's permuted q/k handled by rotating adjacent pairs).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from . import moe_kernels
from .attention import chunk_attention, kernel_for
from .gguf_model import ModelSpec
from .qk_rope import qk_norm_rope
from .kv import LayerKV

if TYPE_CHECKING:
    from .experts import ExpertCache

log = logging.getLogger(__name__)


class WeightSource(Protocol):
    """Anything that yields a model's spec and its float32 tensors by GGUF name."""

    spec: ModelSpec

    def tensor(self, name: str) -> torch.Tensor: ...


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
    """Cos/sin tables for one device, grown on demand."""

    def __init__(self, head_dim: int, base: float, style: str, device: torch.device) -> None:
        self.head_dim, self.base, self.style, self.device = head_dim, base, style, device
        self.inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
        self.cos = torch.empty(0, head_dim // 2, device=device)
        self.sin = torch.empty(0, head_dim // 2, device=device)

    def _ensure(self, n: int) -> None:
        if n <= self.cos.shape[0]:
            return
        cap = max(n, 2 * self.cos.shape[0], 256)
        t = torch.arange(cap, dtype=torch.float64, device=self.device)
        ang = torch.outer(t, self.inv_freq)
        self.cos, self.sin = ang.cos().float(), ang.sin().float()

    def lowp_tables(self, pos: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions pos..pos+n-1 in `dtype`, shaped [n, 1, head_dim] (neox)."""
        self._ensure(pos + n)
        key = (dtype, self.cos.shape[0])
        if getattr(self, "_lowp_key", None) != key:
            self._cos_full = torch.cat((self.cos, self.cos), -1).to(dtype)[:, None, :]
            self._sin_full = torch.cat((self.sin, self.sin), -1).to(dtype)[:, None, :]
            self._lowp_key = key
        return self._cos_full[pos:pos + n], self._sin_full[pos:pos + n]

    def apply_lowp(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """RoPE in x's own dtype (bf16 on GPU), as HF applies it: x*cos + rotate_half(x)*sin."""
        cos, sin = self.lowp_tables(pos, x.shape[0], x.dtype)
        return rotate_lowp(x, cos, sin)

    def apply(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x: [n, heads, head_dim] at positions pos..pos+n-1."""
        n = x.shape[0]
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


def rotate_lowp(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox RoPE of x [n, heads, head_dim] with cos/sin tables [n, 1, head_dim]: five kernels,
    no position argument, so a CUDA graph can hold it with the tables as its inputs."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


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
    gate_exps: torch.Tensor | None = None  # [E, f, d]
    up_exps: torch.Tensor | None = None  # [E, f, d]
    down_exps: torch.Tensor | None = None  # [E, d, f]
    gate: torch.Tensor | None = None
    up: torch.Tensor | None = None
    down: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))


def load_layer_weights(src: WeightSource, i: int, device: torch.device, dtype: torch.dtype,
                       experts: bool = True) -> LayerWeights:
    """One block's weights on a device; experts=False leaves the MoE experts to an ExpertCache."""
    s = src.spec
    b = f"blk.{i}."

    def get(name: str, keep_fp32: bool = False) -> torch.Tensor:
        t = src.tensor(b + name)
        return t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype).contiguous()

    w = LayerWeights(
        attn_norm=get("attn_norm.weight", True),
        wq=get("attn_q.weight"), wk=get("attn_k.weight"), wv=get("attn_v.weight"),
        wo=get("attn_output.weight"), ffn_norm=get("ffn_norm.weight", True),
    )
    if s.qk_norm:
        w.q_norm, w.k_norm = get("attn_q_norm.weight", True), get("attn_k_norm.weight", True)
    if s.qkv_bias:
        w.bq, w.bk, w.bv = get("attn_q.bias"), get("attn_k.bias"), get("attn_v.bias")
    if s.is_moe:
        w.router = get("ffn_gate_inp.weight", True)
        if experts:
            w.gate_exps, w.up_exps = get("ffn_gate_exps.weight"), get("ffn_up_exps.weight")
            w.down_exps = get("ffn_down_exps.weight")
    else:
        w.gate, w.up, w.down = get("ffn_gate.weight"), get("ffn_up.weight"), get("ffn_down.weight")
    return w


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
    if w.gate_exps is not None:
        f = spec.expert_ffn
        gate_up = torch.cat((w.gate_exps, w.up_exps), dim=1)
        w.gate_exps, w.up_exps = gate_up[:, :f], gate_up[:, f:]
    return FusedWeights(wqkv=wqkv, bqkv=bqkv, qk_norm=qk_norm, attn_norm=w.attn_norm.to(dt),
                        ffn_norm=w.ffn_norm.to(dt), router=None if w.router is None else w.router.to(dt),
                        gate_up_exps=gate_up)


class Layer:
    """One transformer block on one device."""

    def __init__(self, spec: ModelSpec, index: int, weights: LayerWeights, rope: Rope,
                 cache: "ExpertCache | None" = None) -> None:
        self.spec, self.index, self.w, self.rope = spec, index, weights, rope
        self.cache = cache  # streamed experts (None: resident in self.w)
        self.prefetch_next: int | None = None  # the layer whose experts to fetch while this one computes
        self.use_grouped_mm: bool | None = None  # decided on first call
        self.fused: FusedWeights | None = None  # the GPU path's weights, built on its first call

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

        Depends on the position only through the cos/sin tables, so `engine.graphs` can
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
        return x + (self.moe(h) if self.spec.is_moe else self.dense(h))

    def graphable(self, x: torch.Tensor) -> bool:
        """Whether this layer's GPU path holds no host synchronisation (streamed experts do)."""
        return self.fast_ok(x) and self.cache is None and (not self.spec.is_moe or bool(self.use_grouped_mm))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n: int, pos: int) -> torch.Tensor:
        """Causal attention of the chunk's queries over keys/values [0, pos+n): [n, H*hd], on
        the kernel chosen for this device (engine/attention.py)."""
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
    def moe(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 softmax router -> top-k -> renormalise -> SiLU-gated experts, weighted sum.

        Only experts that received tokens are computed.  Tokens are sorted by expert once; the
        per-(token, slot) outputs are put back in order and summed over slots, which keeps the
        result deterministic (no atomic adds)."""
        s, w = self.spec, self.w
        n, k = h.shape[0], s.n_experts_used
        fast = self.fused is not None
        if fast:  # router in bf16 as HF runs it, softmax in fp32
            probs = torch.softmax(F.linear(h, self.fused.router), dim=-1, dtype=torch.float32)
        else:
            probs = torch.softmax(F.linear(h.float(), w.router), dim=-1)
        top_w, top_i = torch.topk(probs, k, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        flat = top_i.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // k
        xs = h[token_of]
        # scatter-add, not bincount: bincount syncs the host with the GPU to size its output
        counts = torch.zeros(s.n_experts, dtype=torch.int64, device=h.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        if self.use_grouped_mm is None:
            self.use_grouped_mm = _grouped_mm_ok(h)
        if self.cache is not None:
            ys = self._streamed_experts(xs, counts)
        elif self.use_grouped_mm:
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            if fast and self.fused.gate_up_exps is not None:
                f = s.expert_ffn
                gu = torch._grouped_mm(xs, self.fused.gate_up_exps.transpose(-2, -1), offs=offs)
                a = moe_kernels.swiglu(gu, f)
            else:
                g = torch._grouped_mm(xs, w.gate_exps.transpose(-2, -1), offs=offs)
                u = torch._grouped_mm(xs, w.up_exps.transpose(-2, -1), offs=offs)
                a = F.silu(g) * u
            ys = torch._grouped_mm(a, w.down_exps.transpose(-2, -1), offs=offs)
        else:
            ys = torch.empty_like(xs)
            start = 0
            for e, c in enumerate(counts.tolist()):
                if c == 0:
                    continue
                seg = xs[start:start + c]
                a = F.silu(F.linear(seg, w.gate_exps[e])) * F.linear(seg, w.up_exps[e])
                ys[start:start + c] = F.linear(a, w.down_exps[e])
                start += c
        # back to (token, slot) order by a gather through the inverse permutation: the same values
        # as a scatter (index_copy_) of ys, at a third of its GPU time (measured on H200)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        if fast:  # gather, weight and sum over slots in one pass where Triton runs (moe_kernels)
            return moe_kernels.combine(ys, inv, top_w)
        y = ys[inv]
        y = y.view(n, k, s.hidden).float() * top_w.unsqueeze(-1)
        return y.sum(1).to(h.dtype)

    def _streamed_experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert FFN with weights from the device's ExpertCache, in batches the cache can hold.

        Rows of xs are sorted by expert; each batch's rows are regrouped by cache slot so one
        grouped GEMM over the pool computes them.  Per-row arithmetic is the resident path's."""
        s, cache = self.spec, self.cache
        f, d = s.expert_ffn, s.hidden
        counts_host = counts.tolist()  # which experts a chunk touches decides what to stream
        starts = [0]
        for c in counts_host:
            starts.append(starts[-1] + c)
        needed = [e for e, c in enumerate(counts_host) if c]
        gate, up, down = cache.views(f, d)
        ys = torch.empty_like(xs)
        seq = cache.begin_layer()
        for b0 in range(0, len(needed), cache.n_slots):
            batch = needed[b0:b0 + cache.n_slots]
            slots = cache.ensure(self.index, batch, cache.chunk)
            if self.use_grouped_mm:
                by_slot = sorted(zip(slots, batch))
                rows = torch.cat([torch.arange(starts[e], starts[e + 1]) for _, e in by_slot]).to(xs.device)
                slot_counts = [0] * cache.n_slots
                for sl, e in by_slot:
                    slot_counts[sl] = counts_host[e]
                offs = torch.tensor(slot_counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(xs.device)
                seg = xs[rows]
                gate_up = cache.pool[:, : 2 * f * d].view(cache.n_slots, 2 * f, d)
                gu = torch._grouped_mm(seg, gate_up.transpose(-2, -1), offs=offs)
                out = torch._grouped_mm(moe_kernels.swiglu(gu, f), down.transpose(-2, -1), offs=offs)
                ys.index_copy_(0, rows, out)
            else:
                for e, sl in zip(batch, slots):
                    seg = xs[starts[e]:starts[e + 1]]
                    a = F.silu(F.linear(seg, gate[sl])) * F.linear(seg, up[sl])
                    ys[starts[e]:starts[e + 1]] = F.linear(a, down[sl])
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
        return x + (self.moe(h) if self.spec.is_moe else self.dense(h))

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
    emb = src.tensor("token_embd.weight").to(device=device, dtype=dtype) if (embed or (final and s.tied_embeddings)) else None
    norm = out = None
    if final:
        norm = src.tensor("output_norm.weight").to(device=device, dtype=torch.float32)
        out = emb if s.tied_embeddings else src.tensor("output.weight").to(device=device, dtype=dtype)
    return Head(embed=emb if embed else None, norm=norm, out=out, eps=s.rms_eps)
