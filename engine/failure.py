"""Internal errors as users meet them: one line that says what failed and where, and a log file
that keeps the whole traceback for a bug report.

A user error (a setting, a file, a device out of memory, a stop) is explained by its own
message.  Anything else is a bug of ours: its traceback never reaches the user's screen
unasked.  `strata-bench` exits with INTERNAL_ERROR (3) instead of BAD_INPUT (2), and the
app shows the same line with the traceback behind the dialog's details.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from engine import settings_table

log = logging.getLogger(__name__)

BAD_INPUT = 2  # exit code: a setting, a file or the machine refused; the message says what to change
INTERNAL_ERROR = 3  # exit code: a bug; the message names the log file with the traceback
PACKAGE_DIRS = ("engine", "strata_gui")  # frames of ours, for "where"


def log_dir() -> Path:
    """Where error logs go: STRATA_LOG_DIR, else the platform's per-user log folder."""
    env = settings_table.env_value("log_dir")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_log_dir("strata-gui", appauthor=False))


def is_user_error(exc: BaseException) -> bool:
    """Whether the exception's own message is the whole story (no bug behind it).

    Looks only at modules already imported (an error of a module that never loaded cannot
    be raised), so a bad argument is told apart without importing torch."""
    import sys

    from engine.config import ConfigError

    # OSError: a path that cannot be read or written (its message names the path)
    expected: list[type[BaseException]] = [ConfigError, MemoryError, OSError]
    for module, names in (("engine.io.gguf_model", ("GGUFError",)), ("engine.io.synth", ("RecipeError",)),
                          ("engine.io.trace", ("TraceError",)),
                          ("engine.errors", ("Cancelled", "DeviceMemoryError", "NonFiniteError")),
                          ("engine.pipeline.executor", ("StageLost",))):
        mod = sys.modules.get(module)
        if mod is not None:
            expected += [getattr(mod, n) for n in names]
    errors = sys.modules.get("engine.errors")
    if errors is not None and isinstance(exc, errors.StageError):
        exc = exc.__cause__ or exc
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "OutOfMemoryError"):
        expected.append(torch.OutOfMemoryError)
    return isinstance(exc, tuple(expected))


_HOST_ALLOC = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")


def host_out_of_memory(exc: BaseException) -> str | None:
    """The line for an allocation the host could not satisfy (torch's CPU allocator raises a
    RuntimeError "[enforce fail at alloc_cpu.cpp…] … you tried to allocate N bytes", numpy a
    MemoryError): out of memory with the size, not an internal error.  None for anything else."""
    from engine.sizes import size_text

    errors = sys.modules.get("engine.errors")
    if errors is not None and isinstance(exc, errors.StageError) and exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, MemoryError):
        m = re.search(r"(\d+)(?:\.\d+)? ?([KMGT]i?B)", str(exc))
        what = f" allocating {m.group(0)}" if m else ""
    elif isinstance(exc, RuntimeError) and (m := _HOST_ALLOC.search(str(exc))):
        what = f" allocating {size_text(int(m.group(1)))}"
    else:
        return None
    return (f"out of memory on the host{what}: the run needs more memory than this machine (or this process's "
            f"limit) has; lower --prompt-tokens / --decode-tokens, or use more devices")


def where(exc: BaseException) -> str:
    """`file.py:line in function` of the innermost frame in our packages (else the innermost)."""
    frames = traceback.extract_tb(exc.__traceback__)
    cause = exc.__cause__
    while cause is not None and cause.__traceback__ is not None:  # a wrapped error: where it began
        frames = traceback.extract_tb(cause.__traceback__) or frames
        cause = cause.__cause__
    ours = [f for f in frames if any(f"{os.sep}{d}{os.sep}" in f.filename for d in PACKAGE_DIRS)]
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return "unknown place"
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"


@dataclass(frozen=True)
class InternalError:
    """An internal error, written down."""

    line: str  # what failed, where, and the log file: what the user sees
    log_path: Path | None  # None when the log could not be written
    details: str  # the full traceback


def record(exc: BaseException, context: str) -> InternalError:
    """Write the traceback of `exc` to a new log file and return the line to show.

    `context` says what was being done ("strata-bench run", "the run"); never raises."""
    details = "".join(traceback.format_exception(exc))
    what = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no message'}"
    path: Path | None = None
    try:
        folder = log_dir()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        path.write_text(f"{context}\n{time.strftime('%Y-%m-%d %H:%M:%S %z')}\n\n{details}", encoding="utf-8")
        tail = f"full traceback in {path}"
    except OSError as write_exc:
        log.warning("could not write the error log: %s", write_exc)
        path, tail = None, f"the traceback could not be saved ({write_exc}); run with -v to see it"
    line = f"internal error in {context} at {where(exc)}: {what} — {tail}"
    log.debug("%s\n%s", line, details)
    return InternalError(line, path, details)


def dialog_text(exc: BaseException, context: str, title: str) -> tuple[str, str, str]:
    """(title, message, details) for the app's error dialog: a user error's own message; an
    internal error's one line (what failed, where, the log file) with its traceback as details."""
    oom = host_out_of_memory(exc)
    if oom is not None:
        log.warning("%s failed: %s", context, exc)
        return f"{title}: out of memory", oom, "".join(traceback.format_exception(exc))
    if is_user_error(exc):
        log.warning("%s failed: %s", context, exc)
        return f"{title}: {type(exc).__name__}", str(exc), "".join(traceback.format_exception(exc))
    log.error("%s failed: %s", context, exc, exc_info=exc)
    err = record(exc, context)
    return f"{title}: internal error", err.line, err.details
