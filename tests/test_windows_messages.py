"""Two Windows failures turned into clear messages, checked here on Linux: make-model over a GGUF
another program has mapped ([WinError 5]: the refusal is simulated at os.replace, the one call
Windows refuses), and a run history on a network share, where WAL does not work (the detector
reads /proc/self/mounts or asks Windows for the drive type)."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from history_support import demo_runs  # noqa: F401

from engine.cli import bench
from engine.io import atomic_file
from strata_gui.history import history_model
from strata_gui.history.network_path import linux_mount, network_location, windows_location


def test_make_model_over_a_file_in_use_is_one_clear_line_and_leaves_it(tmp_path, monkeypatch, capsys):
    target = tmp_path / "m.gguf"
    target.write_bytes(b"the model the app has open")

    def refuse(src, dst):  # what Windows does to a file another process has mapped
        raise PermissionError(13, "Access is denied", str(src), 5, str(dst))

    monkeypatch.setattr(atomic_file.os, "replace", refuse)  # the one replace every output file goes through
    rc = bench.main(["make-model", str(target), "--preset", "demo"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"strata-bench: error: cannot replace {target}: another program has the file open")
    assert "write to another path" in err[0]
    assert target.read_bytes() == b"the model the app has open"
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # the temporary file is gone too


MOUNTS = """\
/dev/vda1 / ext4 rw,relatime 0 0
proc /proc proc rw 0 0
//nas/lab /mnt/lab cifs rw,vers=3.1.1 0 0
nas:/export /mnt/lab/nfs nfs4 rw 0 0
/dev/vdb1 /mnt/lab\\040local ext4 rw 0 0
"""


def test_the_mount_holding_a_path_is_the_longest_prefix():
    assert linux_mount(Path("/home/u/h.sqlite3"), MOUNTS) == ("/", "ext4")
    assert linux_mount(Path("/mnt/lab/runs/h.sqlite3"), MOUNTS) == ("/mnt/lab", "cifs")
    assert linux_mount(Path("/mnt/lab/nfs/h.sqlite3"), MOUNTS) == ("/mnt/lab/nfs", "nfs4")
    assert linux_mount(Path("/mnt/lab local/h.sqlite3"), MOUNTS) == ("/mnt/lab local", "ext4")
    assert linux_mount(Path("/mnt/labx/h.sqlite3"), MOUNTS) == ("/", "ext4")  # a prefix of the name is not a parent


def test_windows_unc_paths_and_mapped_drives_are_remote():
    assert windows_location(r"\\nas\lab\strata\history.sqlite3") == "a network share (UNC path)"
    assert windows_location(r"Z:\strata\history.sqlite3", drive_type=4) == "a network drive (Z:)"
    assert windows_location(r"C:\Users\u\history.sqlite3", drive_type=3) == ""  # DRIVE_FIXED


def test_a_local_history_uses_wal_and_says_nothing(tmp_path):
    assert network_location(tmp_path / "h.sqlite3") == ""  # pytest's temp folder is local here
    with history_model.RunHistory(tmp_path / "h.sqlite3") as h:
        assert h.journal_mode == "wal" and h.notice == ""


def test_a_history_on_a_network_share_falls_back_from_wal_and_says_so(tmp_path, monkeypatch, demo_runs):  # noqa: F811
    path = tmp_path / "h.sqlite3"
    with history_model.RunHistory(path) as h:  # made locally first: a WAL file
        h.add(demo_runs.join)
    monkeypatch.setattr(history_model, "network_location", lambda p: "a cifs network mount (/mnt/lab)")
    with history_model.RunHistory(path) as h:
        assert h.journal_mode == "delete"
        assert "is on a cifs network mount (/mnt/lab): SQLite's WAL mode does not work" in h.notice
        h.add(demo_runs.overlap)
        assert len(h.list_runs()) == 2
    assert not Path(f"{path}-wal").exists()
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "delete"


@pytest.mark.skipif(not Path("/proc/self/mounts").exists(), reason="Linux mount table")
def test_network_location_reads_this_machines_mount_table():
    assert network_location("/proc/x") == ""  # proc is no network file system
