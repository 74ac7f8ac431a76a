"""A run to and from files (no Qt): the Chrome trace of `engine.io.trace`, a CSV of its events.

Every file is written atomically (`engine.io.atomic_file.write_atomic`: a temporary file beside the target,
renamed into place), so a crash never leaves a half-written export.  The trace carries the
engine's report, the run's settings and its telemetry (as counter tracks) in `otherData`, and
the exact nanosecond times of every event, so `import_trace` gives back the very events that were
exported.  A trace written by another tool (no report inside) gets figures derived from its
events.  Every problem with a file raises `engine.io.trace.TraceError`, naming the file and what is
wrong; nothing is stored unless the whole file was read.
"""
from __future__ import annotations

import csv
import io
import logging
from pathlib import Path
from typing import Any

from engine.io import trace
from engine.io.atomic_file import write_atomic
from engine.io.trace import TraceError

from .. import __version__
from ..history.record_check import check_report
from .record_model import RunRecord, config_from_dict, config_from_report, report_from_dict, report_from_events

log = logging.getLogger(__name__)

MAX_IMPORT_BYTES = 256 << 20  # a trace above this is refused before it is read (engine.io.trace bounds the memory)
MAX_IMPORT_EVENTS = 2_000_000
CSV_COLUMNS = ("run_id", "stage", "device", "chunk", "kind", "start_ns", "end_ns", "dur_ns", "tokens", "nbytes", "note")
TRACE_FORMAT = "strata-gui run"


def export_trace(record: RunRecord, path: Path | str) -> Path:
    """The Chrome Trace Event JSON of a run (gzip when the name ends in .gz); opens in Perfetto."""
    meta: dict[str, Any] = {"format": TRACE_FORMAT, "app": f"strata-gui {__version__}", "report": record.report,
                            "config": record.config, "status": record.status, "label": record.label,
                            "source": record.source, "created_at": record.created_at}
    return trace.save(path, record.events, meta, telemetry=record.telemetry,
                      stage_names=record.report.plan.stage_names())


def events_csv(record: RunRecord) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for e in record.events:
        w.writerow((e.run_id, e.stage, e.device, e.chunk, e.kind, e.start_ns, e.end_ns, e.end_ns - e.start_ns,
                    e.tokens, e.nbytes, e.note))
    return buf.getvalue()


def export_events_csv(record: RunRecord, path: Path | str) -> Path:
    path = Path(path)
    write_atomic(path, events_csv(record).encode("utf-8"))
    return path


def write_bytes(path: Path | str, data: bytes) -> Path:
    """Any other export (the Gantt's PNG): atomically."""
    path = Path(path)
    write_atomic(path, data)
    return path


def import_trace(path: Path | str, max_bytes: int = MAX_IMPORT_BYTES,
                 max_events: int = MAX_IMPORT_EVENTS) -> RunRecord:
    """A run from a Chrome trace: one this app (or `strata-bench --trace`) wrote, or another
    tool's trace of stage slices.  Raises TraceError for a missing, huge, truncated or malformed
    file, or one without stage events."""
    path = Path(path)
    if path.is_file() and path.stat().st_size > max_bytes:
        raise TraceError(path, f"the file is {path.stat().st_size / 2**20:,.1f} MiB, above the "
                               f"{max_bytes / 2**20:,.0f} MiB an import may read; nothing was imported")
    events, meta = trace.load(path, max_bytes=max_bytes, max_events=max_events)
    if not isinstance(meta, dict):
        raise TraceError(path, "otherData is not an object")
    if not events:
        raise TraceError(path, "the trace holds no pipeline stage slices (compute, wait, copy, stream, decode): "
                               "nothing to import")
    if len(events) > max_events:
        raise TraceError(path, f"{len(events):,} slices, above the {max_events:,} an import takes")
    for i, e in enumerate(events):
        if e.end_ns < e.start_ns:
            raise TraceError(path, f"slice {i} ({e.kind} of stage {e.stage}) ends before it starts")
        if e.stage < 0:
            raise TraceError(path, f"slice {i} has a negative stage {e.stage}")
    run_id = events[0].run_id
    report = None
    note = ""
    if "report" in meta:
        try:
            report = report_from_dict(meta["report"])
            check_report(report, n_stages=max(e.stage for e in events) + 1)
        except ValueError as exc:
            report = None
            note = f"the trace's report could not be read ({exc}); figures derived from its events"
            log.warning("%s: %s", path, note)
    if report is None:
        report = report_from_events(events, run_id, note or f"imported from {path.name}: figures derived from "
                                                            "the trace's events (it carries no engine report)")
    config = meta.get("config")
    if not isinstance(config, dict) or not all(isinstance(k, str) and isinstance(v, (str, int, float, bool, type(None)))
                                               for k, v in config.items()):
        config = config_from_report(report)  # settings are flat name -> value; anything else is not ours
    label = f"imported {path.name}"
    status = "cancelled" if report.cancelled else "finished"
    return RunRecord(report, events, config_from_dict(config), source="import", status=status, label=label)
