"""Whether a file lives on a network file system, where SQLite's WAL mode must not be used.

WAL keeps its index in shared memory beside the database (the -shm file, memory-mapped by every
connection); SQLite's documentation says WAL "does not work over a network filesystem", and SMB
or NFS give no coherent shared mapping between machines.  The history (history_model.RunHistory)
asks `network_location` and opens such a file in rollback-journal mode instead, saying so.

Windows: a UNC path (\\\\server\\share\\…) or a drive letter the system reports as DRIVE_REMOTE (a
mapped network drive).  Linux: the file system type of the longest mount point above the path in
/proc/self/mounts (nfs, cifs/smb3, sshfs, …).  Elsewhere nothing is detected ("").
"""
from __future__ import annotations

import ntpath
import sys
from pathlib import Path

NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "glusterfs", "lustre",
                        "fuse.sshfs", "fuse.rclone", "fuse.s3fs", "davfs", "fuse.davfs2", "ncpfs", "gpfs"})
DRIVE_REMOTE = 4  # GetDriveTypeW


def _unescape(field: str) -> str:
    """A /proc/mounts field: spaces, tabs, newlines and backslashes are octal escapes there."""
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field


def linux_mount(path: Path, mounts_text: str) -> tuple[str, str]:
    """(mount point, file system type) of the mount that holds `path` (absolute), from the text
    of /proc/self/mounts; ("", "") when nothing matches."""
    best = ("", "")
    target = str(path)
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt, fstype = _unescape(parts[1]), parts[2]
        inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best[0]):
            best = (mnt, fstype)
    return best


def windows_location(path: str, drive_type=None) -> str:
    """Why a Windows path is remote ("" when local): a UNC path, or a mapped network drive."""
    unc = path.startswith(("\\\\", "//")) and not path.startswith(("\\\\?\\", "\\\\.\\"))
    if unc or path.startswith("\\\\?\\UNC\\"):
        return "a network share (UNC path)"
    drive = ntpath.splitdrive(path.removeprefix("\\\\?\\"))[0]  # Windows rules, whatever OS reads it
    if len(drive) == 2 and drive[1] == ":":
        if drive_type is None:
            import ctypes

            drive_type = ctypes.windll.kernel32.GetDriveTypeW(drive + "\\")
        if drive_type == DRIVE_REMOTE:
            return f"a network drive ({drive})"
    return ""


def network_location(path: Path | str) -> str:
    """A few words naming the network file system `path` is on, or "" (local, or unknown)."""
    p = Path(path).absolute()
    if sys.platform == "win32":
        try:
            return windows_location(str(p))
        except (OSError, AttributeError):
            return ""
    try:
        text = Path("/proc/self/mounts").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    try:
        resolved = p.parent.resolve() / p.name
    except OSError:
        resolved = p
    mnt, fstype = linux_mount(resolved, text)
    return f"a {fstype} network mount ({mnt})" if fstype in NETWORK_FS else ""
