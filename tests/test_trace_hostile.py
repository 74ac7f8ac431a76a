"""Hostile trace files: malformed, truncated, deeply nested, huge or gzip bombs.

Each gives `trace.load` a TraceError naming the file and the problem, in bounded time and memory
(RSS read from /proc/self/status; the kernel's peak mark is reset through /proc/self/clear_refs
where allowed).  The 1 GiB file is sparse, so the test costs no disk and no time.
"""
from __future__ import annotations

import contextlib
import gzip
import inspect
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.events import StageEvent
from engine.io import trace
from engine.io.trace import TraceError

MiB = 1 << 20
needs_proc = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="RSS is read from /proc")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


@contextlib.contextmanager
def peak_rss_growth() -> Iterator[dict[str, int]]:
    """Peak RSS during the block minus RSS before it, in bytes (an upper bound where the peak
    mark cannot be reset: then it is the growth of the process's lifetime peak)."""
    out: dict[str, int] = {}
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_bytes("VmRSS")
    except OSError:
        before = _status_bytes("VmHWM")
    yield out
    out["growth"] = max(0, _status_bytes("VmHWM") - before)


def _events(n: int = 12) -> list[StageEvent]:
    return [StageEvent("run-1", s, f"cpu:{s}", c, "compute" if c % 3 else "copy", 1_000 * c, 1_000 * c + 900,
                       16, 4096, "") for c in range(n) for s in range(2)]


@pytest.fixture()
def small(tmp_path: Path) -> dict[str, Path]:
    return {ext: trace.save(tmp_path / f"small.{ext}", _events(), {"run_id": "run-1"}) for ext in ("json", "json.gz")}


def expect(path: Path, *words: str, **kw) -> str:
    with pytest.raises(TraceError) as ei:
        trace.load(path, **kw)
    msg = str(ei.value)
    assert msg.startswith(f"{path}: ") and len(msg) < 600, msg
    for w in words:
        assert w in msg, msg
    return msg


# ---------------------------------------------------------------------------------- size
def test_the_default_limit_is_512_mib_and_a_parameter(small):
    assert trace.MAX_TRACE_BYTES == 512 * MiB
    assert inspect.signature(trace.load).parameters["max_bytes"].default == trace.MAX_TRACE_BYTES
    p = small["json"]
    size = p.stat().st_size
    expect(p, f"file is {size} bytes, above the {size - 1}-byte limit", max_bytes=size - 1)
    assert trace.load(p, max_bytes=size)[0] == _events()
    with pytest.raises(ValueError, match="max_bytes"):
        trace.load(p, max_bytes=-1)


@needs_proc
@pytest.mark.parametrize("name", ["huge.json", "huge.json.gz"])
def test_a_1_gib_file_is_refused_by_its_size_before_it_is_read(tmp_path, name):
    p = tmp_path / name
    with p.open("wb") as fh:  # sparse: no disk blocks, no time
        fh.write(b"\x1f\x8b" if name.endswith(".gz") else b'{"traceEvents": [')
        fh.truncate(1 << 30)
    try:
        with peak_rss_growth() as rss:
            expect(p, "file is 1073741824 bytes", f"above the {trace.MAX_TRACE_BYTES}-byte limit")
        assert rss["growth"] < 16 * MiB, rss
    finally:
        p.unlink()


@needs_proc
def test_a_gzip_bomb_is_stopped_at_the_limit_in_bounded_memory(tmp_path):
    bomb = tmp_path / "bomb.json.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as gz:  # 64 MiB of JSON whitespace in ~64 KiB
        gz.write(b"[")
        block = b" " * MiB
        for _ in range(64):
            gz.write(block)
        gz.write(b"]")
    assert bomb.stat().st_size < MiB
    with peak_rss_growth() as rss:
        expect(bomb, "decompressed trace exceeds 8388608 bytes", max_bytes=8 * MiB)
    assert rss["growth"] < 8 * MiB + 24 * MiB, rss  # the capped data plus one read chunk and slack
    assert trace.load(bomb, max_bytes=65 * MiB) == ([], {})  # under a higher limit it is just a big file


@needs_proc
def test_loading_a_large_valid_trace_costs_a_bounded_multiple_of_its_size(tmp_path):
    p = trace.save(tmp_path / "big.json", _events(20_000))
    with peak_rss_growth() as rss:
        events, _ = trace.load(p)
    assert len(events) == 40_000
    ratio = rss["growth"] / p.stat().st_size
    assert ratio < 12, f"{ratio:.1f}x the file's size"


# ------------------------------------------------------------------------------- nesting
@pytest.mark.parametrize("doc", [
    "[" * 100_000 + "]" * 100_000,
    '{"a":' * 100_000 + "1" + "}" * 100_000,
    '{"traceEvents": [{"ph": "X", "args": ' + "[" * 100_000 + "]" * 100_000 + "}]}",
    "[" * 100_000,  # and never closed
])
@pytest.mark.parametrize("gz", [False, True])
def test_deeply_nested_json_is_refused(tmp_path, doc, gz):
    p = tmp_path / ("deep.json.gz" if gz else "deep.json")
    p.write_bytes(gzip.compress(doc.encode()) if gz else doc.encode())
    expect(p, "nested more deeply than Python's recursion limit", str(sys.getrecursionlimit()))


def test_nesting_within_the_limit_is_fine(tmp_path):
    p = tmp_path / "nested.json"
    p.write_text(json.dumps({"traceEvents": [], "otherData": {"deep": json.loads("[" * 200 + "]" * 200)}}))
    events, meta = trace.load(p)
    assert events == [] and "deep" in meta


