"""Chrome Trace Event JSON export/import (opens in Perfetto and chrome://tracing).

One process per stage/device, one lane (thread) per kind, so slices in a lane never overlap;
compute slices are named C0..Cn; flow arrows follow each hand-off to the successor's compute of
the same chunk; telemetry samples become counter tracks.  Exact nanosecond times travel in each
slice's args, so `load` gives back the very events that were written.
"""
from __future__ import annotations

import codecs
import gzip
import json
import logging
import math
import re
import sys
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, is_dataclass, replace
from pathlib import Path
from typing import Any

from engine.events import KINDS, StageEvent
from engine.io.atomic_file import write_atomic

log = logging.getLogger(__name__)

LANES = {"compute": 1, "copy": 2, "wait": 3, "stream": 4, "decode": 5}
# Default cap on a trace file and on the JSON a .gz inflates to; a file above it is refused from
# its size, before any of it is read.  Pass `max_bytes` to `load` for another cap.
MAX_TRACE_BYTES = 512 << 20
MAX_TRACE_EVENTS = 2_000_000  # slices a load keeps; the next one stops it while parsing
MAX_STAGES = 256  # stage numbers a trace may use (0..255): counts sized from stages stay small
# What a load may hold in Python objects: at most MAX_TRACE_MEMORY, and at most MEMORY_RATIO x the
# JSON read so far plus MEMORY_SLACK (so a small trace of small slices still loads).
MAX_TRACE_MEMORY = 1 << 30
MEMORY_RATIO = 3
MEMORY_SLACK = 16 << 20
# Charged per slice on top of its own objects: what an import holds besides the events while it
# derives a report from them (busy histogram marks, the lists of run_record.report_from_events),
# measured at ~130 bytes a slice on Python 3.11.  So the budget bounds the whole import, not just load.
DERIVE_BYTES = 160
MAX_ITEM_CHARS = 16 << 20  # one item of traceEvents (a slice with its args)
MAX_META_CHARS = 8 << 20  # otherData (the report, settings, telemetry) and any other top-level value
READ_CHUNK = 1 << 20  # read/inflate step: the text held beyond the value being parsed is one chunk
_DECODER = json.JSONDecoder()
_SCAN = _DECODER.scan_once  # the C scanner: (value, end) or StopIteration
_WS = re.compile(r"[ \t\n\r]*")
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


class TraceError(Exception):
    """A trace file that cannot be read; names the file and the problem."""

    def __init__(self, path: Path | str, problem: str) -> None:
        self.path, self.problem = Path(path), problem
        super().__init__(f"{path}: {problem}")


def _slice_name(ev: StageEvent) -> str:
    if ev.kind == "decode":
        return f"T{ev.chunk}"
    if ev.chunk < 0:
        return ev.kind if not ev.note else f"{ev.kind}: {ev.note}"
    return f"C{ev.chunk}"


def to_chrome(events: Sequence[StageEvent], meta: dict[str, Any] | None = None,
              telemetry: Iterable[Any] = (), stage_names: dict[int, str] | None = None) -> dict[str, Any]:
    """Build the trace object.  `telemetry` items need t_ns, gpu and numeric fields."""
    meta = dict(meta or {})
    t0 = min((e.start_ns for e in events), default=0)
    out: list[dict[str, Any]] = []
    stages: dict[int, str] = {}
    for e in events:
        stages.setdefault(e.stage, e.device)
    for s, dev in sorted(stages.items()):
        pid = s + 1
        label = (stage_names or {}).get(s, f"stage {s} · {dev}")
        out.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": label}})
        out.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": s}})
        for kind, tid in LANES.items():
            out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": kind}})
            out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    compute_at: dict[tuple[int, int], StageEvent] = {}
    for e in events:
        if e.kind == "compute":
            compute_at[(e.stage, e.chunk)] = e
    for e in events:
        out.append({
            "ph": "X", "pid": e.stage + 1, "tid": LANES.get(e.kind, 9), "name": _slice_name(e), "cat": e.kind,
            "ts": (e.start_ns - t0) / 1000.0, "dur": max(e.end_ns - e.start_ns, 0) / 1000.0,
            "args": {"run_id": e.run_id, "stage": e.stage, "device": e.device, "chunk": e.chunk,
                     "kind": e.kind, "start_ns": e.start_ns, "end_ns": e.end_ns, "tokens": e.tokens,
                     "nbytes": e.nbytes, "note": e.note},
        })
        if e.kind == "copy" and e.chunk >= 0:
            dst = compute_at.get((e.stage + 1, e.chunk))
            if dst is not None:
                fid = (e.stage << 32) | e.chunk
                out.append({"ph": "s", "id": fid, "pid": e.stage + 1, "tid": LANES["copy"], "name": "hand-off",
                            "cat": "handoff", "ts": (e.end_ns - t0) / 1000.0 - 0.001})
                out.append({"ph": "f", "bp": "e", "id": fid, "pid": dst.stage + 1, "tid": LANES["compute"],
                            "name": "hand-off", "cat": "handoff", "ts": (dst.start_ns - t0) / 1000.0})
    for smp in telemetry:
        d = asdict(smp) if is_dataclass(smp) else dict(smp)
        t = d.pop("t_ns")
        gpu = d.pop("gpu")
        for key, val in d.items():
            if isinstance(val, (int, float)) and val is not None:
                out.append({"ph": "C", "pid": 1000 + int(gpu), "name": f"gpu{gpu} {key}",
                            "ts": (t - t0) / 1000.0, "args": {key: val}})
    meta.setdefault("t0_ns", t0)
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": _jsonable(meta)}


