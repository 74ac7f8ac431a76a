"""Attention of one decode token over a fixed span of the KV cache, masked past its position.

The static-shape decode step (engine/models/decode_pos.py) attends over the first `span` cached
keys whatever the token's position, the keys past it masked, so the kernels' shapes and
addresses do not change from token to token and a CUDA graph can hold them.

Grouped-query attention without expanding K/V: the token's H query heads are viewed as
[KV, H/KV, hd], one group per key/value head, and both products are batched GEMMs over the KV
heads reading the cache in place (its [span, KV, hd] rows, strided): scores in the compute
dtype with fp32 accumulation, scale, mask and softmax in fp32, the weighted sum in the compute
dtype.  Six kernels a layer, no copy of the cache.
"""
from __future__ import annotations

import torch


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     masked: torch.Tensor) -> torch.Tensor:
    """q [1, H, hd] of one token; keys/values [S, KV, hd]; masked [S] bool (True: not attended):
    output [1, H*hd]."""
    _, H, hd = q.shape
    KV = keys.shape[1]
    if H % KV:
        raise ValueError(f"{H} query heads are not a multiple of {KV} key/value heads")
    qg = q.reshape(KV, H // KV, hd)
    scores = torch.matmul(qg, keys.permute(1, 2, 0))  # [KV, G, S]
    scores = scores.float().mul_(hd ** -0.5).masked_fill_(masked, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(values.dtype)
    o = torch.matmul(p, values.transpose(0, 1))  # [KV, G, hd]
    return o.reshape(1, H * hd)
