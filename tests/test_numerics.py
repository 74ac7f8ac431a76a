"""Logits of the engine against HF transformers loading the SAME GGUF file (fp32, CPU)."""
from __future__ import annotations

import pytest
import torch
from hf_reference import hf_model

from engine.config import EngineConfig
from engine.io import gguf_model
from engine.io.prompt import synthetic
from engine.pipeline.session import Session

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

PROMPT = 64
GEN = 8


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3", "qwen2", "llama"])
def test_logits_and_greedy_match_transformers(make_arch, arch):
    path = make_arch(arch)
    model = gguf_model.load(path)
    ids = synthetic(PROMPT, model.spec.vocab, nonce=7)
    sess = Session(model, EngineConfig(devices=["cpu"], chunk_tokens=PROMPT))
    res = sess.run(ids, decode_tokens=GEN, logits_all=True)
    ref_model = hf_model(path, model.spec)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
        gen = ref_model.generate(torch.tensor([ids]), max_new_tokens=GEN, do_sample=False)[0, PROMPT:].tolist()
    assert res.logits.shape == ref.shape == (PROMPT, model.spec.vocab)
    diff = (res.logits - ref).abs().max().item()
    assert diff <= 1e-4, f"{arch}: max |logits - HF| = {diff}"
    assert res.report.generated == gen


def test_chunked_prefill_equals_one_shot(demo_path):
    model = gguf_model.load(demo_path)
    ids = synthetic(160, model.spec.vocab, nonce=3)
    one = Session(model, EngineConfig(chunk_tokens=160)).run(ids, decode_tokens=6, logits_all=True)
    chunked = Session(model, EngineConfig(chunk_tokens=16)).run(ids, decode_tokens=6, logits_all=True)
    assert chunked.report.plan.n_chunks == 10
    assert (one.logits - chunked.logits).abs().max().item() <= 1e-5
    assert one.report.generated == chunked.report.generated


def test_digest_identifies_output(demo_path):
    model = gguf_model.load(demo_path)
    sess = Session(model, EngineConfig(chunk_tokens=32))
    a = sess.run(synthetic(96, model.spec.vocab, nonce=1)).report.digest
    b = sess.run(synthetic(96, model.spec.vocab, nonce=1)).report.digest
    c = sess.run(synthetic(96, model.spec.vocab, nonce=2)).report.digest
    assert a == b != c and len(a) == 32
