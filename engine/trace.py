"""Chrome Trace Event JSON export/import (opens in Perfetto and chrome://tracing).

One process per stage/device, one lane (thread) per kind, so slices in a lane never overlap;
compute slices are named C0..Cn; flow arrows follow each hand-off to the successor's compute of
the same chunk; telemetry samples become counter tracks.  Exact nanosecond times travel in each
slice's args, so `load` gives back the very events that were written.
"""
from __future__ import annotations

import gzip
import json
import os
import tempfile
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from .events import KINDS, StageEvent

LANES = {"compute": 1, "copy": 2, "wait": 3, "stream": 4, "decode": 5}
MAX_TRACE_BYTES = 2 << 30


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


def load(path: Path | str, max_bytes: int = MAX_TRACE_BYTES) -> tuple[list[StageEvent], dict[str, Any]]:
    """Read a trace written by `save`: the stage events (exact) and the metadata."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(path, "file not found")
    if path.stat().st_size > max_bytes:
        raise TraceError(path, f"file is {path.stat().st_size} bytes, above the {max_bytes}-byte limit")
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            with gzip.open(path, "rb") as fh:
                raw = fh.read(max_bytes + 1)
            if len(raw) > max_bytes:
                raise TraceError(path, f"decompressed trace exceeds {max_bytes} bytes")
        doc = json.loads(raw)
    except TraceError:
        raise
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise TraceError(path, f"cannot read: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise TraceError(path, f"not valid JSON (truncated or corrupt): {exc}") from None
    if isinstance(doc, list):
        items, meta = doc, {}
    elif isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list):
        items, meta = doc["traceEvents"], doc.get("otherData") or {}
    else:
        raise TraceError(path, "not a Chrome trace (expected a traceEvents list)")
    events: list[StageEvent] = []
    for i, it in enumerate(items):
        if not isinstance(it, dict) or it.get("ph") != "X":
            continue
        a = it.get("args") or {}
        try:
            if "start_ns" in a:
                ev = StageEvent(str(a["run_id"]), int(a["stage"]), str(a["device"]), int(a["chunk"]),
                                str(a["kind"]), int(a["start_ns"]), int(a["end_ns"]), int(a.get("tokens", 0)),
                                int(a.get("nbytes", 0)), str(a.get("note", "")))
            else:  # a foreign trace: best effort from ts/dur
                ts, dur = float(it["ts"]), float(it.get("dur", 0))
                ev = StageEvent(str(meta.get("run_id", "imported")), int(it.get("pid", 1)) - 1,
                                str(it.get("pid", "")), -1, str(it.get("cat", "compute")),
                                int(ts * 1000), int((ts + dur) * 1000))
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(path, f"slice {i} is malformed: {exc}") from None
        if ev.kind not in KINDS:
            raise TraceError(path, f"slice {i} has unknown kind {ev.kind!r}")
        events.append(ev)
    return events, meta
