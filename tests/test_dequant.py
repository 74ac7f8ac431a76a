"""engine.dequant against gguf's numpy dequantiser, bit for bit, on random blocks (CPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from dequant_support import ALL_TYPES, check_type, random_blocks
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from engine import dequant

# random bytes include NaN/inf scales: numpy warns while computing the reference
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def test_every_type_the_issue_lists_is_supported():
    wanted = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
              "IQ4_NL", "IQ4_XS", "BF16", "F16", "F32"}
    assert {t.name for t in dequant.SUPPORTED} == wanted


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bit_exact_against_gguf(qtype, seed):
    check_type(qtype, "cpu", rows=11, blocks_per_row=5, seed=seed)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.IQ4_XS, T.Q5_1], ids=lambda t: t.name)
def test_three_dimensional_tensor_and_chunked_out(monkeypatch, qtype):
    """Expert tensors are [E, f, d]; writing into a preallocated scratch in small steps gives
    the same values as one call, and bf16 output is the cast of the float32 result."""
    raw, (rows, cols) = random_blocks(qtype, 12, 2, seed=5)
    ref = gguf_quants.dequantize(raw, qtype).reshape(3, 4, cols)
    t = torch.from_numpy(raw)
    one = dequant.dequantize(t, qtype, (3, 4, cols))
    monkeypatch.setattr(dequant, "CHUNK_BLOCKS", 5)
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
    with pytest.raises(dequant.UnsupportedType, match="unsupported type IQ2_XXS; supported: .*Q4_K"):
        dequant.dequantize(torch.zeros(66, dtype=torch.uint8), T.IQ2_XXS, (256,))
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        dequant.dequantize(torch.zeros(144, dtype=torch.uint8), T.Q4_K, (2, 128))
    with pytest.raises(ValueError, match="143 bytes"):
        dequant.dequantize(torch.zeros(143, dtype=torch.uint8), T.Q4_K, (256,))
    assert dequant.nbytes_of(T.Q6_K, 512) == 420
