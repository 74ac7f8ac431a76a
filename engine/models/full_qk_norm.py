"""A full-attention layer whose q/k RMSNorm spans the whole projection (MiniMax-M2): one norm
over all query heads' [heads x head_dim] values of a token, one over all key heads', each with
its own weight of that width, before the heads are split and turned by RoPE.  Everything else
is `layers.Layer`'s (routed experts, the KV cache, attention, the GPU path's fused q/k/v and
RoPE, CUDA graphs: `pre_attention` stays free of host synchronisation)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.qk_rope import qk_norm_rope
from engine.models.kv import LayerKV
from engine.models.layers import Layer, LayerWeights, fuse_weights, rms_norm


@dataclass
class FullQKNormWeights(LayerWeights):
    q_norm_full: torch.Tensor | None = None  # [heads * head_dim]
    k_norm_full: torch.Tensor | None = None  # [kv heads * head_dim]


class FullQKNormLayer(Layer):
    weights_type = FullQKNormWeights

    def attention(self, x: torch.Tensor, kv: LayerKV, pos: int) -> torch.Tensor:
        s, w = self.spec, self.w
        n = x.shape[0]
        h = rms_norm(x, w.attn_norm, s.rms_eps)
        q = rms_norm(F.linear(h, w.wq), w.q_norm_full, s.rms_eps).view(n, s.n_heads, s.head_dim)
        k = rms_norm(F.linear(h, w.wk), w.k_norm_full, s.rms_eps).view(n, s.n_kv_heads, s.head_dim)
        v = F.linear(h, w.wv).view(n, s.n_kv_heads, s.head_dim)
        q, k = self.rope.apply(q, pos), self.rope.apply(k, pos)
        keys, values = kv.append(k, v, pos)
        return F.linear(self._attend(q, keys, values, n, pos), w.wo)

    def pre_attention(self, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The GPU path: fused q/k/v, the two wide norms (in the compute dtype, as the per-head
        norm of `Layer.pre_attention`), then RoPE alone through `qk_norm_rope` (Triton where it
        runs)."""
        s = self.spec
        if self.fused is None:
            self.fused = fuse_weights(s, self.w)
            self._norms = (self.w.q_norm_full.to(x.dtype), self.w.k_norm_full.to(x.dtype))
        fw = self.fused
        n, H, KV, hd = x.shape[0], s.n_heads, s.n_kv_heads, s.head_dim
        h = F.rms_norm(x, (s.hidden,), fw.attn_norm, s.rms_eps)
        qkv = F.linear(h, fw.wqkv)
        q = F.rms_norm(qkv[:, : H * hd], (H * hd,), self._norms[0], s.rms_eps)
        k = F.rms_norm(qkv[:, H * hd:(H + KV) * hd], (KV * hd,), self._norms[1], s.rms_eps)
        q, k = qk_norm_rope(torch.cat((q, k), dim=-1).view(n, H + KV, hd), None, cos, sin, s.rms_eps, H)
        v = qkv[:, (H + KV) * hd:].view(n, KV, hd)
        return q, k, v
