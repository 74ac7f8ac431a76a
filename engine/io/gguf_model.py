"""GGUF file -> `ModelSpec` + memory-mapped tensors, checked before any device memory is taken.

`scan` walks the header, the metadata and the tensor table with `struct` and checks every count,
length, type, dimension and offset against the file's size, so a corrupt or hostile file is
refused in time and memory proportional to its header, never to the numbers written in it.  The
loader then maps the tensors from that checked layout (gguf's GGUFReader decodes every metadata
array item up front: seconds for a real vocabulary); the type tables, block sizes and the
dequantisation of every quant type come from the `gguf` package.
Everything that can be wrong with a file is reported as `GGUFError` naming the file and the
problem (and, in `kind`, the class of problem).
"""
from __future__ import annotations

import errno
import logging
import math
import mmap
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUFValueType

from engine import models
from engine.models.spec import ModelSpec
from engine.quant import dequant

log = logging.getLogger(__name__)
# `LoadedModel.raw` views the read-only map on purpose (no copy).  torch warns about such a view
# once per process (TORCH_WARN_ONCE): spend that one warning here, at import, silenced.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.from_numpy(np.frombuffer(b"\0", dtype=np.uint8))

HEADER_BYTES = 24  # magic, version, tensor_count, kv_count
SUPPORTED_VERSIONS = (2, 3)
MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value (the key may be empty)
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset (no dimensions)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSOR_NAME = 63  # GGML_MAX_NAME - 1, as llama.cpp's loader
INT64_MAX = (1 << 63) - 1
# Metadata arrays have no item budget: an array's length is checked against the bytes left in
# the file (a string item takes at least 8 bytes, a scalar its size) before anything walks it,
# so the work and the memory of reading metadata grow with the file's size, never with a count
# the file claims.  (An earlier budget sized for gguf's GGUFReader refused valid small files
# with 100k-token vocabularies.)

# problem classes (GGUFError.kind)
KIND_FILE = "file"
KIND_MAGIC = "magic"
KIND_VERSION = "version"
KIND_TRUNCATED = "truncated"
KIND_COUNT = "count"
KIND_LENGTH = "length"
KIND_TYPE = "type"
KIND_DIMS = "dims"
KIND_OFFSET = "offset"
KIND_ALIGNMENT = "alignment"
KIND_DUPLICATE = "duplicate"
KIND_ENCODING = "encoding"
KIND_METADATA = "metadata"
KIND_TENSOR = "tensor"
KIND_DEQUANTISE = "dequantise"
KIND_READER = "reader"  # an exception inside gguf's reader that `scan` did not foresee
KIND_MODEL = "model"  # the default, for errors raised outside this module
KIND_MEMORY = "memory"  # the file could not be mapped: too little memory or address space, not a defect


class GGUFError(Exception):
    """A model file that cannot be used; the message names the file and the problem.

    `kind` is the class of problem (one of the KIND_* names) for tools that group errors."""

    def __init__(self, path: Path | str, problem: str, kind: str = KIND_MODEL) -> None:
        self.path = Path(path)
        self.problem = problem
        self.kind = kind
        super().__init__(f"{self.path}: {problem}")

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across processes despite the signature
        return (type(self), (self.path, self.problem, self.kind))


def supported_types() -> set[GGMLQuantizationType]:
    """The types `engine.quant.dequant` expands (on any device)."""
    return set(dequant.SUPPORTED)


def _type_sizes(raw_type: int) -> tuple[int, int] | None:
    """(values, bytes) per block of a ggml type id, None for an id gguf does not know."""
    try:
        return GGML_QUANT_SIZES.get(GGMLQuantizationType(raw_type))
    except ValueError:
        return None


def unknown_type_message(tensor: str, raw_type: int) -> str:
    """One line for a tensor whose ggml type id gguf does not know (ik_llama.cpp's IQ*_K, _KS,
    _KT and _R4 types, or a ggml newer than the installed gguf): its block size is unknown, so
    neither the tensor nor anything after it can be read."""
    return (f"tensor {tensor}: unknown tensor type {raw_type} (a ggml type id this gguf does not know: "
            f"ik_llama.cpp's IQ*_K/_KS/_KT/_R4 types or a newer ggml's have no dequantiser here); "
            f"supported: {dequant.supported_names()}")


