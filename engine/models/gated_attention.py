"""Gated full attention (Qwen3-Next, Qwen3.5-MoE): `layers.Layer` whose q projection also gives
each head an output gate.

`attn_q` rows are, per head, its query then its gate ([q_h; g_h], head_dim each: transformers'
view(n, H, 2 * head_dim).chunk(2), which llama.cpp's converter keeps); q and k are RMS-normed per
head, RoPE turns the spec's rotary part, and the attention output is multiplied by
sigmoid(gate) before `attn_output`.  Runs the reference path on every device (no fused q/k/v,
no CUDA graph: `fast_ok` is False); the KV it keeps is `kv.LayerKV`, as any attention layer's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.kv import LayerKV
from engine.models.layers import Layer, rms_norm


class GatedAttentionLayer(Layer):
    def fast_ok(self, x: torch.Tensor) -> bool:
        return False

    def attention(self, x: torch.Tensor, kv: LayerKV, pos: int) -> torch.Tensor:
        s, w = self.spec, self.w
        n, hd = x.shape[0], s.head_dim
        h = rms_norm(x, w.attn_norm, s.rms_eps)
        qg = F.linear(h, w.wq).view(n, s.n_heads, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:]
        k = F.linear(h, w.wk).view(n, s.n_kv_heads, hd)
        v = F.linear(h, w.wv).view(n, s.n_kv_heads, hd)
        q = self.rope.apply(rms_norm(q, w.q_norm, s.rms_eps), pos)
        k = self.rope.apply(rms_norm(k, w.k_norm, s.rms_eps), pos)
        keys, values = kv.append(k, v, pos)
        o = self._attend(q.contiguous(), keys, values, n, pos)
        return F.linear(o * torch.sigmoid(gate.reshape(n, s.n_heads * hd)), w.wo)
