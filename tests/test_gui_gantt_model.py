"""The GUI's data side without widgets: the Gantt event store, the event batcher, run progress,
settings validation and the telemetry store."""
from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from engine.events import RunPlan, StageEvent, StagePlan
from engine.hw.topology import TelemetrySample
from strata_gui.run.event_batcher import EventBatcher
from strata_gui.run.gantt_model import EventStore
from strata_gui.run.progress_model import RunProgress
from strata_gui.run.settings_model import RunSettings, validate
from strata_gui.run.telemetry_model import TelemetryStore

MS = 1_000_000


def pipeline_events(run_id: str, n_stages: int, n_chunks: int, chunk_ns: int = MS, gap_ns: int = 100_000,
                    t0: int = 10**12) -> list[StageEvent]:
    """A filled pipeline: stage s computes chunk c at (c + s) slots, then hands it on."""
    out = []
    for c in range(n_chunks):
        for s in range(n_stages):
            start = t0 + (c + s) * (chunk_ns + gap_ns)
            out.append(StageEvent(run_id, s, "cpu", c, "compute", start, start + chunk_ns, tokens=256))
            if s < n_stages - 1:
                out.append(StageEvent(run_id, s, "cpu", c, "copy", start + chunk_ns, start + chunk_ns + gap_ns // 2,
                                      tokens=256, nbytes=256 * 512, note="host"))
    return out


def brute_visible(events: list[StageEvent], kind: str, a: int, b: int) -> set[tuple[int, int, int]]:
    return {(e.stage, e.chunk, e.start_ns) for e in events if e.kind == kind and e.end_ns >= a and e.start_ns <= b}


def test_100k_blocks_added_in_batches_visible_range_returns_only_blocks_in_range():
    events = [e for e in pipeline_events("r1", 4, 25_000) if e.kind == "compute"]
    assert len(events) == 100_000
    store = EventStore()
    store.reset("r1", events[0].start_ns, [(s, "cpu", s, s + 1) for s in range(4)])
    for i in range(0, len(events), 1_000):  # the worker's ~50 ms batches
        assert store.add(events[i:i + 1_000]) == len(events[i:i + 1_000])
    assert store.count("compute") == 100_000
    rng = random.Random(0)
    lo, hi = events[0].start_ns, max(e.end_ns for e in events)
    for _ in range(20):
        a = rng.randrange(lo, hi)
        b = a + rng.randrange(1, 200 * MS)
        got = store.visible("compute", a, b)
        assert np.all(got.end_ns >= a) and np.all(got.start_ns <= b)
        assert {(int(s), int(c), int(t)) for s, c, t in zip(got.stage, got.chunk, got.start_ns)} == \
            brute_visible(events, "compute", a, b)
    assert len(store.visible("compute", hi + 1, hi + MS)) == 0
    assert len(store.visible("compute", lo - 10 * MS, lo - 1)) == 0


def test_out_of_order_batches_query_the_same():
    events = pipeline_events("r", 3, 200)
    shuffled = events[:]
    random.Random(1).shuffle(shuffled)
    store = EventStore()
    store.reset("r", events[0].start_ns)
    for i in range(0, len(shuffled), 37):
        store.add(shuffled[i:i + 37])
    a, b = events[0].start_ns + 50 * MS, events[0].start_ns + 90 * MS
    for kind in ("compute", "copy"):
        got = store.visible(kind, a, b)
        assert {(int(s), int(c), int(t)) for s, c, t in zip(got.stage, got.chunk, got.start_ns)} == \
            brute_visible(events, kind, a, b)
        assert np.all(np.diff(store.blocks(kind, stage=0).start_ns) >= 0)


def test_visible_runs_merge_below_a_pixel_and_keep_extent():
    events = pipeline_events("r", 2, 10_000, chunk_ns=MS, gap_ns=10_000)
    store = EventStore()
    store.reset("r", events[0].start_ns)
    store.add(events)
    a, b = store.span_ns()
    exact = store.visible_runs("compute", a, b, min_gap_ns=0)
    assert len(exact) == 20_000 and not exact.merged
    px = (b - a) // 1_000  # a 1,000-pixel-wide view
    runs = store.visible_runs("compute", a, b, min_gap_ns=px, merge_above=600)
    assert runs.merged and len(runs) <= 2 * 1_000
    for s in (0, 1):
        m = runs.stage == s
        blocks = store.blocks("compute", stage=s)
        assert runs.start_ns[m].min() == blocks.start_ns.min()
        assert runs.end_ns[m].max() == blocks.end_ns.max()
    # a lane at or under merge_above is never merged (labels and borders stay exact)
    few = store.visible_runs("compute", a, a + 100 * MS, min_gap_ns=px, merge_above=600)
    assert not few.merged


