"""The doors of executor=processes (issue 30), tried as an attacker on 127.0.0.1 would: nothing
that arrives over a socket is unpickled, the key has no default, a stray or hostile client never
blocks the real stages, and spawned stages open no port beyond loopback."""
from __future__ import annotations

import os
import pickle
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path

import numpy as np
import pytest
from executor_support import ROOT, env, free_port, reap, stage_command

from engine.config import ConfigError, EngineConfig
from engine.io import gguf_model
from engine.io.prompt import synthetic
from engine.pipeline import wire
from engine.pipeline.session import Session
from engine.pipeline.stage_messages import Hello, Refused, versions
from engine.pipeline.stage_process import RunOrder, SourceRef, StageSpec

OLD_DEFAULT_KEY = b"strata-gui"  # the public default key of before


class Touch:
    """Unpickling this runs `touch MARKER`: the payload of every attack below."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def demo(demo_path):
    return gguf_model.load(demo_path)


@pytest.fixture()
def key(monkeypatch) -> str:
    k = secrets.token_urlsafe(24)
    monkeypatch.setenv("STRATA_RENDEZVOUS_KEY", k)
    monkeypatch.setenv("STRATA_STAGE_TIMEOUT_S", "60")
    return k


def _dial(port: int, timeout: float = 20.0) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=2)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _until_closed(s: socket.socket, limit_s: float = 20.0) -> str:
    """'closed' once the peer hung up (after its challenge frame), 'open' if it kept the line."""
    s.settimeout(limit_s)
    try:
        while s.recv(1 << 16):
            pass
    except TimeoutError:
        return "open"
    except OSError:
        pass
    return "closed"


def _pickle_frame(obj) -> bytes:
    data = pickle.dumps(obj)
    return struct.pack(">I", len(data)) + data


# ------------------------------------------------------------------ the codec
def test_messages_round_trip_and_nothing_else_decodes():
    spec = StageSpec(rank=1, world=2, device="cpu", first=2, end=4, source=SourceRef("gguf", path="/m.gguf"),
                     dtype="float32", store_host="", store_port=5, backend="gloo", threads=2, timeout_s=60.0,
                     parent_pid=0, ranges=((0, 2), (2, 4)))
    order = RunOrder(run_id="r", ids=[1, 2], bounds=[(0, 2)], capacity=3, chunk=2, depth=1, logits_all=False,
                     events=True, check_nan=False, prefill_main=False, graph_sizes=(1, 2))
    logits = np.arange(6, dtype=np.float32).reshape(2, 3)
    msg = ("prefill_done", 1, "ab", logits, {"hits": 3}, spec, order, None, b"\x00\x01")
    back = wire.decode(wire.encode(msg))
    assert back[:3] == msg[:3] and back[4:] == msg[4:]
    assert np.array_equal(back[3], logits) and back[3].flags.writeable
    for bad in (b'{"v":1,"m":{"$c":"Popen","f":{}}}',  # a class that is not a message type
                b'{"v":1,"m":{"$a":"|O","shape":[1],"b":""}}',  # an object array
                b'{"v":1,"m":{"$c":"StageSpec","f":{"evil":1}}}',  # a field it does not have
                b'{"v":2,"m":1}', b"\x80\x04K\x01.", b"[1,2]"):
        with pytest.raises(wire.WireError):
            wire.decode(bad)
    with pytest.raises(TypeError):
        wire.encode((Touch(Path("x")),))


def test_a_tampered_or_replayed_frame_is_refused():
    a, b = socket.socketpair()
    k = secrets.token_bytes(32)
    tx, rx = wire.Channel(a, k, True, 5.0), wire.Channel(b, k, False, 5.0)
    tx.send(("ping",))
    assert rx.recv(timeout=5) == ("ping",)
    frame = struct.pack(">I", 32 + 5) + bytes(32) + b'{"v":'  # a frame with a forged MAC
    a.sendall(frame)
    with pytest.raises(wire.WireError, match="MAC"):
        rx.recv(timeout=5)
    a.close(), b.close()


# ---------------------------------------------------------------- the controller
def test_no_key_or_a_short_key_is_refused_before_listening(demo, monkeypatch):
    for short in ("", "strata-gui", "x" * 19):
        monkeypatch.setenv("STRATA_RENDEZVOUS_KEY", short)
        with pytest.raises(ConfigError, match="STRATA_RENDEZVOUS_KEY.*at least 20 characters"):
            Session(demo, EngineConfig(devices=["cpu", "cpu"], executor="processes",
                                       rendezvous=f"127.0.0.1:{free_port()}"))


def test_without_a_key_the_controller_makes_one_and_shows_the_command(demo, monkeypatch, caplog):
    from engine.pipeline import rendezvous_key

    monkeypatch.delenv("STRATA_RENDEZVOUS_KEY", raising=False)
    monkeypatch.setenv("STRATA_STAGE_TIMEOUT_S", "1")
    monkeypatch.setattr(rendezvous_key, "_generated", None)
    port = free_port()
    with pytest.raises(ConfigError, match="only ranks none attached"):
        Session(demo, EngineConfig(devices=["cpu", "cpu"], executor="processes", rendezvous=f"127.0.0.1:{port}"))
    made = rendezvous_key.controller_key().decode()
    assert len(made) >= rendezvous_key.MIN_KEY_CHARS and made != "strata-gui"
    text = caplog.text
    for r in range(2):
        assert f"STRATA_RENDEZVOUS_KEY={made} strata-bench stage --rendezvous 127.0.0.1:{port} --rank {r} --world 2" in text


def test_attacks_on_a_waiting_controller_run_nothing_and_the_real_stages_still_attach(demo, key, tmp_path):
    marker = tmp_path / "pwned"
    ids = synthetic(48, demo.spec.vocab, nonce=5)
    want = Session(demo, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=16)).run(ids).report.digest
    port = free_port()
    results: dict = {}
    started: list[subprocess.Popen] = []
    half = threading.Event()
    idle: list[socket.socket] = []

    def attacks() -> None:
        silent = _dial(port)  # a client that connects and never speaks, held open all along
        idle.append(silent)
        try:  # the old default key and a pickle, through multiprocessing's own client
            c = Client(("127.0.0.1", port), authkey=OLD_DEFAULT_KEY)
            c.send(Touch(marker))
            results["mp_client"] = "connected"
        except Exception as exc:
            results["mp_client"] = type(exc).__name__
        for name, data in (("raw_pickle", _pickle_frame(Touch(marker))), ("garbage", os.urandom(64)),
                           ("huge_prefix", struct.pack(">I", 2**31) + b"x" * 16), ("empty", b"")):
            s = _dial(port)
            s.sendall(data)
            results[name] = _until_closed(s)
            s.close()
        rst = _dial(port)  # connect and reset, as a port scan does
        rst.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        rst.close()
        started.append(subprocess.Popen(stage_command(port, "--rank", "0", "--world", "2", "--timeout", "60"),
                                        cwd=ROOT, env=env(), stderr=subprocess.DEVNULL))
        half.wait(60)
        dup = wire.connect(_dial(port), key.encode(), time.monotonic() + 10, 10)  # a second rank 0, with the key
        dup.send(Hello(0, 2, 4242, "intruder", versions()))
        results["dup"] = dup.recv(timeout=10)
        started.append(subprocess.Popen(stage_command(port, "--rank", "1", "--world", "2", "--timeout", "60"),
                                        cwd=ROOT, env=env(), stderr=subprocess.DEVNULL))

    def progress(what: str, frac: float) -> None:
        if "attach" in what and frac == 0.5:
            half.set()

    t = threading.Thread(target=attacks, daemon=True)
    t.start()
    try:
        sess = Session(demo, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=16, executor="processes",
                                          rendezvous=f"127.0.0.1:{port}"), progress=progress)
        t.join(30)
        res = sess.run(ids)
        assert res.report.digest == want
        sess.close()
        for p in started:
            assert p.wait(timeout=30) == 0
    finally:
        for s in idle:
            s.close()
        reap(started)
    assert not marker.exists(), "an attack ran code in the controller"
    assert results["mp_client"] != "connected"
    assert isinstance(results["dup"], Refused) and "taken" in results["dup"].reason
    for name in ("raw_pickle", "garbage", "huge_prefix", "empty"):
        assert results[name] == "closed", name


# -------------------------------------------------------------------- the stage
def _run_stage(port: int, timeout: str = "3", **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(stage_command(port, "--rank", "0", "--world", "2", "--timeout", timeout), cwd=ROOT,
                          env=env(**extra_env), capture_output=True, text=True, timeout=120)


def test_a_fake_controller_with_the_old_default_key_runs_nothing_in_a_stage(tmp_path):
    marker = tmp_path / "pwned"
    port = free_port()
    listener = Listener(("127.0.0.1", port), authkey=OLD_DEFAULT_KEY)

    def fake() -> None:
        try:
            conn = listener.accept()
            conn.send(("spec", Touch(marker)))
        except Exception:
            pass

    threading.Thread(target=fake, daemon=True).start()
    out = _run_stage(port, STRATA_RENDEZVOUS_KEY=secrets.token_urlsafe(24))
    listener.close()
    assert out.returncode == 2, out.stderr
    assert "failed the handshake" in out.stderr or "closed the connection" in out.stderr, out.stderr
    assert not marker.exists()


def test_a_silent_controller_or_one_without_the_key_ends_the_stage_within_its_timeout():
    with socket.create_server(("127.0.0.1", 0)) as srv:  # accepts and never speaks
        port = srv.getsockname()[1]
        out = _run_stage(port, STRATA_RENDEZVOUS_KEY=secrets.token_urlsafe(24))  # a hang is subprocess's timeout
        assert out.returncode == 2 and "did not answer within 3 s" in out.stderr, out.stderr
    port = free_port()
    wrong = secrets.token_bytes(24)

    def impostor() -> None:  # speaks the protocol with another key
        with socket.create_server(("127.0.0.1", port)) as s:
            conn, _ = s.accept()
            try:
                wire.accept(conn, wrong, time.monotonic() + 5, 5)
            except (wire.WireError, OSError, EOFError):
                pass
            conn.close()

    threading.Thread(target=impostor, daemon=True).start()
    time.sleep(0.2)
    out = _run_stage(port, STRATA_RENDEZVOUS_KEY=secrets.token_urlsafe(24))
    assert out.returncode == 2 and "closed the connection: wrong key" in out.stderr, out.stderr


def test_a_stage_without_a_key_or_with_a_short_one_is_refused():
    out = _run_stage(free_port(), STRATA_RENDEZVOUS_KEY="")
    assert out.returncode == 2 and "STRATA_RENDEZVOUS_KEY" in out.stderr and "at least 20" in out.stderr, out.stderr
    e = env()
    e.pop("STRATA_RENDEZVOUS_KEY", None)
    out = subprocess.run(stage_command(free_port(), "--rank", "0", "--world", "2", "--timeout", "1"), cwd=ROOT,
                         env=e, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "STRATA_RENDEZVOUS_KEY" in out.stderr, out.stderr


# ------------------------------------------------------------------ the ports
def _listening(pid: int) -> list[str]:
    """The addresses a process listens on over TCP (Linux /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                addr, port = f[1].split(":")
                out.append(f"{_addr(addr, width)}:{int(port, 16)}")
    return out


def _addr(hexaddr: str, width: int) -> str:
    raw = bytes.fromhex(hexaddr)
    if width == 8:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def _loopback(addr: str) -> bool:
    host = addr.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1") or host.startswith("::ffff:127.")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net")
