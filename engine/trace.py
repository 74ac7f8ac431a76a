"""Chrome Trace Event JSON export/import (opens in Perfetto and chrome://tracing).

One process per stage/device, one lane (thread) per kind, so slices in a lane never overlap;
compute slices are named C0..Cn; flow arrows follow each hand-off to the successor's compute of
the same chunk; telemetry samples become counter tracks.  Exact nanosecond times travel in each
slice's args, so `load` gives back the very events that were written.
"""
from __future__ import annotations

import gzip
import json
import logging
import math
import os
import sys
import tempfile
import zlib
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from .events import KINDS, StageEvent

log = logging.getLogger(__name__)

LANES = {"compute": 1, "copy": 2, "wait": 3, "stream": 4, "decode": 5}
# Default cap on a trace file and on the JSON a .gz inflates to.  Loading parses the whole JSON
# into Python objects (several times the file's size in memory), so a file above this is refused
# from its size, before any of it is read.  Pass `max_bytes` to `load` for another cap.
MAX_TRACE_BYTES = 512 << 20
READ_CHUNK = 1 << 20  # decompression step: memory above the data kept is one chunk


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


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path` and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


def _read_capped(stream: Any, path: Path, max_bytes: int, what: str) -> bytearray:
    """Everything `stream` yields, refusing as soon as it passes `max_bytes` (in READ_CHUNK steps,
    so a gzip bomb costs at most max_bytes + one chunk before it is refused)."""
    buf = bytearray()
    while True:
        chunk = stream.read(READ_CHUNK)
        if not chunk:
            return buf
        buf += chunk
        if len(buf) > max_bytes:
            raise TraceError(path, f"{what} exceeds {max_bytes} bytes (the limit of a trace this loads)")


def _read_json_bytes(path: Path, max_bytes: int) -> bytearray:
    with path.open("rb") as fh:
        if fh.read(2) == b"\x1f\x8b":
            fh.seek(0)
            with gzip.GzipFile(fileobj=fh, mode="rb") as gz:
                return _read_capped(gz, path, max_bytes, "decompressed trace")
        fh.seek(0)
        return _read_capped(fh, path, max_bytes, "trace file")


def _as_int(v: Any, what: str) -> int:
    """An integer field: an int, or a float with an integral finite value (no bools, no strings)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
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


def _event(it: dict[str, Any], meta: dict[str, Any]) -> StageEvent:
    a = it.get("args")
    if a is None:
        a = {}
    if not isinstance(a, dict):
        raise ValueError(f"args is not an object: {_short(a)}")
    if "start_ns" in a:  # written by `save`: exact
        return StageEvent(_as_str(a["run_id"], "run_id"), _as_int(a["stage"], "stage"),
                          _as_str(a["device"], "device"), _as_int(a["chunk"], "chunk"), _as_str(a["kind"], "kind"),
                          _as_int(a["start_ns"], "start_ns"), _as_int(a["end_ns"], "end_ns"),
                          _as_int(a.get("tokens", 0), "tokens"), _as_int(a.get("nbytes", 0), "nbytes"),
                          _as_str(a.get("note", ""), "note"))
    # a foreign trace: best effort from ts/dur (microseconds)
    ts, dur = _as_float(it["ts"], "ts"), _as_float(it.get("dur", 0), "dur")
    start, end = ts * 1000, (ts + dur) * 1000
    if not (math.isfinite(start) and math.isfinite(end)):
        raise ValueError(f"ts {ts} + dur {dur} is out of range")
    pid = it.get("pid", 1)
    return StageEvent(_as_str(meta.get("run_id", "imported"), "otherData.run_id"), _as_int(pid, "pid") - 1,
                      _as_str(pid, "pid"), -1, _as_str(it.get("cat", "compute"), "cat"), int(start), int(end))


def load(path: Path | str, max_bytes: int = MAX_TRACE_BYTES) -> tuple[list[StageEvent], dict[str, Any]]:
    """Read a trace written by `save`: the stage events (exact) and the metadata.

    Every problem raises TraceError naming the file: missing, not a file, above `max_bytes`
    (checked from the size before reading; a .gz is also stopped once its JSON passes
    `max_bytes`), unreadable, not JSON, nested too deeply, not a Chrome trace, a malformed slice.
    Memory: the file's bytes (at most max_bytes) and the parsed JSON, nothing more."""
    path = Path(path)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes must be an integer >= 0, not {max_bytes!r}")
    if not path.exists():
        raise TraceError(path, "file not found")
    if not path.is_file():
        raise TraceError(path, "not a regular file")
    size = path.stat().st_size
    if size > max_bytes:
        raise TraceError(path, f"file is {size} bytes, above the {max_bytes}-byte limit")
    try:
        raw = _read_json_bytes(path, max_bytes)
    except TraceError:
        raise
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise TraceError(path, f"cannot read: {type(exc).__name__}: {_cut(str(exc))}") from None
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise TraceError(path, f"not valid JSON for a trace: nested more deeply than Python's recursion limit "
                               f"({sys.getrecursionlimit()} levels)") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, ints of more than 4300 digits
        raise TraceError(path, f"not valid JSON (truncated or corrupt): {_cut(str(exc))}") from None
    finally:
        del raw
    if isinstance(doc, list):
        items, meta = doc, {}
    elif isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list):
        items, meta = doc["traceEvents"], doc.get("otherData")
        if meta is None:
            meta = {}
        if not isinstance(meta, dict):
            raise TraceError(path, f"otherData is not an object: {_short(meta)}")
    else:
        raise TraceError(path, "not a Chrome trace (expected a traceEvents list)")
    events: list[StageEvent] = []
    for i, it in enumerate(items):
        if not isinstance(it, dict) or it.get("ph") != "X":
            continue
        try:
            ev = _event(it, meta)
        except KeyError as exc:
            raise TraceError(path, f"slice {i} is malformed: missing {_short(exc.args[0])}") from None
        except (TypeError, ValueError, OverflowError) as exc:
            raise TraceError(path, f"slice {i} is malformed: {_cut(str(exc))}") from None
        if ev.kind not in KINDS:
            raise TraceError(path, f"slice {i} has unknown kind {_short(ev.kind)}")
        events.append(ev)
    log.debug("loaded %s: %d events", path, len(events))
    return events, meta
