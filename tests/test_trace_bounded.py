"""Issue 19, items 1 and 3: trace import with memory bounded by construction.

Every file is generated here.  Memory figures are the peak RSS of a fresh process (VmHWM), so they
include everything the import holds, not just what tracemalloc sees."""
from __future__ import annotations

import gzip
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.io import atomic_file, trace
from engine.io.trace import TraceError

ROOT = Path(__file__).resolve().parent.parent
SLICE = {"run_id": "r", "stage": 0, "device": "cpu", "chunk": 0, "kind": "compute", "start_ns": 1, "end_ns": 2,
         "tokens": 4, "nbytes": 0, "note": ""}


def _minimal(path: Path, n: int, gz: bool = False) -> int:
    """n foreign slices of about 50 bytes; returns the JSON's size."""
    body = '{"traceEvents":[' + ",".join(f'{{"ph":"X","ts":{i},"dur":1,"pid":1,"cat":"compute"}}'
                                         for i in range(n)) + "]}"
    data = body.encode()
    path.write_bytes(gzip.compress(data, 1) if gz else data)
    return len(data)


def test_a_huge_pid_is_refused_at_once_and_nothing_is_sized_from_it(tmp_path):
    """The 84-byte trace that took all memory: one slice with pid 10^9 and no report."""
    p = tmp_path / "pid.json"
    p.write_bytes(b'{"traceEvents":[{"ph":"X","ts":0,"dur":1,"pid":1000000000,"cat":"compute"}]}')
    from strata_gui.run import run_files

    with pytest.raises(TraceError, match="slice 0 is malformed: pid - 1 .* outside 0..255"):
        run_files.import_trace(p)  # refused at slice 0: nothing sized from the pid


def test_the_event_cap_stops_the_parse_not_the_end_of_it(tmp_path):
    p = tmp_path / "many.json"
    _minimal(p, 60_000)
    with pytest.raises(TraceError, match="more than 1,000 slices"):
        trace.load(p, max_events=1_000)
    events, _ = trace.load(p)  # 60k small slices fit in the 16 MiB slack
    assert len(events) == 60_000 and events[-1].start_ns == 59_999_000
    # stopped after ~1,000 slices, not after reading them all: with the file's end broken, the
    # cap still answers first (a parse that read to the end would meet the broken JSON first)
    cut = tmp_path / "cut.json"
    cut.write_bytes(p.read_bytes()[: -len("]}") - 200] + b"#not json")
    with pytest.raises(TraceError, match="more than 1,000 slices"):
        trace.load(cut, max_events=1_000)
    with pytest.raises(TraceError) as whole:
        trace.load(cut)
    assert "1,000 slices" not in str(whole.value)


def test_tiny_slices_are_refused_by_the_memory_ratio_while_parsing(tmp_path):
    """50-byte slices cost ~350 bytes each in an import: past 3x the JSON read (+16 MiB) they are refused."""
    p = tmp_path / "tiny.json.gz"
    json_bytes = _minimal(p, 1_000_000, gz=True)
    with pytest.raises(TraceError, match=r"more than 3x the trace's [\d,]+ bytes in memory"):
        trace.load(p)
    assert json_bytes > 40 << 20  # the whole file was not what stopped it