def test_spawned_stages_open_no_store_port_and_nothing_beyond_loopback(demo):
    sess = Session(demo, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=16, executor="processes"))
    try:
        sess.run(synthetic(32, demo.spec.vocab, nonce=1))
        assert _listening(os.getpid()) == [], "the controller of spawned stages listens on a port"
        for pid in sess.stage_pids():
            ports = _listening(pid)
            assert all(_loopback(a) for a in ports), (pid, ports)  # gloo's pair sockets, on loopback
    finally:
        sess.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net")
def test_a_loopback_rendezvous_binds_its_listener_and_store_to_loopback(demo, key):
    port = free_port()
    seen: list[list[str]] = []

    def progress(what: str, frac: float) -> None:
        if "attach" in what and frac == 0.0:
            seen.append(_listening(os.getpid()))

    procs = [subprocess.Popen(stage_command(port, "--rank", str(r), "--world", "2", "--timeout", "60"), cwd=ROOT,
                              env=env(), stderr=subprocess.DEVNULL) for r in range(2)]
    try:
        sess = Session(demo, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=16, executor="processes",
                                          rendezvous=f"127.0.0.1:{port}"), progress=progress)
        ports = _listening(os.getpid())
        sess.close()
    finally:
        reap(procs)
    assert seen and f"127.0.0.1:{port}" in seen[0] and f"127.0.0.1:{port + 1}" in seen[0], seen
    assert all(_loopback(a) for a in seen[0] + ports), (seen, ports)


def test_the_store_works_the_windows_way_without_libuv(monkeypatch):
    """torch's Windows wheels have no libuv: the store is made with use_libuv=False there (here
    forced on Linux), still bound where asked, and a stage's client reaches it the same way."""
    from datetime import timedelta

    import torch.distributed as dist

    from engine.pipeline import stage_job

    monkeypatch.setattr(stage_job, "LIBUV", False)
    port = free_port()
    store = stage_job._tcp_store("127.0.0.1", port, 10.0, f"127.0.0.1:{port - 1}")
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10), use_libuv=False)
    client.set("rank1", "here")
    assert store.get("rank1") == b"here"
    if sys.platform.startswith("linux"):
        assert f"127.0.0.1:{port}" in _listening(os.getpid())
        assert all(_loopback(a) for a in _listening(os.getpid()))
    del client, store
