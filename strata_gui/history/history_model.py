"""The run history: every run's settings, report, events and telemetry in one SQLite file (no Qt).

The file lives in the user's data directory (`default_path`; `STRATA_GUI_DATA_DIR` overrides it,
tests pass their own path).  It is opened in WAL mode with `synchronous=FULL` (on a network file
system, where WAL does not work, in rollback-journal mode, and `notice` says so), and each run is
written in ONE transaction: a crash or a kill in the middle of a write loses at most that run,
never an earlier one.  The schema carries its version in `PRAGMA user_version`; `MIGRATIONS[i]`
takes version i to i+1, so this code opens any older file (and upgrades it in place), while a
file from a newer Strata GUI is refused untouched with a message that says so.

One connection, shared by the GUI thread and the run worker under a lock (a run is saved from
the worker thread, off the GUI thread).

Damage: `PRAGMA quick_check` runs at open, so a file with corrupt pages is reported as damaged
(with "move it aside and start a new history"; nothing is deleted) instead of failing at the
first write.  A run that cannot be written (a damaged or full file, or no usable history at all)
is kept as a Chrome trace in `unsaved-runs/` beside the history file, and the error says where.
Every run is type-checked (`record_check`) before it is stored, so no row can break a listing.
"""
from __future__ import annotations

import json
import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import settings_table
from engine.config import NAME_ALIASES
from engine.events import RunReport, StageEvent

from ..run.record_model import META_KEYS, RunRecord, config_from_dict, report_from_dict, report_to_dict
from .network_path import network_location
from .record_check import check_record, check_report

log = logging.getLogger(__name__)

APP_DIR_NAME = "strata-gui"
FILE_NAME = "history.sqlite3"
ENV_DIR = settings_table.row("gui_data_dir").env
UNSAVED_DIR = "unsaved-runs"  # beside the history file: runs that could not be written to it
MOVE_ASIDE = "Nothing was deleted. Move the file aside (rename it) and start Strata GUI again to start a new history"

# MIGRATIONS[i] upgrades a database at schema version i to version i + 1.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 1: runs with their settings, report and telemetry; one row per stage event
    (
        """CREATE TABLE runs (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            created_at REAL NOT NULL,
            source TEXT NOT NULL,
            status TEXT NOT NULL,
            label TEXT NOT NULL DEFAULT '',
            engine_run_id TEXT NOT NULL,
            model TEXT NOT NULL DEFAULT '',
            devices TEXT NOT NULL DEFAULT '',
            prompt_tokens INTEGER NOT NULL,
            chunk INTEGER NOT NULL,
            n_chunks INTEGER NOT NULL,
            n_stages INTEGER NOT NULL,
            pf_depth INTEGER NOT NULL,
            prefill_tok_s REAL NOT NULL,
            decode_tok_s REAL NOT NULL,
            digest TEXT NOT NULL,
            n_events INTEGER NOT NULL,
            config_json TEXT NOT NULL,
            report_json TEXT NOT NULL,
            telemetry_json TEXT NOT NULL
        )""",
        "CREATE INDEX runs_created ON runs(created_at)",
        """CREATE TABLE events (
            run INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
            seq INTEGER NOT NULL,
            run_id TEXT NOT NULL,
            stage INTEGER NOT NULL,
            device TEXT NOT NULL,
            chunk INTEGER NOT NULL,
            kind TEXT NOT NULL,
            start_ns INTEGER NOT NULL,
            end_ns INTEGER NOT NULL,
            tokens INTEGER NOT NULL,
            nbytes INTEGER NOT NULL,
            note TEXT NOT NULL,
            PRIMARY KEY (run, seq)
        ) WITHOUT ROWID""",
    ),
    # 2: sweeps (prompt sizes x arms x repeats) and the runs that make their points
    (
        """CREATE TABLE sweeps (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            created_at REAL NOT NULL,
            label TEXT NOT NULL DEFAULT '',
            status TEXT NOT NULL,
            plan_json TEXT NOT NULL
        )""",
        """CREATE TABLE sweep_runs (
            sweep INTEGER NOT NULL REFERENCES sweeps(id) ON DELETE CASCADE,
            run INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
            arm INTEGER NOT NULL,
            prompt_tokens INTEGER NOT NULL,
            repeat INTEGER NOT NULL,
            PRIMARY KEY (sweep, run)
        )""",
        "CREATE INDEX sweep_runs_run ON sweep_runs(run)",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)


