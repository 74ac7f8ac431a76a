"""Interleaved layer groups (`layer_split=interleave:V`) on CPU stages: a chunk visits every
device V times, the seeds' semantics hold per hop, and the arithmetic is the contiguous split's."""
from __future__ import annotations

import threading
import time

import pytest

from engine.config import ConfigError, EngineConfig
from engine.io import gguf_model
from engine.io.prompt import synthetic
from engine.pipeline.session import Cancelled, PipelineHooks, Session, StageError

SLEEP = 0.004  # per layer: deterministic work that releases the GIL


@pytest.fixture(scope="module")
def deep(make_arch):
    """12 MoE layers: room for 3 devices x 3 groups (the demo model has 4)."""
    return gguf_model.load(make_arch("qwen3moe", n_layers=12))


def session(model, devices, v: int, depth: int = 1, chunk: int = 16, hooks=None) -> Session:
    cfg = EngineConfig.from_sources({"devices": ",".join(devices), "layer_split": f"interleave:{v}",
                                     "pipeline_depth": str(depth), "chunk_tokens": str(chunk)})
    return Session(model, cfg, hooks=hooks)


def computes(events, stage):
    return {e.chunk: e for e in events if e.kind == "compute" and e.stage == stage}


@pytest.mark.parametrize("n_dev,v", [(2, 2), (2, 3), (3, 2), (3, 3)])
def test_groups_visit_each_device_v_times_with_the_contiguous_digest(deep, n_dev, v):
    devices = ["cpu"] * n_dev
    ids = synthetic(96, deep.spec.vocab, nonce=4)
    contiguous = Session(deep, EngineConfig(devices=devices, chunk_tokens=16)).run(ids, 3).report
    sess = session(deep, devices, v)
    rep = sess.run(ids, 3).report
    plan = rep.plan
    assert plan.interleave == v and len(plan.stages) == n_dev * v and plan.n_lanes == n_dev
    covered = [layer for s in plan.stages for layer in range(s.first_layer, s.end_layer)]
    assert covered == list(range(12))  # groups in order, every layer once
    assert [plan.lane_of(s.stage) for s in plan.stages] == [j % n_dev for j in range(n_dev * v)]
    assert rep.digest == contiguous.digest and rep.generated == contiguous.generated
    for s in range(n_dev * v):
        assert sorted(computes(sess.events, s)) == list(range(plan.n_chunks))  # every group, every chunk
    assert len(rep.busy_histogram) == n_dev + 1  # counted per device, not per group
    hops = [e for e in sess.events if e.kind == "copy" and e.chunk >= 0]
    assert len(hops) == (n_dev * v - 1) * plan.n_chunks and rep.handoff_bytes == sum(e.nbytes for e in hops) > 0
    assert plan.stage_names()[2].startswith("g2 · cpu (layers ")
    sess.close()


def test_join_and_overlap_hold_per_hop(deep):
    join = session(deep, ["cpu", "cpu"], 2, depth=0, hooks=PipelineHooks(after_layer=lambda *a: time.sleep(SLEEP)))
    join.run(synthetic(128, deep.spec.vocab, nonce=2))
    first, last = computes(join.events, 0), computes(join.events, 3)
    for c in range(len(first) - 1):  # join: the next chunk starts after the chain's last group
        assert first[c + 1].start_ns >= last[c].end_ns
    over = session(deep, ["cpu", "cpu"], 2, depth=1, hooks=PipelineHooks(after_layer=lambda *a: time.sleep(SLEEP)))
    over.run(synthetic(128, deep.spec.vocab, nonce=2))
    g0, g1 = computes(over.events, 0), computes(over.events, 1)
    assert any(g0[c + 1].start_ns < g1[c].end_ns for c in range(len(g0) - 1)), "overlap never happened"
    assert over.in_flight() == 0 and join.in_flight() == 0
    join.close()
    over.close()


@pytest.mark.parametrize("group,chunk", [(0, 0), (3, 2), (5, 4)])
def test_a_fault_in_any_group_names_device_group_and_chunk(deep, group, chunk):
    def boom(stage, layer, c):
        if stage == group and c == chunk:
            raise RuntimeError("injected fault")
    sess = session(deep, ["cpu", "cpu", "cpu"], 2, hooks=PipelineHooks(after_layer=boom))
    with pytest.raises(StageError) as ei:
        sess.run(synthetic(96, deep.spec.vocab, nonce=1))
    assert (ei.value.stage, ei.value.chunk, ei.value.device) == (group, chunk, "cpu")
    assert sess.in_flight() == 0
    # the next run works
    assert sess.run(synthetic(32, deep.spec.vocab), hooks=PipelineHooks()).report.plan.n_chunks == 2
    sess.close()
    assert not [t for t in sess.worker_threads() if t.is_alive()]


def test_cancel_lands_within_one_chunk(deep):
    cancel = threading.Event()

    def hook(stage, layer, chunk):
        time.sleep(SLEEP)
        if stage == 0 and chunk == 2:
            cancel.set()
    sess = session(deep, ["cpu", "cpu"], 2, chunk=8, hooks=PipelineHooks(after_layer=hook))
    with pytest.raises(Cancelled) as ei:
        sess.run(synthetic(256, deep.spec.vocab), cancel=cancel)
    assert max(computes(ei.value.events, 0)) == 2 and max(computes(ei.value.events, 3)) == 2
    assert sess.in_flight() == 0
    sess.close()


@pytest.mark.parametrize("value,words", [("interleave:0", "interleave:V"), ("interleave:x", "interleave:V"),
                                         ("interleave:7", "layers")])
def test_impossible_interleaves_are_refused(deep, value, words):
    with pytest.raises(ConfigError) as ei:
        cfg = EngineConfig.from_sources({"devices": "cpu,cpu", "layer_split": value})
        Session(deep, cfg)
    assert "layer_split" in str(ei.value) and words in str(ei.value)
