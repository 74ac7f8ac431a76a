"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2; llama.cpp `deepseek2`): the layer class,
its weights and the latent cache it carries between chunks.

Per token: q from the q LoRA (`attn_q_a`, RMSNorm `attn_q_a_norm`, `attn_q_b`) or a plain
`attn_q`, [heads x (nope + rope)]; the compressed KV `attn_kv_a_mqa` -> a latent of
`kv_lora_rank` (RMSNorm `attn_kv_a_norm`) and one RoPE key of `rope` dims shared by every head.
The cache (`LatentCache`) keeps exactly that: the normed latent and the turned RoPE key of each
token — (kv_lora_rank + rope) values a token instead of heads x (k + v) head dims.  A chunk
expands the cached latents of [0, pos+n) into per-head keys (k_nope from `attn_k_b`, then the
shared RoPE key) and values (`attn_v_b`), then runs causal attention over them; v heads may be
narrower than q/k heads (padded with zeros to the q/k width for the attention call, sliced after).
A decode step or a short chunk attends in the latent space instead (`absorbed_wanted`: q_nope
through k_b onto the latent, the mix of latents through v_b), making no per-head k/v.
Files from older converters hold the unsplit `attn_kv_b` ([heads x (nope + v), kv_lora_rank]);
newer ones the split `attn_k_b` / `attn_v_b`, joined into that matrix when the layer is built, so
the expansion is one GEMM over the latents either way.