class HistoryError(Exception):
    """The history file cannot be used; the message says why and that nothing was changed."""


def default_path() -> Path:
    """`$STRATA_GUI_DATA_DIR/history.sqlite3`, else the platform's user data dir for strata-gui."""
    folder = settings_table.env_value("gui_data_dir") or ""
    if not folder:
        from platformdirs import user_data_dir

        folder = user_data_dir(APP_DIR_NAME, appauthor=False)
    return Path(folder) / FILE_NAME


def _short(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True)
class RunRow:
    """One run in a listing: the columns a list shows, no events."""

    id: int
    created_at: float
    source: str
    status: str
    label: str
    engine_run_id: str
    model: str
    devices: str
    prompt_tokens: int
    chunk: int
    n_chunks: int
    n_stages: int
    pipeline_depth: int
    prefill_tok_s: float
    decode_tok_s: float
    digest: str
    n_events: int

    @property
    def when(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.created_at))

    def problem(self) -> str:
        """Why this row cannot be shown ("" when it can): a column of the wrong type, as a file
        written by something else (or damaged) may hold."""
        for f in self.__dataclass_fields__.values():
            v = getattr(self, f.name)
            want = {"int": int, "float": (int, float), "str": str}[f.type]
            if isinstance(v, bool) or not isinstance(v, want):
                return f"{f.name} is {_short(v)}"
            if isinstance(v, float) and not math.isfinite(v) and f.name != "created_at":
                return f"{f.name} is {v}"
        try:
            time.localtime(self.created_at)
        except (OverflowError, OSError, ValueError):
            return f"created_at is {_short(self.created_at)}"
        return ""

    def title(self) -> str:
        if self.problem():
            return f"unreadable run #{self.id}"
        depth = {0: "depth 0", 1: "depth 1"}.get(self.pipeline_depth, "depth ?")
        head = f"#{self.id} {self.label}" if self.label else f"#{self.id}"
        extra = "" if self.status == "finished" else f" · {self.status}"
        return (f"{head} · {self.prompt_tokens:,} tok · {self.n_stages}× {self.devices} · {depth} · "
                f"chunk {self.chunk} · {self.prefill_tok_s:,.0f} tok/s{extra}")


# RunRow's fields as the runs table's columns (schema 1 named the depth column with the seeds' name)
_COLUMN_OF = {"pipeline_depth": "pf_depth"}
_ROW_COLUMNS = ", ".join(_COLUMN_OF.get(f.name, f.name) for f in RunRow.__dataclass_fields__.values())


@dataclass(frozen=True)
class SweepRow:
    id: int
    created_at: float
    label: str
    status: str  # running | finished | stopped
    n_runs: int

    @property
    def when(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.created_at))


@dataclass(frozen=True)
class SweepMember:
    """A run that is one repeat of one point of a sweep."""

    run: int
    arm: int
    prompt_tokens: int
    repeat: int


# what the History table's columns and the form call a setting -> the key a run records it under
FILTER_ALIASES = {"chunk": "chunk_tokens", "chunk_size": "chunk_tokens", "depth": "pipeline_depth",
                  **NAME_ALIASES,
                  "schedule": "chunk_schedule", "graphs": "cuda_graphs", "split": "layer_split",
                  "tokens": "prompt_tokens", "decode": "decode_tokens", "order": "gpu_order"}


def filter_key(key: str) -> str:
    """The recorded setting a filter's `key=` means (column names and form names accepted)."""
    k = key.strip().lower().replace(" ", "_").replace("-", "_")
    return FILTER_ALIASES.get(k, k)


_OLD_NAME = {new: old for old, new in NAME_ALIASES.items()}


