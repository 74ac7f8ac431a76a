"""executor=processes on GPUs (skipped without CUDA): NCCL between distinct GPUs, gloo with host
staging for two stages on one GPU; digests equal to the threaded executor's, eager and graphed."""
from __future__ import annotations

import pytest
import torch
from executor_support import process_gone

from engine.config import EngineConfig
from engine.io import gguf_model
from engine.io.prompt import synthetic
from engine.pipeline.session import Session

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _both(demo, devices, backend, **kw):
    ids = synthetic(1024, demo.spec.vocab, nonce=7)
    cfg = EngineConfig(devices=list(devices), chunk_tokens=256, **kw)
    ref = Session(demo, cfg).run(ids, decode_tokens=4).report
    sess = Session(demo, cfg.replace(executor="processes"))
    try:
        assert sess.executor.backend == backend
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


def _tiny_cache(model) -> float:
    """GiB for 3 of a layer's 8 experts as stored: every chunk streams."""
    from engine.models.experts import EXPERT_PARTS

    return 0.4 * sum(model.nbytes(f"blk.0.{p}.weight") for p in EXPERT_PARTS) / 2**30


def _captured(notes) -> set[str]:
    """'layers A-B on DEV at chunk N' of every capture note."""
    return {n.split("CUDA graphs captured for ")[1].split(": ")[0] for n in notes if "CUDA graphs captured" in n}


@cuda
@pytest.mark.parametrize("streamed", [False, True])
def test_graphs_in_two_stage_processes_on_one_gpu_match_threads(demo_path, streamed):
    """Two stage processes on ONE GPU (gloo, host-staged): CUDA graphs on and off give the
    threaded executor's digest, tokens and logits bit for bit; with graphs on every stage
    captures its layers at the run's chunk size and its decode step as one graph in the first run
    and replays them in the second.  Streamed experts (a small cache, pinned in part) are never graphed."""
    model = gguf_model.load(demo_path)
    ids = synthetic(1024, model.spec.vocab, nonce=7)
    pin_gib = 0.0005
    extra = {"expert_cache": _tiny_cache(model), "pin_limit_gib": pin_gib} if streamed else {}
    cfg = EngineConfig(devices=["cuda:0", "cuda:0"], prefill=256, cuda_graphs=True, **extra)
    threaded = Session(model, cfg)
    ref = threaded.run(ids, decode_tokens=4, logits_all=True)
    threaded.close()
    want_captured = _captured(ref.report.notes)
    assert bool(want_captured) == (not streamed)  # the threads' own behaviour, as a check
    for graphs in (True, False):
        sess = Session(model, cfg.replace(executor="processes", cuda_graphs=graphs))
        try:
            assert sess.executor.backend == "gloo"
            runs = [sess.run(ids, decode_tokens=4, logits_all=True) for _ in range(2)]
            for k, res in enumerate(runs):
                rep = res.report
                assert (rep.digest, rep.generated) == (ref.report.digest, ref.report.generated), (graphs, k)
                assert torch.equal(res.last_logits, ref.last_logits) and torch.equal(res.logits, ref.logits)
                assert not any("capture failed" in n for n in rep.notes), rep.notes
            first, second = (_captured(r.report.notes) for r in runs)
            if graphs and not streamed:
                assert first == want_captured, (first, want_captured)
                assert "layers 0-1 on cuda:0 at chunk 256" in first
                decode = [n for n in runs[0].report.notes if n.startswith("decode: 1 graph per step")]
                assert {n.split(" at KV span")[0].split("for ")[1] for n in decode} == {
                    "layers 0-1 on cuda:0", "layers 2-3 on cuda:0"}, decode  # one graph per stage
                assert not second  # the second run replays what the first captured
                assert not any(n.startswith("decode: 1 graph") for n in runs[1].report.notes)
            else:
                assert not first and not second
            if streamed:
                stats = runs[1].report.expert_stats
                assert len(stats) == 2 and all(s["misses"] > 0 and s["bytes_pinned"] > 0 for s in stats), stats
                pinned = sum(m.arena[1] for m in sess.executor._job.members)
                assert 0 < pinned <= pin_gib * 2**30
                assert any(e.kind == "stream" for e in sess.events)
            pids = sess.stage_pids()
        finally:
            sess.close()
        assert all(process_gone(p) for p in pids)


@cuda
def test_the_chunk_cost_probe_of_a_stage_process_times_graph_replays(demo_path):
    """The chunk cost is measured in stage 0's process; with graphs on it times graph replays,
    whose host launch is a fraction of the eager layer's (about 10 launches instead of 50)."""
    model = gguf_model.load(demo_path)
    sess = Session(model, EngineConfig(devices=["cuda:0", "cuda:0"], executor="processes", cuda_graphs=True))
    try:
        job = sess.executor._job_or_start()
        eager = job.measure((256, 1024), 1024, 256, 2, False)
        graphed = job.measure((256, 1024), 1024, 256, 2, True)
        for layer_s, _attn_s, host_s in (eager, graphed):
            assert set(layer_s) == {256, 1024} and all(v > 0 for v in layer_s.values()) and host_s > 0
        assert graphed[2] < eager[2], f"graph replay launch {graphed[2] * 1e6:.0f} us, eager {eager[2] * 1e6:.0f} us"
        cost = sess.chunk_cost()  # prefill auto's path: graphs on, measured in the stage process
        assert cost.sizes and cost.host_s_per_layer > 0
        assert sess.run(synthetic(2048, model.spec.vocab, nonce=3), decode_tokens=2).report.digest
        pids = sess.stage_pids()
    finally:
        sess.close()
    assert all(process_gone(p) for p in pids)
