"""The Triton dequantiser (engine/quant/dequant_triton.py) against gguf's numpy dequantiser and the
torch path, bit for bit, run on CPU through Triton's interpreter where triton is installed (the
test extra brings it on Linux, so CI runs them; tests/test_cuda.py runs the compiled kernels on the GPU
machine, where FMA contraction and the conversions are the real risks).  The dispatch tests
run everywhere."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from dequant_support import assert_bit_exact, random_blocks
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants
from triton_compile_support import compiled_lines

from engine.quant import dequant

if not torch.cuda.is_available():  # interpret the kernels here; a CUDA machine compiles them
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

# random bytes include NaN/inf scales: numpy warns while computing the reference
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
interpreted = pytest.mark.skipif(
    not HAVE_TRITON or torch.cuda.is_available(),
    reason="needs triton (the test extra, Linux) and no GPU (tests/test_cuda.py runs the compiled kernels)")
KERNEL_TYPES = [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1, T.Q2_K, T.Q3_K,
                T.IQ4_NL, T.IQ4_XS, T.IQ3_XXS, T.IQ3_S, T.MXFP4, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S,
                T.IQ1_M, T.NVFP4, T.TQ2_0, T.TQ1_0]
# code books gathered from a device table (TQ2_0 is plain arithmetic)
LATTICE_AND_FP4_KERNELS = [T.IQ3_XXS, T.IQ3_S, T.MXFP4, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M, T.NVFP4]


if HAVE_TRITON:
    import triton.language as tl

    from engine.quant.dequant_triton import _bf16

    @triton.jit
    def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        """The dequantiser's bf16 cast alone (defined here: jit resolves module globals)."""
        i = tl.arange(0, BLOCK)
        tl.store(y_ptr + i, _bf16(tl.load(x_ptr + i, mask=i < n, other=0.0)), mask=i < n)


@pytest.fixture
def fresh_choice():
    """Each test decides afresh (the choice is cached per process, as the env is read once)."""
    from engine.quant import dequant_triton
    dequant_triton._kernels.cache_clear()
    yield dequant_triton
    dequant_triton._kernels.cache_clear()


@interpreted
def test_every_listed_type_has_a_kernel(fresh_choice):
    assert set(KERNEL_TYPES) == set(fresh_choice.TYPES)
    assert all(fresh_choice.handles(t, torch.bfloat16) for t in KERNEL_TYPES)
    assert not fresh_choice.handles(T.BF16, torch.bfloat16)  # a cast: torch's
    assert not fresh_choice.handles(T.Q4_K, torch.float64)


@interpreted
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks_per_row,seed,finite", [(7, 3, 0, False), (11, 13, 1, False),
                                                            (1, 1, 2, False), (9, 11, 3, True)])
def test_kernel_bit_exact_against_gguf_and_torch(fresh_choice, qtype, rows, blocks_per_row, seed, finite):
    """Every bit pattern, and finite scales (no block hidden behind a NaN); partial programs
    (block counts that are not a multiple of a program's blocks) included."""
    raw, shape = random_blocks(qtype, rows, blocks_per_row, seed, finite=finite)
    ref = gguf_quants.dequantize(raw, qtype)
    assert np.isfinite(ref).all() if finite else np.isfinite(ref).mean() > 0.5  # not NaN against NaN
    t = torch.from_numpy(raw)
    got = fresh_choice.dequantize_into(t.reshape(-1), qtype, torch.full(shape, 7.0))
    assert_bit_exact(got, ref, f"{qtype.name} Triton vs gguf")
    assert_bit_exact(got, dequant.dequantize(t, qtype, shape).numpy(), f"{qtype.name} Triton vs torch")


@interpreted
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.IQ4_XS, *LATTICE_AND_FP4_KERNELS, T.TQ1_0],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_output_is_the_cast_of_float32(fresh_choice, qtype, dtype):
    raw, shape = random_blocks(qtype, 9, 4, seed=3)
    t = torch.from_numpy(raw)
    f32 = fresh_choice.dequantize_into(t, qtype, torch.empty(shape))
    low = fresh_choice.dequantize_into(t, qtype, torch.empty(shape, dtype=dtype))
    want = f32.to(dtype)
    assert low.dtype == dtype
    assert bool(((low == want) | (low.isnan() & want.isnan())).all())


