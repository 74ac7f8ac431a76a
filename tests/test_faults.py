"""Injected faults through the engine API: each ends in a clear message, no thread is left,
memory is released, and the next run succeeds with the clean run's digest."""
from __future__ import annotations

import threading

import pytest

from engine.config import EngineConfig
from engine.io import gguf_model
from engine.io.prompt import synthetic
from engine.pipeline.session import Cancelled, DeviceMemoryError, PipelineHooks, Session, StageError

DEVICES = ["cpu", "cpu", "cpu"]


@pytest.fixture(scope="module")
def demo(demo_path):
    return gguf_model.load(demo_path)


@pytest.fixture(scope="module")
def clean(demo):
    return Session(demo, EngineConfig(devices=DEVICES, chunk_tokens=16)).run(
        synthetic(128, demo.spec.vocab, nonce=8), decode_tokens=3).report


def settled(sess) -> bool:
    """Nothing of the run is left working: no chunk in flight, every kept stage worker idle,
    no digest thread."""
    digest = [t for t in threading.enumerate() if t.name.startswith("strata-digest")]
    return sess.in_flight() == 0 and not digest and len(sess.worker_threads()) <= len(sess.stages) - 1


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("chunk", [0, 3, 7])
def test_an_exception_in_any_stage_at_any_chunk(demo, clean, stage, chunk):
    def boom(s, layer, c):
        if (s, c) == (stage, chunk):
            raise ValueError("injected")
    sess = Session(demo, EngineConfig(devices=DEVICES, chunk_tokens=16), hooks=PipelineHooks(after_layer=boom))
    with pytest.raises(StageError) as ei:
        sess.run(synthetic(128, demo.spec.vocab, nonce=8), decode_tokens=3)
    assert (ei.value.stage, ei.value.chunk) == (stage, chunk)
    assert f"stage {stage} (cpu), chunk {chunk}" in str(ei.value) and "injected" in str(ei.value)
    assert settled(sess)
    assert all(st.kvs == [] for st in sess.stages)  # per-run memory released
    again = sess.run(synthetic(128, demo.spec.vocab, nonce=8), decode_tokens=3, hooks=PipelineHooks()).report
    assert (again.digest, again.generated) == (clean.digest, clean.generated)


@pytest.mark.parametrize("what, words", [
    ("KV for layers 2-2", ["out of memory on cpu allocating KV for layers 2-2", "--layer-split"]),
    ("the chunk input buffer", ["chunk input buffer", "lower the chunk size"]),
])
def test_out_of_memory_names_device_what_and_what_to_change(demo, clean, what, words):
    armed = {"on": True}

    def oom(kind, device, nbytes):
        if armed["on"] and kind.startswith(what):
            raise MemoryError("simulated")
    sess = Session(demo, EngineConfig(devices=DEVICES, chunk_tokens=16), hooks=PipelineHooks(before_alloc=oom))
    with pytest.raises(DeviceMemoryError) as ei:
        sess.run(synthetic(128, demo.spec.vocab, nonce=8), decode_tokens=3)
    for w in words:
        assert w in str(ei.value), str(ei.value)
    assert settled(sess) and all(st.kvs == [] for st in sess.stages)
    armed["on"] = False
    again = sess.run(synthetic(128, demo.spec.vocab, nonce=8), decode_tokens=3).report
    assert again.digest == clean.digest


def test_out_of_memory_while_loading_weights_or_expert_cache(demo):
    def oom(kind, device, nbytes):
        if kind in ("the weights of layer 3", "an expert cache of 3 slots"):
            raise MemoryError("simulated")
    with pytest.raises(DeviceMemoryError, match="allocating the weights of layer 3.*--layer-split"):
        Session(demo, EngineConfig(devices=["cpu", "cpu"]), hooks=PipelineHooks(before_alloc=oom))
    one = sum(demo.nbytes(f"blk.0.{p}.weight") for p in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    tiny = 3 * one / demo.spec.n_experts / 2**30  # three experts as stored
    with pytest.raises(DeviceMemoryError, match="expert cache of 3 slots.*lower --expert-cache"):
        Session(demo, EngineConfig(expert_cache=tiny), hooks=PipelineHooks(before_alloc=oom))


def test_cancel_at_load_prefill_and_decode(demo, clean):
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Cancelled, match="loading cancelled"):
        Session(demo, EngineConfig(devices=DEVICES), cancel=cancel)

    sess = Session(demo, EngineConfig(devices=DEVICES, chunk_tokens=16))
    for phase in ("prefill", "decode"):
        stop = threading.Event()

        calls: list[tuple[int, int]] = []  # (layer, chunk) of every layer call

        def hook(s, layer, chunk, phase=phase, stop=stop, calls=calls):
            calls.append((layer, chunk))
            if phase == "prefill" and chunk == 2:
                stop.set()
            if phase == "decode" and chunk == -1:
                stop.set()
        with pytest.raises(Cancelled) as ei:
            sess.run(synthetic(128, demo.spec.vocab, nonce=8), decode_tokens=50, cancel=stop,
                     hooks=PipelineHooks(after_layer=hook))
        # stopped at the next boundary, not at the end (a count, not a clock): prefill took at most the
        # chunks already in flight (8 in all); decode at most the step under way (50 asked)
        if phase == "prefill":
            assert max(c for _, c in calls) <= 2 + len(DEVICES) and all(c >= 0 for _, c in calls)
        else:
            assert sum(c == -1 for _, c in calls) <= demo.spec.n_layers
        report = ei.value.report
        assert report.cancelled
        if phase == "decode":  # the prompt finished: its digest stands, no tokens are claimed
            assert report.digest == clean.digest and report.generated == []
        assert settled(sess)
    again = sess.run(synthetic(128, demo.spec.vocab, nonce=8), decode_tokens=3).report
    assert (again.digest, again.generated) == (clean.digest, clean.generated)
