"""Causal attention with per-head sinks and an optional sliding window (gpt-oss), in plain torch.

A sink is one learned logit per query head that joins every query's softmax as an extra
column with no value: it takes a share of the probability mass and returns nothing, so

    o = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink_h))

(transformers' `eager_attention_forward` of GptOss, llama.cpp's `ggml_soft_max_add_sinks`).
A sliding window of w tokens lets the query at position p see keys (p - w, p] (its own
included: llama.cpp's LLAMA_SWA_TYPE_STANDARD, transformers' sliding-window mask).

The reference path, every device: the chunk's queries in blocks whose fp32 score tensor fits
`SCORE_BYTES`, each against only the keys its window can reach, scores and products in the
input's dtype as transformers' eager path computes them, the softmax in fp32.  Grouped-query
heads are batched per KV head (no repeated K/V).

A sliding layer's chunk of at least a window's queries takes the same arithmetic batched over
query blocks of w tokens: block j's queries can reach only the 2w keys of blocks j-1 and j, so
the blocks become one batch of [w x 2w] score tiles under one fixed mask (an unfolded view of
the keys, zero-padded where the cache holds no key any query sees, and before position 0,
hidden), cut into
groups whose scores fit `SLIDING_SCORE_BYTES`.  A handful of kernels a group, whatever the
chunk's length: the row-block loop above needs one batch of kernels per block, and its blocks
shrink as the chunk grows (an 8192-token chunk at gpt-oss-20b's shapes took 264 of them).

On CUDA a full (not sliding) layer's chunk takes the cuDNN split of `engine.kernels.attention`
where that device chose it: the prefix block and the causal diagonal each return their
log-sum-exp, and the sink joins the merge as a third block with no value,

    o = (e^lse_pre o_pre + e^lse_diag o_diag) / (e^lse_pre + e^lse_diag + e^sink)

(fp32, from the maximum of the three).  A sliding layer's chunk at position 0 or at least a
window in takes cuDNN too (`_sliding_split`): its query blocks of w tokens as one batch against
their own block (causal) and, reversed, against the previous block's later keys (causal between
w-1 reversed queries and w-1 reversed keys), merged with the sink the same way; a chunk that
starts inside the first window keeps the blocked torch path.  Each is decided once per shape,
window and device by a self-check against the reference path (sinks of size 2, a chunk behind
a prefix and one at position 0); a failure or an answer off by more than bf16's tolerance keeps
the torch path, logged.
"""
from __future__ import annotations

import logging
import threading

import torch

from engine.kernels import attention

log = logging.getLogger(__name__)

SCORE_BYTES = 64 << 20  # fp32 scores of one query block (bounded scratch on any device)
SLIDING_SCORE_BYTES = 4 * SCORE_BYTES  # fp32 score tiles of one group of sliding query blocks


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
    if window is None and n > 1 and q.is_cuda and _split_ok(q.device, H, KV, hd, q.dtype):
        return _split(q, keys, values, pos, sinks)
    if window is not None and n >= window:
        if q.is_cuda and (pos == 0 or pos >= window) and _split_ok(q.device, H, KV, hd, q.dtype, window):
            return _sliding_split(q, keys, values, pos, sinks, window, first)
        return _sliding(q, keys, values, pos, sinks, window, first)
    return _reference(q, keys, values, pos, sinks, window, first)