@interpreted
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q5_0], ids=lambda t: t.name)
def test_strided_rows_read_in_place(fresh_choice, qtype):
    """ExpertCache.expand hands a [B, part bytes] column slice of its gathered slot rows: the
    kernel reads it in place and gives the values of the contiguous copy."""
    raw, (rows, cols) = random_blocks(qtype, 6, 2, seed=4)
    buf = torch.zeros(rows, raw.shape[1] + 37, dtype=torch.uint8)
    buf[:, 11:11 + raw.shape[1]] = torch.from_numpy(raw)
    view = buf[:, 11:11 + raw.shape[1]]
    assert not view.is_contiguous()
    got = fresh_choice.dequantize_into(view, qtype, torch.empty(3, 2, cols))
    assert_bit_exact(got.reshape(rows, cols), gguf_quants.dequantize(raw, qtype), f"{qtype.name} strided")


@interpreted
def test_wrong_sizes_are_refused(fresh_choice):
    with pytest.raises(ValueError, match="do not fill"):
        fresh_choice.dequantize_into(torch.zeros(143, dtype=torch.uint8), T.Q4_K, torch.empty(256))
    with pytest.raises(ValueError, match="no Triton dequantiser for BF16"):
        fresh_choice.dequantize_into(torch.zeros(512, dtype=torch.uint8), T.BF16, torch.empty(256))


def test_cpu_always_uses_the_torch_path(monkeypatch):
    """A CPU tensor never reaches the Triton module, whatever is installed."""
    assert dequant.backend("cpu", T.Q4_K, torch.bfloat16) == "torch"
    if HAVE_TRITON:
        from engine.quant import dequant_triton

        def boom(*a, **k):
            raise AssertionError("the Triton path ran for a CPU tensor")
        monkeypatch.setattr(dequant_triton, "dequantize_into", boom)
    raw, shape = random_blocks(T.Q4_K, 3, 2, seed=6)
    got = dequant.dequantize(torch.from_numpy(raw), T.Q4_K, shape)
    assert_bit_exact(got, gguf_quants.dequantize(raw, T.Q4_K), "Q4_K on CPU")


def test_strata_dequant_torch_forces_the_torch_path_on_cuda(monkeypatch, fresh_choice):
    monkeypatch.setenv("STRATA_DEQUANT", "torch")
    fresh_choice._kernels.cache_clear()
    assert dequant.backend("cuda:0", T.Q4_K, torch.bfloat16) == "torch"
    assert not fresh_choice.handles(T.Q4_K, torch.bfloat16)
    monkeypatch.delenv("STRATA_DEQUANT")
    fresh_choice._kernels.cache_clear()
    want = "triton" if HAVE_TRITON else "torch"
    assert dequant.backend("cuda:0", T.Q4_K, torch.bfloat16) == want
    assert dequant.backend("cuda:0", T.F16, torch.bfloat16) == "torch"  # no kernel: a cast


@interpreted
def test_bf16_rounding_is_torchs(fresh_choice):
    """The kernels' float32 -> bf16 (integer RTNE) on ties, carries into the exponent, overflow
    to inf, signed zeros, subnormals, inf/NaN and random bit patterns."""
    edges = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20, 2 - 2**-9, 3.3895e38,
                          3.4e38, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, -3e-39, 5.9e-39],
                          dtype=torch.float32)
    rand = torch.from_numpy(np.random.default_rng(8).integers(0, 2**32, 1000, dtype=np.uint32).view(np.float32).copy())
    x = torch.cat((edges, rand))
    y = torch.empty(x.numel(), dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, y, x.numel(), BLOCK=1024)
    want = x.to(torch.bfloat16)
    same = (y.view(torch.int16) == want.view(torch.int16)) | (y.isnan() & want.isnan())
    assert bool(same.all()), x[~same][:5]


@interpreted
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.IQ4_XS, *LATTICE_AND_FP4_KERNELS, T.TQ1_0],
                         ids=lambda t: t.name)
def test_row_index_gathers_in_place(fresh_choice, qtype):
    """ExpertCache.expand hands its whole pool's column slice and the slots' index: the kernel
    reads rows in the index's order (repeats included) and gives the values of the gathered copy."""
    raw, (n_rows, cols) = random_blocks(qtype, 5, 2, seed=8)
    pool = torch.zeros(n_rows, raw.shape[1] + 40, dtype=torch.uint8)
    pool[:, 24:24 + raw.shape[1]] = torch.from_numpy(raw)
    rows = torch.tensor([3, 0, 3, 4], dtype=torch.int64)
    got = fresh_choice.dequantize_into(pool[:, 24:24 + raw.shape[1]], qtype, torch.empty(4, cols), rows=rows)
    want = gguf_quants.dequantize(raw[rows.numpy()], qtype)
    assert_bit_exact(got, want, f"{qtype.name} gathered")
    with pytest.raises(ValueError, match="do not fill"):
        fresh_choice.dequantize_into(pool[:, 24:24 + raw.shape[1]], qtype, torch.empty(3, cols), rows=rows)


