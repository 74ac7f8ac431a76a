"""Every output file is written atomically: to a temporary file beside the target, renamed into
place once it is whole.  A failed write (a full disk, a crash, Ctrl-C) leaves the earlier file at
that path byte-identical, and never a half-written one.

`atomic_path` is the one place this happens; `write_atomic` (bytes) and `atomic_open` (a file
object) are its two forms.  The file gets the mode a plain `open()` would give it (0666 less
the umask, not mkstemp's 0600), and the folder is fsynced after the rename so the new name
survives a power cut.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)


def _read_umask() -> int:
    """The process umask, read without changing it where the OS shows it (Linux), else set and
    restored once at import (before the app starts threads that create files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _read_umask()


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (POSIX); a file system that cannot fsync a folder is logged."""
    if os.name != "posix":
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError as exc:
        log.debug("cannot open %s to fsync it: %s", folder, exc)
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        log.debug("cannot fsync the folder %s: %s", folder, exc)
    finally:
        os.close(fd)


def free_bytes(folder: Path) -> int | None:
    """Bytes an unprivileged writer may still put on `folder`'s file system (None: unknown)."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):  # no statvfs on Windows
        return None
    return st.f_bavail * st.f_frsize


_SHORT_WRITE = re.compile(r"(\d+) requested and (\d+) written")


def disk_full_error(exc: OSError, folder: Path) -> OSError:
    """`exc` as the ENOSPC it is: numpy's `tofile` reports a short write on a full disk as
    "25024 requested and 7136 written", with no errno; anything else is returned as it is."""
    if exc.errno is not None:
        return exc
    m = _SHORT_WRITE.search(str(exc))
    free = free_bytes(folder)
    if m is None or free is None or free >= int(m.group(1)) - int(m.group(2)):
        return exc
    return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {int(m.group(2)):,} of {int(m.group(1)):,} bytes "
                                 f"written, {free:,} bytes free on {folder}")


class FileInUseError(PermissionError):
    """The target exists and cannot be replaced: on Windows, a file another program has open or
    mapped ([WinError 5] / [WinError 32]) — a GGUF the app or a strata-bench run has loaded."""

    def __init__(self, path: Path, cause: OSError) -> None:
        winerror = getattr(cause, "winerror", None)
        code = f"WinError {winerror}" if winerror else (cause.strerror or type(cause).__name__)
        super().__init__(cause.errno, f"cannot replace {path}: another program has the file open ({code}) — on Windows "
                                      f"a GGUF that Strata GUI or a strata-bench run has loaded stays mapped until that "
                                      f"program closes it. Close it there (or the app), or write to another path; "
                                      f"{path.name} was left as it was")
        self.path = path

    def __str__(self) -> str:
        return self.strerror


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """A temporary path beside `path` for the caller to write (by name: a writer that opens the
    file itself); on a clean exit it is fsynced, given the usual mode and renamed to `path`; on
    any exception it is removed and `path` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=path.name + ".", suffix=".part", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o666 & ~UMASK)
        try:
            os.replace(tmp, path)
        except PermissionError as exc:  # Windows: the old file is open or mapped elsewhere
            if path.exists() and not path.is_dir():
                raise FileInUseError(path, exc) from None
            raise
    except OSError as exc:
        full = disk_full_error(exc, path.parent)  # while the partial file still holds the space
        tmp.unlink(missing_ok=True)
        if full is exc:
            raise
        raise full from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextmanager
def atomic_open(path: Path | str) -> Iterator[IO[bytes]]:
    """A binary file object whose content replaces `path` only once it is all written."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        yield fh
        fh.flush()


def write_atomic(path: Path | str, data: bytes) -> Path:
    """`data` as the whole content of `path`, atomically."""
    with atomic_open(path) as fh:
        fh.write(data)
    return Path(path)
