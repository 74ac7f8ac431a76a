"""Model families proven against their authors' code (issue 35): tiny random models of
transformers' own classes, converted by llama.cpp's convert_hf_to_gguf.py
(scripts/family_files.py made tests/data/families), run by the engine on the GGUF file and by
transformers on the safetensors it was converted from, fp32 on CPU, prompts of several chunks."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.io import gguf_model
from engine.io.prompt import synthetic
from engine.pipeline.session import Session

DATA = Path(__file__).parent / "data" / "families"
# family -> (transformers auto class, the architecture the file says)
FAMILIES = {"mixtral": ("AutoModelForCausalLM", "llama"), "qwen3vlmoe": ("AutoModelForImageTextToText", "qwen3vlmoe"),
            "qwen3next": ("AutoModelForCausalLM", "qwen3next")}
TOKENS = 48


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param


def reference_logits(family: str, ids: list[int]) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    auto = getattr(transformers, FAMILIES[family][0])
    model = auto.from_pretrained(str(DATA / family), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_the_file_is_the_converters(family):
    model = gguf_model.load(DATA / f"{family}.gguf")
    assert model.spec.arch == FAMILIES[family][1]
    assert model.spec.n_experts == 4 and model.spec.n_experts_used == 2


@pytest.mark.parametrize("devices,chunk,depth,main", [(["cpu"], 16, 1, False), (["cpu", "cpu"], 16, 0, False),
                                                      (["cpu", "cpu"], 32, 1, True)])
def test_logits_equal_transformers_on_the_weights_the_file_came_from(family, devices, chunk, depth, main):
    model = gguf_model.load(DATA / f"{family}.gguf")
    ids = synthetic(TOKENS, model.spec.vocab, nonce=3)
    ref = reference_logits(family, ids)
    sess = Session(model, EngineConfig(devices=devices, dtype="float32", chunk_tokens=chunk, pipeline_depth=depth,
                                       prefill_main=main))
    try:
        ours = sess.run(ids, decode_tokens=0, logits_all=True).logits
    finally:
        sess.close()
    assert (ours - ref).abs().max().item() <= 1e-4


def test_digest_is_the_same_over_stages_depths_executors_and_prefill_main(family):
    """(Chunk sizes change the arithmetic's order, so the logits test above covers them.)"""
    model = gguf_model.load(DATA / f"{family}.gguf")
    ids = synthetic(TOKENS, model.spec.vocab, nonce=4)
    digests = set()
    for cfg in (dict(devices=["cpu"], chunk_tokens=16), dict(devices=["cpu", "cpu"], chunk_tokens=16),
                dict(devices=["cpu", "cpu"], chunk_tokens=16, pipeline_depth=0),
                dict(devices=["cpu", "cpu"], chunk_tokens=16, prefill_main=True),
                dict(devices=["cpu", "cpu"], chunk_tokens=16, executor="processes")):
        sess = Session(model, EngineConfig(**cfg))
        try:
            digests.add(sess.run(ids, decode_tokens=2).report.digest)
        finally:
            sess.close()
    assert len(digests) == 1
