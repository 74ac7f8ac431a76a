"""Type checks of a run before it is stored or formatted (no Qt).

A report rebuilt from a file (an imported trace, an old history row) holds whatever the file
said: `report_from_dict` fills the dataclasses without looking at the values.  `check_report`
walks every field against the dataclass's type hints (int, float, str, bool, lists, tuples and
nested dataclasses), so "many" never reaches an `f"{x:,}"` and a nested list never reaches
SQLite.  Integers must fit in 64 bits (what SQLite stores) and floats must be finite.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from functools import cache
from typing import Any

from engine.events import RunReport, StageEvent

from ..run.record_model import SOURCES, STATUSES, RunRecord

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
MAX_STAGES = 256  # as engine.io.trace.MAX_STAGES: a report with more stages is not one this app made
JSON_SCALARS = (str, int, float, bool, type(None))


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


def _check(value: Any, hint: Any, where: str) -> None:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where} is not true/false: {_short(value)}")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where} is not an integer: {_short(value)}")
        if not I64_MIN <= value <= I64_MAX:
            raise ValueError(f"{where} does not fit in 64 bits: {_short(value)}")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{where} is not a finite number: {_short(value)}")
    elif hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{where} is not a string: {_short(value)}")
    elif dataclasses.is_dataclass(hint):
        if not isinstance(value, hint):
            raise ValueError(f"{where} is not a {hint.__name__}: {_short(value)}")
        check_fields(value, where)
    elif origin in (list, tuple):
        if not isinstance(value, origin):
            raise ValueError(f"{where} is not a {origin.__name__}: {_short(value)}")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):  # tuple[int, int]
            if len(value) != len(args):
                raise ValueError(f"{where} has {len(value)} items, not {len(args)}")
            for i, (v, h) in enumerate(zip(value, args)):
                _check(v, h, f"{where}[{i}]")
            return
        item = args[0] if args else Any
        for i, v in enumerate(value):
            _check(v, item, f"{where}[{i}]")
    elif origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where} is not an object: {_short(value)}")
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where} has a key that is not a string: {_short(k)}")
            if not isinstance(v, JSON_SCALARS) or (isinstance(v, float) and not math.isfinite(v)):
                raise ValueError(f"{where}[{k!r}] is not a plain value: {_short(v)}")
    elif origin in (typing.Union, types.UnionType):
        errors = []
        for h in args:
            try:
                _check(value, h, where)
                return
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0])
    elif hint is type(None):
        if value is not None:
            raise ValueError(f"{where} is not empty: {_short(value)}")
    # Any and other hints: nothing to check


def check_fields(obj: Any, where: str) -> None:
    """Every field of dataclass `obj` against its type hint; ValueError names the first bad one."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        _check(getattr(obj, f.name), hints[f.name], f"{where}.{f.name}")


def check_report(report: Any, n_stages: int | None = None) -> None:
    """A report safe to store and format.  `n_stages`: the stages the run's events use, which the
    plan must cover."""
    if not isinstance(report, RunReport):
        raise ValueError(f"the report is a {type(report).__name__}, not a RunReport")
    check_fields(report, "report")
    stages = report.plan.stages
    if len(stages) > MAX_STAGES or len(report.per_stage) > MAX_STAGES:
        raise ValueError(f"report.plan has {len(stages)} stages, above the {MAX_STAGES} a run may have")
    if n_stages is not None and n_stages > len(stages):
        raise ValueError(f"the events use {n_stages} stages but report.plan has {len(stages)}")


def check_record(record: Any) -> None:
    """A run safe to store in the history: its report, settings, events, source and status."""
    if not isinstance(record, RunRecord):
        raise ValueError(f"not a RunRecord: {type(record).__name__}")
    if record.source not in SOURCES:
        raise ValueError(f"unknown run source {record.source!r}: allowed {', '.join(SOURCES)}")
    if record.status not in STATUSES:
        raise ValueError(f"unknown run status {record.status!r}: allowed {', '.join(STATUSES)}")
    _check(record.label, str, "label")
    _check(record.created_at, float, "created_at")
    if not isinstance(record.config, dict) or not all(isinstance(k, str) for k in record.config):
        raise ValueError(f"the settings are not an object with string keys: {_short(record.config)}")
    check_events(record.events)
    check_report(record.report)


def check_events(events: Any) -> None:
    """Every event a StageEvent with fields of the right types (a fast loop: runs hold millions)."""
    if not isinstance(events, list):
        raise ValueError(f"the events are a {type(events).__name__}, not a list")
    for i, e in enumerate(events):
        if not (type(e) is StageEvent and type(e.run_id) is str and type(e.stage) is int
                and type(e.device) is str and type(e.chunk) is int and type(e.kind) is str
                and type(e.start_ns) is int and type(e.end_ns) is int and type(e.tokens) is int
                and type(e.nbytes) is int and type(e.note) is str):
            if isinstance(e, StageEvent):
                check_fields(e, f"event {i}")  # names the field
            raise ValueError(f"event {i} is not a StageEvent with plain fields: {_short(e)}")
        if not 0 <= e.stage < MAX_STAGES:
            raise ValueError(f"event {i} has stage {e.stage}, outside 0..{MAX_STAGES - 1}")
