"""executor=processes on GPUs (skipped without CUDA): NCCL between distinct GPUs, gloo with host
staging for two stages on one GPU; digests equal to the threaded executor's, eager and graphed."""
from __future__ import annotations

import pytest
import torch
from executor_support import process_gone

from engine import gguf_model
from engine.config import EngineConfig
from engine.pipeline import Session
from engine.prompt import synthetic

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _both(demo, devices, backend, **kw):
    ids = synthetic(1024, demo.spec.vocab, nonce=7)
    cfg = EngineConfig(devices=list(devices), chunk_tokens=256, **kw)
    ref = Session(demo, cfg).run(ids, decode_tokens=4).report
    sess = Session(demo, cfg.replace(executor="processes"))
    try:
        assert sess.backend == backend
        for depth in (1, 0):
            sess.config = sess.config.replace(pipeline_depth=depth)
            rep = sess.run(ids, decode_tokens=4).report
            assert (rep.digest, rep.generated) == (ref.digest, ref.generated), f"depth {depth}"
            assert rep.handoff == backend and rep.handoff_bytes > 0
            assert {e.stage for e in sess.events if e.kind == "compute"} == set(range(len(devices)))
        pids = sess.stage_pids()
    finally:
        sess.close()
    assert all(process_gone(p) for p in pids)


@two_gpus
@pytest.mark.parametrize("graphs", [False, True])
def test_two_gpus_on_nccl_match_threads(demo_path, graphs):
    _both(gguf_model.load(demo_path), ("cuda:0", "cuda:1"), "nccl", cuda_graphs=graphs)


@cuda
def test_two_stages_on_one_gpu_go_through_gloo_and_match_threads(demo_path):
    _both(gguf_model.load(demo_path), ("cuda:0", "cuda:0"), "gloo", cuda_graphs=False)
