"""The controller's side of attaching stages started elsewhere (`strata-bench stage --rendezvous`).

`wait_for_stages` listens at the rendezvous address, lets each connection prove the key and say
its `Hello` (engine/pipeline/stage_messages.py) on a thread of its own under a deadline, so a stray,
silent or hostile client never holds up the real stages, checks what each stage says about
itself (versions and protocol, world size, rank) and returns one connection per rank.  The
stage's side is `engine.pipeline.stage_process.attach`; what crosses the network is `engine.pipeline.wire`'s.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable

from engine.config import ConfigError, rendezvous_address
from engine.pipeline import wire
from engine.pipeline.rendezvous_key import attach_commands, bind_host, controller_key, exposure_warning
from engine.pipeline.stage_messages import Hello, Refused, versions

log = logging.getLogger(__name__)

HANDSHAKE_S = 10.0  # an attaching connection proves the key and says hello within this
MAX_PENDING = 32  # connections in their handshake at once (more are closed at once)


def _versions(v: dict[str, str]) -> str:
    return ", ".join(f"{k} {x}" for k, x in sorted(v.items()))


def _listen(rendezvous: str) -> socket.socket:
    host, port = rendezvous_address(rendezvous)
    try:
        return socket.create_server((bind_host(host), port),
                                    family=socket.AF_INET6 if ":" in bind_host(host) else socket.AF_INET)
    except OSError as exc:
        raise ConfigError("rendezvous", rendezvous, "a HOST:PORT this machine can listen on",
                          f"cannot listen: {exc.strerror or exc}") from None


def _serve_handshakes(listener: socket.socket, rendezvous: str, key: bytes, timeout_s: float,
                      arrived: queue.SimpleQueue) -> None:
    """Accept connections on a thread; each proves the key and says hello on a thread of its
    own (at most MAX_PENDING at once); the greeted ones go to `arrived` as (channel, Hello)."""
    handshake_s = min(HANDSHAKE_S, timeout_s)
    pending = threading.BoundedSemaphore(MAX_PENDING)

    def greet(sock: socket.socket, peer: str) -> None:
        try:
            ch = wire.accept(sock, key, time.monotonic() + handshake_s, timeout_s)
            hello = ch.recv(timeout=handshake_s)
            if not isinstance(hello, Hello):
                raise ValueError("the first message was not a stage's hello")
            arrived.put((ch, hello.check()))
        except (OSError, EOFError, wire.WireError, ValueError) as exc:
            log.warning("refused a connection to %s from %s: %s", rendezvous, peer, exc or type(exc).__name__)
            sock.close()
        finally:
            pending.release()

    def accept() -> None:
        while True:
            try:
                sock, addr = listener.accept()
            except OSError:  # the listener was closed: every stage is in, or the wait ended
                return
            peer = f"{addr[0]}:{addr[1]}"
            if not pending.acquire(blocking=False):
                log.warning("refused a connection to %s from %s: %d handshakes already pending",
                            rendezvous, peer, MAX_PENDING)
                sock.close()
                continue
            threading.Thread(target=greet, args=(sock, peer), daemon=True, name="strata-greet").start()

    threading.Thread(target=accept, daemon=True, name="strata-rendezvous").start()


def _refusal(hello: Hello, world: int, taken: dict, here: str) -> tuple[str, str]:
    """(why this stage may not join and may retry, why the whole job must end) — empty when it may."""
    mine = versions()
    if hello.versions != mine:
        return "", (f"version mismatch between hosts: stage {hello.rank} on host {hello.host} runs "
                    f"{_versions(hello.versions)}, the controller on {here} {_versions(mine)}")
    if hello.world != world:
        return "", f"stage {hello.rank} on host {hello.host} expects {hello.world} stages, this split has {world}"
    if not 0 <= hello.rank < world or hello.rank in taken:
        return f"rank {hello.rank} from host {hello.host} is out of range or taken (ranks 0..{world - 1})", ""
    return "", ""


def wait_for_stages(rendezvous: str, world: int, timeout_s: float, here: str,
                    progress: Callable[[str, float], None]) -> dict[int, tuple[wire.Channel, Hello]]:
    """One key-proven connection and its `Hello` per rank 0..world-1, within `timeout_s`; a
    ConfigError naming what is missing or wrong otherwise (every connection then closed)."""
    key = controller_key()
    listener = _listen(rendezvous)
    warning = exposure_warning(rendezvous_address(rendezvous)[0])
    if warning:
        log.warning("%s", warning)
    commands = attach_commands(rendezvous, world, key.decode())
    log.warning("waiting for %d stage(s) at %s; start each with:\n  %s", world, rendezvous, "\n  ".join(commands))
    what = f"waiting for {world} stage(s) to attach at {rendezvous}"
    progress(what, 0.0)
    arrived: queue.SimpleQueue = queue.SimpleQueue()
    _serve_handshakes(listener, rendezvous, key, timeout_s, arrived)
    deadline = time.monotonic() + timeout_s
    by_rank: dict[int, tuple[wire.Channel, Hello]] = {}
    try:
        while len(by_rank) < world:
            try:
                conn, hello = arrived.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise ConfigError("rendezvous", rendezvous, f"{world} stages attached",
                                  f"only ranks {sorted(by_rank) or 'none'} attached within {timeout_s:g} s; "
                                  f"start `{commands[0]}` with each rank") from None
            why, fatal = _refusal(hello, world, by_rank, here)
            if why or fatal:
                try:
                    conn.send(Refused(why or fatal))
                except OSError:
                    pass
                conn.close()
                if fatal:
                    raise ConfigError("rendezvous", rendezvous, "stages of the same versions, one per rank", fatal)
                log.warning("refused a stage at %s: %s", rendezvous, why)
                continue
            by_rank[hello.rank] = (conn, hello)
            progress(what, len(by_rank) / world)
    except BaseException:
        for conn, _ in by_rank.values():
            conn.close()
        raise
    finally:
        listener.close()
    return by_rank
