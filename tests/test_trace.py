"""Chrome trace export: the keys and units Perfetto needs, and an exact round trip."""
from __future__ import annotations

import gzip
import json

import pytest

from engine.config import EngineConfig
from engine.io import gguf_model, trace
from engine.io.prompt import synthetic
from engine.pipeline.session import Session


@pytest.fixture(scope="module")
def run_events(demo_path):
    model = gguf_model.load(demo_path)
    sess = Session(model, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=16))
    res = sess.run(synthetic(64, model.spec.vocab), decode_tokens=3)
    return sess.events, res.report


@pytest.mark.parametrize("name", ["t.json", "t.json.gz"])
def test_round_trip_gives_the_same_events(tmp_path, run_events, name):
    events, report = run_events
    p = trace.save(tmp_path / name, events, {"report": report})
    back, meta = trace.load(p)
    assert back == events
    assert meta["report"]["digest"] == report.digest
    if name.endswith(".gz"):
        assert p.read_bytes()[:2] == b"\x1f\x8b"


def test_trace_keys_units_lanes_and_flows(tmp_path, run_events):
    events, _ = run_events
    doc = json.loads(trace.save(tmp_path / "t.json", events).read_text())
    items = doc["traceEvents"]
    assert doc["displayTimeUnit"] == "ms"
    meta = [e for e in items if e["ph"] == "M"]
    assert {"process_name", "process_sort_index", "thread_name", "thread_sort_index"} <= {m["name"] for m in meta}
    slices = [e for e in items if e["ph"] == "X"]
    t0 = min(e.start_ns for e in events)
    for s in slices:
        assert {"pid", "tid", "ts", "dur", "name", "args"} <= s.keys()
        assert s["ts"] == pytest.approx((s["args"]["start_ns"] - t0) / 1000)  # microseconds
        assert s["dur"] == pytest.approx((s["args"]["end_ns"] - s["args"]["start_ns"]) / 1000)
    names = {s["name"] for s in slices if s["cat"] == "compute"}
    assert {"C0", "C1", "C2", "C3"} == names
    lanes: dict = {}
    for s in slices:
        lanes.setdefault((s["pid"], s["tid"]), []).append((s["ts"], s["ts"] + s["dur"]))
    for spans in lanes.values():  # slices in a lane never overlap
        spans.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:]))
    starts = [e for e in items if e["ph"] == "s"]
    ends = [e for e in items if e["ph"] == "f"]
    assert len(starts) == len(ends) == 4  # one hand-off per chunk from stage 0 to stage 1
    assert {e["pid"] for e in ends} == {2}


def test_bad_trace_files_give_clear_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [')
    with pytest.raises(trace.TraceError, match="not valid JSON"):
        trace.load(bad)
    gz = tmp_path / "bad.json.gz"
    gz.write_bytes(gzip.compress(b"[1, 2")[:-4])
    with pytest.raises(trace.TraceError):
        trace.load(gz)
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(trace.TraceError, match="traceEvents"):
        trace.load(other)
    with pytest.raises(trace.TraceError, match="file not found"):
        trace.load(tmp_path / "none.json")


def test_telemetry_becomes_counter_tracks(tmp_path, run_events):
    events, report = run_events
    assert report.telemetry == [] and report.telemetry_status == "unavailable: CPU stages only"
    t0 = min(e.start_ns for e in events)
    samples = [{"t_ns": t0 + 1_000_000 * i, "gpu": 1, "util_pct": 10.0 * i, "pcie_rx_gbs": None} for i in range(3)]
    doc = json.loads(trace.save(tmp_path / "t.json", events, telemetry=samples).read_text())
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    assert [c["args"]["util_pct"] for c in counters] == [0.0, 10.0, 20.0]
    assert {c["name"] for c in counters} == {"gpu1 util_pct"}
    assert [c["ts"] for c in counters] == [0.0, 1000.0, 2000.0]  # microseconds on the event clock
    assert trace.load(tmp_path / "t.json")[0] == events
