"""Every output file is written atomically (engine/io/atomic_file.py): a write that fails with a full
disk leaves the earlier file at that path byte-identical and no temporary file behind (issue 39).

The full disk is real where the test may mount a small tmpfs (root), else injected: `os.fsync`
of a file in the test's folder fails with ENOSPC, as a file system that ran out of blocks at
write-back does."""
from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from engine.cli import bench
from engine.io import atomic_file, synth, trace

ROOT = Path(__file__).resolve().parent.parent
EARLIER = b"the earlier file \x00\xff, kept byte for byte\n" * 3


@pytest.fixture
def full_disk(tmp_path, monkeypatch):
    """A folder whose files cannot be made durable: ENOSPC from fsync of any file in it."""
    folder = tmp_path / "full"
    folder.mkdir()
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to tell the test's files from others")
    monkeypatch.setattr(os, "fsync", fsync)
    return folder


def _earlier(path: Path) -> Path:
    path.write_bytes(EARLIER)
    return path


def _intact(path: Path) -> None:
    assert path.read_bytes() == EARLIER
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no .part left behind


def test_write_atomic_keeps_the_earlier_file_on_a_full_disk(full_disk):
    target = _earlier(full_disk / "out.bin")
    with pytest.raises(OSError) as info:
        atomic_file.write_atomic(target, b"new" * 1000)
    assert info.value.errno == errno.ENOSPC
    _intact(target)


def test_an_exception_inside_the_writer_keeps_the_earlier_file(tmp_path):
    target = _earlier(tmp_path / "out.npy")
    with pytest.raises(KeyboardInterrupt), atomic_file.atomic_open(target) as fh:
        fh.write(b"half a file")
        raise KeyboardInterrupt
    _intact(target)


def test_a_successful_write_replaces_the_file(tmp_path):
    target = _earlier(tmp_path / "out.bin")
    atomic_file.write_atomic(target, b"new")
    assert target.read_bytes() == b"new"


def test_every_output_kind_keeps_the_earlier_file(full_disk, demo_path):
    """Trace, logits, the history's CSV and PNG exports (run_files), and make-model."""
    from strata_gui.run import run_files

    writers = {
        "t.json": lambda p: trace.save(p, [], {"x": 1}),
        "t.json.gz": lambda p: trace.save(p, [], {"x": 1}),
        "logits.npy": lambda p: bench._save_npy(p, np.zeros((4, 8), np.float32)),
        "events.png": lambda p: run_files.write_bytes(p, b"\x89PNG" + b"\0" * 100),
        "sweep.csv": lambda p: run_files.write_bytes(p, b"a,b\n1,2\n"),
        "model.gguf": lambda p: synth.write_model(p, synth.recipe_from_args("demo")),
    }
    for name, write in writers.items():
        folder = full_disk / name.replace(".", "_")
        folder.mkdir()
        target = _earlier(folder / name)
        with pytest.raises(OSError):
            write(target)
        _intact(target)


def test_logits_out_on_a_full_disk_keeps_the_earlier_file_and_saves_elsewhere(full_disk, demo_path, capsys,
                                                                              tmp_path):
    target = _earlier(full_disk / "logits.npy")
    rc = bench.main(["run", "--model", str(demo_path), "--prompt-tokens", "16", "--warmup", "0",
                     "--logits-out", str(target), "--trace", str(tmp_path / "t.json")])
    out, err = capsys.readouterr()
    assert rc == 2
    assert "digest:" in out  # the table and digest were printed before the write
    line = [x for x in err.splitlines() if "--logits-out" in x]
    assert len(line) == 1 and f"cannot write --logits-out {target}" in line[0] and "No space" in line[0], err
    saved = Path(line[0].split("saved it to ")[1].split(" instead")[0])
    try:
        assert np.load(saved).shape[0] == 16
    finally:
        saved.unlink()
    _intact(target)
    assert (tmp_path / "t.json").exists()  # the other output still went where it was asked


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 32 KiB tmpfs (root only): a disk that really fills up."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder = tmp_path / "tiny"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def test_logits_onto_a_real_full_tmpfs_keep_the_earlier_file_and_say_the_disk_is_full(tiny_tmpfs):
    """numpy reports a short write on a full disk as "25024 requested and 7136 written" (no errno):
    the writer says ENOSPC with the bytes free, and the earlier file stays."""
    target = _earlier(tiny_tmpfs / "logits.npy")
    with pytest.raises(OSError) as info:
        bench._save_npy(target, np.zeros((64, 391), np.float32))  # 100 KiB onto 32
    assert info.value.errno == errno.ENOSPC and "bytes free on" in str(info.value), info.value
    _intact(target)


def test_logits_out_larger_than_its_disk_is_refused_before_the_run(tiny_tmpfs, demo_path, capsys):
    target = _earlier(tiny_tmpfs / "logits.npy")
    rc = bench.main(["run", "--model", str(demo_path), "--prompt-tokens", "64", "--warmup", "0",
                     "--logits-out", str(target)])
    err = capsys.readouterr().err
    assert rc == 2 and "invalid --logits-out" in err and "free on" in err and "digest" not in err, err
    _intact(target)