@dataclass
class LoadedModel:
    """A parsed, validated GGUF file.  Tensors stay memory-mapped until asked for."""

    path: Path
    spec: ModelSpec
    metadata: dict[str, Any]
    _map: np.memmap = field(repr=False)
    _tensors: dict[str, Any] = field(repr=False)

    @property
    def file_bytes(self) -> int:
        return self.path.stat().st_size

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor_names(self) -> list[str]:
        """Every tensor in the file, in file order."""
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def qtype(self, name: str) -> GGMLQuantizationType:
        return self._mapped(name).tensor_type

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in torch order."""
        return tuple(int(x) for x in reversed(self._mapped(name).shape.tolist()))

    def nbytes(self, name: str) -> int:
        """Bytes the tensor takes in the file (its blocks as stored)."""
        return self._mapped(name).n_bytes

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as stored (uint8, a view of the read-only mapped file: no copy).
        Read it, or copy it (`.to(device)`, `.clone()`) to change it: a write into the view
        itself faults, the file is never written."""
        t = self._mapped(name)
        return torch.from_numpy(t.data.reshape(-1).view(np.uint8))

    def read_into(self, name: str, offset: int, out: torch.Tensor) -> None:
        """Read `out.numel()` bytes of the tensor's blocks from byte `offset` into `out` (a
        contiguous CPU uint8 tensor) with file reads, not through the mapping, so the pages
        are not counted twice in this process's memory (the arena holds them once)."""
        t = self._mapped(name)
        n = out.numel()
        if offset < 0 or offset + n > t.n_bytes:
            raise GGUFError(self.path, f"tensor {name}: bytes {offset}-{offset + n} outside its {t.n_bytes}",
                            KIND_TENSOR)
        view = memoryview(out.numpy()).cast("B")
        pos = t.data_offset + offset
        with self.path.open("rb", buffering=0) as fh:
            fh.seek(pos)
            got = 0
            while got < n:
                k = fh.readinto(view[got:])
                if not k:
                    raise GGUFError(self.path, f"truncated file: tensor {name} ends at byte {pos + got}",
                                    KIND_TRUNCATED)
                got += k

    def _mapped(self, name: str) -> MappedTensor:
        t = self._tensors.get(name)
        if t is None:
            raise GGUFError(self.path, f"missing tensor {name}", KIND_TENSOR)
        return t

    def tensor(self, name: str, device: torch.device | str | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantised tensor in torch order (a new tensor; the file stays mapped).

        The raw blocks are copied to `device` (default CPU) and expanded there by
        `engine.quant.dequant`, so a GPU does the work for the weights it keeps."""
        t = self._mapped(name)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        shape = self.shape(name)
        try:
            if t.data.dtype.byteorder == ">":  # a big-endian file's floats: numpy swaps them
                arr = np.array(t.data, dtype=np.float32, order="C", copy=True)
                return torch.from_numpy(arr).to(device=dev, dtype=dtype)
            raw = self.raw(name)
            if dev.type != "cpu":
                raw = raw.to(dev, non_blocking=False)
            return dequant.dequantize(raw, t.tensor_type, shape, dtype=dtype)
        except Exception as exc:  # whatever the blocks make the dequantiser raise is a file defect
            raise GGUFError(self.path, f"cannot dequantise {name} ({t.tensor_type.name}): {type(exc).__name__}: "
                                       f"{_cut(str(exc))}", KIND_DEQUANTISE) from None

    def quant_mix(self) -> list[tuple[str, float]]:
        """(type name, share of the file's tensor bytes), largest first: e.g. Q4_K 0.82."""
        return quant_mix((t.tensor_type.name, t.n_bytes) for t in self._tensors.values())

    def has_vocab(self) -> bool:
        return "tokenizer.ggml.tokens" in self.metadata

    def describe(self) -> str:
        s = self.spec
        kind = f"{s.n_experts} experts, top-{s.n_experts_used}" if s.is_moe else f"dense FFN {s.ffn}"
        return (f"{s.arch}: {s.n_layers} layers, hidden {s.hidden}, {s.n_heads}/{s.n_kv_heads} heads, "
                f"{kind}, vocab {s.vocab}, {self.file_bytes / 2**20:.1f} MiB; {format_quant_mix(self.quant_mix())}")


def quant_mix(items) -> list[tuple[str, float]]:
    """(type name, share of the bytes) of (type name, bytes) pairs, largest first."""
    by_type: dict[str, int] = {}
    for name, n in items:
        by_type[name] = by_type.get(name, 0) + n
    total = sum(by_type.values()) or 1
    return sorted(((k, v / total) for k, v in by_type.items()), key=lambda kv: (-kv[1], kv[0]))


def format_quant_mix(mix: list[tuple[str, float]]) -> str:
    """"Q4_K 82%, Q6_K 14%, F32 4%" (shares of the tensor bytes)."""
    return ", ".join(f"{name} {100 * share:.0f}%" if share >= 0.005 else f"{name} <1%" for name, share in mix)


# --------------------------------------------------------------------------- the layout scan
_SCALAR_SIZES: dict[int, int] = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}
_VALUE_TYPES = ", ".join(f"{t.value} {t.name}" for t in GGUFValueType)
_RESERVED_KEYS = frozenset({"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"})  # gguf's reader adds these


def _short(text: str | bytes, limit: int = 60) -> str:
    """repr() of a name or value, cut so that a hostile file cannot make a huge message."""
    return _cut(repr(text), limit)


def _cut(text: str, limit: int = 200) -> str:
    """Plain text (an exception's message) cut to `limit` characters."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True)
class KVRecord:
    """One metadata entry as stored in the file."""

    key: str
    value_type: int
    offset: int  # of the key's length field
    value_offset: int  # of the value; for arrays, of the item type (then the count, then the items)
    end: int
    item_type: int | None = None  # arrays only
    count: int = 0  # arrays only: number of items


@dataclass(frozen=True)
class TensorRecord:
    """One entry of the tensor table as stored in the file."""

    name: str
    offset: int  # of the name's length field
    name_bytes: int
    dims: tuple[int, ...]  # ggml order (fastest-varying first)
    ggml_type: int
    data_offset: int  # relative to the start of the tensor data section
    n_bytes: int
    end: int

    @property
    def n_dims_at(self) -> int:
        return self.offset + 8 + self.name_bytes

    @property
    def dims_at(self) -> int:
        return self.n_dims_at + 4

    @property
    def type_at(self) -> int:
        return self.dims_at + 8 * len(self.dims)

    @property
    def data_offset_at(self) -> int:
        return self.type_at + 4


@dataclass(frozen=True)
class GGUFLayout:
    """Where everything lies in a GGUF file, after every count, length and offset was checked."""

    size: int
    byte_order: str  # struct prefix: "<" or ">" (a file written on a big-endian machine)
    version: int
    tensor_count: int
    kv_count: int
    kvs: tuple[KVRecord, ...]
    tensors: tuple[TensorRecord, ...]
    alignment: int
    info_end: int  # end of the tensor table; padding follows up to data_start
    data_start: int
    array_elements: int  # items in all metadata arrays together


class _Scanner:
    """Reads the structure of a GGUF image with `struct`, failing with GGUFError at the first
    value that cannot be right.  Allocates nothing in proportion to a count it has not checked."""

    def __init__(self, buf: Any, size: int, path: Path) -> None:
        self.buf, self.size, self.path = buf, size, path
        self.order = "<"

    def fail(self, kind: str, problem: str) -> GGUFError:
        return GGUFError(self.path, problem, kind)

    def need(self, pos: int, n: int, what: str) -> None:
        if pos + n > self.size:
            raise self.fail(KIND_TRUNCATED, f"truncated file: {what} at byte {pos} needs {n} bytes, "
                                            f"the file ends at byte {self.size}")

    def u32(self, pos: int, what: str) -> int:
        self.need(pos, 4, what)
        return struct.unpack_from(self.order + "I", self.buf, pos)[0]

    def u64(self, pos: int, what: str) -> int:
        self.need(pos, 8, what)
        return struct.unpack_from(self.order + "Q", self.buf, pos)[0]

    def string_at(self, pos: int, what: str) -> tuple[int, int]:
        """(start of the bytes, their length) of the length-prefixed string at pos."""
        n = self.u64(pos, f"{what} length")
        left = self.size - pos - 8
        if n > left:
            raise self.fail(KIND_LENGTH, f"{what} length {n} exceeds the {left} bytes left in the file "
                                         f"(corrupt length or truncated file)")
        return pos + 8, n

    def text(self, start: int, n: int, what: str) -> str:
        raw = bytes(self.buf[start:start + n])
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(KIND_ENCODING, f"{what} {_short(raw)} is not valid UTF-8 ({exc.reason} at byte "
                                           f"{exc.start})") from None

    def scan(self) -> GGUFLayout:
        buf, size = self.buf, self.size
        if size < HEADER_BYTES:
            raise self.fail(KIND_TRUNCATED, f"truncated file: {size} bytes is shorter than a GGUF header "
                                            f"({HEADER_BYTES} bytes)")
        magic = bytes(buf[0:4])
        if magic != b"GGUF":
            raise self.fail(KIND_MAGIC, f"bad magic {magic!r}: not a GGUF file (expected b'GGUF')")
        version = struct.unpack_from("<I", buf, 4)[0]
        if version & 0xFFFF == 0:  # written on a big-endian machine, as gguf's reader decides
            self.order = ">"
            version = struct.unpack_from(">I", buf, 4)[0]
        if version not in SUPPORTED_VERSIONS:
            endian = " (read big-endian)" if self.order == ">" else ""
            raise self.fail(KIND_VERSION, f"unsupported GGUF version {version}{endian} "
                                          f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        tensor_count, kv_count = struct.unpack_from(self.order + "QQ", buf, 8)
        rest = size - HEADER_BYTES
        if kv_count * MIN_KV_BYTES > rest:
            raise self.fail(KIND_COUNT, f"kv_count {kv_count} cannot fit in the {rest} bytes after the header "
                                        f"(a metadata entry takes at least {MIN_KV_BYTES} bytes): corrupt count "
                                        f"or truncated file")
        if tensor_count * MIN_TENSOR_INFO_BYTES > rest:
            raise self.fail(KIND_COUNT, f"tensor_count {tensor_count} cannot fit in the {rest} bytes after the "
                                        f"header (a tensor entry takes at least {MIN_TENSOR_INFO_BYTES} bytes): "
                                        f"corrupt count or truncated file")
        if kv_count * MIN_KV_BYTES + tensor_count * MIN_TENSOR_INFO_BYTES > rest:
            raise self.fail(KIND_COUNT, f"kv_count {kv_count} and tensor_count {tensor_count} cannot fit together "
                                        f"in the {rest} bytes after the header: corrupt count or truncated file")
        pos, kvs, alignment, elements = self._scan_metadata(HEADER_BYTES, kv_count)
        pos, tensors = self._scan_tensor_table(pos, tensor_count)
        info_end = pos
        data_start = -(-info_end // alignment) * alignment
        self._check_data(tensors, data_start, alignment)
        return GGUFLayout(size=size, byte_order=self.order, version=version, tensor_count=tensor_count,
                          kv_count=kv_count, kvs=tuple(kvs), tensors=tuple(tensors), alignment=alignment,
                          info_end=info_end, data_start=data_start, array_elements=elements)

    def _scan_metadata(self, pos: int, kv_count: int) -> tuple[int, list[KVRecord], int, int]:
        seen: set[str] = set(_RESERVED_KEYS)
        kvs: list[KVRecord] = []
        alignment = GGUF_DEFAULT_ALIGNMENT
        elements = 0
        for i in range(kv_count):
            start = pos
            kstart, klen = self.string_at(pos, f"metadata entry #{i}: key")
            key = self.text(kstart, klen, f"metadata entry #{i}: key")
            if key in seen:
                raise self.fail(KIND_DUPLICATE, f"duplicate metadata key {_short(key)} (entry #{i})")
            seen.add(key)
            pos = kstart + klen
            label = f"metadata key {_short(key)}"
            vtype = self.u32(pos, f"{label}: value type")
            pos += 4
            value_at = pos
            item_type: int | None = None
            count = 0
            if vtype == GGUFValueType.ARRAY:
                item_type = self.u32(pos, f"{label}: array item type")
                count = self.u64(pos + 4, f"{label}: array length")
                pos += 12
                pos = self._skip_array(pos, label, item_type, count, elements)
                elements += count
            elif vtype == GGUFValueType.STRING:
                sstart, slen = self.string_at(pos, f"{label}: string value")
                pos = sstart + slen
            elif vtype in _SCALAR_SIZES:
                self.need(pos, _SCALAR_SIZES[vtype], f"{label}: value")
                pos += _SCALAR_SIZES[vtype]
            else:
                raise self.fail(KIND_TYPE, f"{label} has unknown value type {vtype} (valid: {_VALUE_TYPES})")
            if key == "general.alignment":
                if vtype != GGUFValueType.UINT32:
                    raise self.fail(KIND_ALIGNMENT, f"metadata key general.alignment has value type {vtype}, "
                                                    f"expected {GGUFValueType.UINT32.value} UINT32")
                alignment = self.u32(value_at, "general.alignment")
                if alignment == 0 or alignment & (alignment - 1):
                    raise self.fail(KIND_ALIGNMENT, f"general.alignment {alignment} is not a power of two")
            kvs.append(KVRecord(key, vtype, start, value_at, pos, item_type, count))
        return pos, kvs, alignment, elements

    def _skip_array(self, pos: int, label: str, item_type: int, count: int, elements: int) -> int:
        """Checks an array's length against the bytes left, then walks
        it (strings) or steps over it (scalars); returns the position after it."""
        left = self.size - pos
        if item_type == GGUFValueType.STRING:
            if count * 8 > left:
                raise self.fail(KIND_COUNT, f"{label}: array length {count} cannot fit in the {left} bytes left "
                                            f"(a string takes at least 8 bytes): corrupt length or truncated file")
            unpack, size, fmt = struct.unpack_from, self.size, self.order + "Q"
            for j in range(count):
                if pos + 8 > size:
                    self.need(pos, 8, f"{label}: string #{j} length")
                n = unpack(fmt, self.buf, pos)[0]
                if n > size - pos - 8:
                    raise self.fail(KIND_LENGTH, f"{label}: string #{j} length {n} exceeds the {size - pos - 8} "
                                                 f"bytes left in the file (corrupt length or truncated file)")
                pos += 8 + n
            return pos
        if item_type == GGUFValueType.ARRAY:
            raise self.fail(KIND_TYPE, f"{label}: arrays of arrays are not supported")
        if item_type not in _SCALAR_SIZES:
            raise self.fail(KIND_TYPE, f"{label}: unknown array item type {item_type} (valid: {_VALUE_TYPES})")
        isz = _SCALAR_SIZES[item_type]
        if count * isz > left:
            raise self.fail(KIND_COUNT, f"{label}: array length {count} of {isz}-byte items cannot fit in the "
                                        f"{left} bytes left: corrupt length or truncated file")
        return pos + count * isz

    def _scan_tensor_table(self, pos: int, tensor_count: int) -> tuple[int, list[TensorRecord]]:
        names: set[str] = set()
        out: list[TensorRecord] = []
        for j in range(tensor_count):
            start = pos
            nstart, nlen = self.string_at(pos, f"tensor #{j}: name")
            if nlen > MAX_TENSOR_NAME:
                raise self.fail(KIND_LENGTH, f"tensor #{j}: name length {nlen} is longer than ggml's limit of "
                                             f"{MAX_TENSOR_NAME} bytes")
            name = self.text(nstart, nlen, f"tensor #{j}: name")
            if name in names:
                raise self.fail(KIND_DUPLICATE, f"duplicate tensor {name!r} (tensor #{j})")
            names.add(name)
            pos = nstart + nlen
            n_dims = self.u32(pos, f"tensor {name}: n_dims")
            if n_dims > MAX_DIMS:
                raise self.fail(KIND_DIMS, f"tensor {name}: n_dims {n_dims} is more than ggml's {MAX_DIMS}")
            pos += 4
            self.need(pos, 8 * n_dims, f"tensor {name}: dimensions")
            dims = struct.unpack_from(self.order + "Q" * n_dims, self.buf, pos)
            pos += 8 * n_dims
            if any(d > INT64_MAX for d in dims):
                raise self.fail(KIND_DIMS, f"tensor {name}: dimensions {list(dims)} include a value above 2**63-1")
            n_elems = math.prod(dims)
            if n_elems > INT64_MAX:
                raise self.fail(KIND_DIMS, f"tensor {name}: dimensions {list(dims)} overflow: their product "
                                           f"{n_elems} exceeds 2**63-1")
            raw_type = self.u32(pos, f"tensor {name}: type")
            pos += 4
            sizes = _type_sizes(raw_type)
            if sizes is None:  # its bytes cannot even be counted: the rest of the file is unreadable
                raise self.fail(KIND_TYPE, unknown_type_message(name, raw_type))
            qtype, (block, type_size) = GGMLQuantizationType(raw_type), sizes
            if block > 1 and (not dims or dims[0] % block):
                raise self.fail(KIND_DIMS, f"tensor {name}: first dimension {dims[0] if dims else '(none)'} is not "
                                           f"a multiple of {qtype.name}'s block size {block}")
            data_offset = self.u64(pos, f"tensor {name}: data offset")
            pos += 8
            out.append(TensorRecord(name, start, nlen, tuple(dims), raw_type, data_offset,
                                    n_elems * type_size // block, pos))
        return pos, out

    def _check_data(self, tensors: list[TensorRecord], data_start: int, alignment: int) -> None:
        size = self.size
        if tensors and data_start > size:
            raise self.fail(KIND_TRUNCATED, f"truncated file: the tensor data would start at byte {data_start} "
                                            f"(alignment {alignment}), the file has {size} bytes")
        prev: TensorRecord | None = None
        for t in sorted(tensors, key=lambda r: (r.data_offset, r.n_bytes)):
            if t.data_offset % alignment:
                raise self.fail(KIND_OFFSET, f"tensor {t.name}: data offset {t.data_offset} is not a multiple of "
                                             f"the alignment {alignment}")
            begin = data_start + t.data_offset
            end = begin + t.n_bytes
            if begin > size:
                raise self.fail(KIND_OFFSET, f"tensor {t.name}: data offset {t.data_offset} points past the end of "
                                             f"the file ({size} bytes): corrupt offset or truncated file")
            if end > size:
                raise self.fail(KIND_TRUNCATED, f"truncated file: tensor {t.name} needs bytes up to {end}, "
                                                f"file has {size}")
            if t.n_bytes == 0:
                continue
            if prev is not None and begin < data_start + prev.data_offset + prev.n_bytes:
                raise self.fail(KIND_OFFSET, f"tensor {t.name} (data bytes {t.data_offset}-{t.data_offset + t.n_bytes}) "
                                             f"overlaps tensor {prev.name} (data bytes {prev.data_offset}-"
                                             f"{prev.data_offset + prev.n_bytes})")
            prev = t


def _check_path(p: Path) -> int:
    if not p.exists():
        raise GGUFError(p, "file not found", KIND_FILE)
    if not p.is_file():
        raise GGUFError(p, "not a regular file", KIND_FILE)
    return p.stat().st_size


def scan_buffer(buf: Any, path: Path | str = "<memory>") -> GGUFLayout:
    """`scan` of a GGUF image in memory (bytes, bytearray or mmap)."""
    return _Scanner(buf, len(buf), Path(path)).scan()


def scan(path: Path | str) -> GGUFLayout:
    """Check the structure of a GGUF file against its size before anything trusts its numbers:
    header (magic, version, tensor_count, kv_count), every metadata entry (key and string lengths,
    value and item types, array lengths), the tensor table (names, n_dims, dimensions and their
    product, types, block sizes) and the data section (alignment, offsets, extents, overlaps)."""
    p = Path(path)
    size = _check_path(p)
    if size < HEADER_BYTES:
        raise GGUFError(p, f"truncated file: {size} bytes is shorter than a GGUF header ({HEADER_BYTES} bytes)",
                        KIND_TRUNCATED)
    try:
        with p.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _Scanner(buf, len(buf), p).scan()
    except OSError as exc:
        if exc.errno == errno.ENOMEM:
            raise map_error(p, size, exc) from None
        raise GGUFError(p, f"cannot read: {exc}", KIND_FILE) from None


def map_error(path: Path, size: int, exc: BaseException) -> GGUFError:
    """A memory map that failed for want of memory or address space: not the file's fault."""
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
    return GGUFError(path, f"cannot map the {size / 2**30:,.1f} GiB file into memory ({why}): this process may not "
                           f"use that much address space (ulimit -v) or memory; the file was not found corrupt",
                     KIND_MEMORY)


def _describe(v: Any) -> str:
    """A short description of a metadata value for a message (arrays stay undecoded)."""
    if isinstance(v, MetadataArray):
        return "an array"
    if isinstance(v, (list, tuple)):
        return f"a list of {len(v)} items"
    return _short(v)


def _meta_int(meta: dict[str, Any], path: Path, key: str, default: int | None = None, minimum: int = 1) -> int:
    """An integer setting of the model; `minimum` is the smallest value that makes sense."""
    v = meta.get(key)
    if v is None:
        if default is None:
            raise GGUFError(path, f"missing metadata key {key}", KIND_METADATA)
        return default
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise GGUFError(path, f"metadata key {key} is not a number: {_describe(v)}", KIND_METADATA)
    if isinstance(v, (float, np.floating)) and not (math.isfinite(v) and float(v).is_integer()):
        raise GGUFError(path, f"metadata key {key} is not an integer: {v!r}", KIND_METADATA)
    n = int(v)
    if n < minimum:
        raise GGUFError(path, f"metadata key {key} is {n}, must be at least {minimum}", KIND_METADATA)
    return n


def _meta_float(meta: dict[str, Any], path: Path, key: str, default: float, positive: bool = True) -> float:
    """A real-valued setting: finite, and above zero when `positive` (else at least zero)."""
    v = meta.get(key)
    if v is None:
        log.info("%s: %s missing, using %s", path.name, key, default)
        return default
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.floating, np.integer)):
        raise GGUFError(path, f"metadata key {key} is not a number: {_describe(v)}", KIND_METADATA)
    x = float(v)
    if not math.isfinite(x) or x < 0 or (positive and x == 0):
        allowed = "a finite number above 0" if positive else "a finite number >= 0"
        raise GGUFError(path, f"metadata key {key} is {x!r}, must be {allowed}", KIND_METADATA)
    return x


