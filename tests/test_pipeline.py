"""The seeds' pipeline semantics on CPU stages: join vs overlap, digests, the finish guard."""
from __future__ import annotations

import gc
import threading
import time

import pytest

from engine.config import ConfigError, EngineConfig
from engine.events import busy_histogram
from engine.io import gguf_model
from engine.io.prompt import synthetic
from engine.pipeline.session import Cancelled, PipelineHooks, Session, StageError, split_layers

SLEEP = 0.012  # per layer: deterministic stage work that releases the GIL


@pytest.fixture(scope="module")
def demo(make_arch):
    """The demo's shapes with float weights: the sleep hook is the stages' work (the demo's own
    Q8_0 experts are expanded per call on the CPU, holding the GIL, which blurs the timing tests)."""
    return gguf_model.load(make_arch("qwen3moe", quant="f32"))


def stage_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("strata-stage")]


def sleepy(seconds: float = SLEEP, extra=None) -> PipelineHooks:
    def hook(stage, layer, chunk):
        time.sleep(seconds)
        if extra:
            extra(stage, layer, chunk)
    return PipelineHooks(after_layer=hook)


def compute(events, stage):
    return {e.chunk: e for e in events if e.kind == "compute" and e.stage == stage}


def run(demo, depth, devices=("cpu", "cpu"), tokens=128, chunk=16, hooks=None, **kw):
    cfg = EngineConfig(devices=list(devices), pipeline_depth=depth, chunk_tokens=chunk, **kw)
    sess = Session(demo, cfg, hooks=hooks)
    t0 = time.perf_counter()
    res = sess.run(synthetic(tokens, demo.spec.vocab, nonce=5))
    return res, sess.events, time.perf_counter() - t0


def test_join_waits_for_the_whole_chain(demo):
    res, events, _ = run(demo, 0, devices=("cpu", "cpu", "cpu"), hooks=sleepy())
    first, last = compute(events, 0), compute(events, 2)
    assert len(first) == len(last) == 8
    for c in range(7):
        assert first[c + 1].start_ns >= last[c].end_ns, \
            f"join: stage 0 started C{c + 1} before the last stage ended C{c}"
    assert any(e.kind == "wait" and e.note == "join" for e in events)


def test_overlap_fills_the_pipeline_and_is_faster(demo):
    join, _, _ = run(demo, 0, tokens=256, hooks=sleepy(0.02))
    over, events, _ = run(demo, 1, tokens=256, hooks=sleepy(0.02))
    t_join, t_over = join.report.prefill_s, over.report.prefill_s
    s0, s1 = compute(events, 0), compute(events, 1)
    overlapping = [c for c in range(15) if s0[c + 1].start_ns < s1[c].end_ns and s1[c].start_ns < s0[c + 1].end_ns]
    assert overlapping, "overlap: stage 0's C(c+1) never ran beside stage 1's Cc"
    assert t_join / t_over >= 1.5, f"join {t_join:.3f}s vs overlap {t_over:.3f}s"
    assert join.report.digest == over.report.digest  # reordering waits never changes arithmetic
    hist = over.report.busy_histogram
    assert len(hist) == 3 and hist[2] > 0.5 and abs(sum(hist) - 1) < 1e-9


def test_digests_identical_across_depth_stages_and_prefill_main(demo):
    digests = {}
    for name, kw in {
        "one stage": dict(devices=("cpu",), depth=1),
        "2 stages join": dict(devices=("cpu", "cpu"), depth=0),
        "2 stages overlap": dict(devices=("cpu", "cpu"), depth=1),
        "3 stages overlap": dict(devices=("cpu", "cpu", "cpu"), depth=1),
        "prefill-main": dict(devices=("cpu", "cpu"), depth=1, prefill_main=True),
    }.items():
        depth = kw.pop("depth")
        res, _, _ = run(demo, depth, tokens=96, chunk=32, **kw)
        digests[name] = res.report.digest
    assert len(set(digests.values())) == 1, digests


def test_prefill_main_then_split_decode_matches_split(demo):
    ids = synthetic(80, demo.spec.vocab, nonce=9)
    split = Session(demo, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=16)).run(ids, decode_tokens=5)
    sess = Session(demo, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=16, prefill_main=True))
    main = sess.run(ids, decode_tokens=5)
    assert main.report.generated == split.report.generated
    assert main.report.digest == split.report.digest
    kinds = {(e.stage, e.kind) for e in sess.events}
    assert (0, "compute") in kinds and (1, "compute") not in kinds  # the whole prompt on the main device
    kv_copies = [e for e in sess.events if e.kind == "copy" and e.stage == 1]
    assert len(kv_copies) == 1 and kv_copies[0].nbytes > 0 and "kv layers 2-3" in kv_copies[0].note
    assert {e.stage for e in sess.events if e.kind == "decode"} == {0, 1}  # decode stays split


