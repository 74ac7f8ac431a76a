"""The Triton kernels compute the torch expressions they replace, checked on CPU through
Triton's interpreter where triton is installed (the test extra brings it on Linux, so CI runs this; the
CUDA variants in tests/test_cuda.py run the compiled kernels on the GPU machine)."""
from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():  # the compiled kernels are tested there (test_cuda.py); keep the process compiled
    pytest.skip("CUDA machine: tests/test_cuda.py runs the compiled kernels", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.kernels import moe_kernels, qk_rope  # noqa: E402
from engine.models.layers import Rope  # noqa: E402


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("rot", [16, 8, 6])  # full RoPE, and partial rotary (the first rot dimensions)
def test_qk_norm_rope_kernel(norm, rot):
    torch.manual_seed(0)
    n, H, KV, hd = 7, 4, 2, 16
    qkv = torch.randn(n, (H + 2 * KV) * hd)
    qk = qkv[:, : (H + KV) * hd].view(n, H + KV, hd)  # strided rows, as the fused projection gives
    w = torch.randn(H + KV, hd) if norm else None
    cos, sin = Rope(hd, 10000.0, "neox", torch.device("cpu"), rot_dim=rot).lowp_tables(3, n, torch.float32)
    assert cos.shape == (n, 1, rot)
    q, k = torch.empty(H, n, hd), torch.empty(n, KV, hd)
    qk_rope._compiled()[(n, H + KV)](qk, qk.stride(0), w if norm else qk, cos, sin, q, k, n, H, KV, 1e-6,
                                   HD=hd, HAS_NORM=norm, ROT=rot)
    rq, rk = qk_rope._torch(qk, w, cos, sin, 1e-6, H)
    assert torch.allclose(q.transpose(0, 1), rq, atol=1e-5) and torch.allclose(k, rk, atol=1e-5)


def test_swiglu_and_combine_kernels():
    torch.manual_seed(1)
    swiglu, combine, swiglu_oai = moe_kernels._kernels()
    gu = torch.randn(9, 24)
    out = torch.empty(9, 12)
    swiglu[(9, 1)](gu, out, 12, gu.stride(0), BLOCK=16)
    assert torch.allclose(out, torch.nn.functional.silu(gu[:, :12]) * gu[:, 12:], atol=1e-6)
    ys, inv = torch.randn(15, 20), torch.randperm(15)
    w = torch.softmax(torch.randn(5, 3), -1)
    o = torch.empty(5, 20)
    combine[(5, 1)](ys, inv, w, o, ys, inv, 20, K=3, HAS_BIAS=False, BLOCK=32)
    assert torch.allclose(o, (ys[inv].view(5, 3, 20) * w.unsqueeze(-1)).sum(1), atol=1e-6)
    bias, experts = torch.randn(4, 20), torch.randint(0, 4, (5, 3))
    combine[(5, 1)](ys, inv, w, o, bias, experts, 20, K=3, HAS_BIAS=True, BLOCK=32)
    want = ((ys[inv].view(5, 3, 20) + bias[experts]) * w.unsqueeze(-1)).sum(1)
    assert torch.allclose(o, want, atol=1e-5)


def test_gpt_oss_swiglu_kernel():
    from engine.models import gpt_oss_layer as gl

    torch.manual_seed(2)
    _, _, swiglu_oai = moe_kernels._kernels()
    g, u = 5 * torch.randn(9, 12), 5 * torch.randn(9, 12)
    row_e = torch.sort(torch.randint(0, 3, (9,))).values
    gb, ub = torch.randn(3, 12), torch.randn(3, 12)
    out = torch.empty(9, 12)
    swiglu_oai[(9, 1)](g, u, row_e, gb, ub, out, 12, gl.SWIGLU_ALPHA, gl.SWIGLU_LIMIT, BLOCK=16)
    assert torch.allclose(out, gl.swiglu_oai(g + gb[row_e], u + ub[row_e]), atol=1e-5)
    g[1, 3], u[4, 5] = float("nan"), float("nan")  # a NaN passes the clamps as it does torch's
    swiglu_oai[(9, 1)](g, u, row_e, gb, ub, out, 12, gl.SWIGLU_ALPHA, gl.SWIGLU_LIMIT, BLOCK=16)
    want = gl.swiglu_oai(g + gb[row_e], u + ub[row_e])
    assert torch.equal(out.isnan(), want.isnan()) and out.isnan().sum() == 2
    assert torch.allclose(out.nan_to_num(), want.nan_to_num(), atol=1e-5)


@pytest.mark.parametrize("pos,span", [(0, 64), (37, 64), (200, 300), (299, 300)])
def test_split_k_decode_attention_is_the_torch_one(pos, span):
    """Slices of SPLIT keys past the position are skipped (nothing read there: NaN rows past it
    change nothing), the slices merged by their log-sum-exp; GQA 8 heads over 2."""
    from engine.kernels import decode_attention as da

    g = torch.Generator().manual_seed(pos)
    H, KV, hd = 8, 2, 32
    q = torch.randn(1, H, hd, generator=g)
    keys = torch.randn(span, KV, hd, generator=g)
    values = torch.randn(span, KV, hd, generator=g)
    index = torch.tensor([pos])
    masked = torch.arange(span) > index
    want = da._torch(q, keys.masked_fill(masked[:, None, None], 0), values.masked_fill(masked[:, None, None], 0),
                     masked)
    keys[pos + 1:] = float("nan")
    values[pos + 1:] = float("nan")
    got = da._triton(da._compiled(), q, keys, values, index)
    assert got.shape == (1, H * hd) and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_the_split_k_kernels_are_checked_against_torch_before_they_serve():
    """The first call of a shape runs the kernels on a small problem against torch: they pass
    here (the interpreter), and kernels that fail to launch are refused with the reason."""
    from engine.kernels import decode_attention as da

    assert da._self_check(da._compiled(), torch.device("cpu"), torch.float32, 8, 2, 32) == ""

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("PTX compile failed (a build that cannot)")
            return launch

    why = da._self_check((Broken(), Broken()), torch.device("cpu"), torch.float32, 8, 2, 32)
    assert why.startswith("the split-K kernels failed (RuntimeError: PTX compile failed"), why
