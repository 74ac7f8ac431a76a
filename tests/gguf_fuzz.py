"""GGUF fuzzing: mutate a valid model file and check that `gguf_model.load` copes with each.

    python tests/gguf_fuzz.py --cases 10000 --seed 0

Every mutated file must either load (and then dequantise every tensor) or raise `GGUFError`
with a message naming the problem: never another exception, never longer than `--time-limit`
seconds, never a peak RSS growth beyond `Limits.rss_limit` (a fixed slack plus a multiple of the
file's size).  The base file is the demo model written by `synth.write_model`; the mutations are
bit flips and overwrites in each section (header, metadata, tensor table, padding, data),
truncation inside each section and at every kind of field boundary, absurd counts and lengths in
the header, the metadata and the tensor table, bad value/item/tensor types, bad offsets and
alignments, dimensions whose product overflows, invalid UTF-8, duplicate keys and tensors, and
structural edits (entries inserted, dropped or duplicated with the counts kept consistent).

Case `i` of seed `s` is the same file on every machine and in every worker, so a failing case is
reproduced with `--start i --cases 1 --seed s --keep-failures DIR`.
"""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import contextlib
import json
import logging
import math
import multiprocessing
import os
import random
import signal
import statistics
import struct
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from engine.io import gguf_model, synth
from engine.io.gguf_model import GGUFError, GGUFLayout, KVRecord, TensorRecord

log = logging.getLogger("strata.gguf_fuzz")

MiB = 1 << 20
STATUS_LOADED = "loaded"
STATUS_GGUF_ERROR = "GGUFError"
STATUS_EXCEPTION = "other exception"
STATUS_TIMEOUT = "timeout"