@dataclass
class _FileFacts:
    """A scanned file's metadata and tensor table as a model family reads them
    (`engine.models.SpecSource`): every problem is a GGUFError naming the file."""

    values: dict[str, Any]
    tensors: dict[str, Any]
    path: Path

    @property
    def n_tensors(self) -> int:
        return len(self.tensors)

    def read_int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        return _meta_int(self.values, self.path, key, default, minimum)

    def read_float(self, key: str, default: float, positive: bool = True) -> float:
        return _meta_float(self.values, self.path, key, default, positive)

    def has(self, key: str) -> bool:
        return key in self.values

    def get(self, key: str) -> Any:
        return self.values.get(key)

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def vocab(self) -> int:
        emb = self.tensors.get("token_embd.weight")
        if emb is None:
            raise GGUFError(self.path, "missing tensor token_embd.weight", KIND_TENSOR)
        return int(emb.shape[1]) if len(emb.shape) == 2 else 0

    def problem(self, text: str) -> GGUFError:
        return GGUFError(self.path, text, KIND_METADATA)


def spec_from_metadata(meta: dict[str, Any], tensors: dict[str, Any], path: Path) -> ModelSpec:
    """The spec the file's family reads from its metadata (engine/models/)."""
    arch = meta.get("general.architecture")
    if arch is None:
        raise GGUFError(path, "missing metadata key general.architecture", KIND_METADATA)
    if not isinstance(arch, str):
        raise GGUFError(path, f"metadata key general.architecture is not a string: {_describe(arch)}", KIND_METADATA)
    if arch not in models.names():
        raise GGUFError(path, f"unsupported architecture {_short(arch)} (supported: {', '.join(models.names())})",
                        KIND_METADATA)
    return models.family(arch).spec_from_metadata(_FileFacts(meta, tensors, path))