def test_exception_in_a_stage_surfaces_with_context(demo):
    def boom(stage, layer, chunk):
        if stage == 2 and chunk == 5:
            raise RuntimeError("injected fault")
    cfg = EngineConfig(devices=["cpu", "cpu", "cpu"], chunk_tokens=16)
    sess = Session(demo, cfg, hooks=PipelineHooks(after_layer=boom))
    with pytest.raises(StageError) as ei:
        sess.run(synthetic(128, demo.spec.vocab, nonce=1))
    err = ei.value
    assert (err.stage, err.chunk) == (2, 5) and "injected fault" in str(err) and "stage 2 (cpu), chunk 5" in str(err)
    assert sess.in_flight() == 0 and len(sess.worker_threads()) <= len(sess.stages) - 1
    ok = sess.run(synthetic(128, demo.spec.vocab, nonce=1), hooks=PipelineHooks())  # this run without the fault
    clean = Session(demo, cfg).run(synthetic(128, demo.spec.vocab, nonce=1))
    assert ok.report.digest == clean.report.digest


@pytest.mark.parametrize("depth", [0, 1])
def test_cancel_returns_within_one_chunk(demo, depth):
    cancel = threading.Event()

    def hook(stage, layer, chunk):
        time.sleep(SLEEP)
        if stage == 0 and chunk == 3:
            cancel.set()
    sess = Session(demo, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=8, pipeline_depth=depth),
                   hooks=PipelineHooks(after_layer=hook))
    with pytest.raises(Cancelled) as ei:
        sess.run(synthetic(256, demo.spec.vocab), cancel=cancel)
    assert ei.value.report.cancelled and ei.value.report.per_stage[0].chunks == 4
    started = compute(ei.value.events, 0)
    assert max(started) == 3, "no chunk may start after the cancel"
    assert max(compute(ei.value.events, 1)) == 3, "chunks in flight were drained"
    assert sess.in_flight() == 0 and len(sess.worker_threads()) <= len(sess.stages) - 1
    sess.run(synthetic(64, demo.spec.vocab))  # the next run works


def test_finish_guard_never_returns_with_chunks_in_flight(demo):
    """Every compute event of every stage is recorded before prefill returns."""
    sess = Session(demo, EngineConfig(devices=["cpu"] * 3, chunk_tokens=16), hooks=sleepy())
    sess.run(synthetic(128, demo.spec.vocab, nonce=5))
    for s in range(3):
        assert sorted(compute(sess.events, s)) == list(range(8))
    assert sess.in_flight() == 0


def test_stage_workers_are_kept_between_runs_and_stopped_by_close(demo):
    """A fresh thread pays CUDA's per-thread set-up inside its first chunk: workers are kept."""
    sess = Session(demo, EngineConfig(devices=["cpu"] * 3, chunk_tokens=16))
    sess.run(synthetic(64, demo.spec.vocab, nonce=5))
    threads = sess.worker_threads()
    assert [t.name for t in threads] == ["strata-stage1", "strata-stage2"]
    sess.run(synthetic(64, demo.spec.vocab, nonce=6))
    assert sess.worker_threads() == threads and sess.in_flight() == 0
    sess.close()
    assert not any(t.is_alive() for t in threads) and sess.worker_threads() == []


def test_an_unclosed_session_does_not_keep_its_workers(demo):
    sess = Session(demo, EngineConfig(devices=["cpu"] * 2, chunk_tokens=16))
    sess.run(synthetic(64, demo.spec.vocab, nonce=5))
    (thread,) = sess.worker_threads()
    del sess
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


@pytest.mark.parametrize("settings, words", [
    (dict(pipeline_depth=2), ["pipeline_depth=2", "0 (join) or 1 (overlap)", "ONE set of chunk buffers"]),
    (dict(layer_split="2,3", devices="cpu,cpu"), ["layer_split='2,3'", "summing to the model's 4 layers"]),
    (dict(layer_split="4,0", devices="cpu,cpu"), ["layer_split", "positive"]),
    (dict(layer_split="2,2", devices="cpu"), ["layer_split", "one per device"]),
    (dict(chunk_tokens="abc"), ["chunk_tokens='abc'", "chunk size"]),
])
def test_impossible_settings_are_refused(demo, settings, words):
    with pytest.raises(ConfigError) as ei:
        Session(demo, EngineConfig.from_sources(settings, env={}))
    for w in words:
        assert w in str(ei.value), str(ei.value)


def test_env_settings_and_precedence(demo):
    env = {"STRATA_PIPELINE_DEPTH": "0", "STRATA_PREFILL_MAIN": "1", "STRATA_CHUNK_TOKENS": "64"}
    cfg = EngineConfig.from_sources({"pipeline_depth": "1"}, env=env)
    assert (cfg.pipeline_depth, cfg.prefill_main, cfg.chunk_tokens) == (1, True, 64)
    with pytest.raises(ConfigError, match="STRATA_PIPELINE_DEPTH"):
        EngineConfig.from_sources({}, env={"STRATA_PIPELINE_DEPTH": "3"})
    assert EngineConfig.from_sources({"pipeline_depth": 0}, env={"STRATA_PIPELINE_DEPTH": "3"}).pipeline_depth == 0


