"""benchmarks/mla_bench.py at DeepSeek-V3's attention shapes on CUDA (the GPU gate; skipped without
one), on a short prompt: each block runs on the engine's CUDA path (bf16, the attention kernel its
self-check chose) to finite outputs, MLA's chunks expand, and the KV bytes per token and layer are
bf16's: the latent and RoPE key (512 + 64) x 2 against 2 x KV heads x head_dim x 2."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("strata_mla_bench", ROOT / "benchmarks" / "mla_bench.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_deepseek_v3_attention_blocks_on_cuda():
    rows = bench.run(bench.parser().parse_args(["--device", "cuda:0", "--tokens", "1024", "--chunks", "512,1024",
                                                "--repeat", "1"]))
    assert {r.variant.name.split()[0] for r in rows} == {"MLA", "MHA", "GQA"} and len(rows) == 8
    assert all(r.kv_bytes_per_token == (512 + 64) * 2 for r in rows if r.variant.is_mla)
    kv = {(r.variant.spec.n_kv_heads, r.variant.spec.head_dim): r.kv_bytes_per_token for r in rows
          if not r.variant.is_mla}
    assert kv == {(128, 128): 2 * 128 * 128 * 2, (128, 192): 2 * 128 * 192 * 2, (8, 128): 2 * 8 * 128 * 2}
    assert all(r.kv_bytes_per_token == r.plan_bytes_per_token for r in rows)
    assert all(r.form == "expanded" for r in rows if r.variant.is_mla)
    assert all(r.seconds > 0 and r.tflops > 0 for r in rows)