def expected_shapes(s: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the engine needs, in torch order (each layer's as its family declares them)."""
    out: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (s.vocab, s.hidden),
        "output_norm.weight": (s.hidden,),
    }
    if not s.tied_embeddings:
        out["output.weight"] = (s.vocab, s.hidden)
    fam = models.family_of(s)
    for i in range(s.n_layers):
        for part in fam.layer_parts(s, i):
            out[f"blk.{i}.{part.name}"] = part.shape
    return out


def load(path: Path | str) -> LoadedModel:
    """Parse and validate a GGUF model.  Takes no device memory; tensors stay mapped."""
    p = Path(path)
    layout = scan(p)
    size = layout.size
    try:
        meta, tensors, mapped = _read_layout(p, layout)
    except GGUFError:
        raise
    except (MemoryError, OSError) as exc:
        if isinstance(exc, MemoryError) or exc.errno == errno.ENOMEM:
            raise map_error(p, size, exc) from None
        raise GGUFError(p, f"cannot read: {exc}", KIND_FILE) from None
    except Exception as exc:  # scan vouched for every number; anything else is still the file's fault
        raise GGUFError(p, f"corrupt GGUF metadata or tensor table ({type(exc).__name__}: {_cut(str(exc))})",
                        KIND_READER) from None
    spec = spec_from_metadata(meta, tensors, p)
    ok_types = supported_types()
    for name, shape in expected_shapes(spec).items():
        t = tensors.get(name)
        if t is None:
            raise GGUFError(p, f"missing tensor {name} (needed by {spec.arch})", KIND_TENSOR)
        got = tuple(int(x) for x in reversed(t.shape.tolist()))
        if got != shape:
            raise GGUFError(p, f"tensor {name} has shape {list(got)}, expected {list(shape)} from the metadata",
                            KIND_TENSOR)
        if t.tensor_type not in ok_types:
            raise GGUFError(
                p, f"unsupported type {t.tensor_type.name} in tensor {name}; "
                   f"supported: {', '.join(sorted(q.name for q in ok_types))}", KIND_TYPE)
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(
                p, f"truncated file: tensor {name} needs bytes up to {t.data_offset + t.n_bytes}, "
                   f"file has {size}", KIND_TRUNCATED)
    log.info("loaded %s: %s", p.name, spec)
    return LoadedModel(path=p, spec=spec, metadata=meta, _map=mapped, _tensors=tensors)


def vocabulary(model: LoadedModel) -> list[str]:
    f = model.metadata.get("tokenizer.ggml.tokens")
    if f is None:
        raise GGUFError(model.path, "the file has no vocabulary (tokenizer.ggml.tokens): use token ids", KIND_METADATA)
    return f.decode() if isinstance(f, MetadataArray) else list(f)


# ------------------------------------------------------------------ reading a scanned file
# gguf's GGUFReader builds a numpy view per metadata array item (about 25 us each): a real
# model's 150k-token vocabulary and merges cost ~7 s and hundreds of MiB before the first
# tensor.  `scan` has already located and bounds-checked every entry, so the loader reads the
# scalars it needs straight from the mapped file, keeps arrays undecoded until asked for, and
# maps each tensor exactly as GGUFReader would; gguf still does the dequantisation.

_SCALARS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
_TYPED = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class MetadataArray:
    """A metadata array left undecoded in the mapped file (vocabularies are large)."""

    buf: Any
    order: str
    item_type: int
    count: int
    items_at: int

    def __len__(self) -> int:
        return self.count

    def decode(self) -> list:
        items, pos = [], self.items_at
        if self.item_type == GGUFValueType.STRING:
            for _ in range(self.count):
                n = struct.unpack_from(self.order + "Q", self.buf, pos)[0]
                items.append(bytes(self.buf[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace"))
                pos += 8 + n
            return items
        fmt = _SCALARS.get(GGUFValueType(self.item_type))
        if fmt is None:
            raise ValueError(f"arrays of {GGUFValueType(self.item_type).name} are not decoded")
        return list(struct.unpack_from(f"{self.order}{self.count}{fmt}", self.buf, self.items_at))


@dataclass(frozen=True)
class MappedTensor:
    """A tensor of the file, as gguf's ReaderTensor presents it (shape in ggml order)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_bytes: int
    data_offset: int  # absolute, in the file
    data: np.ndarray


def _decode_value(buf: Any, order: str, vtype: int, pos: int) -> Any:
    if vtype == GGUFValueType.STRING:
        n = struct.unpack_from(order + "Q", buf, pos)[0]
        return bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace")
    return struct.unpack_from(order + _SCALARS[GGUFValueType(vtype)], buf, pos)[0]


def _read_layout(p: Path, layout: GGUFLayout) -> tuple[dict[str, Any], dict[str, MappedTensor], np.memmap]:
    # read-only and shared: pages come from the page cache and count against no commit limit, so
    # a file larger than RAM + swap maps (a copy-on-write map of it fails with ENOMEM).  torch
    # views tensors of it without a copy; anything that changes a tensor works on a copy
    buf = np.memmap(p, mode="r")
    order = layout.byte_order
    meta: dict[str, Any] = {}
    for kv in layout.kvs:
        if kv.value_type == GGUFValueType.ARRAY:
            meta[kv.key] = MetadataArray(buf, order, kv.item_type, kv.count, kv.value_offset + 12)
        else:
            meta[kv.key] = _decode_value(buf, order, kv.value_type, kv.value_offset)
    tensors: dict[str, MappedTensor] = {}
    for t in layout.tensors:
        qtype = GGMLQuantizationType(t.ggml_type)
        start = layout.data_start + t.data_offset
        np_dims = tuple(reversed(t.dims))
        raw = buf[start:start + t.n_bytes]
        if qtype in _TYPED:
            dtype = np.dtype(_TYPED[qtype]).newbyteorder(order)
            data = raw.view(dtype).reshape(np_dims)
        else:
            data = raw.reshape(gguf_quants.quant_shape_to_byte_shape(np_dims, qtype))
        tensors[t.name] = MappedTensor(t.name, qtype, np.array(t.dims, dtype=np.uint64), t.n_bytes, start, data)
    return meta, tensors, buf