def test_block_at_finds_the_block_under_the_cursor():
    events = pipeline_events("r", 2, 5)
    store = EventStore()
    store.reset("r", events[0].start_ns, [(0, "cpu", 0, 2), (1, "cpu", 2, 4)])
    store.add(events)
    c3 = next(e for e in events if e.kind == "compute" and e.stage == 1 and e.chunk == 3)
    b = store.block_at(1, (c3.start_ns + c3.end_ns) // 2)
    assert (b.kind, b.stage, b.chunk, b.tokens, b.device) == ("compute", 1, 3, 256, "cpu")
    copy0 = next(e for e in events if e.kind == "copy" and e.chunk == 0)
    b = store.block_at(0, copy0.start_ns + 1)
    assert b.kind == "copy" and b.note == "host" and b.nbytes == 256 * 512
    far = c3.end_ns + 10 * MS + 777
    assert store.block_at(1, far) is None or store.block_at(1, far).chunk != 3


def test_events_of_another_run_are_refused():
    store = EventStore()
    store.reset("mine", 0)
    added = store.add(pipeline_events("mine", 2, 3) + pipeline_events("stale", 2, 3))
    assert added == len(pipeline_events("mine", 2, 3))
    assert store.dropped == len(pipeline_events("stale", 2, 3))


def test_one_compute_block_per_stage_and_chunk_check():
    store = EventStore()
    store.reset("r", 0)
    store.add(pipeline_events("r", 2, 4))
    ok, what = store.one_compute_per_stage_chunk(2, 4)
    assert ok, what
    store.add([StageEvent("r", 1, "cpu", 2, "compute", 1, 2)])  # a duplicate
    ok, what = store.one_compute_per_stage_chunk(2, 4)
    assert not ok and "9 compute blocks" in what


def test_batcher_delivers_every_event_once_in_lists_and_flushes_on_stop():
    batches: list[list[StageEvent]] = []
    batcher = EventBatcher(batches.append, interval_s=0.02)
    batcher.start()

    def produce(stage: int) -> None:
        for i in range(5_000):
            batcher(StageEvent("r", stage, "cpu", i, "compute", i, i + 1))
            if i % 500 == 0:
                time.sleep(0.005)

    threads = [threading.Thread(target=produce, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batcher.stop()
    assert not batcher.running
    got = [e for b in batches for e in b]
    assert len(got) == 20_000 and len({(e.stage, e.chunk) for e in got}) == 20_000
    assert all(isinstance(b, list) and b for b in batches)
    assert 1 < len(batches) < 20_000  # coalesced, not one signal per event
    per_stage = {}
    for e in got:  # each producer's order is kept
        assert per_stage.get(e.stage, -1) < e.chunk
        per_stage[e.stage] = e.chunk


def _plan(n_stages: int, n_chunks: int, decode: int = 0, prefill_main: bool = False) -> RunPlan:
    return RunPlan("r", tuple(StagePlan(s, "cpu", s, s + 1) for s in range(n_stages)), n_chunks * 256, 256,
                   n_chunks, decode, "host", prefill_main, 1)


def test_progress_counts_the_last_stage_then_decode_steps():
    p = RunProgress(_plan(2, 4, decode=3))
    events = pipeline_events("r", 2, 4)
    p.add([e for e in events if e.stage == 0])
    snap = p.snapshot()
    assert (snap.phase, snap.chunks_done, snap.done) == ("prefill", 0, 0)
    p.add([e for e in events if e.stage == 1][:2])
    snap = p.snapshot()
    assert snap.chunks_done == 2 and snap.tokens_done == 512 and snap.tok_s > 0 and snap.seconds_left > 0
    assert "prefill 2/4 chunks" in snap.text()
    p.add(events)
    t = max(e.end_ns for e in events)
    p.add([StageEvent("r", s, "cpu", 1, "decode", t + s * 10, t + s * 10 + 5, tokens=1) for s in (0, 1)])
    snap = p.snapshot()
    assert (snap.phase, snap.chunks_done, snap.decode_done, snap.total) == ("decode", 4, 1, 6)
    p.add([StageEvent("r", 1, "cpu", 2, "decode", t + 100, t + 150, tokens=1)])
    assert p.snapshot().phase == "done" and p.snapshot().done == 6


def test_progress_with_prefill_main_counts_stage_0():
    p = RunProgress(_plan(2, 3, prefill_main=True))
    p.add([StageEvent("r", 0, "cpu", c, "compute", c * 10, c * 10 + 9, tokens=256) for c in range(3)])
    assert p.snapshot().chunks_done == 3 and p.snapshot().phase == "done"


@pytest.mark.parametrize("changes, field, words", [
    ({"split_mode": "manual", "split_counts": "3,3"}, "layer_split", ["layer_split", "3,3", "4 layers"]),
    ({"chunk_mode": "fixed", "chunk_tokens": "abc"}, "chunk_tokens", ["chunk_tokens", "abc", "chunk size"]),
    ({"pin_limit_gib": "-1"}, "pin_limit_gib", ["pin_limit_gib", "-1", "negative"]),
    ({"expert_cache": "lots"}, "expert_cache", ["expert_cache", "lots", "auto, all"]),
    ({"devices": "cpu,,cpu"}, "devices", ["devices"]),
    ({"devices": "cpu,cpu,cpu,cpu,cpu"}, "devices", ["at most 4 devices"]),
    ({"split_mode": "manual", "split_counts": "1,1,2"}, "layer_split", ["2 counts, one per device"]),
    ({"prompt_mode": "text", "prompt_text": "  "}, "prompt", ["prompt", "at least one token"]),
])
def test_validation_messages_are_the_engines(changes, field, words):
    v = validate(RunSettings(**changes), n_layers=4, env={})
    assert not v.ok and field in v.errors, v.errors
    for w in words:
        assert w in v.errors[field]


def test_validation_ok_gives_the_engine_config_and_env_problems_are_general():
    v = validate(RunSettings(devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="64"), 4, env={})
    assert v.ok and v.config.chunk_tokens == 64 and v.config.devices == ["cpu", "cpu"]
    v = validate(RunSettings(), 4, env={"STRATA_DBG_NAN": "maybe"})
    assert "STRATA_DBG_NAN" in v.errors["general"]
    v = validate(RunSettings(devices="cuda:0"), 4, env={}, cuda_count=0)
    assert "no CUDA" in v.errors["devices"]


def test_first_start_takes_valid_environment_values():
    s = RunSettings.from_env({"STRATA_PIPELINE_DEPTH": "0", "STRATA_CHUNK_TOKENS": "512", "STRATA_PREFILL_MAIN": "1",
                              "STRATA_GPU_ORDER": "nonsense"})
    assert (s.pipeline_depth, s.chunk_mode, s.chunk_tokens, s.prefill_main, s.gpu_order) == \
        (0, "fixed", "512", True, "pcie")
    loaded = RunSettings.from_dict({"pipeline_depth": "0", "prefill_main": "true", "decode_tokens": "x"})
    assert loaded.pipeline_depth == 0


def test_telemetry_store_series_on_the_run_clock():
    t = TelemetryStore()
    t.reset(origin_ns=1_000_000_000, available=True, reason="")
    t.add([TelemetrySample(1_500_000_000, 0, util_pct=40, pcie_tx_gbs=1.5),
           TelemetrySample(2_000_000_000, 0, util_pct=None, pcie_tx_gbs=2.0)])
    ts, util = t.series(0, "util_pct")
    assert ts.tolist() == [0.5, 1.0] and util[0] == 40 and np.isnan(util[1])
    with pytest.raises(ValueError):
        t.series(0, "nope")


def test_telemetry_store_appends_in_place_across_batches():
    t = TelemetryStore()
    t.reset(origin_ns=0, available=True, reason="")
    for b in range(40):  # 40 batches of 25 samples on 2 GPUs: past the first capacity
        t.add([TelemetrySample(10**6 * (25 * b + i), g, util_pct=float(i), mem_used=None) for i in range(25)
               for g in (0, 1)])
    ts, util = t.series(1, "util_pct")
    assert len(t) == 2000 and ts.size == 1000 and np.all(np.diff(ts) > 0)
    assert util[:25].tolist() == [float(i) for i in range(25)] and np.isnan(t.series(0, "mem_used")[1]).all()
    assert t.series(7, "util_pct")[0].size == 0