@pytest.mark.parametrize("qtype", [T.F16, T.BF16, T.F32], ids=lambda t: t.name)
def test_types_without_a_kernel_fall_back_to_torch_on_cuda(fresh_choice, qtype, caplog):
    """Every quantised type has a kernel; the float types are torch casts: a CUDA tensor of
    theirs takes the torch path (and its step temporaries are budgeted), and the log line naming
    the Triton types says the others use torch."""
    assert qtype not in fresh_choice.TYPES
    assert not fresh_choice.handles(qtype, torch.bfloat16)
    assert dequant.backend("cuda:0", qtype, torch.bfloat16) == "torch"
    assert dequant.gpu_temporaries("cuda:0", [T.Q4_K, qtype], torch.bfloat16) == dequant.STEP_BYTES_CUDA
    if HAVE_TRITON and os.environ.get("STRATA_DEQUANT", "") != "torch":
        fresh_choice._kernels.cache_clear()
        with caplog.at_level("INFO", logger="engine.quant.dequant_triton"):
            fresh_choice.handles(qtype, torch.bfloat16)
        assert "torch for the other types" in caplog.text
        assert qtype.name not in caplog.text.split("torch for")[0]


@interpreted
def test_quantised_types_all_have_kernels_and_need_no_step_temporaries(fresh_choice):
    """The memory plan: a model of any quantised types expands each tensor in one launch into
    its output, so no torch step's float32 temporaries are reserved on the GPU."""
    quantised = dequant.SUPPORTED - {T.F32, T.F16, T.BF16}
    assert quantised == fresh_choice.TYPES
    assert dequant.gpu_temporaries("cuda:0", sorted(quantised), torch.bfloat16) == 0
    assert all(dequant.backend("cuda:0", t, torch.bfloat16) == "triton" for t in quantised)


# compiled for an H100/H200 (sm_90) without a GPU, in a process where @triton.jit compiles (the
# interpreter is off): every kernel, float32 and bf16 out, gathering; the PTX is read for FMA
_COMPILE_CHECK = """
import re, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import torch
from engine.quant import dequant_triton as dt
from engine.quant.code_books import code_book
for qt, (kernel, r, w) in sorted(dt._TABLE.items(), key=lambda kv: kv[0].name):
    names = dt.CODE_BOOKS.get(qt, ())
    books = kernel.arg_names[6:6 + len(names)]
    kinds = ["*i32" if code_book(n, torch.device("cpu")).dtype == torch.int32 else "*fp32" for n in names]
    for out in ("*fp32", "*bf16"):
        sig = {"src": "*u8", "out": out, "rows": "*i64", "n_blocks": "i32", "bpr": "i32", "row_stride": "i64",
               **dict(zip(books, kinds)), "R": "constexpr", "GATHER": "constexpr"}
        c = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs={"R": r, "GATHER": True}),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": w, "enable_fp_fusion": False})
        ptx = c.asm["ptx"]
        fused = ptx.count("fma") + len(re.findall(r"\\b(?:mul|add|sub)\\.f32", ptx))  # contractible
        print(qt.name, out, "fused-or-contractible", fused, "cubin", len(c.asm["cubin"]))
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton (the test extra, Linux)")
def test_every_kernel_compiles_for_sm90_without_fused_multiply_add():
    """The interpreter accepts code the compiler may refuse, and cannot show FMA contraction:
    each kernel is compiled for sm_90 (through ptxas) with the dequantiser's launch options and
    its PTX holds only rounded .rn float operations, no fma."""
    lines = compiled_lines(_COMPILE_CHECK)
    from engine.quant import dequant_triton
    for qt in dequant_triton.TYPES:
        for out in ("*fp32", "*bf16"):
            line = next((x for x in lines if x.startswith(f"{qt.name} {out} ")), None)
            assert line is not None, (qt.name, out, lines[-20:])
            assert " fused-or-contractible 0 " in line, line
