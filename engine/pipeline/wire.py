"""The control channel between a controller and the stages that attach to it over TCP.

Nothing that arrives here is unpickled or evaluated.  A message is a tuple of plain values
(None, bool, int, float, str, bytes, list, tuple, dict with str keys, numpy arrays of numeric
dtypes) and of the few dataclasses registered in `MESSAGE_TYPES`, encoded as JSON; a decoder
that meets anything else (an unknown tag, class, field or dtype) raises `WireError`.

A connection starts with a mutual challenge-response on the shared key (HMAC-SHA256 over both
sides' random nonces): the controller proves it knows the key to the stage as the stage proves it
to the controller, before either reads a byte of a real message.  Frames before that are at most
`HANDSHAKE_MAX` bytes and read under a deadline, so a stray, silent or hostile client costs a
bounded time and memory.  After it every frame carries an HMAC under a key derived from the two
nonces and a sequence number, so a frame injected into or replayed on the stream is refused.
Frames are not encrypted (see docs/executor.md for what the key protects and what it does not).

Frame: 4 bytes big-endian length, then (after the handshake) a 32-byte MAC and the JSON payload.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import secrets
import select
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

PROTOCOL = "strata-rendezvous"
VERSION = 1
HANDSHAKE_MAX = 4096  # bytes of one frame before the peer proved the key
FRAME_MAX = 1 << 30  # bytes of one frame after (a run's logits travel in one)
_MAC = 32
_LEN = struct.Struct(">I")
# numpy dtypes a message may carry (logits); never object or structured dtypes
_DTYPES = {"<f2", "<f4", "<f8", "<i4", "<i8", "|u1", "|i1", "<u2", "<i2", "|b1"}

# The dataclasses a message may hold, by name (filled by register(); engine/pipeline/stage_messages.py
# registers every control message and StageEvent, engine/pipeline/stage_process.py its StageSpec,
# SourceRef and RunOrder, and the ModelRecipe of engine/io/synth.py)
MESSAGE_TYPES: dict[str, type] = {}


class WireError(ValueError):
    """A frame that does not parse, is too large, fails its MAC, or breaks the protocol."""


def register(cls: type) -> type:
    """Admit a dataclass of plain fields into messages (a class decorator)."""
    assert dataclasses.is_dataclass(cls), cls
    MESSAGE_TYPES[cls.__name__] = cls
    return cls


# ------------------------------------------------------------------ the codec
def _enc(v: Any) -> Any:
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, list):
        return [_enc(x) for x in v]
    if isinstance(v, tuple):
        return {"$t": [_enc(x) for x in v]}
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise TypeError("message dicts need str keys")
        return {"$d": {k: _enc(x) for k, x in v.items()}}
    if isinstance(v, bytes | bytearray):
        return {"$b": base64.b64encode(bytes(v)).decode()}
    if isinstance(v, np.ndarray):
        a = np.ascontiguousarray(v)
        if a.dtype.str not in _DTYPES:
            raise TypeError(f"numpy dtype {a.dtype} cannot travel")
        return {"$a": a.dtype.str, "shape": list(a.shape), "b": base64.b64encode(a.tobytes()).decode()}
    if isinstance(v, np.generic):
        return _enc(v.item())
    name = type(v).__name__
    if dataclasses.is_dataclass(v) and MESSAGE_TYPES.get(name) is type(v):
        return {"$c": name, "f": {f.name: _enc(getattr(v, f.name)) for f in dataclasses.fields(v)}}
    raise TypeError(f"a {name} cannot travel on the control channel")


def _dec(v: Any, depth: int = 0) -> Any:
    if depth > 32:
        raise WireError("message nested too deep")
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, list):
        return [_dec(x, depth + 1) for x in v]
    if not isinstance(v, dict) or len(v) not in (1, 2, 3):
        raise WireError(f"unexpected value of type {type(v).__name__}")
    if set(v) == {"$t"} and isinstance(v["$t"], list):
        return tuple(_dec(x, depth + 1) for x in v["$t"])
    if set(v) == {"$d"} and isinstance(v["$d"], dict):
        return {k: _dec(x, depth + 1) for k, x in v["$d"].items()}
    if set(v) == {"$b"} and isinstance(v["$b"], str):
        return _b64(v["$b"])
    if set(v) == {"$a", "shape", "b"}:
        dt, shape = v["$a"], v["shape"]
        if dt not in _DTYPES or not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise WireError(f"array of dtype {dt!r} / shape {shape!r} refused")
        raw = _b64(v["b"])
        a = np.frombuffer(bytearray(raw), dtype=np.dtype(dt))
        if a.size != int(np.prod(shape, dtype=np.int64)):
            raise WireError("array bytes do not match its shape")
        return a.reshape(shape)
    if set(v) == {"$c", "f"} and isinstance(v["f"], dict):
        cls = MESSAGE_TYPES.get(v["$c"]) if isinstance(v["$c"], str) else None
        if cls is None:
            raise WireError(f"unknown message type {v['$c']!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        if not set(v["f"]) <= names:
            raise WireError(f"unknown fields {sorted(set(v['f']) - names)} of {v['$c']}")
        try:
            return cls(**{k: _dec(x, depth + 1) for k, x in v["f"].items()})
        except TypeError as exc:
            raise WireError(f"bad {v['$c']}: {exc}") from None
    raise WireError(f"unexpected object with keys {sorted(v)[:4]}")


def _b64(text: Any) -> bytes:
    if not isinstance(text, str):
        raise WireError("bytes must be base64 text")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise WireError("bad base64") from None


def encode(msg: Any) -> bytes:
    return json.dumps({"v": VERSION, "m": _enc(msg)}, separators=(",", ":")).encode()


def decode(payload: bytes) -> Any:
    try:
        doc = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError(f"not a JSON message: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"v", "m"}:
        raise WireError("not a strata message")
    if doc["v"] != VERSION:
        raise WireError(f"message version {doc['v']!r}, this install speaks {VERSION}")
    return _dec(doc["m"])


# ------------------------------------------------------------------- framing
def _read_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the peer stopped sending mid-frame")
            sock.settimeout(left)
        else:
            sock.settimeout(None)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return bytes(buf)


def _read_frame(sock: socket.socket, limit: int, first_deadline: float | None, body_s: float | None) -> bytes:
    """One frame: its length prefix by `first_deadline` (None: wait as long as it takes), then
    its body within `body_s` of the prefix."""
    n = _LEN.unpack(_read_exact(sock, _LEN.size, first_deadline))[0]
    if n > limit:
        raise WireError(f"frame of {n} bytes refused (at most {limit})")
    return _read_exact(sock, n, None if body_s is None else time.monotonic() + body_s)


class Channel:
    """An authenticated connection: `send`, `recv`, `poll`, `fileno` and `close`, as the
    multiprocessing Connection the spawned stages use (so `multiprocessing.connection.wait`
    takes it too).  `io_timeout_s` bounds how long a frame already begun may take to arrive."""

    def __init__(self, sock: socket.socket, session_key: bytes, server: bool, io_timeout_s: float) -> None:
        self.sock, self.io_timeout_s = sock, io_timeout_s
        self._key = session_key
        self._out_dir, self._in_dir = (b"s>c", b"c>s") if server else (b"c>s", b"s>c")
        self._out_seq = self._in_seq = 0
        self._lock = threading.Lock()

    def _mac(self, direction: bytes, seq: int, payload: bytes) -> bytes:
        return hmac.new(self._key, direction + seq.to_bytes(8, "big") + payload, hashlib.sha256).digest()

    def send(self, msg: Any) -> None:
        payload = encode(msg)
        with self._lock:
            mac = self._mac(self._out_dir, self._out_seq, payload)
            self._out_seq += 1
            self.sock.settimeout(self.io_timeout_s)
            self.sock.sendall(_LEN.pack(_MAC + len(payload)) + mac + payload)

    def recv(self, timeout: float | None = None) -> Any:
        """The next message; waits `timeout` s for it to begin (None: as long as it takes)."""
        first = None if timeout is None else time.monotonic() + timeout
        frame = _read_frame(self.sock, FRAME_MAX, first, self.io_timeout_s)
        mac, payload = frame[:_MAC], frame[_MAC:]
        if len(mac) < _MAC or not hmac.compare_digest(mac, self._mac(self._in_dir, self._in_seq, payload)):
            raise WireError("a frame failed its MAC (injected, replayed or corrupt)")
        self._in_seq += 1
        return decode(payload)

    def poll(self, timeout: float | None = 0.0) -> bool:
        try:
            r, _, _ = select.select([self.sock], [], [], timeout)
        except (OSError, ValueError):
            return True  # closed: the next recv says so
        return bool(r)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# ----------------------------------------------------------------- handshake
def _plain(sock: socket.socket, doc: dict) -> None:
    data = json.dumps(doc).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _read_plain(sock: socket.socket, deadline: float) -> dict:
    raw = _read_frame(sock, HANDSHAKE_MAX, deadline, max(deadline - time.monotonic(), 0.001))
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise WireError("handshake frame is not JSON") from None
    if not isinstance(doc, dict) or doc.get("v") != VERSION:
        raise WireError(f"not a strata rendezvous peer of protocol version {VERSION}")
    return doc


def _nonce(doc: dict) -> bytes:
    try:
        n = bytes.fromhex(doc["nonce"])
    except (KeyError, TypeError, ValueError):
        raise WireError("handshake without a nonce") from None
    if len(n) != 32:
        raise WireError("handshake nonce of the wrong size")
    return n


def _proof(key: bytes, who: bytes, sn: bytes, cn: bytes) -> str:
    return hmac.new(key, who + sn + cn, hashlib.sha256).hexdigest()


def _session(key: bytes, sn: bytes, cn: bytes) -> bytes:
    return hmac.new(key, b"session" + sn + cn, hashlib.sha256).digest()


def accept(sock: socket.socket, key: bytes, deadline: float, io_timeout_s: float) -> Channel:
    """The controller's side of the handshake on a freshly accepted socket."""
    sn = secrets.token_bytes(32)
    sock.settimeout(max(deadline - time.monotonic(), 0.01))
    _plain(sock, {"proto": PROTOCOL, "v": VERSION, "nonce": sn.hex()})
    doc = _read_plain(sock, deadline)
    cn = _nonce(doc)
    if not isinstance(doc.get("proof"), str) or not hmac.compare_digest(doc["proof"], _proof(key, b"stage", sn, cn)):
        raise WireError("wrong key")
    _plain(sock, {"v": VERSION, "proof": _proof(key, b"controller", sn, cn)})
    return Channel(sock, _session(key, sn, cn), True, io_timeout_s)


def connect(sock: socket.socket, key: bytes, deadline: float, io_timeout_s: float) -> Channel:
    """A stage's side of the handshake: it proves the key and checks that the controller does."""
    first = _read_plain(sock, deadline)
    if first.get("proto") != PROTOCOL:
        raise WireError("the peer is not a strata controller")
    sn, cn = _nonce(first), secrets.token_bytes(32)
    _plain(sock, {"v": VERSION, "nonce": cn.hex(), "proof": _proof(key, b"stage", sn, cn)})
    doc = _read_plain(sock, deadline)
    if not isinstance(doc.get("proof"), str) or not hmac.compare_digest(doc["proof"], _proof(key, b"controller", sn, cn)):
        raise WireError("the controller did not prove the key")
    return Channel(sock, _session(key, sn, cn), False, io_timeout_s)