def _config_value_sql(key: str) -> str:
    """SQL for a recorded setting's value in config_json; a run recorded before issue 16 holds
    it under the seeds' name (prefill, pf_depth)."""
    value = "json_extract(config_json, '$.\"' || ? || '\"')"
    return f"COALESCE({value}, {value})" if key in _OLD_NAME else value


def unknown_filter_keys(text: str) -> list[str]:
    """The `key=` words of a filter that name no recorded setting (they would match nothing)."""
    from engine.config import EngineConfig

    known = set(EngineConfig().as_dict()) | {"model", "prompt", "prompt_tokens", "decode_tokens"} | set(META_KEYS)
    out = []
    for word in text.split():
        key, eq, _ = word.partition("=")
        if eq and key and filter_key(key) not in known:
            out.append(key)
    return out


def set_journal(conn: sqlite3.Connection, path: Path) -> tuple[str, str]:
    """Set the journal mode: WAL, except on a network file system (WAL's shared-memory index
    does not work there: SQLite's documentation); (the mode SQLite reports, what to tell the
    user or "")."""
    remote = network_location(path)
    if remote:
        try:
            mode = str(conn.execute("PRAGMA journal_mode = DELETE").fetchone()[0]).lower()
        except sqlite3.OperationalError as exc:  # a WAL file another program has open
            raise HistoryError(f"The run history {path} is on {remote} and in WAL mode, which needs shared "
                               f"memory a network file system does not give; it could not be switched to a "
                               f"rollback journal ({exc}). Close other programs using it, or move it to a local "
                               f"disk (STRATA_GUI_DATA_DIR names another folder).") from None
        return mode, (f"The run history {path} is on {remote}: SQLite's WAL mode does not work on network "
                      f"file systems, so it uses journal mode {mode} (slower writes; keep one Strata GUI writing to "
                      f"it at a time). A local folder (STRATA_GUI_DATA_DIR) is faster.")
    mode = str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]).lower()
    if mode != "wal":
        return mode, (f"The run history {path} cannot use WAL mode here (SQLite reports journal mode {mode}): "
                      f"runs are still saved, each in one transaction, but slower.")
    return mode, ""


def _has_tables(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0] > 0