def test_the_memory_cap_is_a_hard_limit(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": [{"ph": "X", "args": {**SLICE, "chunk": i}} for i in range(5_000)]}))
    with pytest.raises(TraceError, match="more than 1 MiB of memory"):
        trace.load(p, max_memory=1 << 20)
    assert len(trace.load(p)[0]) == 5_000


def test_metadata_is_capped_and_charged(tmp_path):
    p = tmp_path / "meta.json"
    p.write_text('{"otherData":{"x":[' + ",".join(["{}"] * 400_000) + ']},"traceEvents":[]}')
    with pytest.raises(TraceError, match="otherData would take more than 3x"):  # 1.2 MB of '{}' is ~30 MB of dicts
        trace.load(p)
    p.write_text('{"otherData":{"x":"' + "a" * (9 << 20) + '"},"traceEvents":[]}')
    with pytest.raises(TraceError, match="longer than 8388608 characters"):
        trace.load(p)


def test_foreign_slices_before_otherdata_take_its_run_id(tmp_path):
    p = tmp_path / "order.json"
    p.write_text('{"traceEvents":[{"ph":"X","ts":1,"dur":2,"pid":2}],"otherData":{"run_id":"abc"}}')
    (ev,), meta = trace.load(p)
    assert ev.run_id == "abc" and ev.stage == 1 and ev.device == "2" and (ev.start_ns, ev.end_ns) == (1000, 3000)
    p.write_text('{"traceEvents":[{"ph":"X","ts":1}]}')
    assert trace.load(p)[0][0].run_id == "imported"


CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[3])
from pathlib import Path
from strata_gui.run import run_files
from strata_gui.history.history_model import RunHistory
def status(key):  # VmHWM, not ru_maxrss: that one keeps the forking parent's peak across exec
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
h = RunHistory(Path(sys.argv[2]))
base = status("VmRSS:")
run = h.add(run_files.import_trace(sys.argv[1]))
print(json.dumps({"run": run, "peak_above_base": status("VmHWM:") - base}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_peak_memory_of_an_import_is_within_3x_the_json(tmp_path):
    """A saved-format trace of 200k slices (~49 MB), imported and stored in a fresh process."""
    p = tmp_path / "saved.json"
    with p.open("w") as fh:
        fh.write('{"traceEvents":[')
        for i in range(200_000):
            t = 1_700_000_000_000_000_000 + i * 1000
            fh.write(("," if i else "") + json.dumps(
                {"ph": "X", "pid": i % 4 + 1, "tid": 1, "name": f"C{i // 4}", "cat": "compute", "ts": i, "dur": 1.0,
                 "args": {**SLICE, "stage": i % 4, "device": f"cuda:{i % 4}", "chunk": i // 4, "start_ns": t,
                          "end_ns": t + 900}}, separators=(",", ":")))
        fh.write("]}")
    size = p.stat().st_size
    out = subprocess.run([sys.executable, "-c", CHILD, str(p), str(tmp_path / "h.sqlite3"), str(ROOT)],
                         capture_output=True, text=True, check=True, timeout=300)
    peak = json.loads(out.stdout)["peak_above_base"]
    assert peak <= 3 * size, (peak, size)


def test_written_files_get_the_umask_mode_not_0600(tmp_path):
    p = tmp_path / "x.json"
    atomic_file.write_atomic(p, b"{}")
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~atomic_file.UMASK
    assert atomic_file.UMASK == _umask()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------------- property test
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                    st.text(max_size=8))
_json = st.recursive(_scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                     max_leaves=12)
_valid_args = st.fixed_dictionaries({
    "run_id": st.sampled_from(["r1", "r2"]), "stage": st.integers(0, 3), "device": st.sampled_from(["cpu", "cuda:0"]),
    "chunk": st.integers(-1, 5), "kind": st.sampled_from(["compute", "wait", "copy", "stream", "decode"]),
    "start_ns": st.integers(0, 10**6), "end_ns": st.integers(10**6, 2 * 10**6), "tokens": st.integers(0, 64),
    "nbytes": st.integers(0, 2**20), "note": st.text(max_size=4)})
_slice = st.one_of(
    st.builds(lambda a: {"ph": "X", "name": "C", "args": a}, _valid_args),
    st.builds(lambda ts, dur, pid, cat: {"ph": "X", "ts": ts, "dur": dur, "pid": pid, "cat": cat},
              st.floats(0, 1e9), st.floats(0, 1e6), st.one_of(st.integers(1, 4), st.integers(-5, 10**9), _scalar),
              st.sampled_from(["compute", "wait", "bogus"])),
    st.builds(lambda a, k, v: {"ph": "X", "args": {**a, k: v}}, _valid_args, st.sampled_from(sorted(SLICE)), _scalar),
    st.builds(lambda x: {"ph": "M", "args": x}, _json),
    _json,
)
_plan = st.fixed_dictionaries({
    "run_id": _scalar, "prompt_tokens": st.one_of(st.integers(0, 10**6), _scalar), "chunk": st.integers(0, 64),
    "n_chunks": st.one_of(st.integers(0, 9), _scalar), "decode_tokens": st.integers(0, 4),
    "handoff": st.one_of(st.just("host"), _scalar), "prefill_main": st.one_of(st.booleans(), _scalar),
    "pipeline_depth": st.one_of(st.sampled_from([0, 1]), _scalar),
    "stages": st.one_of(st.lists(st.fixed_dictionaries({"stage": st.integers(0, 3), "device": st.just("cpu"),
                                                         "first_layer": st.integers(0, 4),
                                                         "end_layer": st.one_of(st.integers(0, 4), _scalar)}),
                                 max_size=5), _json)})
_report = st.one_of(_json, st.fixed_dictionaries(
    {"run_id": st.one_of(st.just("r1"), _scalar), "plan": _plan, "prefill_tok_s": st.one_of(st.floats(0, 1e6), _scalar),
     "decode_tok_s": st.floats(0, 10), "prefill_s": st.floats(0, 10), "decode_s": st.floats(0, 10),
     "digest": st.one_of(st.just("ab"), _scalar), "generated": st.one_of(st.lists(st.integers(0, 9)), _json),
     "per_stage": st.one_of(st.just([]), _json), "busy_histogram": st.one_of(st.lists(st.floats(0, 1)), _json),
     "handoff": st.just("host"), "device_order": st.one_of(st.lists(st.just("cpu")), _json)}))


def _valid_report() -> dict:
    """The JSON form of a real report (stages 0-3, so every valid slice above fits its plan)."""
    from engine.events import StageEvent
    from strata_gui.run.record_model import report_from_events

    events = [StageEvent("r1", s, "cpu", 0, "compute", 10 * s, 10 * s + 5, 4) for s in range(4)]
    return report_from_events(events, "r1").to_dict()


_VALID_REPORT = _valid_report()
_REPORT_PATHS = [("run_id",), ("prefill_tok_s",), ("digest",), ("generated",), ("busy_histogram",), ("notes",),
                 ("plan", "prompt_tokens"), ("plan", "chunk"), ("plan", "pipeline_depth"), ("plan", "stages"),
                 ("plan", "handoff"), ("per_stage",), ("device_order",), ("cancelled",)]


def _mutated(path: tuple[str, ...], value) -> dict:
    rep = json.loads(json.dumps(_VALID_REPORT))
    node = rep
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return rep


_good_report = st.one_of(st.just(_VALID_REPORT), st.builds(_mutated, st.sampled_from(_REPORT_PATHS), _json))
_good_slice = st.builds(lambda a: {"ph": "X", "name": "C", "args": a}, _valid_args)
_doc = st.one_of(
    st.builds(lambda ev, rep: {"traceEvents": ev, "otherData": {"report": rep}},
              st.lists(st.one_of(_good_slice, _slice), min_size=1, max_size=8), _good_report),
    st.builds(lambda ev, rep: {"traceEvents": ev, "otherData": {"report": rep}}, st.lists(_slice, max_size=8), _report),
    st.builds(lambda ev, meta: {"traceEvents": ev, "otherData": meta}, st.lists(_slice, max_size=8), _json),
    st.builds(lambda ev: ev, st.lists(_slice, max_size=8)),
    _json)


@pytest.fixture(scope="module")
def prop_history(tmp_path_factory):
    from strata_gui.history.history_model import RunHistory

    h = RunHistory(tmp_path_factory.mktemp("prop") / "history.sqlite3")
    yield h
    h.close()


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(doc=_doc)
def test_any_trace_document_imports_or_raises_traceerror_and_the_history_still_lists(doc, tmp_path, prop_history):
    from strata_gui.history.history_model import RunHistory
    from strata_gui.run import run_files

    p = tmp_path / "doc.json"
    p.write_text(json.dumps(doc))
    try:
        record = run_files.import_trace(p, max_bytes=1 << 20, max_events=100)
    except TraceError:
        event("refused")
        return
    derived = any("figures derived" in n for n in record.report.notes)
    event("imported, figures derived from the events" if derived else "imported with its report")
    run = prop_history.add(record)
    rows = prop_history.list_runs()
    assert rows[0].id == run and not rows[0].problem()
    assert f"#{run}" in rows[0].title()  # formats without error
    again = prop_history.get(run)
    assert again.events == record.events
    with RunHistory(prop_history.path) as reopened:  # opens (quick_check) and lists
        assert reopened.count() == prop_history.count()


def test_items_that_are_not_slices_are_capped_too(tmp_path):
    """128M items of `0,` fit in 256 MiB: parsing them all would take minutes for nothing."""
    p = tmp_path / "zeros.json"
    p.write_text('{"traceEvents":[' + ",".join(["0"] * 3_000) + "]}")
    with pytest.raises(TraceError, match="more than 2,000 items in traceEvents"):
        trace.load(p, max_events=1_000)
    assert trace.load(p, max_events=1_500)[0] == []
