"""One session run, closed after: the digest a test compares across settings; and the error measure
for logits of sessions in different dtypes."""
from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.pipeline.session import Session

# the settings whose digests must agree for every family: stages, depth, prefill-main, executor
SAME_DIGEST = (dict(devices=["cpu"]), dict(devices=["cpu", "cpu"]), dict(devices=["cpu", "cpu"], pipeline_depth=0),
               dict(devices=["cpu", "cpu"], prefill_main=True), dict(devices=["cpu", "cpu"], executor="processes"))


def run_digest(model, ids: list[int], chunk_tokens: int = 16, decode_tokens: int = 2, **settings) -> str:
    """The digest of one run of `ids` (and `decode_tokens` decoded) under these settings."""
    sess = Session(model, EngineConfig(chunk_tokens=chunk_tokens, **settings))
    try:
        return sess.run(ids, decode_tokens=decode_tokens).report.digest
    finally:
        sess.close()


def token_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The mean over tokens of each token's largest logit error, relative to the largest |logit|:
    the measure for bf16 sessions of random files that amplify rounding, where one token's largest
    error may reach the whole logit range under a right rule and a wrong one alike."""
    return ((got.float() - want.float()).abs().amax(-1) / want.float().abs().max().clamp_min(1e-6)).mean().item()