def test_check_nan_names_stage_layer_and_chunk(demo):
    sess = Session(demo, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=16, check_nan=True))
    lay = sess.stages[1].layers[1]
    # poison layer 3's FFN norm in a copy: weights are views of the file's (copy-on-write) mapping,
    # which every session of this LoadedModel shares
    lay.w.ffn_norm = lay.w.ffn_norm.clone()
    lay.w.ffn_norm[0] = float("nan")
    with pytest.raises(StageError) as ei:
        sess.run(synthetic(64, demo.spec.vocab))
    assert (ei.value.stage, ei.value.layer, ei.value.chunk) == (1, 3, 0)
    assert "non-finite" in str(ei.value)


def test_auto_split_and_auto_chunk(demo):
    assert split_layers(48, 2, "auto") == [(0, 24), (24, 48)]
    assert split_layers(10, 3, "auto") == [(0, 4), (4, 7), (7, 10)]
    assert split_layers(4, 2, [1, 3]) == [(0, 1), (1, 4)]
    sess = Session(demo, EngineConfig(devices=["cpu", "cpu"]))
    chunk, why = sess.choose_chunk(4096)
    assert chunk in (16, 32, 64, 128, 256, 512, 1024, 2048) and "auto" in why


def test_busy_histogram_counts_concurrent_stages():
    from engine.events import StageEvent
    ev = [StageEvent("r", 0, "cpu", 0, "compute", 0, 10), StageEvent("r", 1, "cpu", 0, "compute", 5, 20),
          StageEvent("r", 0, "cpu", 1, "compute", 10, 12)]
    h = busy_histogram(ev, 2)
    assert h == pytest.approx([0.0, 13 / 20, 7 / 20])


def test_balanced_schedule_runs_its_planned_chunks_and_keeps_digests(demo):
    """chunk_schedule=balanced: as many chunks as the fixed size would make, bigger early and
    smaller late; every stage count and depth plans the same chunks (costs are measured once per
    process), so the digests agree."""
    ids = synthetic(512, demo.spec.vocab, nonce=9)
    seen = {}
    for devices, depth in ((["cpu"], 1), (["cpu", "cpu"], 1), (["cpu", "cpu"], 0), (["cpu"] * 3, 1)):
        cfg = EngineConfig(devices=devices, chunk_tokens=64, pipeline_depth=depth, chunk_schedule="balanced")
        sess = Session(demo, cfg)
        res = sess.run(ids, decode_tokens=3)
        plan = res.report.plan
        assert plan.schedule == "balanced" and plan.n_chunks <= 8 and len(plan.bounds) == plan.n_chunks
        assert sum(n for _, n in plan.bounds) == 512 and plan.chunk == max(n for _, n in plan.bounds)
        tokens = {e.chunk: e.tokens for e in sess.events if e.kind == "compute" and e.stage == 0}
        assert [tokens[c] for c in range(plan.n_chunks)] == [n for _, n in plan.bounds]
        assert "balanced" in plan.chunk_reason
        seen[(len(devices), depth)] = (plan.bounds, res.report.digest, tuple(res.report.generated))
        sess.close()
    assert len(set(seen.values())) == 1, seen
    fixed = Session(demo, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=64, chunk_schedule="fixed")).run(ids)
    assert fixed.report.plan.bounds == () and fixed.report.plan.n_chunks == 8


def test_a_run_owns_its_sink_hooks_and_events_and_leaves_the_session_as_it_was(demo):
    """session.run(sink=, hooks=) applies to that run only: the session's defaults stay, each
    Run carries its own events (what its sink saw), and a cancel carries its report and events."""
    sess = Session(demo, EngineConfig(devices=["cpu", "cpu"], prefill=16))
    seen: list = []
    layers: list = []
    ids = synthetic(64, demo.spec.vocab, nonce=3)
    first = sess.run(ids, 2, sink=seen.append, hooks=PipelineHooks(after_layer=lambda s, layer, c: layers.append(c)))
    assert sess.sink is None and sess.hooks.after_layer is None  # nothing rewired on the session
    assert first.events == seen and first.report.run_id == first.plan.run_id == first.events[0].run_id
    assert layers and first.digest == first.report.digest and first.last_logits is not None
    second = sess.run(ids, 2)
    assert len(seen) == len(first.events) and not {e.run_id for e in second.events} & {first.run_id}
    assert second.report.digest == first.report.digest and sess.events is second.events
    stop = threading.Event()

    def cancel_at(stage, layer, chunk):
        if chunk == 1:
            stop.set()
    with pytest.raises(Cancelled) as ei:
        sess.run(ids, cancel=stop, hooks=PipelineHooks(after_layer=cancel_at))
    cancelled = ei.value
    assert cancelled.report is not None and cancelled.report.cancelled
    assert cancelled.events and {e.run_id for e in cancelled.events} == {cancelled.report.run_id}
    assert sess.in_flight() == 0
    sess.close()
