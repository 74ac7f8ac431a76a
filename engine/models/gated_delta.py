"""Gated DeltaNet (GDN), the linear-attention layer of Qwen3-Next and Qwen3.5-MoE, with the state
it carries from one chunk to the next (issue 34).

A GDN layer keeps two pieces of state per sequence instead of a KV cache: the last K-1 inputs of
its causal depthwise conv1d (`conv`, K the kernel width) and the recurrent matrix S of each value
head (`recurrent`, dk x dv, float32).  A chunk that starts from chunk c's final state gives
exactly the outputs of one pass over the whole prompt, so the pipeline may cut the prompt
anywhere.

The recurrence per value head (q and k L2-normalised, q scaled by dk^-1/2, g = log decay <= 0):

    S_t = e^{g_t} S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - e^{g_t} S_{t-1}^T k_t),   o_t = S_t^T q_t

Within a block of C tokens with cumulative decay G_t = sum_{i<=t} g_i this is a unit lower
triangular system for U = [u_1 .. u_C] (the "WY" form the chunked kernels use):

    (I + A) U = diag(beta) (V - diag(e^G) K S_0),   A_ti = beta_t e^{G_t - G_i} k_t.k_i  (i < t)
    O = diag(e^G) Q S_0 + (M * Q K^T) U,             M_ti = e^{G_t - G_i}           (i <= t)
    S_C = e^{G_C} S_0 + K^T diag(e^{G_C - G}) U

so each block costs a few matrix products and one triangular solve, never a loop over tokens;
the solves and in-block products of many blocks are batched, and only S passes from block to
block in a loop.  This torch version is the reference: it runs on CPU and wherever fla does not.

On CUDA in bf16/fp16 `gdn_mix` hands the rule to flash-linear-attention's Triton kernels where the
`gdn` extra is installed (engine/kernels/gated_delta_fla.py says what it is given and why that is
this math; STRATA_GDN_KERNEL=torch keeps this one).  The conv there is fla's causal_conv1d too
(the K taps and the SiLU in fp32, one rounding), else one grouped `F.conv1d` in the half dtype
(fp32 accumulation, rounded before the SiLU); on CPU and in fp32 it stays the K shifted products
in fp32 below, exact on every device (cuDNN would take fp32 convs as TF32).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.kernels import gated_delta_fla

BLOCK = 64  # tokens per block of the chunked rule (the kernels' usual size)


@dataclass(frozen=True)
class GdnShape:
    """The sizes of one GDN layer, as the GGUF's ssm.* keys give them."""

    n_k_heads: int  # ssm.group_count
    n_v_heads: int  # ssm.time_step_rank
    head_k: int  # ssm.state_size
    head_v: int  # ssm.inner_size / n_v_heads
    conv_kernel: int  # ssm.conv_kernel
    # value head h's q/k head: h // (n_v / n_k) as transformers groups them (Qwen3-Next's file), or
    # h % n_k where the converter tiled them for ggml's broadcast (Qwen3.5's file)
    v_tiled: bool = False

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_k

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_v

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, conv_dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of one sequence's state for this layer (what the memory plan and prefill-main's
        hand-off count instead of KV)."""
        conv = self.conv_dim * (self.conv_kernel - 1) * torch.empty((), dtype=conv_dtype).element_size()
        return conv + self.n_v_heads * self.head_k * self.head_v * 4


@dataclass
class GdnState:
    """One GDN layer's state for one sequence: conv inputs and the recurrent matrices."""

    shape: GdnShape
    device: torch.device
    dtype: torch.dtype = torch.float32  # of the conv state (the activations' dtype)
    conv: torch.Tensor = field(init=False)
    recurrent: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        s = self.shape
        self.conv = torch.zeros(s.conv_dim, s.conv_kernel - 1, device=self.device, dtype=self.dtype)
        self.recurrent = torch.zeros(s.n_v_heads, s.head_k, s.head_v, device=self.device, dtype=torch.float32)

    def reset(self) -> None:
        self.conv.zero_()
        self.recurrent.zero_()

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * 4

    def copy_from(self, other: GdnState) -> None:
        """Take another device's state (prefill-main hands each stage its layers' rows)."""
        self.conv.copy_(other.conv, non_blocking=True)
        self.recurrent.copy_(other.recurrent, non_blocking=True)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv over time of x [T, C] with weight [C, K], continuing from `state`
    [C, K-1] (the inputs before x), then SiLU; `state` is updated in place to x's last K-1 inputs."""
    t = x.shape[0]
    k = weight.shape[1]
    if gated_delta_fla.serves_conv(x):  # fla's kernel: fp32 taps and SiLU, one rounding
        return gated_delta_fla.conv(x, weight, state)
    full = torch.cat([state.to(x.dtype), x.t()], dim=1)  # [C, K-1+T]
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        # one grouped conv (cuDNN, fp32 accumulation in a half dtype): one pass instead of K
        # passes that each widen a copy of the chunk to fp32
        y = F.conv1d(full.unsqueeze(0), weight.to(x.dtype).unsqueeze(1), groups=full.shape[0])[0]
        state.copy_(full[:, full.shape[1] - (k - 1):])
        return F.silu(y.t())
    # K shifted products summed in float32: exact on every device (cuDNN's conv would take TF32
    # on a GPU), K elementwise passes over the chunk (K is 4)
    wf = weight.float()
    y = full[:, 0:t].float() * wf[:, 0:1]
    for j in range(1, k):
        y.addcmul_(full[:, j:j + t].float(), wf[:, j:j + 1])
    state.copy_(full[:, full.shape[1] - (k - 1):])
    return F.silu(y.t()).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The gated delta rule over T tokens, blocked as the module doc says.

    q, k: [T, H, dk] (normalised and, for q, scaled by the caller), v: [T, H, dv], g, beta: [T, H];
    `state` [H, dk, dv] float32 is the recurrent state before the first token and is updated in
    place to the state after the last.  Returns o [T, H, dv] in float32.

    What does not depend on S_0 (the decays, the triangular solves, the in-block products) is
    computed for up to GROUP blocks at once; only the state's pass from block to block is a loop
    (four products a block).  The last block is padded with beta = 0 and g = 0 tokens, which
    neither read nor change the state."""
    n = q.shape[0]
    out = torch.empty(n, v.shape[1], v.shape[2], dtype=torch.float32, device=v.device)
    span = block * GROUP
    s = state
    for a in range(0, n, span):
        b = min(a + span, n)
        out[a:b], s = _blocks(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s, block)
    state.copy_(s)
    return out


GROUP = 16  # blocks whose S_0-free parts are computed together (memory: H x GROUP x block^2 floats a tensor)


def _blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            s: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gated_delta over at most GROUP blocks from state s: (o [T, H, dv], the state after)."""
    t = q.shape[0]
    c = min(block, t)
    pad = (-t) % c
    q, k, v = (F.pad(x.float(), (0, 0, 0, 0, 0, pad)) for x in (q, k, v))  # [T', H, d]
    g, beta = (F.pad(x.float(), (0, 0, 0, pad)) for x in (g, beta))  # [T', H]
    h, nb = q.shape[1], q.shape[0] // c
    q, k, v = (x.permute(1, 0, 2).reshape(h, nb, c, x.shape[-1]) for x in (q, k, v))  # [H, B, C, d]
    g, beta = (x.t().reshape(h, nb, c) for x in (g, beta))  # [H, B, C]
    cum = g.cumsum(-1)  # G_t within each block
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    diff = cum.unsqueeze(-1) - cum.unsqueeze(-2)  # G_t - G_i
    decay = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()  # M (i <= t), 0 above
    strict = decay.masked_fill(torch.eye(c, dtype=torch.bool, device=q.device), 0.0)
    system = torch.eye(c, device=q.device) + beta.unsqueeze(-1) * strict * (k @ k.transpose(-1, -2))  # I + A
    g_exp = cum.exp().unsqueeze(-1)  # e^{G_t}
    # (I + A) U = diag(beta) V - diag(beta e^G) K S_0: the two parts solved apart, S_0 enters below
    rhs = torch.cat((beta.unsqueeze(-1) * v, beta.unsqueeze(-1) * g_exp * k), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_v, u_k = solved[..., :v.shape[-1]], solved[..., v.shape[-1]:]
    attn = decay * (q @ k.transpose(-1, -2))  # M * Q K^T
    q_read = g_exp * q  # diag(e^G) Q: what reads S_0
    tail = (cum[..., -1:] - cum).exp().unsqueeze(-1)  # e^{G_C - G_i}
    k_write = (tail * k).transpose(-1, -2)  # K^T diag(e^{G_C - G})
    block_decay = cum[..., -1].exp()[..., None, None]  # e^{G_C}
    out = torch.empty_like(v)
    for j in range(nb):
        u = u_v[:, j] - u_k[:, j] @ s
        out[:, j] = q_read[:, j] @ s + attn[:, j] @ u
        s = block_decay[:, j] * s + k_write[:, j] @ u
    return out.reshape(h, nb * c, -1)[:, :t].transpose(0, 1), s


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x per head, times its weight, gated by SiLU(z) (the norm before the gate)."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).float().mul(F.silu(z.float())).to(x.dtype)


def gdn_mix(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, *, ssm_a: torch.Tensor,
            dt_bias: torch.Tensor, conv_weight: torch.Tensor, norm_weight: torch.Tensor, shape: GdnShape,
            state: GdnState, eps: float) -> torch.Tensor:
    """A GDN layer between its input projections and its output projection, for one chunk.

    qkv [T, 2*key_dim + value_dim] (q of every k head, then k, then v, as llama.cpp's converter
    stores attn_qkv), z [T, value_dim] (attn_gate), b and a [T, n_v_heads] (beta and decay
    inputs), ssm_a [n_v_heads] (= -exp(A_log)), dt_bias [n_v_heads], conv_weight [conv_dim, K],
    norm_weight [head_v].  Continues from `state` and leaves it after the chunk's last token.
    Returns the gated, normed core output [T, value_dim] in qkv's dtype."""
    s = shape
    t = qkv.shape[0]
    mixed = causal_conv1d(qkv, conv_weight, state.conv)
    q, k, v = torch.split(mixed, [s.key_dim, s.key_dim, s.value_dim], dim=-1)
    q, k = q.reshape(t, s.n_k_heads, s.head_k), k.reshape(t, s.n_k_heads, s.head_k)
    v = v.reshape(t, s.n_v_heads, s.head_v)
    beta = torch.sigmoid(b.float())
    g = ssm_a.float() * F.softplus(a.float() + dt_bias.float())
    if gated_delta_fla.serves(qkv, s.head_k):  # fla normalises q/k itself and reads a q/k head per value-head group
        if s.v_tiled:
            q, k = per_value_head(q, k, s)
        o = gated_delta_fla.chunk_rule(q, k, v, g, beta, state.recurrent, scale=s.head_k ** -0.5)
    else:
        q, k = per_value_head(l2norm(q.float()) * s.head_k ** -0.5, l2norm(k.float()), s)
        o = gated_delta(q, k, v, g, beta, state.recurrent)
    o = gated_rmsnorm(o.to(qkv.dtype), z.reshape(t, s.n_v_heads, s.head_v), norm_weight, eps)
    return o.reshape(t, s.value_dim)


def per_value_head(q: torch.Tensor, k: torch.Tensor, shape: GdnShape) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, n_k, dk] repeated to the value heads [T, n_v, dk] in the file's grouping."""
    ratio = shape.n_v_heads // shape.n_k_heads
    if ratio == 1:
        return q, k
    if shape.v_tiled:  # q/k head g serves value heads g, g + n_k, g + 2 n_k, ...
        return q.repeat(1, ratio, 1), k.repeat(1, ratio, 1)
    # each q/k head serves `ratio` consecutive value heads
    return q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)


def split_ba(ba: torch.Tensor, shape: GdnShape) -> tuple[torch.Tensor, torch.Tensor]:
    """beta and decay inputs [T, n_v_heads] each from the ssm_ba projection [T, 2 * n_v_heads],
    which keeps Qwen3-Next's order: per k head, its value heads' b, then their a."""
    t = ba.shape[0]
    ratio = shape.n_v_heads // shape.n_k_heads
    grouped = ba.reshape(t, shape.n_k_heads, 2 * ratio)
    return grouped[..., :ratio].reshape(t, shape.n_v_heads), grouped[..., ratio:].reshape(t, shape.n_v_heads)