RoPE turns the rope part only, pairing adjacent dims (llama.cpp's NORM mode; transformers'
`rope_interleave` de-interleaves first, the same dot products).  The softmax scale is
(nope + rope)^-0.5 times mscale^2 (DeepSeek's YaRN attention factor, `spec.kq_factor`).

This layer runs one path on every device (device-agnostic torch; no fused q/k/v, no CUDA graph:
`graphable` is False); its FFN (dense lead layer, or routed experts plus the shared ones) is
`layers.Layer`'s."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.kv import LayerState, copy_state
from engine.models.layers import Layer, LayerWeights, rms_norm


@dataclass
class MLAWeights(LayerWeights):
    # (full attention's q/k/v are not in an MLA layer: defaults, left None)
    wq: torch.Tensor | None = None  # the plain q projection of files without a q LoRA [H*(nope+rope), d]
    wk: torch.Tensor | None = None
    wv: torch.Tensor | None = None
    wo: torch.Tensor | None = None  # [d, H*v]
    ffn_norm: torch.Tensor | None = None
    q_a: torch.Tensor | None = None  # [q_lora_rank, d]
    q_a_norm: torch.Tensor | None = None  # [q_lora_rank]
    q_b: torch.Tensor | None = None  # [H*(nope+rope), q_lora_rank]
    kv_a: torch.Tensor | None = None  # [kv_lora_rank + rope, d]
    kv_a_norm: torch.Tensor | None = None  # [kv_lora_rank]
    k_b: torch.Tensor | None = None  # [H, kv_lora_rank, nope]: latent -> k_nope (the converter's transposed split)
    v_b: torch.Tensor | None = None  # [H, v, kv_lora_rank]: latent -> v
    # older files' unsplit [H*(nope+v), kv_lora_rank] (per head nope rows of k, then v's); for
    # newer ones made from k_b and v_b when the layer is built (they are dropped): the expansion
    kv_b: torch.Tensor | None = None


class LatentCache:
    """One MLA layer's cache for one sequence: the normed KV latent [capacity, kv_lora_rank] and
    the turned RoPE key [capacity, rope] of every token so far."""

    def __init__(self, capacity: int, rank: int, rope: int, device: torch.device, dtype: torch.dtype) -> None:
        self.capacity = capacity
        self.latent = torch.empty(capacity, rank, device=device, dtype=dtype)
        self.rope_key = torch.empty(capacity, rope, device=device, dtype=dtype)
        self.length = 0

    @staticmethod
    def bytes_for(tokens: int, rank: int, rope: int, dtype: torch.dtype) -> int:
        return tokens * (rank + rope) * torch.empty((), dtype=dtype).element_size()

    # the two tensors under the names the chunk-cost probe fills with noise (engine/plan/chunk_cost.py)
    @property
    def k(self) -> torch.Tensor:
        return self.latent

    @property
    def v(self) -> torch.Tensor:
        return self.rope_key

    @property
    def nbytes(self) -> int:
        return self.latent.numel() * self.latent.element_size() + self.rope_key.numel() * self.rope_key.element_size()

    def reset(self) -> None:
        self.length = 0

    def append(self, latent: torch.Tensor, rope_key: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store tokens [pos, pos+n) and return views of [0, pos+n)."""
        n = latent.shape[0]
        if pos != self.length:
            raise RuntimeError(f"latent KV append at position {pos}, but the cache holds {self.length} tokens")
        if pos + n > self.capacity:
            raise RuntimeError(f"latent KV cache full: {pos + n} tokens exceed its capacity of {self.capacity}")
        self.latent[pos:pos + n] = latent
        self.rope_key[pos:pos + n] = rope_key
        self.length = pos + n
        return self.latent[: pos + n], self.rope_key[: pos + n]

    def handoff_length(self) -> int:
        return self.length

    def handoff_views(self, length: int) -> list[torch.Tensor]:
        """The latents and RoPE keys of tokens [0, length): all that travels to another device."""
        if length > self.capacity:
            raise RuntimeError(f"latent KV copy of {length} tokens into a cache of capacity {self.capacity}")
        return [self.latent[:length], self.rope_key[:length]]

    def adopt(self, length: int) -> None:
        self.length = length

    def copy_from(self, other: LayerState) -> int:
        return copy_state(self, other)


def absorbed_wanted(s: Any, n: int) -> bool:
    """Whether a chunk of n queries attends in the latent space (fewer multiply-adds a cached
    token: n x heads x (2 kv_lora_rank + rope), against expanding the token's k and v, heads x
    kv_lora_rank x (nope + v), plus n x heads x (q/k + v) for the attention itself): decode steps
    and short chunks."""
    r = s.kv_lora_rank
    return n * (2 * r + s.rope_dim) < r * (s.qk_nope_dim + s.v_head_dim) + n * (s.head_dim + s.v_head_dim)


class MLALayer(Layer):
    """A DeepSeek-V2/V3 block: multi-head latent attention, then the layer's FFN (a dense SwiGLU
    in the leading dense layers, routed experts plus the shared ones in the rest)."""

    weights_type = MLAWeights

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        s, w = self.spec, self.w
        if w.kv_b is None:  # the split halves back into one expansion matrix: per head nope rows of k, then v's
            w.kv_b = torch.cat((w.k_b.transpose(1, 2), w.v_b), dim=1).reshape(-1, s.kv_lora_rank).contiguous()
            w.k_b = w.v_b = None

    def graphable(self, x: torch.Tensor) -> bool:
        return False  # the CUDA graphs capture full attention's pre/post halves, not this layer

    def _query(self, h: torch.Tensor) -> torch.Tensor:
        s, w = self.spec, self.w
        if w.q_a is not None:
            q = F.linear(rms_norm(F.linear(h, w.q_a), w.q_a_norm, s.rms_eps), w.q_b)
        else:
            q = F.linear(h, w.wq)
        return q.view(h.shape[0], s.n_heads, s.head_dim)

    def attention(self, x: torch.Tensor, cache: LatentCache, pos: int) -> torch.Tensor:
        s, w = self.spec, self.w
        n, H, nope, dv = x.shape[0], s.n_heads, s.qk_nope_dim, s.v_head_dim
        h = rms_norm(x, w.attn_norm, s.rms_eps)
        q = self._query(h)
        q_nope, q_pe = q[..., :nope], self.rope.apply(q[..., nope:], pos)
        kv = F.linear(h, w.kv_a)
        latent = rms_norm(kv[:, : s.kv_lora_rank], w.kv_a_norm, s.rms_eps)
        k_pe = self.rope.apply(kv[:, s.kv_lora_rank:].unsqueeze(1), pos)[:, 0]
        lat, kpe = cache.append(latent, k_pe, pos)
        if absorbed_wanted(s, n):
            o = self._absorbed(q_nope, q_pe, lat, kpe, pos)
        else:
            o = self._expanded(q_nope, q_pe, lat, kpe, pos)
        return F.linear(o.reshape(n, H * dv), w.wo)

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor, kpe: torch.Tensor,
                  pos: int) -> torch.Tensor:
        """Per-head keys and values of [0, pos+n) from the latents, then causal attention: [n, H, v]."""
        s, w = self.spec, self.w
        n, L, H, nope, dv = q_nope.shape[0], lat.shape[0], s.n_heads, s.qk_nope_dim, s.v_head_dim
        # one GEMM over the cached latents (row by row the same whatever the chunk: digests agree)
        kv_heads = F.linear(lat, w.kv_b).view(L, H, nope + dv)
        keys = torch.cat((kv_heads[..., :nope], kpe.unsqueeze(1).expand(L, H, s.rope_dim)), dim=-1)
        values = kv_heads[..., nope:]
        if dv < s.head_dim:  # one attention call on every kernel: v padded to the q/k width
            values = F.pad(values, (0, s.head_dim - dv))
        query = torch.cat((q_nope, q_pe), dim=-1)
        if s.kq_factor != 1.0:  # the softmax scale's factor beyond (nope + rope)^-0.5
            query = query * s.kq_factor
        return self._attend(query, keys, values, n, pos).view(n, H, s.head_dim)[..., :dv]

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor, kpe: torch.Tensor,
                  pos: int) -> torch.Tensor:
        """The same attention in the latent space (DeepSeek's absorbed form, llama.cpp's MLA graph):
        q_nope taken through each head's k half of kv_b onto the latent, scores against the
        latents plus the RoPE part's, the softmax's mix of latents through the v half: [n, H, v].
        No per-head keys or values of the prefix are made — a decode step's cost."""
        s, w = self.spec, self.w
        n, L, H, nope = q_nope.shape[0], lat.shape[0], s.n_heads, s.qk_nope_dim
        kv_b = w.kv_b.view(H, nope + s.v_head_dim, s.kv_lora_rank)
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope, kv_b[:, :nope])
        scores = torch.einsum("nhr,lr->nhl", q_lat, lat) + torch.einsum("nhe,le->nhl", q_pe, kpe)
        scores = scores.float() * (s.kq_factor / s.head_dim ** 0.5)
        if n > 1:  # causal within the chunk: query i sees keys up to pos + i
            later = torch.arange(L, device=lat.device) > (pos + torch.arange(n, device=lat.device)).unsqueeze(1)
            scores = scores.masked_fill(later.unsqueeze(1), float("-inf"))
        p = torch.softmax(scores, dim=-1).to(lat.dtype)
        return torch.einsum("nhr,hdr->nhd", torch.einsum("nhl,lr->nhr", p, lat), kv_b[:, nope:])

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        """The leading dense layers' SwiGLU, else routed experts plus the shared ones."""
        return self.dense(h) if self.index < self.spec.dense_lead else super().ffn(h)

    def forward(self, x: torch.Tensor, cache: LatentCache, pos: int) -> torch.Tensor:
        x = x + self.attention(x, cache, pos)
        return x + self.ffn(rms_norm(x, self.w.ffn_norm, self.spec.rms_eps))

    __call__ = forward
