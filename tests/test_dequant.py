"""engine.quant.dequant against gguf's numpy dequantiser, bit for bit, on random blocks (CPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from dequant_support import ALL_TYPES, assert_bit_exact, check_type, random_blocks
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from engine.quant import dequant
from engine.quant.code_books import code_book

# random bytes include NaN/inf scales: numpy warns while computing the reference
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def test_every_type_the_issue_lists_is_supported():
    wanted = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
              "IQ4_NL", "IQ4_XS", "BF16", "F16", "F32",
              "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "MXFP4",
              "TQ1_0", "TQ2_0", "NVFP4"}
    assert {t.name for t in dequant.SUPPORTED} == wanted


def test_every_type_gguf_dequantises_is_supported():
    """gguf's reference dequantiser is the oracle: whatever it expands, so does the engine."""
    assert set(gguf_quants._type_traits) <= set(dequant.SUPPORTED)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bit_exact_against_gguf(qtype, seed):
    check_type(qtype, "cpu", rows=11, blocks_per_row=5, seed=seed)


LATTICE_AND_FP4 = [T.IQ3_XXS, T.IQ3_S, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M, T.MXFP4,
                   T.NVFP4, T.TQ1_0, T.TQ2_0]


@pytest.mark.parametrize("qtype", LATTICE_AND_FP4, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [3, 4])
def test_valid_blocks_bit_exact_and_all_finite(qtype, seed):
    """Valid blocks (finite scales, subnormal ones included): every value finite and gguf's bit
    for bit, so no difference hides behind a NaN block; a block count above one step too."""
    raw, shape = random_blocks(qtype, 9, 7, seed, finite=True)
    ref = gguf_quants.dequantize(raw, qtype)
    assert np.isfinite(ref).all()
    assert np.count_nonzero(ref) > ref.size // 2
    got = dequant.dequantize(torch.from_numpy(raw), qtype, shape)
    assert_bit_exact(got, ref, f"{qtype.name} valid blocks")


def test_code_books_are_gguf_s():
    """The lattices, sign table and fp4 scales are read from gguf, not written out here: they
    have gguf's sizes and values."""
    for name, rows in (("IQ2_XXS", 256), ("IQ2_XS", 512), ("IQ2_S", 1024), ("IQ3_XXS", 256),
                       ("IQ3_S", 512), ("IQ1_S", 2048)):
        cls = getattr(gguf_quants, name)
        cls.init_grid()
        table = code_book(name, torch.device("cpu"))
        assert table.shape[0] == rows
        np.testing.assert_array_equal(table.numpy(), cls.grid.reshape(cls.grid_shape))
    signs = code_book("ksigns", torch.device("cpu")).numpy()
    assert signs.shape == (128, 8) and set(np.unique(signs)) == {-1.0, 1.0}
    assert ((signs < 0).sum(axis=1) % 2 == 0).all()  # ggml's sign bytes have even parity
    assert code_book("e8m0_half", torch.device("cpu"))[127].item() == 0.5  # 2**(127-127) halved


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.IQ4_XS, T.Q5_1, T.IQ3_XXS, T.IQ3_S, T.IQ2_S,
                                   T.IQ1_M, T.MXFP4, T.NVFP4], ids=lambda t: t.name)
def test_three_dimensional_tensor_and_chunked_out(monkeypatch, qtype):
    """Expert tensors are [E, f, d]; writing into a preallocated scratch in small steps gives
    the same values as one call, and bf16 output is the cast of the float32 result."""
    raw, (rows, cols) = random_blocks(qtype, 12, 2, seed=5)
    ref = gguf_quants.dequantize(raw, qtype).reshape(3, 4, cols)
    t = torch.from_numpy(raw)
    one = dequant.dequantize(t, qtype, (3, 4, cols))
    monkeypatch.setattr(dequant, "CHUNK_VALUES", 5 * dequant.block_geometry(qtype)[0])  # 5 blocks a step
    out = torch.full((3, 4, cols), 7.0)
    dequant.dequantize(t, qtype, (3, 4, cols), out=out)
    assert torch.equal(one.nan_to_num(), out.nan_to_num())
    np.testing.assert_array_equal(np.nan_to_num(one.numpy()), np.nan_to_num(ref))
    bf = dequant.dequantize(t, qtype, (3, 4, cols), dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf.nan_to_num(), one.to(torch.bfloat16).nan_to_num())


def test_non_contiguous_byte_slice():
    """A slice of a larger byte buffer (an expert inside a cache slot) expands the same."""
    raw, shape = random_blocks(T.Q4_K, 4, 2, seed=9)
    buf = torch.zeros(raw.size + 100, dtype=torch.uint8)
    buf[50:50 + raw.size] = torch.from_numpy(raw.reshape(-1))
    got = dequant.dequantize(buf[50:50 + raw.size], T.Q4_K, shape)
    ref = gguf_quants.dequantize(raw, T.Q4_K)
    np.testing.assert_array_equal(np.nan_to_num(got.numpy()), np.nan_to_num(ref))


def test_unsupported_type_and_bad_sizes_are_refused():
    with pytest.raises(dequant.UnsupportedType, match="unsupported type Q8_K; supported: .*IQ3_XXS"):
        dequant.dequantize(torch.zeros(292, dtype=torch.uint8), T.Q8_K, (256,))
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        dequant.dequantize(torch.zeros(144, dtype=torch.uint8), T.Q4_K, (2, 128))
    with pytest.raises(ValueError, match="143 bytes"):
        dequant.dequantize(torch.zeros(143, dtype=torch.uint8), T.Q4_K, (256,))
    assert dequant.nbytes_of(T.Q6_K, 512) == 420


def test_cpu_broadcast_shape_follows_torch():
    """The CPU steps' own shape broadcast (torch.broadcast_shapes costs ~1 ms a call there)
    gives torch's shapes, and refuses what torch refuses."""
    pairs = [((3, 8, 1), (3, 8, 32)), ((5,), (1,)), ((2, 1, 4), (3, 1)), ((), (2, 3)), ((7, 1), (1, 7)),
             ((4, 16, 1), (4, 16, 16)), ((1,), ())]
    for a, b in pairs:
        assert dequant.broadcast_shape(a, b) == tuple(torch.broadcast_shapes(a, b)), (a, b)
    with pytest.raises(ValueError, match="do not broadcast"):
        dequant.broadcast_shape((3, 4), (5, 4))
    with pytest.raises(RuntimeError):
        torch.broadcast_shapes((3, 4), (5, 4))