def _sliding(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, sinks: torch.Tensor,
             window: int, first: int) -> torch.Tensor:
    """A sliding layer's chunk as a batch of query blocks of `window` tokens, each against the
    2 * window keys of its own and the previous block (the module docstring)."""
    n, H, hd = q.shape
    KV, w = keys.shape[1], window
    rep = H // KV
    nb = -(-n // w)
    base = pos - w  # the position of the padded keys' first row
    kept = max(base + 1, first)  # the row at `base` is in no query's window: never copied (a NaN there
    # would reach the output as 0 * NaN, where the reference path never reads it)
    kpad = keys.new_zeros((nb + 1) * w, KV, hd)
    vpad = values.new_zeros((nb + 1) * w, KV, hd)
    kpad[kept - base:pos + n - base] = keys[kept - first:]
    vpad[kept - base:pos + n - base] = values[kept - first:]
    qpad = q if nb * w == n else torch.cat((q, q.new_zeros(nb * w - n, H, hd)))
    kb = kpad.unfold(0, 2 * w, w)  # [nb, KV, hd, 2w]: block j's keys, positions base + j*w + t
    vb = vpad.unfold(0, 2 * w, w).transpose(-1, -2)  # [nb, KV, 2w, hd]
    qb = qpad.view(nb, w, KV, rep, hd).permute(0, 2, 1, 3, 4).reshape(nb, KV, w * rep, hd)
    i = torch.arange(w, device=q.device).view(w, 1)  # a query's offset in its block
    t = torch.arange(2 * w, device=q.device).view(1, 2 * w)  # a key's offset in the block's keys
    hidden = ((t > i + w) | (t <= i)).view(1, 1, w, 1, 2 * w)  # key t at i + w - t tokens back: seen in [0, w)
    sink = sinks.float().view(1, KV, 1, rep, 1)
    out = torch.empty(nb, w, KV, rep, hd, device=q.device, dtype=q.dtype)
    step = max(1, SLIDING_SCORE_BYTES // (4 * H * w * 2 * w))
    for a in range(0, nb, step):
        b = min(nb, a + step)
        s = torch.matmul(qb[a:b], kb[a:b]).float().mul_(hd ** -0.5).view(b - a, KV, w, rep, 2 * w)
        s.masked_fill_(hidden, float("-inf"))
        if a == 0 and base < 0:  # a chunk at the start: block 0's padded rows stand for no token
            s[0, ..., :-base] = float("-inf")
        p = torch.softmax(torch.cat((s, sink.expand(b - a, KV, w, rep, 1)), dim=-1), dim=-1)[..., :-1]
        o = torch.matmul(p.to(vb.dtype).reshape(b - a, KV, w * rep, 2 * w), vb[a:b])  # [g, KV, w*rep, hd]
        out[a:b] = o.view(b - a, KV, w, rep, hd).permute(0, 2, 1, 3, 4)
    return out.view(nb * w, H * hd)[:n]


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, sinks: torch.Tensor,
               window: int | None, first: int) -> torch.Tensor:
    n, H, hd = q.shape
    total, KV = keys.shape[0], keys.shape[1]
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


def describe(device: torch.device, H: int, KV: int, hd: int, dtype: torch.dtype, window: int | None) -> str:
    """The run report's line for a model of this attention on `device`."""
    ref = f"torch with sinks{f', window {window} on sliding layers' if window else ''}"
    if device.type == "cuda" and _split_ok(device, H, KV, hd, dtype):
        if window and _split_ok(device, H, KV, hd, dtype, window):
            return (f"cuDNN prefix+diagonal split with the sink merged (full layers' chunks), cuDNN block split "
                    f"with the sink merged (sliding layers' chunks, window {window}); torch with sinks (the rest)")
        return f"cuDNN prefix+diagonal split with the sink merged (full layers' chunks); {ref} (the rest)"
    return ref


_SPLIT_OK: dict[tuple, bool] = {}
_LOCK = threading.Lock()


def _split_ok(device: torch.device, H: int, KV: int, hd: int, dtype: torch.dtype, window: int | None = None) -> bool:
    """Whether full layers (window None) or sliding layers of `window` of this shape take the cuDNN
    split on this device (decided once each)."""
    key = (str(device), H, KV, hd, dtype, window)
    ok = _SPLIT_OK.get(key)
    if ok is None:
        with _LOCK:
            ok = _SPLIT_OK.get(key)
            if ok is None:
                ok = _SPLIT_OK[key] = _check_split(device, H, KV, hd, dtype, window)
    return ok


def _check_split(device: torch.device, H: int, KV: int, hd: int, dtype: torch.dtype, window: int | None) -> bool:
    if attention.kernel_for(device, H, KV, hd, dtype).name != attention.CUDNN_SPLIT:
        return False
    gen = torch.Generator(device="cpu").manual_seed(0)
    w = window or 0
    n, pos = (64, 192) if window is None else (3 * w + w // 2, 2 * w)  # sliding: a ragged last block
    q = torch.randn(n, H, hd, generator=gen).to(device, dtype)
    k = torch.randn(pos + n, KV, hd, generator=gen).to(device, dtype)
    v = torch.randn(pos + n, KV, hd, generator=gen).to(device, dtype)
    sinks = (2 * torch.randn(H, generator=gen)).to(device)
    what = "cuDNN split + sink merge" if window is None else f"cuDNN block split + sink merge (window {window})"
    try:
        err = 0.0
        for p in (pos, 0):
            if window is None:
                got = _split(q, k[:p + n], v[:p + n], p, sinks)
            else:
                got = _sliding_split(q, k[:p + n], v[:p + n], p, sinks, window, 0)
            want = _reference(q, k[:p + n], v[:p + n], p, sinks, window, 0)
            err = max(err, float((got.float() - want.float()).abs().max()))
    except Exception as exc:  # a build or GPU where the split fails: the reference path
        log.info("attention with sinks on %s: the torch path (the %s failed: %s: %s)", device, what,
                 type(exc).__name__, str(exc).splitlines()[0][:120] if str(exc) else "")
        return False
    ok = err < 2e-2
    log.info("attention with sinks on %s (%d/%d heads of %d): %s (max error %.3g against the reference)", device, H,
             KV, hd, what if ok else "the torch path", err)
    return ok


def _split(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, sinks: torch.Tensor) -> torch.Tensor:
    """A full layer's chunk over every earlier key: cuDNN's prefix and diagonal blocks, merged
    with the sink through their log-sum-exps (fp32)."""
    n, H, hd = q.shape
    kern = attention.kernel_for(q.device, H, keys.shape[1], hd, q.dtype)
    qt = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, H, n, hd]
    kt = keys.transpose(0, 1).unsqueeze(0)  # [1, KV, L, hd]
    vt = values.transpose(0, 1).unsqueeze(0)
    if not kern.native_gqa and kt.shape[1] != H:
        kt, vt = kt.repeat_interleave(H // kt.shape[1], dim=1), vt.repeat_interleave(H // vt.shape[1], dim=1)
    blocks = [attention._cudnn(qt, kt[:, :, pos:].contiguous(), vt[:, :, pos:].contiguous(), causal=True)]
    if pos:
        blocks.append(attention._cudnn(qt, kt[:, :, :pos].contiguous(), vt[:, :, :pos].contiguous(), causal=False))
    sink = sinks.float().view(1, H, 1).expand(1, H, n)
    top = torch.stack([lse for _, lse in blocks] + [sink]).amax(0)
    weights = [torch.exp(lse - top) for _, lse in blocks]
    total = sum(weights) + torch.exp(sink - top)
    o = sum(b.float() * (w / total).unsqueeze(-1) for (b, _), w in zip(blocks, weights))
    return o.to(q.dtype).squeeze(0).transpose(0, 1).reshape(n, H * hd)


def _sliding_split(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, sinks: torch.Tensor,
                   window: int, first: int) -> torch.Tensor:
    """A sliding layer's chunk (pos 0, or at least a window in) on cuDNN, batched over query
    blocks of w = `window` tokens.  Query i of block j sees key t of the 2w keys of blocks j-1 and
    j where i < t <= i + w (the module docstring): its own block causally (one cuDNN call, the
    blocks as the batch), and the previous block's keys after its own offset, t - 0 > i: with both
    blocks' order reversed that is causal between the last w-1 reversed queries and the first w-1
    reversed keys (a second call).  The last query of a block sees nothing of the previous one,
    and neither does block 0 of a chunk at position 0.  The two blocks and the sink merge through
    their log-sum-exps in fp32, as `_split` merges a full layer's."""
    n, H, hd = q.shape
    KV, w = keys.shape[1], window
    kern = attention.kernel_for(q.device, H, KV, hd, q.dtype)
    nb = -(-n // w)
    base = pos - w  # the position of the padded keys' first row
    kept = max(base + 1, first, 0)
    kpad = keys.new_zeros((nb + 1) * w, KV, hd)
    vpad = values.new_zeros((nb + 1) * w, KV, hd)
    kpad[kept - base:pos + n - base] = keys[kept - first:]
    vpad[kept - base:pos + n - base] = values[kept - first:]
    qpad = q if nb * w == n else torch.cat((q, q.new_zeros(nb * w - n, H, hd)))
    qb = qpad.view(nb, w, H, hd).transpose(1, 2)  # [nb, H, w, hd]

    def blocks(t: torch.Tensor, lo: int) -> torch.Tensor:  # rows [lo, lo + nb*w) as [nb, heads, w, hd]
        b = t[lo:lo + nb * w].view(nb, w, KV, hd).transpose(1, 2)
        return b.repeat_interleave(H // KV, dim=1) if not kern.native_gqa and KV != H else b

    o_own, lse_own = attention._cudnn(qb.contiguous(), blocks(kpad, w).contiguous(), blocks(vpad, w).contiguous(),
                                      causal=True)
    o_r, lse_r = attention._cudnn(qb.flip(2)[:, :, 1:].contiguous(), blocks(kpad, 0).flip(2)[:, :, :w - 1].contiguous(),
                                  blocks(vpad, 0).flip(2)[:, :, :w - 1].contiguous(), causal=True)
    del kpad, vpad, qpad, qb  # a 32K chunk's blocks are hundreds of MiB each: freed before the merge
    lse_prev = lse_r.new_full((nb, H, w), float("-inf"))
    lse_prev[:, :, :w - 1] = lse_r.flip(2)
    if pos == 0:  # block 0's previous block stands for no token
        lse_prev[0] = float("-inf")
    sink = sinks.float().view(1, H, 1).expand(nb, H, w)
    top = torch.maximum(torch.maximum(lse_own, lse_prev), sink)
    w_own, w_prev = torch.exp(lse_own - top), torch.exp(lse_prev - top)
    total = w_own + w_prev + torch.exp(sink - top)
    o = o_own.float().mul_((w_own / total).unsqueeze(-1))  # in place: one fp32 copy of the output
    o[:, :, :w - 1].add_(o_r.flip(2).float().mul_((w_prev / total)[:, :, :w - 1].unsqueeze(-1)))
    return o.to(q.dtype).transpose(1, 2).reshape(nb * w, H * hd)[:n]
