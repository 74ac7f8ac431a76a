"""Routed experts' matrix-vector products from stored blocks (engine/quant/qmatvec_triton.py)
against gguf's dequantiser: the weights expanded by `gguf.quants.dequantize`, rounded to the
activations' dtype as the scratch path holds them, then a float64 product.  Only the order of
the float32 sum differs, so the tolerance is a few float32 ulps of the sum's magnitude.  Run on
CPU through Triton's interpreter where triton is installed (tests/test_cuda.py compiles them)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from dequant_support import random_blocks
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants
from triton_compile_support import compiled_lines

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from engine.quant import qmatvec_triton  # noqa: E402

needs_triton = pytest.mark.skipif(not qmatvec_triton.available() or torch.cuda.is_available(),
                                  reason="needs triton (the test extra, Linux) and no GPU (tests/test_cuda.py)")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def expert_tensor(qtype: T, E: int, N: int, K: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """Random valid blocks of an [E, N, K] expert tensor: its bytes and gguf's float32 values."""
    bs = gguf_quants.GGML_QUANT_SIZES[qtype][0] if hasattr(gguf_quants, "GGML_QUANT_SIZES") else None
    raw, _ = random_blocks(qtype, E * N, K // (bs or 256), seed, finite=True)
    values = gguf_quants.dequantize(raw, qtype).reshape(E, N, K).astype(np.float32)
    return torch.from_numpy(raw.reshape(-1).copy()), values


def reference(values: np.ndarray, x: torch.Tensor, experts: torch.Tensor) -> np.ndarray:
    w = torch.from_numpy(values)[experts].to(x.dtype).double()  # the scratch path's rounding
    return torch.einsum("mnk,mk->mn", w, x.double()).numpy()


@needs_triton
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matvec_equals_the_expanded_weights_product(qtype, dtype):
    _check_product(qtype, dtype)


@needs_triton
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("bn,warps,bk", [(2, 1, 1), (4, 2, 4), (8, 4, 8)])
def test_every_launch_shape_gives_the_product(monkeypatch, qtype, bn, warps, bk):
    """The table's launch shape is tuned per device (benchmarks/matvec_bench.py): any rows a
    program and blocks a step compute the same product, a step reaching past the row's end
    (4 or 8 blocks of a 2-block row; 8 of 11 Q8_0 blocks) included; blocks a step are a power of two."""
    kernel = qmatvec_triton._TABLE[qtype][0]
    monkeypatch.setitem(qmatvec_triton._TABLE, qtype, (kernel, bn, warps, bk))
    _check_product(qtype, torch.bfloat16)


def _check_product(qtype: T, dtype: torch.dtype) -> None:
    E, N, K = 5, 24, 512 if qtype != T.Q8_0 else 352  # N not a multiple of the rows a program takes; Q8_0: a partial step
    raw, values = expert_tensor(qtype, E, N, K, seed=3)
    g = torch.Generator().manual_seed(0)
    experts = torch.tensor([4, 0, 2, 2, 1, 3], dtype=torch.int64)  # repeats and every expert order
    x = torch.randn(len(experts), K, generator=g).to(dtype)
    got = qmatvec_triton.matvec(raw, qtype, (E, N, K), x, experts)
    assert got.shape == (len(experts), N) and got.dtype == dtype
    ref = reference(values, x, experts)
    scale = np.abs(torch.from_numpy(values)[experts].to(dtype).double().numpy() * x.double().numpy()[:, None, :]).sum(-1)
    out_ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23  # the output's own rounding
    err = np.abs(got.double().numpy() - ref)
    assert (err <= scale * (K * 2.0 ** -24) + np.abs(ref) * out_ulp + 1e-30).all(), float(err.max())


@needs_triton
def test_matvec_refuses_what_it_cannot_do():
    raw, _ = expert_tensor(T.Q4_K, 2, 4, 256, seed=1)
    x = torch.zeros(1, 256)
    with pytest.raises(ValueError, match="IQ3_S"):
        qmatvec_triton.matvec(raw, T.IQ3_S, (2, 4, 256), x, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="do not match"):
        qmatvec_triton.matvec(raw, T.Q4_K, (2, 4, 256), torch.zeros(2, 256), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="bytes are not"):
        qmatvec_triton.matvec(raw[:-1], T.Q4_K, (2, 4, 256), x, torch.zeros(1, dtype=torch.int64))


_COMPILE_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.quant import qmatvec_triton as q
for qt, (kernel, bn, warps, bk) in sorted(q._TABLE.items(), key=lambda kv: kv[0].name):
    for dt in ("*bf16", "*fp32"):
        sig = {"w": "*u8", "x": dt, "ids": "*i64", "out": dt, "N": "i32", "K": "constexpr", "row_bytes": "i64",
               "expert_bytes": "i64", "BN": "constexpr", "BK": "constexpr"}
        c = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs={"K": 2048, "BN": bn, "BK": bk}),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "enable_fp_fusion": False})
        print(qt.name, dt, "cubin", len(c.asm["cubin"]))
