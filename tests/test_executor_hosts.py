"""Stages started apart from their controller (`strata-bench stage --rendezvous HOST:PORT`, what
torchrun runs on each workstation), tested as separate process groups on 127.0.0.1; and the bad
rendezvous cases: port in use, nobody listening, versions that differ between hosts."""
from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import pytest
from executor_support import ROOT, env, free_port, reap, stage_command
from platform_support import posix_signals

from engine.config import ConfigError, EngineConfig
from engine.io import gguf_model
from engine.io.prompt import synthetic
from engine.pipeline import wire
from engine.pipeline.session import Session
from engine.pipeline.stage_messages import Hello, Refused, versions


@pytest.fixture(scope="module")
def demo(demo_path):
    return gguf_model.load(demo_path)


@pytest.fixture(autouse=True)
def key(monkeypatch) -> str:
    """The key controller and stages share in these tests (random: there is no default)."""
    import secrets

    k = secrets.token_urlsafe(24)
    monkeypatch.setenv("STRATA_RENDEZVOUS_KEY", k)
    return k


def connect(port: int, key: str, timeout: float = 10.0) -> wire.Channel:
    """A stage's side of the rendezvous from a test (retrying until the controller listens)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    return wire.connect(sock, key.encode(), time.monotonic() + timeout, timeout)


def test_stages_started_apart_attach_and_match_threads(demo):
    ids = synthetic(64, demo.spec.vocab, nonce=3)
    want = Session(demo, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=16)).run(ids, decode_tokens=2).report
    port = free_port()
    # rank 0 as torchrun starts it (RANK/WORLD_SIZE), rank 1 with flags
    procs = [subprocess.Popen(stage_command(port, "--timeout", "120"), cwd=ROOT, env=env(RANK="0", WORLD_SIZE="2"),
                              stderr=subprocess.PIPE, text=True),
             subprocess.Popen(stage_command(port, "--rank", "1", "--world", "2", "--timeout", "120"), cwd=ROOT,
                              env=env(), stderr=subprocess.PIPE, text=True)]
    try:
        sess = Session(demo, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=16, executor="processes",
                                          rendezvous=f"127.0.0.1:{port}"))
        assert sorted(sess.stage_pids()) == sorted(p.pid for p in procs)
        res = sess.run(ids, decode_tokens=2)
        assert (res.report.digest, res.report.generated) == (want.digest, want.generated)
        assert {e.stage for e in sess.events if e.kind == "compute"} == {0, 1}
        assert res.report.executor == "processes"
        sess.close()
        for p in procs:
            assert p.wait(timeout=30) == 0, p.stderr.read()
    finally:
        reap(procs)


def test_a_port_in_use_is_a_clear_error(demo):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"rendezvous='127.0.0.1:{port}'.*cannot listen"):
            Session(demo, EngineConfig(devices=["cpu", "cpu"], executor="processes", rendezvous=f"127.0.0.1:{port}"))


def test_an_unreachable_controller_is_a_clear_error():
    port = free_port()
    out = subprocess.run(stage_command(port, "--rank", "0", "--world", "2", "--timeout", "1"), cwd=ROOT, env=env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"cannot reach the controller at 127.0.0.1:{port} within 1 s" in out.stderr, out.stderr


def test_a_version_mismatch_between_hosts_is_refused_with_both_versions(demo, monkeypatch, key):
    monkeypatch.setenv("STRATA_STAGE_TIMEOUT_S", "30")
    port = free_port()
    theirs = dict(versions(), torch="0.0.1")
    answer: list = []

    def other_host() -> None:  # a stage of another install, speaking the protocol
        conn = connect(port, key)
        conn.send(Hello(1, 2, 4242, "ws-b", theirs))
        answer.append(conn.recv())

    t = threading.Thread(target=other_host, daemon=True)
    t.start()
    with pytest.raises(ConfigError, match="version mismatch between hosts: stage 1 on host ws-b runs .*torch 0.0.1"):
        Session(demo, EngineConfig(devices=["cpu", "cpu"], executor="processes", rendezvous=f"127.0.0.1:{port}"))
    t.join(10)
    assert answer and isinstance(answer[0], Refused) and "version mismatch" in answer[0].reason


@posix_signals
def test_an_attached_stage_killed_mid_run_is_named_and_the_other_one_ends(demo):
    import signal
    import time

    from engine.pipeline.executor import StageLost
    from engine.pipeline.session import StageError

    ids = synthetic(128, demo.spec.vocab, nonce=3)
    port = free_port()
    procs = [subprocess.Popen(stage_command(port, "--rank", str(r), "--world", "2", "--timeout", "120"), cwd=ROOT,
                              env=env(), stderr=subprocess.DEVNULL) for r in range(2)]
    try:
        sess = Session(demo, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=16, executor="processes",
                                          rendezvous=f"127.0.0.1:{port}"))
        victim = procs[1]

        def sink(ev):
            if ev.kind == "compute" and ev.stage == 0 and ev.chunk == 2:
                os.kill(victim.pid, signal.SIGKILL)

        t0 = time.monotonic()
        with pytest.raises(StageError) as info:
            sess.run(ids, sink=sink)
        assert time.monotonic() - t0 < 30
        msg = str(info.value)
        assert isinstance(info.value.__cause__, StageLost)
        assert f"stage 1 (cpu on host {socket.gethostname()}, pid {victim.pid}) closed its connection" in msg, msg
        procs[0].wait(timeout=60)  # the survivor ends once its controller hung up (TimeoutExpired otherwise)
        sess.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


def test_the_app_form_attaches_through_the_environment():
    from strata_gui.run.settings_model import RunSettings, validate

    v = validate(RunSettings(executor="processes"), 4, env={"STRATA_RENDEZVOUS": "127.0.0.1:29600"})
    assert v.ok and v.config.executor == "processes" and v.config.rendezvous == "127.0.0.1:29600"
    bad = validate(RunSettings(executor="processes"), 4, env={"STRATA_RENDEZVOUS": "ws-a:99999"})
    assert "STRATA_RENDEZVOUS='ws-a:99999'" in bad.errors["general"]
