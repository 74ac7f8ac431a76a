"""Greedy decode against the prefill path's argmax continuation (tests on CPU and CUDA)."""
from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.io.prompt import synthetic
from engine.pipeline.session import Session


def decode_and_prefill(src, devices: list[str], dtype: str, decode: int = 6,
                       prompt: int = 11, **config) -> tuple[list[int], torch.Tensor]:
    """(tokens decoded greedily after a prompt, the logits of ONE prefill pass over prompt +
    decoded[:-1] at the positions that predicted them: row j predicted decoded[j]).

    Decode runs one token per step (KV appended step by step, CUDA graphs of size 1 where on);
    the prefill runs the whole sequence as one chunk."""
    ids = synthetic(prompt, src.spec.vocab, nonce=5)
    sess = Session(src, EngineConfig(devices=devices, chunk_tokens=4, dtype=dtype, **config))
    gen = sess.run(ids, decode_tokens=decode).report.generated
    sess.close()
    assert len(gen) == decode
    full = Session(src, EngineConfig(devices=devices, chunk_tokens=64, dtype=dtype, **config))
    logits = full.run(list(ids) + gen[:-1], logits_all=True).logits[prompt - 1:]
    full.close()
    return gen, logits


def disagreements(gen: list[int], logits: torch.Tensor, rel: float) -> list[int]:
    """Positions where decode's token is not the prefill argmax and not within `rel` of the
    largest logit there either (a real disagreement, not a rounding near-tie)."""
    top = logits.max(-1).values
    picked = logits[torch.arange(len(gen)), torch.tensor(gen)]
    return [j for j in range(len(gen))
            if int(logits[j].argmax()) != gen[j] and float(top[j] - picked[j]) > rel * float(top[j].abs())]
