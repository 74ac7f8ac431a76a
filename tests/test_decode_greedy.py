"""Greedy decode equals the prefill path's argmax continuation (issue 32's check), CPU.

Decode `N` tokens after a prompt, then prefill prompt + generated[:-1] in one pass: the argmax
of the logits at each position from the prompt's last on must be the token decode generated
there.  Decode runs one token per step through the split (KV appended step by step, on CPU
through the compact expert path); the check prefills everything at once (full expansion
wherever a chunk uses every expert), so the two share no code past the weights."""
from __future__ import annotations

import pytest
import torch
from decode_support import decode_and_prefill

from engine.config import EngineConfig
from engine.io import synth
from engine.io.prompt import synthetic
from engine.pipeline.session import Session

K_SHAPES = dict(hidden=256, head_dim=64, n_experts=16, expert_ffn=256, ffn=512)
DECODE = 6


def greedy_matches_prefill(src, devices: list[str], dtype: str) -> tuple[list[int], list[int]]:
    """(decoded tokens, argmax of one prefill pass over prompt + decoded[:-1])."""
    gen, logits = decode_and_prefill(src, devices, dtype, decode=DECODE)
    return gen, logits.argmax(-1).tolist()


@pytest.mark.parametrize("quant,dtype", [(q, "float32") for q in synth.QUANTS]  # every mix make-model writes
                         + [("f16", "bfloat16"), ("q4_k_m", "bfloat16")])
def test_greedy_decode_is_the_prefill_argmax(quant, dtype):
    src = synth.SyntheticSource(synth.recipe_from_args("demo", quant=quant, n_layers=2, **K_SHAPES), "cpu")
    gen, argmax = greedy_matches_prefill(src, ["cpu"], dtype)
    assert gen == argmax, f"{quant} {dtype}: decode {gen} vs prefill argmax {argmax}"


def test_greedy_decode_through_two_stages():
    src = synth.SyntheticSource(synth.recipe_from_args("demo", quant="q4_k_m", n_layers=2, **K_SHAPES), "cpu")
    gen, argmax = greedy_matches_prefill(src, ["cpu", "cpu"], "float32")
    assert gen == argmax
    one, _ = greedy_matches_prefill(src, ["cpu"], "float32")
    assert gen == one  # split and one device decode the same tokens


def test_decode_is_not_stuck_on_one_token():
    """The check means something only if decode moves: the tokens are not all the same."""
    src = synth.SyntheticSource(synth.recipe_from_args("demo", quant="q4_k_m", n_layers=2, **K_SHAPES), "cpu")
    ids = synthetic(11, src.spec.vocab, nonce=5)
    gen = Session(src, EngineConfig(devices=["cpu"], chunk_tokens=4)).run(ids, decode_tokens=DECODE).report.generated
    assert len(set(gen)) > 1, gen
    assert torch.tensor(gen).max() < src.spec.vocab