class RunHistory:
    def __init__(self, path: Path | str, before_commit: Callable[[], None] | None = None) -> None:
        """Open (creating or upgrading) the history at `path`.  Raises HistoryError, leaving the
        file as it was, when it is not a Strata history or comes from a newer version."""
        self.path = Path(path)
        self.before_commit = before_commit  # test seam: called inside a write, just before COMMIT
        self._lock = threading.RLock()
        self.journal_mode = ""  # what SQLite reports: "wal" normally, "delete" on a network file system
        self.notice = ""  # a one-line warning for the user about how the file is kept ("" when all is well)
        self._conn = self._open()

    # ------------------------------------------------------------------ open
    def _open(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise HistoryError(f"cannot create the folder of the run history {self.path}: {exc}") from None
        try:
            conn = sqlite3.connect(str(self.path), timeout=10.0, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise HistoryError(f"cannot open the run history {self.path}: {exc}") from None
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise HistoryError(
                    f"The run history {self.path} was written by a newer Strata GUI (schema version {version}; "
                    f"this version reads up to {SCHEMA_VERSION}). It was left untouched and no run of this "
                    f"session is saved to it. Update Strata GUI, or move the file away to start a new history.")
            if version == 0 and _has_tables(conn):
                raise HistoryError(f"{self.path} holds tables but no Strata history schema version; it was left "
                                   "untouched. Move it away to start a new history.")
            conn.execute("PRAGMA busy_timeout = 10000")
            if version > 0:
                problems = [str(r[0]) for r in conn.execute("PRAGMA quick_check(5)").fetchall()]
                if problems != ["ok"]:
                    raise HistoryError(self._damaged("; ".join(problems)))
            self.journal_mode, self.notice = set_journal(conn, self.path)
            if self.notice:
                log.warning("%s", self.notice)
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("PRAGMA foreign_keys = ON")
            self._migrate(conn, version)
        except HistoryError:
            conn.close()
            raise
        except sqlite3.DatabaseError as exc:
            conn.close()
            if "malformed" in str(exc) or "corrupt" in str(exc):
                raise HistoryError(self._damaged(str(exc))) from None
            raise HistoryError(f"{self.path} is not a readable Strata run history ({exc}); it was left "
                               "untouched. Move it away to start a new history.") from None
        return conn

    def _damaged(self, problem: str) -> str:
        return (f"The run history {self.path} is damaged (SQLite: {problem[:300]}). {MOVE_ASIDE}. Runs of "
                f"this session are kept as trace files in {self.path.parent / UNSAVED_DIR}.")

    def _migrate(self, conn: sqlite3.Connection, version: int) -> None:
        for target in range(version + 1, SCHEMA_VERSION + 1):
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in MIGRATIONS[target - 1]:
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {target}")
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            log.info("run history %s: schema upgraded to version %d", self.path, target)

    @property
    def schema_version(self) -> int:
        with self._lock:
            return int(self._conn.execute("PRAGMA user_version").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> RunHistory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ writing
    def _write(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        """Run `fn` in one write transaction: all of it is stored, or none of it."""
        with self._lock:
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(conn)
                if self.before_commit is not None:
                    self.before_commit()
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            return result

    def add(self, record: RunRecord, sweep: tuple[int, SweepMember] | None = None) -> int:
        """Store a run (and its membership of a sweep); returns its id in the history.

        Raises ValueError (nothing stored) for a run whose fields have the wrong types, and
        HistoryError when the file cannot take it: the run is then kept as a trace file in
        `unsaved-runs/` beside the history, and the message says where."""
        check_record(record)
        try:
            return self._add(record, sweep)
        except sqlite3.Error as exc:
            log.exception("saving run %s to the history %s failed", record.report.run_id, self.path)
            where = keep_unsaved(self.path, record)
            damaged = isinstance(exc, sqlite3.DatabaseError) and ("malformed" in str(exc) or "corrupt" in str(exc))
            head = self._damaged(str(exc)) if damaged else f"The run could not be saved to {self.path} ({exc})."
            raise HistoryError(f"{head} {where}") from None

    def _add(self, record: RunRecord, sweep: tuple[int, SweepMember] | None) -> int:
        r = record.report
        plan = r.plan
        devices = ",".join(r.device_order) or ",".join(s.device for s in plan.stages)
        row = (record.created_at, record.source, record.status, record.label, r.run_id,
               str(record.config.get("model", "")), devices, plan.prompt_tokens, plan.chunk, plan.n_chunks,
               len(plan.stages), plan.pipeline_depth, float(r.prefill_tok_s), float(r.decode_tok_s), r.digest,
               len(record.events), json.dumps(record.config, sort_keys=True),
               json.dumps(report_to_dict(r, telemetry=False)), json.dumps(r.telemetry))
        events = record.events

        def write(conn: sqlite3.Connection) -> int:
            cur = conn.execute(
                "INSERT INTO runs (created_at, source, status, label, engine_run_id, model, devices, prompt_tokens, "
                "chunk, n_chunks, n_stages, pf_depth, prefill_tok_s, decode_tok_s, digest, n_events, config_json, "
                "report_json, telemetry_json) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
            run = int(cur.lastrowid)
            conn.executemany(
                "INSERT INTO events (run, seq, run_id, stage, device, chunk, kind, start_ns, end_ns, tokens, nbytes, "
                "note) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                ((run, i, e.run_id, e.stage, e.device, e.chunk, e.kind, e.start_ns, e.end_ns, e.tokens, e.nbytes,
                  e.note) for i, e in enumerate(events)))
            if sweep is not None:
                sweep_id, m = sweep
                conn.execute("INSERT INTO sweep_runs (sweep, run, arm, prompt_tokens, repeat) VALUES (?, ?, ?, ?, ?)",
                             (sweep_id, run, m.arm, m.prompt_tokens, m.repeat))
            return run

        run_id = self._write(write)
        log.info("saved run %s (%d events) to the history as #%d", r.run_id, len(events), run_id)
        return run_id

    def delete(self, ids: Iterable[int]) -> int:
        """Delete runs (their events and sweep memberships go with them); returns how many."""
        ids = [int(i) for i in ids]
        if not ids:
            return 0

        def write(conn: sqlite3.Connection) -> int:
            marks = ",".join("?" * len(ids))
            return conn.execute(f"DELETE FROM runs WHERE id IN ({marks})", ids).rowcount

        return int(self._write(write))

    def set_label(self, run: int, label: str) -> None:
        self._write(lambda conn: conn.execute("UPDATE runs SET label = ? WHERE id = ?", (label, int(run))))

    # ------------------------------------------------------------------ reading
    def count(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT count(*) FROM runs").fetchone()[0])

    def list_runs(self, text: str = "", source: str | None = None, limit: int = 2000) -> list[RunRow]:
        """Newest first.  Each word of `text` must match: `setting=value` (e.g. `pipeline_depth=0`) a
        recorded setting; `#12` a run id; any other word (case-insensitively) the label, model,
        devices, digest, engine run id, source, status or a setting's value.  `source` keeps one
        source (run, sweep, import)."""
        where, args = [], []
        if source:
            where.append("source = ?")
            args.append(source)
        for word in text.split():
            key, eq, value = word.partition("=")
            if eq and key:
                value = {"true": "1", "on": "1", "yes": "1", "false": "0", "off": "0", "no": "0"}.get(
                    value.lower(), value)
                key = filter_key(key)
                where.append(f"lower(CAST({_config_value_sql(key)} AS TEXT)) = lower(?)")
                args += [key, _OLD_NAME[key], value] if key in _OLD_NAME else [key, value]
                continue
            like = f"%{word.lower()}%"
            where.append("(lower(label) LIKE ? OR lower(model) LIKE ? OR lower(devices) LIKE ? OR lower(digest) "
                         "LIKE ? OR lower(engine_run_id) LIKE ? OR lower(config_json) LIKE ? OR '#' || id = ? "
                         "OR lower(source) LIKE ? OR lower(status) LIKE ?)")
            args += [like] * 6 + [word] + [like] * 2
        sql = f"SELECT {_ROW_COLUMNS} FROM runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, id DESC LIMIT ?"
        args.append(int(limit))
        with self._lock:
            return [RunRow(*row) for row in self._conn.execute(sql, args)]

    def row(self, run: int) -> RunRow | None:
        with self._lock:
            found = self._conn.execute(f"SELECT {_ROW_COLUMNS} FROM runs WHERE id = ?", (int(run),)).fetchone()
        return RunRow(*found) if found else None

    def get(self, run: int) -> RunRecord:
        """The whole run: report (with telemetry), events in their original order, settings."""
        with self._lock:
            found = self._conn.execute(
                "SELECT created_at, source, status, label, config_json, report_json, telemetry_json FROM runs "
                "WHERE id = ?", (int(run),)).fetchone()
            if found is None:
                raise KeyError(f"no run #{run} in the history")
            rows = self._conn.execute(
                "SELECT run_id, stage, device, chunk, kind, start_ns, end_ns, tokens, nbytes, note FROM events "
                "WHERE run = ? ORDER BY seq", (int(run),)).fetchall()
        created_at, source, status, label, config_json, report_json, telemetry_json = found
        try:
            report = report_from_dict(json.loads(report_json))
            report.telemetry = json.loads(telemetry_json)
            events = [StageEvent(*r) for r in rows]
            record = RunRecord(report, events, config_from_dict(json.loads(config_json)), source, status, label,
                               created_at)
            check_record(record)
        except (TypeError, ValueError) as exc:  # json's errors are ValueErrors
            raise HistoryError(f"run #{run} in the history is unreadable: {exc}") from None
        return record

    def report(self, run: int) -> RunReport:
        """The engine report of a run, without its events or telemetry (cheap: lists, sweeps)."""
        with self._lock:
            found = self._conn.execute("SELECT report_json FROM runs WHERE id = ?", (int(run),)).fetchone()
        if found is None:
            raise KeyError(f"no run #{run} in the history")
        try:
            report = report_from_dict(json.loads(found[0]))
            check_report(report)
        except (TypeError, ValueError) as exc:
            raise HistoryError(f"run #{run} in the history is unreadable: {exc}") from None
        return report

    # ------------------------------------------------------------------ sweeps
    def add_sweep(self, label: str, plan: dict[str, Any]) -> int:
        return int(self._write(lambda conn: conn.execute(
            "INSERT INTO sweeps (created_at, label, status, plan_json) VALUES (?, ?, 'running', ?)",
            (time.time(), label, json.dumps(plan, sort_keys=True))).lastrowid))

    def set_sweep_status(self, sweep: int, status: str) -> None:
        if status not in ("running", "finished", "stopped"):
            raise ValueError(f"unknown sweep status {status!r}")
        self._write(lambda conn: conn.execute("UPDATE sweeps SET status = ? WHERE id = ?", (status, int(sweep))))

    def list_sweeps(self, limit: int = 200) -> list[SweepRow]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT s.id, s.created_at, s.label, s.status, "
                "(SELECT count(*) FROM sweep_runs r WHERE r.sweep = s.id) "
                "FROM sweeps s ORDER BY s.created_at DESC, s.id DESC LIMIT ?", (int(limit),)).fetchall()
        return [SweepRow(*r) for r in rows]

    def sweep(self, sweep: int) -> tuple[dict[str, Any], list[SweepMember]]:
        """A sweep's plan (as stored) and its runs, in the order they ran."""
        with self._lock:
            found = self._conn.execute("SELECT plan_json FROM sweeps WHERE id = ?", (int(sweep),)).fetchone()
            if found is None:
                raise KeyError(f"no sweep #{sweep} in the history")
            members = self._conn.execute(
                "SELECT run, arm, prompt_tokens, repeat FROM sweep_runs WHERE sweep = ? ORDER BY run",
                (int(sweep),)).fetchall()
        return json.loads(found[0]), [SweepMember(*m) for m in members]

    def integrity(self) -> str:
        """SQLite's own check: "ok" for a sound file."""
        with self._lock:
            return str(self._conn.execute("PRAGMA integrity_check").fetchone()[0])


def keep_unsaved(history_path: Path, record: RunRecord) -> str:
    """Write a run that the history could not take as a trace in `unsaved-runs/` beside it;
    returns a sentence saying where (or that even that failed)."""
    from ..run import run_files  # here: run_files is only needed on this rare path

    folder = Path(history_path).parent / UNSAVED_DIR
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(record.created_at))
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in record.report.run_id)[:40]
    target = folder / f"run-{stamp}-{safe}.json.gz"
    n = 1
    while target.exists():
        n += 1
        target = folder / f"run-{stamp}-{safe}-{n}.json.gz"
    try:
        run_files.export_trace(record, target)
    except Exception as exc:  # noqa: BLE001 - the message says that the run is lost
        log.exception("keeping the unsaved run as %s failed", target)
        return f"Keeping it as a trace file in {folder} failed too ({type(exc).__name__}: {exc}): the run is lost."
    log.warning("the run %s was kept as %s", record.report.run_id, target)
    return f"The run was kept as {target} (Import trace adds it to a new history)."


class UnsavedRuns:
    """The recorder of a session whose history could not be opened: every run goes to a trace
    file in `unsaved-runs/` beside the history file, and `add` raises HistoryError saying where."""

    def __init__(self, history_path: Path | None = None, why: str = "") -> None:
        self.path = default_path() if history_path is None else Path(history_path)
        self.why = why

    def add(self, record: RunRecord, sweep: object = None) -> int:
        check_record(record)
        raise HistoryError(f"No run history is open{': ' + self.why if self.why else ''}. "
                           f"{keep_unsaved(self.path, record)}")


def open_history(path: Path | None = None) -> tuple[RunHistory | None, str]:
    """The history at `path` (default: the user's data dir), or None and why it cannot be used."""
    path = default_path() if path is None else Path(path)
    try:
        return RunHistory(path), ""
    except HistoryError as exc:
        log.warning("%s", exc)
        return None, str(exc)