_SCALAR_FORMATS: dict[int, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "B",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


# ------------------------------------------------------------------------------------ limits
@dataclass(frozen=True)
class Limits:
    """What every case must stay within."""

    seconds: float = 2.0
    rss_slack_bytes: int = 64 * MiB
    rss_per_file_byte: float = 4.0
    message_chars: int = 600  # a message quoting a hostile value in full is a defect too
    watchdog_seconds: float = 20.0  # a case still running then is stopped and reported as a timeout

    def rss_limit(self, file_bytes: int) -> int:
        return int(self.rss_slack_bytes + self.rss_per_file_byte * file_bytes)


# ------------------------------------------------------------------------------- the mutations
@dataclass(frozen=True)
class Case:
    index: int
    mutation: str  # the mutation class, e.g. "bitflip:metadata"
    detail: str  # what exactly was changed
    data: bytes


def _interesting_u64(rng: random.Random, orig: int, room: int) -> int:
    """Counts and lengths that break readers: zero, off by one, the room left and one more,
    powers of two around 2**31/2**32/2**63, all ones, random."""
    pick = rng.choice([
        0, 1, max(orig - 1, 0), orig + 1, orig * 2 + 1, room, room + 1, room // 2, 255, 65535,
        (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 60, 1 << 62, (1 << 63) - 1, 1 << 63,
        (1 << 64) - 1, rng.getrandbits(64), rng.getrandbits(32), rng.getrandbits(16),
    ])
    return pick & ((1 << 64) - 1)


def _interesting_u32(rng: random.Random, orig: int) -> int:
    pick = rng.choice([0, 1, max(orig - 1, 0), orig + 1, 13, 255, 1 << 15, 1 << 16, (1 << 31) - 1, 1 << 31,
                       (1 << 32) - 1, rng.getrandbits(32), rng.getrandbits(8)])
    return pick & 0xFFFFFFFF


def _interesting_value(rng: random.Random, vtype: int) -> bytes:
    fmt = "<" + _SCALAR_FORMATS[vtype]
    if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        v: float | int = rng.choice([math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e-45, 3e38,
                                     rng.uniform(-1e6, 1e6)])
        return struct.pack(fmt, v)
    bits = struct.calcsize(fmt) * 8
    signed = _SCALAR_FORMATS[vtype].islower()
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    v = rng.choice([0, 1, 2, hi, lo, hi // 2 + 1, -1 if signed else hi, rng.randint(lo, hi)])
    return struct.pack(fmt, v)


def encode_kv(key: str, value_type: int, payload: bytes) -> bytes:
    """One metadata entry as GGUF stores it (little-endian): key, value type, value bytes."""
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", value_type) + payload


def rebuild(base: bytes, layout: GGUFLayout, kvs: Sequence[bytes], infos: Sequence[bytes],
            alignment: int | None = None) -> bytes:
    """A file with these metadata entries and tensor-table entries (counts set to match) and the
    base's tensor data; offsets are relative to the data section, so they stay right."""
    align = alignment or layout.alignment
    head = b"GGUF" + struct.pack("<IQQ", layout.version, len(infos), len(kvs))
    body = head + b"".join(kvs) + b"".join(infos)
    pad = (-len(body)) % align if align <= 1 << 16 else 0  # a huge alignment: the file ends short of it
    return body + b"\0" * pad + base[layout.data_start:]


def kv_blobs(base: bytes, layout: GGUFLayout) -> list[bytes]:
    return [base[kv.offset:kv.end] for kv in layout.kvs]


def info_blobs(base: bytes, layout: GGUFLayout) -> list[bytes]:
    return [base[t.offset:t.end] for t in layout.tensors]


class Mutator:
    """Makes case `i` of a seed from a valid GGUF image and its layout (see `gguf_model.scan`)."""

    def __init__(self, base: bytes, layout: GGUFLayout) -> None:
        self.base = base
        self.L = layout
        size = layout.size
        kv_end = layout.kvs[-1].end if layout.kvs else gguf_model.HEADER_BYTES
        self.sections: dict[str, tuple[int, int]] = {
            "header": (0, gguf_model.HEADER_BYTES), "metadata": (gguf_model.HEADER_BYTES, kv_end),
            "tensor_info": (kv_end, layout.info_end), "padding": (layout.info_end, layout.data_start),
            "data": (layout.data_start, size),
        }
        self.sections = {k: v for k, v in self.sections.items() if v[1] > v[0]}
        self.boundaries = sorted({0, 4, 8, 16, gguf_model.HEADER_BYTES, layout.info_end, layout.data_start}
                                 | {x for kv in layout.kvs for x in (kv.offset, kv.offset + 8, kv.value_offset, kv.end)}
                                 | {x for t in layout.tensors for x in (t.offset, t.n_dims_at, t.dims_at, t.type_at,
                                                                         t.data_offset_at, t.end)}
                                 | {layout.data_start + t.data_offset for t in layout.tensors})
        self.ops: list[tuple[str, Callable[[random.Random], tuple[str, bytes]]]] = []
        for sec in self.sections:
            self.ops.append((f"bitflip:{sec}", lambda r, s=sec: self.bitflip(r, s)))
            self.ops.append((f"overwrite:{sec}", lambda r, s=sec: self.overwrite(r, s)))
            self.ops.append((f"truncate:{sec}", lambda r, s=sec: self.truncate(r, s)))
        self.ops += [
            ("truncate:field-boundary", self.truncate_boundary),
            ("header:magic", self.header_magic),
            ("header:version", self.header_version),
            ("header:tensor_count", lambda r: self.header_count(r, 8, "tensor_count", layout.tensor_count)),
            ("header:kv_count", lambda r: self.header_count(r, 16, "kv_count", layout.kv_count)),
            ("kv:key_length", self.kv_key_length),
            ("kv:key_bytes", self.kv_key_bytes),
            ("kv:value_type", self.kv_value_type),
            ("kv:string_length", self.kv_string_length),
            ("kv:array_item_type", self.kv_array_item_type),
            ("kv:array_length", self.kv_array_length),
            ("kv:array_string_length", self.kv_array_string_length),
            ("kv:scalar_value", self.kv_scalar_value),
            ("tensor:name_length", self.tensor_name_length),
            ("tensor:name_bytes", self.tensor_name_bytes),
            ("tensor:n_dims", self.tensor_n_dims),
            ("tensor:dims", self.tensor_dims),
            ("tensor:dims_overflow", self.tensor_dims_overflow),
            ("tensor:type", self.tensor_type),
            ("tensor:data_offset", self.tensor_data_offset),
            ("struct:insert_kv", self.insert_kv),
            ("struct:drop_kv", self.drop_kv),
            ("struct:duplicate_tensor", self.duplicate_tensor),
            ("struct:drop_tensor", self.drop_tensor),
            ("splice", self.splice),
        ]

    @property
    def op_names(self) -> list[str]:
        return [name for name, _ in self.ops]

    def case(self, seed: int, index: int) -> Case:
        """Ops are taken in turn (index modulo the catalogue), so any len(ops) consecutive cases
        cover every mutation class; the rest of the case comes from (seed, index)."""
        rng = random.Random(f"strata-gguf-fuzz/{seed}/{index}")
        name, op = self.ops[index % len(self.ops)]
        detail, data = op(rng)
        return Case(index, name, detail, data)

    # -- helpers
    def _put(self, buf: bytearray, fmt: str, at: int, value: int) -> None:
        struct.pack_into("<" + fmt, buf, at, value)

    def _get(self, fmt: str, at: int) -> int:
        return struct.unpack_from("<" + fmt, self.base, at)[0]

    def _room(self, at: int) -> int:
        return self.L.size - at

    def _kv(self, rng: random.Random, pred: Callable[[KVRecord], bool] = lambda kv: True) -> KVRecord:
        return rng.choice([kv for kv in self.L.kvs if pred(kv)])

    def _tensor(self, rng: random.Random) -> TensorRecord:
        return rng.choice(self.L.tensors)

    def _rebuild(self, kvs: Sequence[bytes], infos: Sequence[bytes], alignment: int | None = None) -> bytes:
        return rebuild(self.base, self.L, kvs, infos, alignment)

    def _kv_blobs(self) -> list[bytes]:
        return kv_blobs(self.base, self.L)

    def _info_blobs(self) -> list[bytes]:
        return info_blobs(self.base, self.L)

    # -- section-wise noise
    def bitflip(self, rng: random.Random, section: str) -> tuple[str, bytes]:
        lo, hi = self.sections[section]
        buf = bytearray(self.base)
        flips = [(rng.randrange(lo, hi), rng.randrange(8)) for _ in range(rng.choice([1, 1, 1, 2, 3, 8]))]
        for at, bit in flips:
            buf[at] ^= 1 << bit
        return "flipped " + ", ".join(f"bit {b} of byte {a}" for a, b in flips), bytes(buf)

    def overwrite(self, rng: random.Random, section: str) -> tuple[str, bytes]:
        lo, hi = self.sections[section]
        at = rng.randrange(lo, hi)
        n = min(rng.choice([1, 2, 4, 8, 16]), hi - at)
        fill = rng.choice([b"\x00", b"\xff", b"\x7f", b"\x80", None])
        data = fill * n if fill is not None else rng.randbytes(n)
        buf = bytearray(self.base)
        buf[at:at + n] = data
        return f"overwrote bytes {at}..{at + n - 1} with {data.hex()}", bytes(buf)

    def truncate(self, rng: random.Random, section: str) -> tuple[str, bytes]:
        lo, hi = self.sections[section]
        keep = rng.randrange(lo, hi)
        return f"kept the first {keep} bytes ({section} is {lo}..{hi})", self.base[:keep]

    def truncate_boundary(self, rng: random.Random) -> tuple[str, bytes]:
        keep = rng.choice(self.boundaries)
        keep = max(0, keep + rng.choice([-1, 0, 0, 1]))
        return f"kept the first {keep} bytes (at a field boundary)", self.base[:keep]

    def splice(self, rng: random.Random) -> tuple[str, bytes]:
        n = rng.choice([4, 8, 16, 64, 256])
        src = rng.randrange(0, self.L.size - n)
        dst = rng.randrange(0, min(self.L.data_start + 64, self.L.size - n))
        buf = bytearray(self.base)
        buf[dst:dst + n] = self.base[src:src + n]
        return f"copied {n} bytes from {src} over {dst}", bytes(buf)

    # -- header
    def header_magic(self, rng: random.Random) -> tuple[str, bytes]:
        magic = rng.choice([b"GGML", b"gguf", b"FUGG", b"\0\0\0\0", rng.randbytes(4)])
        return f"magic {magic!r}", magic + self.base[4:]

    def header_version(self, rng: random.Random) -> tuple[str, bytes]:
        v = rng.choice([0, 1, 2, 4, 0x00030000, 0x03000000, 0xFFFFFFFF, rng.getrandbits(32)])
        buf = bytearray(self.base)
        self._put(buf, "I", 4, v)
        return f"version {v}", bytes(buf)

    def header_count(self, rng: random.Random, at: int, what: str, orig: int) -> tuple[str, bytes]:
        v = _interesting_u64(rng, orig, self._room(24))
        buf = bytearray(self.base)
        self._put(buf, "Q", at, v)
        return f"{what} {orig} -> {v}", bytes(buf)

    # -- metadata entries
    def kv_key_length(self, rng: random.Random) -> tuple[str, bytes]:
        kv = self._kv(rng)
        orig = self._get("Q", kv.offset)
        v = _interesting_u64(rng, orig, self._room(kv.offset + 8))
        buf = bytearray(self.base)
        self._put(buf, "Q", kv.offset, v)
        return f"key length of {kv.key} {orig} -> {v}", bytes(buf)

    def kv_key_bytes(self, rng: random.Random) -> tuple[str, bytes]:
        kv = self._kv(rng)
        klen = len(kv.key.encode())
        buf = bytearray(self.base)
        twins = [o for o in self.L.kvs if o is not kv and len(o.key.encode()) == klen]
        if twins and rng.random() < 0.5:
            twin = rng.choice(twins)
            buf[kv.offset + 8:kv.offset + 8 + klen] = twin.key.encode()
            return f"renamed {kv.key} to {twin.key} (a duplicate key)", bytes(buf)
        at = kv.offset + 8 + rng.randrange(klen)
        buf[at] = rng.choice([0xFF, 0xC0, 0x80, 0xED, 0x00])
        return f"byte {at - kv.offset - 8} of key {kv.key} -> {buf[at]:#x}", bytes(buf)

    def kv_value_type(self, rng: random.Random) -> tuple[str, bytes]:
        kv = self._kv(rng)
        v = rng.choice([*range(13), 13, 14, 255, 1 << 31, 0xFFFFFFFF, rng.getrandbits(32)])
        buf = bytearray(self.base)
        self._put(buf, "I", kv.value_offset - 4, v)
        return f"value type of {kv.key} {kv.value_type} -> {v}", bytes(buf)

    def kv_string_length(self, rng: random.Random) -> tuple[str, bytes]:
        kv = self._kv(rng, lambda k: k.value_type == GGUFValueType.STRING)
        orig = self._get("Q", kv.value_offset)
        v = _interesting_u64(rng, orig, self._room(kv.value_offset + 8))
        buf = bytearray(self.base)
        self._put(buf, "Q", kv.value_offset, v)
        return f"string length of {kv.key} {orig} -> {v}", bytes(buf)

    def kv_array_item_type(self, rng: random.Random) -> tuple[str, bytes]:
        kv = self._kv(rng, lambda k: k.value_type == GGUFValueType.ARRAY)
        v = rng.choice([*range(13), 13, 255, 0xFFFFFFFF, GGUFValueType.ARRAY])
        buf = bytearray(self.base)
        self._put(buf, "I", kv.value_offset, v)
        return f"item type of {kv.key} {kv.item_type} -> {v}", bytes(buf)

    def kv_array_length(self, rng: random.Random) -> tuple[str, bytes]:
        kv = self._kv(rng, lambda k: k.value_type == GGUFValueType.ARRAY)
        v = _interesting_u64(rng, kv.count, self._room(kv.value_offset + 12))
        buf = bytearray(self.base)
        self._put(buf, "Q", kv.value_offset + 4, v)
        return f"array length of {kv.key} {kv.count} -> {v}", bytes(buf)

    def kv_array_string_length(self, rng: random.Random) -> tuple[str, bytes]:
        kv = self._kv(rng, lambda k: k.value_type == GGUFValueType.ARRAY and k.item_type == GGUFValueType.STRING)
        j = rng.randrange(kv.count)
        at = kv.value_offset + 12
        for _ in range(j):
            at += 8 + self._get("Q", at)
        orig = self._get("Q", at)
        v = _interesting_u64(rng, orig, self._room(at + 8))
        buf = bytearray(self.base)
        self._put(buf, "Q", at, v)
        return f"length of string #{j} of {kv.key} {orig} -> {v}", bytes(buf)

    def kv_scalar_value(self, rng: random.Random) -> tuple[str, bytes]:
        kv = self._kv(rng, lambda k: k.value_type in _SCALAR_FORMATS)
        raw = _interesting_value(rng, kv.value_type)
        buf = bytearray(self.base)
        buf[kv.value_offset:kv.value_offset + len(raw)] = raw
        return f"value of {kv.key} -> {raw.hex()}", bytes(buf)

    # -- tensor table
    def tensor_name_length(self, rng: random.Random) -> tuple[str, bytes]:
        t = self._tensor(rng)
        v = _interesting_u64(rng, t.name_bytes, self._room(t.offset + 8))
        buf = bytearray(self.base)
        self._put(buf, "Q", t.offset, v)
        return f"name length of {t.name} {t.name_bytes} -> {v}", bytes(buf)

    def tensor_name_bytes(self, rng: random.Random) -> tuple[str, bytes]:
        t = self._tensor(rng)
        buf = bytearray(self.base)
        twins = [o for o in self.L.tensors if o is not t and o.name_bytes == t.name_bytes]
        if twins and rng.random() < 0.5:
            twin = rng.choice(twins)
            buf[t.offset + 8:t.offset + 8 + t.name_bytes] = twin.name.encode()
            return f"renamed {t.name} to {twin.name} (a duplicate tensor)", bytes(buf)
        at = t.offset + 8 + rng.randrange(t.name_bytes)
        buf[at] = rng.choice([0xFF, 0xC3, 0x80, ord("x"), ord(".")])
        return f"byte {at - t.offset - 8} of name {t.name} -> {buf[at]:#x}", bytes(buf)

    def tensor_n_dims(self, rng: random.Random) -> tuple[str, bytes]:
        t = self._tensor(rng)
        v = rng.choice([0, 1, 2, 3, 4, 5, 8, len(t.dims) + 1, max(len(t.dims) - 1, 0), 1 << 31, 0xFFFFFFFF])
        buf = bytearray(self.base)
        self._put(buf, "I", t.n_dims_at, v)
        return f"n_dims of {t.name} {len(t.dims)} -> {v}", bytes(buf)

    def tensor_dims(self, rng: random.Random) -> tuple[str, bytes]:
        t = self._tensor(rng)
        i = rng.randrange(len(t.dims))
        v = _interesting_u64(rng, t.dims[i], 1 << 20)
        buf = bytearray(self.base)
        self._put(buf, "Q", t.dims_at + 8 * i, v)
        return f"dimension {i} of {t.name} {t.dims[i]} -> {v}", bytes(buf)

    def tensor_dims_overflow(self, rng: random.Random) -> tuple[str, bytes]:
        """Dimensions whose product wraps around 2**64 (to 0 or to a small number)."""
        t = rng.choice([x for x in self.L.tensors if len(x.dims) >= 2])
        a, b = rng.choice([(1 << 32, 1 << 32), (1 << 33, 1 << 31), (1 << 63, 2), ((1 << 64) - 1, 2),
                           (1 << 62, 8), (3 << 61, 1 << 3)])
        if t.ggml_type != GGMLQuantizationType.F32 and rng.random() < 0.5:
            a, b = b, a
        buf = bytearray(self.base)
        self._put(buf, "Q", t.dims_at, a)
        self._put(buf, "Q", t.dims_at + 8, b)
        wrapped = (a * b) % (1 << 64)
        return f"dimensions of {t.name} {list(t.dims)} -> [{a}, {b}, ...] (product {a * b} wraps to {wrapped})", bytes(buf)

    def tensor_type(self, rng: random.Random) -> tuple[str, bytes]:
        t = self._tensor(rng)
        valid = [q.value for q in GGML_QUANT_SIZES]
        v = rng.choice([*valid, 4, 5, 31, 36, 42, 255, 1 << 31, 0xFFFFFFFF, rng.getrandbits(32)])
        buf = bytearray(self.base)
        self._put(buf, "I", t.type_at, v)
        return f"type of {t.name} {t.ggml_type} -> {v}", bytes(buf)

    def tensor_data_offset(self, rng: random.Random) -> tuple[str, bytes]:
        t = self._tensor(rng)
        other = self._tensor(rng)
        data_room = self.L.size - self.L.data_start
        v = rng.choice([t.data_offset + 1, t.data_offset + 16, t.data_offset + self.L.alignment,
                        other.data_offset, other.data_offset + self.L.alignment, data_room, data_room + 32,
                        data_room - self.L.alignment, 1 << 62, (1 << 64) - 1, (1 << 64) - self.L.alignment,
                        rng.getrandbits(64)]) & ((1 << 64) - 1)
        buf = bytearray(self.base)
        self._put(buf, "Q", t.data_offset_at, v)
        return f"data offset of {t.name} {t.data_offset} -> {v}", bytes(buf)

    # -- structural edits (counts kept consistent)
    def insert_kv(self, rng: random.Random) -> tuple[str, bytes]:
        entry = encode_kv
        u32 = GGUFValueType.UINT32
        choices: list[tuple[str, bytes, int | None]] = [
            ("general.alignment = 0", entry("general.alignment", u32, struct.pack("<I", 0)), None),
            ("general.alignment = 3", entry("general.alignment", u32, struct.pack("<I", 3)), None),
            ("general.alignment = 2**31", entry("general.alignment", u32, struct.pack("<I", 1 << 31)), 1 << 31),
            ("general.alignment = 64", entry("general.alignment", u32, struct.pack("<I", 64)), 64),
            ("general.alignment = 16 (offsets written for 32)", entry("general.alignment", u32, struct.pack("<I", 16)), 16),
            ("general.alignment = 32 as UINT64", entry("general.alignment", GGUFValueType.UINT64, struct.pack("<Q", 32)), None),
            ("general.alignment as a string",
             entry("general.alignment", GGUFValueType.STRING, struct.pack("<Q", 2) + b"32"), None),
            ("a nested array", entry("x.nested", GGUFValueType.ARRAY,
                                     struct.pack("<IQ", GGUFValueType.ARRAY, 1) + struct.pack("<IQ", u32, 1) + b"\0" * 4), None),
            ("an array of 2**40 uint8 (nothing after it)", entry("x.big", GGUFValueType.ARRAY,
                                                                 struct.pack("<IQ", GGUFValueType.UINT8, 1 << 40)), None),
            ("a 70000-item uint8 array (over the reader budget)",
             entry("x.many", GGUFValueType.ARRAY, struct.pack("<IQ", GGUFValueType.UINT8, 70000) + b"\0" * 70000), None),
            ("a 1 MiB string value", entry("x.long", GGUFValueType.STRING, struct.pack("<Q", MiB) + b"a" * MiB), None),
            ("a key 'GGUF.version' (reserved by gguf's reader)", entry("GGUF.version", u32, struct.pack("<I", 3)), None),
            ("general.architecture as UINT32", None, None),  # handled below: replaces the original entry
        ]
        what, blob, align = rng.choice(choices)
        kvs = self._kv_blobs()
        if blob is None:
            idx = next(i for i, kv in enumerate(self.L.kvs) if kv.key == "general.architecture")
            kvs[idx] = entry("general.architecture", u32, struct.pack("<I", 7))
        else:
            kvs.insert(rng.randrange(len(kvs) + 1), blob)
        if rng.random() < 0.2:  # and a duplicate of an existing entry
            kvs.insert(rng.randrange(len(kvs) + 1), rng.choice(self._kv_blobs()))
            what += " + a duplicate entry"
        return f"inserted {what}", self._rebuild(kvs, self._info_blobs(), align)

    def drop_kv(self, rng: random.Random) -> tuple[str, bytes]:
        kvs = self._kv_blobs()
        i = rng.randrange(len(kvs))
        del kvs[i]
        return f"dropped metadata key {self.L.kvs[i].key}", self._rebuild(kvs, self._info_blobs())

    def duplicate_tensor(self, rng: random.Random) -> tuple[str, bytes]:
        infos = self._info_blobs()
        i = rng.randrange(len(infos))
        infos.insert(rng.randrange(len(infos) + 1), infos[i])
        return f"duplicated tensor entry {self.L.tensors[i].name}", self._rebuild(self._kv_blobs(), infos)

    def drop_tensor(self, rng: random.Random) -> tuple[str, bytes]:
        infos = self._info_blobs()
        i = rng.randrange(len(infos))
        del infos[i]
        return f"dropped tensor entry {self.L.tensors[i].name}", self._rebuild(self._kv_blobs(), infos)


# --------------------------------------------------------------------------- running a case
@dataclass
class Outcome:
    index: int
    mutation: str
    detail: str
    status: str
    kind: str  # GGUFError.kind, or the exception's type name
    message: str  # without the path prefix; cut to 1000 characters
    seconds: float
    rss_growth: int  # peak RSS during the case minus RSS before it, bytes
    file_bytes: int
    tensors: int = 0  # tensors dequantised (loaded cases)
    message_chars: int = 0  # full length of the message

    def violations(self, limits: Limits) -> list[str]:
        out = []
        if self.status in (STATUS_EXCEPTION, STATUS_TIMEOUT):
            out.append(f"{self.status}: {self.kind}: {self.message[:200]}")
        if self.status == STATUS_GGUF_ERROR and not self.message.strip():
            out.append("GGUFError with an empty message")
        if self.message_chars > limits.message_chars:
            out.append(f"message of {self.message_chars} characters (limit {limits.message_chars})")
        if self.seconds > limits.seconds:
            out.append(f"took {self.seconds:.2f} s (limit {limits.seconds} s)")
        if self.rss_growth > limits.rss_limit(self.file_bytes):
            out.append(f"peak RSS grew {self.rss_growth / MiB:.1f} MiB "
                       f"(limit {limits.rss_limit(self.file_bytes) / MiB:.1f} MiB)")
        return out


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status", "rb") as fh:
        for line in fh:
            if line.startswith(field_name.encode() + b":"):
                return int(line.split()[1]) * 1024
    return 0


def rss_bytes() -> int:
    """Resident set size now, from /proc/self/status (0 where there is no /proc)."""
    try:
        return _status_kib("VmRSS")
    except OSError:
        return 0


def peak_rss_bytes() -> int:
    try:
        return _status_kib("VmHWM")
    except OSError:
        return 0


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class CaseTimeout(BaseException):
    """Raised in the main thread by the watchdog; a BaseException so no `except Exception` eats it."""


@contextlib.contextmanager
def _watchdog(seconds: float) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum: int, frame: object) -> None:
        raise CaseTimeout(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def load_and_dequantise(path: Path) -> int:
    """What a case must survive: load, then dequantise every tensor. Returns the tensor count."""
    model = gguf_model.load(path)
    names = model.tensor_names()
    for name in names:
        model.tensor(name)
    return len(names)


def run_case(case: Case, workdir: Path, limits: Limits, loader: Callable[[Path], int] = load_and_dequantise) -> Outcome:
    path = workdir / f"case-{case.index}.gguf"
    path.write_bytes(case.data)
    prefix = f"{path}: "
    status, kind, message, tensors = STATUS_LOADED, "", "", 0
    precise = reset_peak_rss()
    rss0 = rss_bytes()
    peak0 = peak_rss_bytes()
    t0 = time.perf_counter()
    try:
        with _watchdog(limits.watchdog_seconds), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # NaN/inf from dequantising flipped scales
            tensors = loader(path)
    except GGUFError as exc:
        status, kind, message = STATUS_GGUF_ERROR, exc.kind, str(exc)
    except CaseTimeout as exc:
        status, kind, message = STATUS_TIMEOUT, "timeout", str(exc)
    except Exception as exc:  # noqa: BLE001 - exactly what the fuzzer looks for
        status, kind, message = STATUS_EXCEPTION, type(exc).__name__, str(exc)
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    growth = max(0, peak - rss0) if precise else max(0, peak - peak0)
    path.unlink(missing_ok=True)
    if message.startswith(prefix):
        message = message[len(prefix):]
    elif status == STATUS_GGUF_ERROR:
        message = "(message does not start with the path) " + message
    return Outcome(case.index, case.mutation, case.detail, status, kind, message[:1000], seconds, growth,
                   len(case.data), tensors, len(message))


# ------------------------------------------------------------------------------ many cases
@dataclass(frozen=True)
class _Job:
    base: bytes
    seed: int
    limits: Limits
    workdir: str
    memory_cap_bytes: int  # RLIMIT_AS headroom in worker processes (0: none)


_worker_state: dict[str, object] = {}


def _init_worker(job: _Job, quiet: bool = True) -> None:
    if quiet:  # a worker process: the engine's INFO lines would drown the table
        logging.getLogger("engine").setLevel(logging.WARNING)
    _worker_state["job"] = job
    _worker_state["mutator"] = Mutator(job.base, gguf_model.scan_buffer(job.base, "<base>"))
    if job.memory_cap_bytes:
        try:  # a runaway allocation becomes a MemoryError (reported), not the OOM killer
            import resource  # POSIX only

            vm = _status_kib("VmSize")
            resource.setrlimit(resource.RLIMIT_AS, (vm + job.memory_cap_bytes, resource.RLIM_INFINITY))
        except (ImportError, OSError, ValueError):
            log.warning("could not cap the worker's address space")


def _run_indices(indices: Sequence[int]) -> list[Outcome]:
    job = _worker_state["job"]
    mut = _worker_state["mutator"]
    assert isinstance(job, _Job) and isinstance(mut, Mutator)
    wd = Path(job.workdir) / f"w{os.getpid()}"
    wd.mkdir(parents=True, exist_ok=True)
    return [run_case(mut.case(job.seed, i), wd, job.limits) for i in indices]


def base_model(workdir: Path) -> Path:
    """The demo model, written by `synth.write_model` into workdir."""
    return synth.write_model(workdir / "base-demo.gguf", synth.DEMO_RECIPE)


def run_cases(base: bytes, seed: int, indices: Sequence[int], limits: Limits = Limits(), jobs: int = 0,
              workdir: Path | None = None, memory_cap_bytes: int = 4 << 30,
              progress: Callable[[int, int], None] | None = None) -> list[Outcome]:
    """Run the cases; jobs=0 runs them in this process (what the tests do), jobs>=1 in that many
    worker processes (spawned: no state shared with the caller)."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gguf-fuzz-")))
        job = _Job(base, seed, limits, str(workdir), memory_cap_bytes if jobs else 0)
        if jobs <= 0:
            _init_worker(job, quiet=False)
            out = []
            for n, i in enumerate(indices, 1):
                out.extend(_run_indices([i]))
                if progress and n % 100 == 0:
                    progress(n, len(indices))
            return out
        chunk = max(1, min(50, len(indices) // (jobs * 8) or 1))
        batches = [list(indices[k:k + chunk]) for k in range(0, len(indices), chunk)]
        ctx = multiprocessing.get_context("spawn")
        out: list[Outcome] = []
        with futures.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init_worker, initargs=(job,)) as pool:
            for res in pool.map(_run_indices, batches):
                out.extend(res)
                if progress:
                    progress(len(out), len(indices))
        return sorted(out, key=lambda o: o.index)


# -------------------------------------------------------------------------------- reporting
@dataclass
class Summary:
    cases: int
    seed: int
    first_index: int
    file_bytes: int
    limits: Limits
    wall_seconds: float
    jobs: int
    outcomes: list[Outcome] = field(repr=False, default_factory=list)

    @property
    def violations(self) -> list[tuple[Outcome, list[str]]]:
        return [(o, v) for o in self.outcomes if (v := o.violations(self.limits))]

    def as_dict(self) -> dict[str, object]:
        times = [o.seconds for o in self.outcomes]
        return {
            "cases": self.cases, "seed": self.seed, "first_index": self.first_index, "jobs": self.jobs,
            "base_file_bytes": self.file_bytes, "wall_seconds": round(self.wall_seconds, 1),
            "by_outcome": dict(Counter(f"{o.status}:{o.kind}" if o.kind else o.status for o in self.outcomes)),
            "time_max_s": max(times, default=0.0), "time_p99_s": _quantile(times, 0.99),
            "rss_growth_max_bytes": max((o.rss_growth for o in self.outcomes), default=0),
            "violations": [{"index": o.index, "mutation": o.mutation, "detail": o.detail, "problems": v}
                           for o, v in self.violations],
        }


def _quantile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def render(summary: Summary) -> str:
    """Markdown tables: outcomes by problem class, then by mutation class."""
    oc = summary.outcomes
    n = max(len(oc), 1)
    groups: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
    for o in oc:
        groups[(o.status, o.kind or "—")].append(o)
    order = {STATUS_LOADED: 0, STATUS_GGUF_ERROR: 1, STATUS_EXCEPTION: 2, STATUS_TIMEOUT: 3}
    lines = ["| outcome | problem class | cases | share | max time (s) | max peak RSS growth (MiB) | example message |",
             "|---|---|---:|---:|---:|---:|---|"]
    for (status, kind), items in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 9), -len(kv[1]))):
        example = items[0].message.replace("|", "\\|")
        example = example if len(example) <= 110 else example[:109] + "…"
        if status == STATUS_LOADED:
            example = f"{sum(o.tensors for o in items)} tensors dequantised"
        lines.append(f"| {status} | {kind} | {len(items)} | {100 * len(items) / n:.1f}% | "
                     f"{max(o.seconds for o in items):.3f} | {max(o.rss_growth for o in items) / MiB:.1f} | {example} |")
    times = [o.seconds for o in oc]
    growth = max((o.rss_growth for o in oc), default=0)
    lim = summary.limits
    viol = summary.violations
    lines += [
        "",
        f"cases {len(oc)} (indices {summary.first_index}..{summary.first_index + len(oc) - 1}), seed {summary.seed}, "
        f"base file {summary.file_bytes} bytes, {summary.jobs or 1} process(es), wall {summary.wall_seconds:.1f} s",
        f"time per case: max {max(times, default=0):.3f} s, p99 {_quantile(times, 0.99):.3f} s, "
        f"median {statistics.median(times) if times else 0:.3f} s (limit {lim.seconds} s)",
        f"peak RSS growth per case: max {growth / MiB:.1f} MiB "
        f"(limit {lim.rss_limit(summary.file_bytes) / MiB:.1f} MiB = {lim.rss_slack_bytes // MiB} MiB + "
        f"{lim.rss_per_file_byte:g} x file size)",
        f"violations: {len(viol)}",
        "",
        "| mutation | cases | loaded | GGUFError | other exception / timeout | max time (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    by_mut: dict[str, list[Outcome]] = defaultdict(list)
    for o in oc:
        by_mut[o.mutation].append(o)
    for mut in sorted(by_mut):
        items = by_mut[mut]
        c = Counter(o.status for o in items)
        lines.append(f"| {mut} | {len(items)} | {c[STATUS_LOADED]} | {c[STATUS_GGUF_ERROR]} | "
                     f"{c[STATUS_EXCEPTION] + c[STATUS_TIMEOUT]} | {max(o.seconds for o in items):.3f} |")
    for o, v in viol[:20]:
        lines.append(f"\nVIOLATION case {o.index} ({o.mutation}: {o.detail}): {'; '.join(v)}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python tests/gguf_fuzz.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=1000, help="number of cases (default 1000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="index of the first case (to replay one)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="worker processes (default: one per core); 0 runs in this process")
    ap.add_argument("--base", type=Path, help="a valid GGUF file to mutate (default: the demo model, freshly written)")
    ap.add_argument("--time-limit", type=float, default=Limits.seconds, help="seconds a case may take (default 2)")
    ap.add_argument("--format", choices=("md", "json"), default="md")
    ap.add_argument("--keep-failures", type=Path, help="write each violating case's file into this folder")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if ns.cases < 1 or ns.start < 0:
        print("gguf_fuzz: error: --cases must be >= 1 and --start >= 0", file=sys.stderr)
        return 2
    limits = Limits(seconds=ns.time_limit)
    with tempfile.TemporaryDirectory(prefix="gguf-fuzz-") as tmp:
        base_path = ns.base or base_model(Path(tmp))
        base = Path(base_path).read_bytes()
        layout = gguf_model.scan_buffer(base, base_path)  # the base must itself be sound
        log.info("base %s: %d bytes, %d metadata entries, %d tensors", base_path, len(base), layout.kv_count,
                 layout.tensor_count)
        t0 = time.perf_counter()
        last = [t0]

        def progress(done: int, total: int) -> None:
            if time.perf_counter() - last[0] > 10:
                last[0] = time.perf_counter()
                log.info("%d/%d cases", done, total)

        outcomes = run_cases(base, ns.seed, range(ns.start, ns.start + ns.cases), limits, ns.jobs,
                             Path(tmp), progress=progress)
        summary = Summary(ns.cases, ns.seed, ns.start, len(base), limits, time.perf_counter() - t0, ns.jobs, outcomes)
        if ns.keep_failures and summary.violations:
            ns.keep_failures.mkdir(parents=True, exist_ok=True)
            mut = Mutator(base, layout)
            for o, _ in summary.violations:
                (ns.keep_failures / f"case-{ns.seed}-{o.index}.gguf").write_bytes(mut.case(ns.seed, o.index).data)
    if ns.format == "json":
        print(json.dumps(summary.as_dict(), indent=1))
    else:
        print(render(summary))
    return 1 if summary.violations else 0


if __name__ == "__main__":
    sys.exit(main())