def _jsonable(obj: Any) -> Any:
    if is_dataclass(obj):
        return _jsonable(asdict(obj))
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def save(path: Path | str, events: Sequence[StageEvent], meta: dict[str, Any] | None = None,
         telemetry: Iterable[Any] = (), stage_names: dict[int, str] | None = None) -> Path:
    """Write the trace; gzip when the name ends in .gz."""
    path = Path(path)
    data = json.dumps(to_chrome(events, meta, telemetry, stage_names), separators=(",", ":")).encode()
    if path.suffix == ".gz":
        data = gzip.compress(data, compresslevel=6)
    write_atomic(path, data)
    return path


def _cut(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _short(value: Any, limit: int = 80) -> str:
    """repr() of a value from the file, cut so that a hostile file cannot make a huge message."""
    return _cut(repr(value), limit)


FOREIGN_RUN_ID = "imported"


class _Text:
    """The JSON text of a trace, read in READ_CHUNK steps (inflated on the fly for a .gz) and
    parsed one value at a time with the C scanner of `json`: never more than one chunk plus the
    value being parsed is held as text."""

    def __init__(self, raw: Any, path: Path, max_bytes: int) -> None:
        self.raw, self.path, self.max_bytes = raw, path, max_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8-sig")()
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.nbytes = 0  # JSON bytes read so far (after inflating)

    def fill(self, want: int = READ_CHUNK) -> bool:
        """Append up to `want` more bytes of text; False at the end of the file."""
        if self.eof:
            return False
        try:
            data = self.raw.read(want)
            text = self.decoder.decode(data, final=not data)
        except UnicodeDecodeError as exc:
            raise TraceError(self.path, f"not valid JSON: not UTF-8 text ({_cut(str(exc))})") from None
        except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
            raise TraceError(self.path, f"cannot read: {type(exc).__name__}: {_cut(str(exc))}") from None
        if not data:
            self.eof = True
        self.nbytes += len(data)
        if self.nbytes > self.max_bytes:
            what = "decompressed trace" if isinstance(self.raw, gzip.GzipFile) else "trace file"
            raise TraceError(self.path, f"{what} exceeds {self.max_bytes} bytes (the limit of a trace this loads)")
        if self.pos:
            self.buf = self.buf[self.pos:]
            self.pos = 0
        self.buf += text
        return bool(data)

    def peek(self) -> str:
        """The next character that is not white space ('' at the end), not consumed."""
        while True:
            m = _WS.match(self.buf, self.pos)
            self.pos = m.end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.fill():
                return ""

    def expect(self, chars: str, where: str) -> str:
        pos = self.pos
        if pos < len(self.buf) and self.buf[pos] in chars:  # the common case: no white space
            self.pos = pos + 1
            return self.buf[pos]
        ch = self.peek()
        if not ch or ch not in chars:
            found = repr(ch) if ch else "the end of the file"
            raise TraceError(self.path, f"not valid JSON (truncated or corrupt): expected "
                                        f"{' or '.join(repr(c) for c in chars)} {where}, found {found}")
        self.pos += 1
        return ch

    def value(self, limit: int, what: str) -> Any:
        """The next JSON value; refused when its text passes `limit` characters."""
        buf, pos = self.buf, self.pos
        if pos < len(buf) and buf[pos] not in " \t\n\r":  # fast path: a complete value inside the buffer
            try:
                val, end = _SCAN(buf, pos)
            except StopIteration:  # incomplete or invalid: the slow path reads on or says what is wrong
                pass
            except RecursionError:
                raise TraceError(self.path, f"not valid JSON for a trace: nested more deeply than Python's "
                                            f"recursion limit ({sys.getrecursionlimit()} levels)") from None
            except ValueError:  # ints of more than 4300 digits: the slow path names it
                pass
            else:
                if end < len(buf) and end - pos <= limit:  # not at the buffer's end: no number cut short
                    self.pos = end
                    return val
        return self._value(limit, what)

    def _value(self, limit: int, what: str) -> Any:
        self.peek()
        want = READ_CHUNK
        while True:
            try:
                val, end = _DECODER.raw_decode(self.buf, self.pos)
            except RecursionError:
                raise TraceError(self.path, f"not valid JSON for a trace: nested more deeply than Python's "
                                            f"recursion limit ({sys.getrecursionlimit()} levels)") from None
            except ValueError as exc:  # JSONDecodeError; ints of more than 4300 digits
                if self.eof:
                    raise TraceError(self.path, f"not valid JSON (truncated or corrupt): {_cut(str(exc))}") from None
                if len(self.buf) - self.pos > limit:
                    raise TraceError(self.path, f"{what} is not valid JSON or longer than {limit} characters "
                                                f"({_cut(str(exc))})") from None
                self.fill(want)
                want *= 2
                continue
            if end == len(self.buf) and not self.eof:  # a number may go on in the next chunk
                self.fill(want)
                continue
            if end - self.pos > limit:
                raise TraceError(self.path, f"{what} is longer than {limit} characters")
            self.pos = end
            return val


def _json_size(value: Any) -> int:
    """Bytes of the Python objects of a parsed JSON value (containers, their slots and leaves)."""
    total, todo = 0, [value]
    while todo:
        v = todo.pop()
        if v is None or isinstance(v, bool):
            continue
        total += sys.getsizeof(v)
        if isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return total


def _check_i64(v: int, what: str) -> int:
    if not _I64_MIN <= v <= _I64_MAX:
        raise ValueError(f"{what} {_short(v)} does not fit in 64 bits")
    return v


def _as_int(v: Any, what: str) -> int:
    """An integer field: an int, or a float with an integral finite value (no bools, no strings),
    within 64 bits (what the history stores)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return _check_i64(v, what)
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return _check_i64(int(v), what)
    raise ValueError(f"{what} is not an integer: {_short(v)}")


def _as_float(v: Any, what: str) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    raise ValueError(f"{what} is not a finite number: {_short(v)}")


def _as_str(v: Any, what: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return str(v)
    raise ValueError(f"{what} is not a string: {_short(v)}")


def _stage(v: Any, what: str, max_stages: int) -> int:
    s = _as_int(v, what)
    if not 0 <= s < max_stages:
        raise ValueError(f"{what} {s} is outside 0..{max_stages - 1} (a trace has at most {max_stages} stages)")
    return s


EVENT_BYTES = sys.getsizeof(StageEvent("", 0, "", 0, "", 0, 0)) + 8  # the object and its list slot
# a foreign slice read before otherData gets this run id (a distinct object), fixed once otherData is read
_PENDING_RUN_ID = "".join(("impor", "ted"))


def _event_bytes(ev: StageEvent) -> int:
    """The event's object, its list slot and its integers (those not cached by Python)."""
    n = EVENT_BYTES
    for v in (ev.start_ns, ev.end_ns, ev.tokens, ev.nbytes, ev.stage, ev.chunk):
        if not -5 <= v <= 256:
            n += sys.getsizeof(v)
    return n


class _Strings:
    """Repeated strings of a trace (run id, device, kind, note) kept once; counts the bytes of the new ones."""

    def __init__(self) -> None:
        self.table: dict[str, str] = {FOREIGN_RUN_ID: FOREIGN_RUN_ID}
        self.new_bytes = 0

    def __call__(self, v: str) -> str:
        got = self.table.get(v)
        if got is None:
            self.table[v] = got = v
            self.new_bytes += sys.getsizeof(v) + 64  # the string and its slot in the table
        return got


def _event(it: dict[str, Any], run_id: str, max_stages: int, s: _Strings) -> StageEvent:
    a = it.get("args")
    if a is None:
        a = {}
    if not isinstance(a, dict):
        raise ValueError(f"args is not an object: {_short(a)}")
    if "start_ns" in a:  # written by `save`: exact
        return StageEvent(s(_as_str(a["run_id"], "run_id")), _stage(a["stage"], "stage", max_stages),
                          s(_as_str(a["device"], "device")), _as_int(a["chunk"], "chunk"),
                          s(_as_str(a["kind"], "kind")),
                          _as_int(a["start_ns"], "start_ns"), _as_int(a["end_ns"], "end_ns"),
                          _as_int(a.get("tokens", 0), "tokens"), _as_int(a.get("nbytes", 0), "nbytes"),
                          s(_as_str(a.get("note", ""), "note")))
    # a foreign trace: best effort from ts/dur (microseconds)
    ts, dur = _as_float(it["ts"], "ts"), _as_float(it.get("dur", 0), "dur")
    start, end = ts * 1000, (ts + dur) * 1000
    if not (math.isfinite(start) and math.isfinite(end)):
        raise ValueError(f"ts {ts} + dur {dur} is out of range")
    pid = it.get("pid", 1)
    stage = _stage(_as_int(pid, "pid") - 1, "pid - 1 (the stage)", max_stages)
    return StageEvent(run_id, stage, s(_as_str(pid, "pid")), -1, s(_as_str(it.get("cat", "compute"), "cat")),
                      _as_int(int(start), "ts"), _as_int(int(end), "ts + dur"))


@dataclass
class _Budget:
    """What a load holds, estimated from the objects it keeps, against its two limits."""

    path: Path
    max_memory: int
    held: int = 0

    def charge(self, nbytes: int, text: _Text, what: str) -> None:
        self.held += nbytes
        ratio_cap = MEMORY_RATIO * text.nbytes + MEMORY_SLACK
        if self.held > self.max_memory:
            raise TraceError(self.path, f"{what} would take more than {self.max_memory / 2**20:,.0f} MiB of memory "
                                        "(the limit of a trace this loads)")
        if self.held > ratio_cap:
            raise TraceError(self.path, f"{what} would take more than {MEMORY_RATIO}x the trace's "
                                        f"{text.nbytes:,} bytes in memory (slices or metadata made of tiny items)")


def load(path: Path | str, max_bytes: int = MAX_TRACE_BYTES, max_events: int = MAX_TRACE_EVENTS,
         max_stages: int = MAX_STAGES,
         max_memory: int = MAX_TRACE_MEMORY) -> tuple[list[StageEvent], dict[str, Any]]:
    """Read a trace written by `save`: the stage events (exact) and the metadata.

    Every problem raises TraceError naming the file: missing, not a file, above `max_bytes`
    (checked from the size before reading; a .gz is also stopped once its JSON passes
    `max_bytes`), unreadable, not JSON, nested too deeply, not a Chrome trace, a malformed slice,
    more than `max_events` slices or `max_stages` stages.

    Memory is bounded by construction: the JSON is parsed one slice at a time while it is read, each
    slice becomes a StageEvent (repeated strings shared) and is charged to a budget; the load stops
    as soon as the budget passes `max_memory` or MEMORY_RATIO x the JSON read so far (plus
    MEMORY_SLACK).  `otherData` and other top-level values are parsed whole, each at most
    MAX_META_CHARS characters, and charged the same way."""
    path = Path(path)
    for name, v in (("max_bytes", max_bytes), ("max_events", max_events), ("max_stages", max_stages),
                    ("max_memory", max_memory)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an integer >= 0, not {v!r}")
    if not path.exists():
        raise TraceError(path, "file not found")
    if not path.is_file():
        raise TraceError(path, "not a regular file")
    size = path.stat().st_size
    if size > max_bytes:
        raise TraceError(path, f"file is {size} bytes, above the {max_bytes}-byte limit")
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise TraceError(path, f"cannot read: {type(exc).__name__}: {_cut(str(exc))}") from None
    with fh:
        try:
            gz = fh.read(2) == b"\x1f\x8b"
            fh.seek(0)
        except OSError as exc:
            raise TraceError(path, f"cannot read: {type(exc).__name__}: {_cut(str(exc))}") from None
        raw = gzip.GzipFile(fileobj=fh, mode="rb") if gz else fh
        with raw:
            events, meta, foreign = _parse(_Text(raw, path, max_bytes), path, max_events, max_stages,
                                           _Budget(path, max_memory))
    if foreign:  # slices read before otherData take its run id now
        try:
            run_id = _as_str(meta.get("run_id", FOREIGN_RUN_ID), "otherData.run_id")
        except ValueError as exc:
            raise TraceError(path, str(exc)) from None
        for i, e in enumerate(events):
            if e.run_id is _PENDING_RUN_ID:
                events[i] = replace(e, run_id=run_id)
    log.debug("loaded %s: %d events", path, len(events))
    return events, meta


def _slice(it: dict, i: int, run_id: str, max_stages: int, strings: _Strings, budget: _Budget, text: _Text,
           path: Path) -> StageEvent:
    """Item i of traceEvents, a slice, as an event (its bytes charged to the budget)."""
    before = strings.new_bytes
    try:
        ev = _event(it, run_id, max_stages, strings)
    except KeyError as exc:
        raise TraceError(path, f"slice {i} is malformed: missing {_short(exc.args[0])}") from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise TraceError(path, f"slice {i} is malformed: {_cut(str(exc))}") from None
    if ev.kind not in KINDS:
        raise TraceError(path, f"slice {i} has unknown kind {_short(ev.kind)}")
    budget.charge(_event_bytes(ev) + DERIVE_BYTES + strings.new_bytes - before, text, f"slice {i}")
    return ev


def _parse(text: _Text, path: Path, max_events: int, max_stages: int,
           budget: _Budget) -> tuple[list[StageEvent], dict[str, Any], bool]:
    events: list[StageEvent] = []
    meta: dict[str, Any] = {}
    foreign = False
    strings = _Strings()
    seen_events = False

    def items() -> None:
        nonlocal foreign
        run_id = _PENDING_RUN_ID  # fixed up once the whole otherData is known (it may follow the slices)
        text.expect("[", "at the start of traceEvents")
        if text.peek() == "]":
            text.pos += 1
            return
        i = 0
        max_items = 2 * max_events  # slices and everything else (metadata, flows, counters) together
        while True:
            if i >= max_items:
                raise TraceError(path, f"more than {max_items:,} items in traceEvents (the limit of a trace this "
                                       "loads: twice its slices)")
            it = text.value(MAX_ITEM_CHARS, f"item {i} of traceEvents")
            if isinstance(it, dict) and it.get("ph") == "X":
                if len(events) >= max_events:
                    raise TraceError(path, f"more than {max_events:,} slices (the limit of a trace this loads)")
                events.append(_slice(it, i, run_id, max_stages, strings, budget, text, path))
                foreign |= "start_ns" not in (it.get("args") or {})
            i += 1
            if text.expect(",]", f"after item {i - 1} of traceEvents") == "]":
                return

    ch = text.peek()
    if ch == "[":
        items()
    elif ch == "{":
        text.pos += 1
        if text.peek() == "}":
            raise TraceError(path, "not a Chrome trace (expected a traceEvents list)")
        while True:
            key = text.value(MAX_ITEM_CHARS, "a key of the trace object")
            if not isinstance(key, str):
                raise TraceError(path, "not valid JSON (truncated or corrupt): a key that is not a string")
            text.expect(":", f"after the key {_short(key)}")
            if key == "traceEvents" and text.peek() == "[":
                if seen_events:
                    raise TraceError(path, "not a Chrome trace: traceEvents appears twice")
                seen_events = True
                items()
            else:
                value = text.value(MAX_META_CHARS, f"the trace's {_short(key)}")
                if key == "traceEvents":
                    raise TraceError(path, "not a Chrome trace (expected a traceEvents list)")
                if key == "otherData":
                    if value is None:
                        value = {}
                    if not isinstance(value, dict):
                        raise TraceError(path, f"otherData is not an object: {_short(value)}")
                    budget.charge(_json_size(value), text, "otherData")
                    meta = value
                del value
            if text.expect(",}", f"after the value of {_short(key)}") == "}":
                break
        if not seen_events:
            raise TraceError(path, "not a Chrome trace (expected a traceEvents list)")
    elif not ch:
        raise TraceError(path, "not valid JSON (truncated or corrupt): the file is empty")
    else:
        text.value(MAX_META_CHARS, "the trace")  # invalid JSON is named as such
        raise TraceError(path, "not a Chrome trace (expected a traceEvents list)")
    if text.peek():
        raise TraceError(path, "not valid JSON (truncated or corrupt): extra data after the trace")
    return events, meta, foreign