# ------------------------------------------------------------------------------ malformed
X = {"ph": "X", "ts": 1.0, "dur": 2.0, "pid": 1, "cat": "compute"}
SLICE = {"run_id": "r", "stage": 0, "device": "cpu", "chunk": 0, "kind": "compute", "start_ns": 0, "end_ns": 5}


def _doc(*events: dict, **top) -> bytes:
    return json.dumps({"traceEvents": list(events), **top}).encode()


@pytest.mark.parametrize("data, words", [
    (b"", ["not valid JSON", "truncated or corrupt"]),
    (b"\x00\xff\xfe garbage", ["not valid JSON"]),
    (b'{"traceEvents": [', ["not valid JSON", "truncated or corrupt"]),
    (b"[1, 2", ["not valid JSON"]),
    (b'{"traceEvents": 5}', ["not a Chrome trace"]),
    (b'"just a string"', ["not a Chrome trace"]),
    (b"1" * 5000, ["not valid JSON"]),  # an int of more digits than Python converts
    (_doc(X, otherData=[1, 2]), ["otherData is not an object"]),  # was AttributeError
    (_doc({**X, "ts": 1e308, "dur": 1e308}), ["slice 0 is malformed", "out of range"]),  # was OverflowError
    (b'{"traceEvents": [{"ph": "X", "ts": Infinity}]}', ["slice 0 is malformed", "finite number"]),  # OverflowError
    (b'{"traceEvents": [{"ph": "X", "ts": NaN}]}', ["slice 0 is malformed", "finite number"]),
    (_doc({**X, "ts": "soon"}), ["slice 0 is malformed", "ts is not a finite number: 'soon'"]),
    (_doc({"ph": "X"}), ["slice 0 is malformed", "missing 'ts'"]),
    (_doc({**X, "pid": [1]}), ["slice 0 is malformed", "pid is not an integer"]),
    (_doc({"ph": "X", "args": [1, 2]}), ["slice 0 is malformed", "args is not an object"]),
    (_doc({"ph": "X", "args": "start_ns"}), ["slice 0 is malformed", "args is not an object"]),
    (_doc({"ph": "X", "args": {**SLICE, "start_ns": 1e400}}), ["slice 0 is malformed", "start_ns"]),  # inf
    (_doc({"ph": "X", "args": {**SLICE, "stage": True}}), ["slice 0 is malformed", "stage is not an integer"]),
    (_doc({"ph": "X", "args": {**SLICE, "stage": 1.5}}), ["slice 0 is malformed", "stage is not an integer"]),
    (_doc({"ph": "X", "args": {**SLICE, "run_id": {"a": 1}}}), ["slice 0 is malformed", "run_id is not a string"]),
    (_doc({"ph": "X", "args": {k: v for k, v in SLICE.items() if k != "end_ns"}}), ["missing 'end_ns'"]),
    (_doc({"ph": "X", "args": {**SLICE, "kind": "k" * 10_000_000}}), ["slice 0 has unknown kind 'kkkk", "…"]),
])
def test_malformed_traces_get_a_clear_short_message(tmp_path, data, words):
    p = tmp_path / "bad.json"
    p.write_bytes(data)
    expect(p, *words)


@pytest.mark.parametrize("data, words", [
    (b"\x1f\x8b" + b"\x00" * 40, ["cannot read"]),
    (gzip.compress(b"[1, 2, 3]" * 1000)[:-12], ["cannot read", "EOFError"]),
    (gzip.compress(b'{"traceEvents": []}')[:-4] + b"\x00\x00\x00\x00", ["cannot read"]),  # wrong length
    (gzip.compress(b"not json"), ["not valid JSON"]),
])
def test_broken_gzip_files_get_a_clear_message(tmp_path, data, words):
    p = tmp_path / "bad.json.gz"
    p.write_bytes(data)
    expect(p, *words)


def test_corrupt_deflate_data_is_a_trace_error(tmp_path):
    """zlib.error is neither OSError nor EOFError: it escaped `load` before."""
    good = bytearray(gzip.compress(b"[1,2,3]" * 1000))
    good[20] ^= 0xFF
    good[30] ^= 0xFF
    p = tmp_path / "deflate.json.gz"
    p.write_bytes(bytes(good))
    expect(p, "cannot read", "error")


def test_a_directory_and_a_missing_file(tmp_path):
    expect(tmp_path, "not a regular file")
    expect(tmp_path / "none.json", "file not found")


# ------------------------------------------------------------------------ truncation, noise
@pytest.mark.parametrize("ext", ["json", "json.gz"])
def test_truncation_at_every_byte(tmp_path, ext):
    full = trace.save(tmp_path / f"full.{ext}", _events(2), {"run_id": "run-1"})
    data = full.read_bytes()
    p = tmp_path / f"cut.{ext}"
    for keep in range(len(data)):
        p.write_bytes(data[:keep])
        with pytest.raises(TraceError):
            trace.load(p)
    assert trace.load(full)[0] == _events(2)


@pytest.mark.parametrize("ext", ["json", "json.gz"])
def test_random_corruption_loads_or_raises_trace_error(tmp_path, small, ext):
    data = small[ext].read_bytes()
    rng = random.Random(f"trace-noise/{ext}")
    p = tmp_path / f"noise.{ext}"
    outcomes = {"loaded": 0, "TraceError": 0}
    for _ in range(400):
        buf = bytearray(data)
        for _ in range(rng.choice([1, 2, 4])):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        p.write_bytes(bytes(buf))
        try:
            trace.load(p)
            outcomes["loaded"] += 1
        except TraceError as exc:
            assert str(exc).startswith(f"{p}: ") and len(str(exc)) < 600
            outcomes["TraceError"] += 1
    assert outcomes["TraceError"] > 0, outcomes
