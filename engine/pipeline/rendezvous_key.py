"""The secret a controller and the stages that attach to it share (executor=processes with a
rendezvous).  There is no default: a controller that is given none makes a random one for its
process and shows the exact command to start each stage with it; a key someone types must be
long enough to resist guessing.  Stages spawned on this machine need none (they talk to their
controller over inherited pipes and meet each other through a file store in a private folder).
"""
from __future__ import annotations

import ipaddress
import secrets
import socket
import sys
import threading
from pathlib import Path

from engine import settings_table
from engine.config import ConfigError

KEY_ENV = settings_table.row("rendezvous_key").env
MIN_KEY_CHARS = 20  # a random key of the generated kind has 32 (192 bits)

_lock = threading.Lock()
_generated: str | None = None


def check_key(text: str, where: str = KEY_ENV) -> bytes:
    """A user-given key as bytes, or ConfigError when it is empty or too short to be a secret."""
    text = text.strip()
    if len(text) < MIN_KEY_CHARS:
        raise ConfigError(where, "<hidden>" if text else "", f"a secret of at least {MIN_KEY_CHARS} characters "
                          f"(e.g. the one a controller prints; python -c \"import secrets; print(secrets.token_urlsafe(24))\")")
    return text.encode()


def controller_key(env: dict | None = None) -> bytes:
    """The key of this controller process: $STRATA_RENDEZVOUS_KEY when set (checked), else one
    random key made on first use and kept for the process (the app shows it; the CLI prints it)."""
    global _generated
    key = settings_table.env_value("rendezvous_key", env)
    if key is not None:
        return check_key(key)
    with _lock:
        if _generated is None:
            _generated = secrets.token_urlsafe(24)
        return _generated.encode()


def stage_key(key_file: str | None = None, env: dict | None = None) -> bytes:
    """The key a stage proves to its controller: from --key-file, else $STRATA_RENDEZVOUS_KEY."""
    if key_file:
        try:
            text = Path(key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("--key-file", key_file, "a readable text file holding the controller's key",
                              str(exc)) from None
        return check_key(text, "--key-file")
    key = settings_table.env_value("rendezvous_key", env)
    if key is None:
        raise ConfigError(KEY_ENV, "", "the key the controller shows (set it, or pass --key-file)",
                          "a stage attaches only with its controller's key")
    return check_key(key)


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_host(host: str) -> str:
    """Where a controller listens for `HOST:PORT`: loopback unless a host is named."""
    return host or "127.0.0.1"


def exposure_warning(host: str) -> str | None:
    """What a user must know when the rendezvous listens beyond this machine (None on loopback)."""
    if is_loopback(bind_host(host)):
        return None
    where = "every interface" if host in ("0.0.0.0", "::") else host
    return (f"listening on {where}: the key guards the stages' control connections, not the process group's "
            f"store (port + 1) or its tensor traffic; use a network you trust")


def attach_commands(rendezvous: str, world: int, key: str, windows: bool | None = None) -> list[str]:
    """The command that starts each stage (one per rank) against this controller."""
    windows = sys.platform == "win32" if windows is None else windows
    host, _, port = rendezvous.rpartition(":")
    if host in ("0.0.0.0", "::"):  # stages elsewhere reach this machine by its name
        host = socket.gethostname()
    target = f"{host or '127.0.0.1'}:{port}"
    if windows:
        return [f'$env:{KEY_ENV}="{key}"; strata-bench stage --rendezvous {target} --rank {r} --world {world}'
                for r in range(world)]
    return [f"{KEY_ENV}={key} strata-bench stage --rendezvous {target} --rank {r} --world {world}"
            for r in range(world)]
