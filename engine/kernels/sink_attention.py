"""Causal attention with per-head sinks and an optional sliding window (gpt-oss), in plain torch.

A sink is one learned logit per query head that joins every query's softmax as an extra
column with no value: it takes a share of the probability mass and returns nothing, so

    o = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink_h))

(transformers' `eager_attention_forward` of GptOss, llama.cpp's `ggml_soft_max_add_sinks`).
A sliding window of w tokens lets the query at position p see keys (p - w, p] (its own
included: llama.cpp's LLAMA_SWA_TYPE_STANDARD, transformers' sliding-window mask).

One path for every device: the chunk's queries in blocks whose fp32 score tensor fits
`SCORE_BYTES`, each against only the keys its window can reach (a sliding layer's block costs
O(block * (block + w)) whatever the prefix), scores and products in the input's dtype as
transformers' eager path computes them, the softmax in fp32.  Grouped-query heads are batched
per KV head (no repeated K/V).  No flash kernel takes sinks and a window today; on CUDA this is
a materialised-score path (docs/architecture.md names what its GPU check covers).
"""
from __future__ import annotations

import torch

SCORE_BYTES = 64 << 20  # fp32 scores of one query block (bounded scratch on any device)


def _block_rows(n_heads: int, keys_per_row: int, n: int) -> int:
    """Queries per block so that a block's fp32 scores stay within SCORE_BYTES."""
    return max(1, min(n, SCORE_BYTES // max(1, 4 * n_heads * keys_per_row)))


def sink_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, sinks: torch.Tensor,
                   window: int | None = None) -> torch.Tensor:
    """q [n, H, hd] of tokens [pos, pos+n); keys/values [L, KV, hd] of tokens [pos+n-L, pos+n):
    every token so far, or (a sliding layer's cache) at least the window of the chunk's first
    query; sinks [H]; window: keys a query sees, its own included (None: all earlier ones).
    Returns [n, H*hd] in q's dtype."""
    n, H, hd = q.shape
    total, KV = keys.shape[0], keys.shape[1]
    first = pos + n - total  # the position of keys[0]
    need = 0 if window is None else max(0, pos - window + 1)
    if first < 0 or first > need:
        raise ValueError(f"attention of a chunk of {n} at position {pos} over keys from position {first}: "
                         f"it needs every key from position {need}")
    rep = H // KV
    scale = hd ** -0.5
    out = torch.empty(n, H, hd, device=q.device, dtype=q.dtype)
    sink = sinks.float().view(KV, 1, rep, 1)  # head h = kv * rep + r (transformers' repeat_kv order)
    reach = total if window is None else min(total, window + n - 1)
    step = _block_rows(H, reach, n)
    for a in range(0, n, step):
        b = min(n, a + step)
        lo = first if window is None else max(first, pos + a - window + 1)
        hi = pos + b
        k = keys[lo - first:hi - first].permute(1, 2, 0)  # [KV, hd, L]
        v = values[lo - first:hi - first].transpose(0, 1)  # [KV, L, hd]
        qb = q[a:b].view(b - a, KV, rep, hd).permute(1, 0, 2, 3).reshape(KV, (b - a) * rep, hd)
        s = torch.bmm(qb, k).float().mul_(scale).view(KV, b - a, rep, hi - lo)
        qpos = torch.arange(pos + a, pos + b, device=q.device).view(-1, 1)
        kpos = torch.arange(lo, hi, device=q.device).view(1, -1)
        hidden = kpos > qpos
        if window is not None:
            hidden |= qpos - kpos >= window
        s.masked_fill_(hidden.view(1, b - a, 1, hi - lo), float("-inf"))
        p = torch.softmax(torch.cat((s, sink.expand(KV, b - a, rep, 1)), dim=-1), dim=-1)[..., :-1]
        o = torch.bmm(p.to(v.dtype).reshape(KV, (b - a) * rep, hi - lo), v)  # [KV, rows*rep, hd]
        out[a:b] = o.view(KV, b - a, rep, hd).permute(1, 0, 2, 3).reshape(b - a, H, hd)
    return out.reshape(n, H * hd)
