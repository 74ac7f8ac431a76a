"""A run to files and back, without the GUI: the Chrome trace round-trips the events exactly
(telemetry as counter tracks), the CSV holds every event, files are written atomically, and a
malformed, truncated, huge or foreign trace is refused with a message while the history keeps
what it had."""
from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import pytest
from history_support import demo_runs  # noqa: F401

from engine.io import atomic_file, trace
from engine.io.trace import TraceError
from strata_gui.history.history_model import RunHistory
from strata_gui.run.record_model import RunRecord
from strata_gui.run.run_files import events_csv, export_events_csv, export_trace, import_trace


@pytest.mark.parametrize("name", ["run.json", "run.json.gz"])
def test_export_then_import_round_trips_the_run_exactly(tmp_path, demo_runs, name):
    rec = demo_runs.join
    path = export_trace(rec, tmp_path / name)
    with RunHistory(tmp_path / "h.sqlite3") as h:
        run = h.add(import_trace(path))
        back = h.get(run)
    assert back.events == rec.events  # every field of every event, in order
    assert back.report == rec.report
    assert back.config == rec.config
    assert (back.source, back.status, back.label) == ("import", "finished", f"imported {name}")
    # what Perfetto reads: one process per stage, compute slices named C0..Cn, flow arrows
    raw = path.read_bytes()
    doc = json.loads(gzip.decompress(raw) if name.endswith(".gz") else raw)
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(rec.events)
    assert {e["name"] for e in slices if e["cat"] == "compute"} >= {"C0", "C3"}
    assert any(e["ph"] == "s" for e in doc["traceEvents"])
    assert doc["otherData"]["config"]["pipeline_depth"] == 0


def test_telemetry_becomes_counter_tracks_and_comes_back(tmp_path, demo_runs):
    rec = demo_runs.overlap
    t0 = rec.origin_ns
    # test input in the sampler's shape (this machine has no GPU to sample)
    samples = [{"t_ns": t0 + i * 1_000_000, "gpu": 0, "util_pct": 50 + i, "mem_used": 1 << 30,
                "pcie_tx_gbs": 1.5, "pcie_rx_gbs": None, "sm_clock_mhz": 1980, "power_w": 300.0, "temp_c": 60}
               for i in range(3)]
    rec.report.telemetry = samples
    try:
        path = export_trace(rec, tmp_path / "t.json")
    finally:
        rec.report.telemetry = []
    doc = json.loads(path.read_text())
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    assert {e["name"] for e in counters} >= {"gpu0 util_pct", "gpu0 pcie_tx_gbs", "gpu0 power_w"}
    assert [e["args"]["util_pct"] for e in counters if e["name"] == "gpu0 util_pct"] == [50, 51, 52]
    assert import_trace(path).telemetry == samples


def test_events_csv_has_every_event(tmp_path, demo_runs):
    rec = demo_runs.overlap
    path = export_events_csv(rec, tmp_path / "e.csv")
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == len(rec.events)
    e, r = rec.events[0], rows[0]
    assert (r["kind"], int(r["stage"]), int(r["start_ns"]), int(r["dur_ns"])) == \
        (e.kind, e.stage, e.start_ns, e.end_ns - e.start_ns)
    assert path.read_text() == events_csv(rec)


def test_a_failed_write_leaves_the_old_file_and_no_partial_one(tmp_path, demo_runs, monkeypatch):
    path = tmp_path / "run.json"
    path.write_text("the previous export")

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(atomic_file.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        export_trace(demo_runs.join, path)
    assert path.read_text() == "the previous export"
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temporary file left behind


def _bad_files(tmp_path: Path, good: Path) -> dict[str, tuple[Path, str]]:
    text = good.read_text()
    files = {}

    def put(name: str, data: str | bytes, expect: str) -> None:
        p = tmp_path / name
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
        files[name] = (p, expect)

    put("truncated.json", text[: len(text) // 2], "truncated or corrupt")
    put("garbage.json", b"\x00\xff\x10 not json at all", "not valid JSON")
    put("empty.json", b"", "not valid JSON")
    put("not-a-trace.json", json.dumps({"hello": "world"}), "not a Chrome trace")
    put("no-slices.json", json.dumps({"traceEvents": [{"ph": "M", "name": "process_name"}]}), "no pipeline stage")
    doc = json.loads(text)
    sl = next(e for e in doc["traceEvents"] if e["ph"] == "X")
    sl["args"]["stage"] = "two"
    put("bad-slice.json", json.dumps(doc), "is malformed")
    doc = json.loads(text)
    sl = next(e for e in doc["traceEvents"] if e["ph"] == "X")
    sl["args"]["end_ns"] = sl["args"]["start_ns"] - 5
    put("backwards.json", json.dumps(doc), "ends before it starts")
    doc = json.loads(text)
    next(e for e in doc["traceEvents"] if e["ph"] == "X")["args"]["kind"] = "teleport"
    put("unknown-kind.json", json.dumps(doc), "unknown kind")
    put("bad-gzip.json.gz", b"\x1f\x8b" + b"\x00" * 40, "cannot read")
    return files


def test_bad_trace_files_get_a_clear_message_and_change_nothing(tmp_path, demo_runs):
    good = export_trace(demo_runs.join, tmp_path / "good.json")
    with RunHistory(tmp_path / "h.sqlite3") as h:
        keep = h.add(demo_runs.overlap)
        for name, (path, expect) in _bad_files(tmp_path, good).items():
            with pytest.raises(TraceError) as info:
                h.add(import_trace(path))
            assert expect in str(info.value), (name, str(info.value))
            assert str(path) in str(info.value)
        with pytest.raises(TraceError, match="file not found"):
            import_trace(tmp_path / "missing.json")
        # huge: refused by size before it is read
        with pytest.raises(TraceError, match="above the 0 MiB an import may read"):
            import_trace(good, max_bytes=1024)
        # a gzip that inflates past the limit
        bomb = tmp_path / "bomb.json.gz"
        bomb.write_bytes(gzip.compress(b" " * (4 << 20)))
        with pytest.raises(TraceError, match="decompressed trace exceeds"):
            import_trace(bomb, max_bytes=1 << 20)
        assert [r.id for r in h.list_runs()] == [keep]
        assert h.get(keep).events == demo_runs.overlap.events


def test_a_foreign_trace_gets_figures_from_its_events(tmp_path, demo_runs):
    """A trace without the engine's report (e.g. edited by hand, or another tool's): the figures
    come from the events; compare still works on it."""
    rec = demo_runs.join
    path = trace.save(tmp_path / "bare.json", rec.events)  # no report, no settings
    imported = import_trace(path)
    assert imported.events == rec.events
    r = imported.report
    assert r.plan.prompt_tokens == rec.report.plan.prompt_tokens == 128
    assert r.plan.n_chunks == 4 and r.plan.chunk == 32 and len(r.plan.stages) == 2
    assert r.per_stage == rec.report.per_stage and r.busy_histogram == rec.report.busy_histogram
    assert r.prefill_tok_s > 0 and "derived from the trace's events" in r.notes[0]
    from strata_gui.history.compare_model import compare

    c = compare(RunRecord(rec.report, rec.events, rec.config), imported)
    assert c.metric("prefill tok/s").ratio is not None
