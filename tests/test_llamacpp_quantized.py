"""A file that llama.cpp's own quantizer made (issue 33): IQ3_S from `llama-quantize` without an
importance matrix (scripts/llamacpp_quant_files.sh made it from a random F32 qwen3moe), run by
the engine and by transformers loading the same file, in fp32 on CPU."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import hf_model

from engine.config import EngineConfig
from engine.io import gguf_model
from engine.io.prompt import synthetic
from engine.pipeline.session import Session

FILE = Path(__file__).parent / "data" / "qwen3moe-2L-iq3_s.llamacpp.gguf"


@pytest.fixture(scope="module")
def model():
    return gguf_model.load(FILE)


def test_the_file_holds_llamacpps_iq3_s_mix(model):
    mix = dict(model.quant_mix())
    assert "IQ3_S" in mix and mix["IQ3_S"] > 0.5, mix  # the experts and most matrices


@pytest.mark.parametrize("chunk", [16, 48])
def test_logits_equal_transformers_on_the_same_file(model, chunk):
    pytest.importorskip("transformers")
    ids = synthetic(48, model.spec.vocab, nonce=11)
    with torch.no_grad():
        ref = hf_model(FILE, model.spec)(torch.tensor([ids])).logits[0]
    ours = Session(model, EngineConfig(devices=["cpu", "cpu"], dtype="float32", chunk_tokens=chunk)).run(
        ids, decode_tokens=0, logits_all=True).logits
    assert (ours - ref).abs().max().item() <= 1e-4
