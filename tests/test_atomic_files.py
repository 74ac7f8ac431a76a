"""Every output file is written atomically (engine/atomic_file.py): a write that fails with a full
disk leaves the earlier file at that path byte-identical and no temporary file behind (issue 39).

The full disk is real where the test may mount a small tmpfs (root), else injected: `os.fsync`
of a file in the test's folder fails with ENOSPC, as a file system that ran out of blocks at
write-back does."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine import atomic_file, bench, synth, trace

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


TMPFS_CHILD = r"""
import subprocess, sys
folder, demo = sys.argv[1], sys.argv[2]
from pathlib import Path
target = Path(folder) / "logits.npy"
target.write_bytes(b"earlier logits")
from engine import bench
rc = bench.main(["run", "--model", demo, "--prompt-tokens", "64", "--warmup", "0", "--logits-out", str(target)])
print(rc, target.read_bytes() == b"earlier logits", sorted(p.name for p in Path(folder).iterdir()))
"""


@pytest.mark.skipif(os.geteuid() != 0 if hasattr(os, "geteuid") else True, reason="mounting a tmpfs needs root")
def test_logits_out_onto_a_real_full_tmpfs(tmp_path, demo_path):
    """64 tokens of demo logits (~100 KiB) onto a 32 KiB tmpfs that holds the earlier file."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        out = subprocess.run([sys.executable, "-c", TMPFS_CHILD, str(folder), str(demo_path)], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == "2 True ['logits.npy']", out.stdout + out.stderr
        assert "No space left on device" in out.stderr and "saved it to" in out.stderr
        for line in out.stderr.splitlines():  # the fallback copy in the temp folder
            if "saved it to " in line:
                Path(line.split("saved it to ")[1].split(" instead")[0]).unlink()
    finally:
        subprocess.run(["umount", str(folder)], check=False)