"""


@pytest.mark.skipif(not qmatvec_triton.available(), reason="needs triton (the test extra, Linux)")
def test_every_matvec_kernel_compiles_for_sm90():
    """The interpreter accepts code the compiler may refuse: each kernel is compiled for sm_90
    (through ptxas) with its launch options, for bf16 and float32 activations."""
    lines = compiled_lines(_COMPILE_CHECK)
    for qt in qmatvec_triton.TYPES:
        for dt in ("*bf16", "*fp32"):
            assert any(line.startswith(f"{qt.name} {dt} cubin") for line in lines), lines


@needs_triton
def test_matvec_reads_experts_a_stride_apart():
    """The expert cache's slots: each expert's part starts `expert_stride` bytes after the last,
    with other bytes between; the products are those of the packed tensor."""
    E, N, K = 3, 8, 256
    raw, values = expert_tensor(T.Q4_K, E, N, K, seed=5)
    per = raw.numel() // E
    pad = 40
    pool = torch.zeros(E, pad + per + 24, dtype=torch.uint8)
    pool[:, pad:pad + per] = raw.view(E, per)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(1))
    experts = torch.tensor([2, 0, 1, 2], dtype=torch.int64)
    packed = qmatvec_triton.matvec(raw, T.Q4_K, (E, N, K), x, experts)
    strided = qmatvec_triton.matvec(pool.view(-1)[pad:], T.Q4_K, (E, N, K), x, experts, expert_stride=pool.stride(0))
    assert torch.equal(packed, strided)


@needs_triton
@pytest.mark.parametrize("n", [1, 3])
def test_decode_moe_from_stored_blocks_needs_no_sort(monkeypatch, n):
    """Layer.moe on the stored-block path leaves the (token, slot) rows unsorted: the output is
    bit for bit the sorted path's (rows sorted by expert, products, then un-permuted), since
    each row's product is its own program's and the slot sum keeps its order."""
    import torch.nn.functional as F

    from engine.io import synth
    from engine.models import routed_matvec, routing
    from engine.models.layers import Layer, Rope
    from engine.models.loading import load_layer_weights

    shapes = dict(hidden=256, head_dim=64, n_experts=16, expert_ffn=256, ffn=512)
    src = synth.SyntheticSource(synth.recipe_from_args("demo", quant="q4_k_m", n_layers=2, **shapes))
    spec, dev = src.spec, torch.device("cpu")
    w = load_layer_weights(src, 1, dev, torch.float32)
    layer = Layer(spec, 1, w, Rope(spec.head_dim, spec.rope_base, spec.rope_style, dev))
    layer.use_grouped_mm = True
    monkeypatch.setattr(routed_matvec, "wanted", lambda *_: True)  # the CUDA rule, here on the interpreter
    k = spec.n_experts_used
    for seed in range(50):  # tokens whose routing the sort really permutes
        h = torch.randn(n, spec.hidden, generator=torch.Generator().manual_seed(seed))
        top_w, top_i = routing.route(F.linear(h.float(), w.router), spec, w.router_bias)
        flat = top_i.reshape(-1)
        order = torch.argsort(flat, stable=True)
        if not torch.equal(order, torch.arange(order.numel())):
            break
    got = layer.moe(h)
    ys = routed_matvec.experts(w, h[order // k], flat[order])
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel())
    want = (ys[inv].view(n, k, spec.hidden).float() * top_w.unsqueeze(-1)).sum(1).to(h.dtype)
    assert not torch.equal(order, torch.arange(order.numel()))  # a real permutation
    assert torch.equal(got, want)
