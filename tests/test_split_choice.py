"""layer_split=auto over several devices: the split (contiguous or interleave:V) is chosen per
prompt from measured costs, the session rebuilt for it, the choice said in the report, and the
numbers are the contiguous split's."""
from __future__ import annotations

import argparse

import pytest

from engine.cli import bench
from engine.config import EngineConfig
from engine.io import gguf_model
from engine.io.prompt import synthetic
from engine.pipeline.session import Session
from engine.plan import split_choice
from engine.plan.chunking import ChunkCost

T = 0.05  # modelled seconds per layer for any chunk: the fill/drain bubble decides


@pytest.fixture(scope="module")
def demo(make_arch):
    return gguf_model.load(make_arch("qwen3moe", quant="f32"))


@pytest.fixture
def two_devices(monkeypatch):
    """The two CPU stages counted as two devices (as two GPUs are): the choice's logic on CPU."""
    monkeypatch.setattr(split_choice, "distinct_devices", lambda config: len(config.devices))


def costed(sess: Session) -> Session:
    """The session with a chunk cost the test knows: every chunk T per layer, no attention term."""
    real = sess.chunk_cost()
    sess._chunk_cost = ChunkCost({c: T for c in real.layer_s}, 0.0, 0.0, real.layers_per_stage)
    return sess


def test_two_chunks_over_two_devices_pick_interleave_and_rebuild(demo, two_devices):
    user = EngineConfig.from_sources({"devices": "cpu,cpu", "prefill": 128})
    sess = costed(Session(demo, user, events=False))
    choice = split_choice.choose_split(sess, user, 256)
    # contiguous: 2 chunks + 1 of fill/drain = 3 T per device; interleave:2: 2 + 1/2
    assert choice is not None and choice.interleave == 2
    assert choice.modelled_s[2] < choice.modelled_s[1] * 0.9
    assert "interleave:2" in choice.reason and "contiguous" in choice.reason
    ids = synthetic(256, demo.spec.vocab, nonce=2)
    contiguous = sess.run(ids, 0).report
    ns = argparse.Namespace(no_events=True, quiet=True)
    name, rebuilt = bench._split_for(demo, user, sess, "base", 256, ns)
    try:
        assert rebuilt is not sess and rebuilt.interleave == 2 and len(rebuilt.stages) == 4
        report = rebuilt.run(ids, 0).report
        assert report.plan.interleave == 2
        assert any(n.startswith("layer split auto: interleave:2") for n in report.notes)
        assert report.digest == contiguous.digest  # the split changes where layers run, not the numbers
    finally:
        rebuilt.close()


def test_many_chunks_keep_the_contiguous_split_without_a_rebuild(demo, two_devices):
    user = EngineConfig.from_sources({"devices": "cpu,cpu", "prefill": 8})
    sess = costed(Session(demo, user, events=False))
    try:
        choice = split_choice.choose_split(sess, user, 256)
        # 32 chunks: 33 T against 32.5 T — under the 3% a rebuild must buy
        assert choice is not None and choice.interleave == 1
        name, same = bench._split_for(demo, user, sess, "base", 256, argparse.Namespace(no_events=True, quiet=True))
        assert same is sess
        assert any(n.startswith("layer split auto: a contiguous split") for n in sess.run(
            synthetic(64, demo.spec.vocab), 0).report.notes)
    finally:
        sess.close()


@pytest.mark.parametrize("settings", [{"devices": "cpu"}, {"devices": "cpu,cpu"}, {"devices": "cuda:0,cuda:0"},
                                      {"devices": "cpu,cpu", "layer_split": "2,2"},
                                      {"devices": "cpu,cpu", "layer_split": "interleave:2"},
                                      {"devices": "cpu,cpu", "prefill_main": True}])
def test_a_split_the_user_set_or_one_device_is_kept(demo, settings):
    user = EngineConfig.from_sources(settings)
    assert not split_choice.applies(user)
    if any(d.startswith("cuda") for d in user.devices):
        return  # validated only: this machine may have no GPU
    sess = Session(demo, user, events=False)
    try:
        assert split_choice.choose_split(sess, user, 256) is None
    finally:
        sess.close()


@pytest.mark.parametrize("n", [64, 256, 1024])
def test_auto_split_is_the_brute_force_best_over_splits_and_chunk_sizes(demo, n, two_devices):
    """The sleep-hook model of test_auto_model (fixed + per-token + prefix cost per layer): the
    split and chunk auto picks model within 5% of the best any (V, chunk size) models."""
    from engine.plan.chunking import bounds_makespan, chunk_bounds

    user = EngineConfig.from_sources({"devices": "cpu,cpu"})
    sess = Session(demo, user, events=False)
    try:
        real = sess.chunk_cost()
        sess._chunk_cost = cost = ChunkCost({c: 0.04 + 0.8e-3 * c for c in real.layer_s}, 0.4e-6, 0.0,
                                            real.layers_per_stage)
        choice = split_choice.choose_split(sess, user, n)
        hop = sess.hop_s_per_token()
        brute = min(bounds_makespan(chunk_bounds(n, c), 2, cost, v, hop) for v in (1, 2) for c in range(16, n + 1, 16))
        assert choice is not None
        assert choice.modelled_s[choice.interleave] <= brute * 1.05, (choice.reason, brute)
    finally:
        sess.close()
