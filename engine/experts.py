"""MoE experts in a host arena, streamed into a per-device LRU cache (seed 004).

The arena holds every MoE layer's experts in host RAM, each expert's gate/up/down contiguous
(one row of `[layers, experts, 3*f*d]`).  The first `pin_limit` bytes are page-locked with
`cudaHostRegister` in pieces (fast DMA); the rest is pageable and goes through a small pinned
staging ring (slow).  Each stage's device keeps an `ExpertCache`: a pool of expert-sized slots
with LRU eviction by (layer, expert).  Misses are copied on a separate CUDA stream, so the
next layer's experts can arrive while the current layer computes.
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

from .config import ConfigError
from .gguf_model import ModelSpec

log = logging.getLogger(__name__)

GiB = 1 << 30
PIN_PIECE = 1 * GiB  # registered in pieces, never one giant call
PAGE = 4096


def physical_ram() -> int:
    """Bytes of physical memory (POSIX sysconf; GlobalMemoryStatusEx on Windows)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - Windows
        import ctypes

        class MemoryStatusEx(ctypes.Structure):
            _fields_ = [("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong),
                        ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
                        ("ullTotalPageFile", ctypes.c_ulonglong), ("ullAvailPageFile", ctypes.c_ulonglong),
                        ("ullTotalVirtual", ctypes.c_ulonglong), ("ullAvailVirtual", ctypes.c_ulonglong),
                        ("ullAvailExtendedVirtual", ctypes.c_ulonglong)]

        st = MemoryStatusEx()
        st.dwLength = ctypes.sizeof(MemoryStatusEx)
        ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(st))  # type: ignore[attr-defined]
        return int(st.ullTotalPhys)


def expert_elems(spec: ModelSpec) -> int:
    return 3 * spec.expert_ffn * spec.hidden


@dataclass
class ExpertStats:
    stage: int = 0
    device: str = ""
    hits: int = 0
    misses: int = 0
    bytes_pinned: int = 0
    bytes_pageable: int = 0
    stream_ns: int = 0
    slots: int = 0
    resident: bool = False

    @property
    def gbs(self) -> float:
        moved = self.bytes_pinned + self.bytes_pageable
        return moved / self.stream_ns if self.stream_ns else 0.0  # bytes/ns == GB/s

    def as_dict(self) -> dict:
        d = asdict(self)
        d["gbs"] = self.gbs
        return d


def resolve_pin_limit(setting: str | float, arena_bytes: int, cuda: bool,
                      cap: tuple[int | None, str] | None = None) -> tuple[int, str]:
    """Bytes of the arena to page-lock, and a note.  Refused (ConfigError) before anything is
    registered when the machine cannot honour it.

    cap: (bytes, why) that caps auto (`topology.wddm_pin_cap`); None: asked of this machine's
    devices when auto is pinning for CUDA."""
    ram = physical_ram()
    if setting == "auto":
        limit = min(arena_bytes, ram // 2)  # Windows' pinned pool is about half of RAM
        why = f"auto: min(arena {arena_bytes / GiB:.1f} GiB, half of RAM {ram / 2 / GiB:.1f} GiB)"
        if cap is None and cuda:
            cap = _machine_pin_cap()
        if cap is not None and cap[0] is not None and cap[0] < limit:
            limit, why = cap[0], cap[1]
    else:
        limit = int(float(setting) * GiB)
        if limit > ram:
            raise ConfigError("pin_limit_gib", setting, f"0 to {ram / GiB:.1f} GiB (this machine's RAM)",
                              "more than the machine has cannot be page-locked")
        limit = min(limit, arena_bytes)
        why = f"{float(setting):g} GiB asked"
    if not cuda:
        return 0, "pinning skipped: no CUDA device (host memory stays pageable)"
    return limit, why


def _machine_pin_cap() -> tuple[int | None, str]:
    """The WDDM cap of this machine's GPUs (never fails a run: unknown means no cap)."""
    try:
        from . import topology

        return topology.wddm_pin_cap(topology.discover())
    except Exception as exc:  # the driver query must never stop a run
        log.debug("driver-model query for the pin limit failed: %s", exc)
        return None, ""


class HostArena:
    """Every MoE layer's experts in host RAM: [n_moe_layers, n_experts, 3*f*d]."""

    def __init__(self, source, spec: ModelSpec, dtype: torch.dtype, layers: Sequence[int]) -> None:
        self.spec = spec
        self.dtype = dtype
        self.layers = list(layers)
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.elems = expert_elems(spec)
        esize = torch.empty((), dtype=dtype).element_size()
        nbytes = len(self.layers) * spec.n_experts * self.elems * esize
        # page-aligned, so registered pieces start on page boundaries
        self._raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
        off = (-self._raw.data_ptr()) % PAGE
        self.data = self._raw[off:off + nbytes].view(dtype).view(len(self.layers), spec.n_experts, self.elems)
        f, d = spec.expert_ffn, spec.hidden
        for i, layer in enumerate(self.layers):
            b = f"blk.{layer}."
            rows = self.data[i]
            rows[:, : f * d].copy_(source.tensor(b + "ffn_gate_exps.weight").reshape(spec.n_experts, -1))
            rows[:, f * d: 2 * f * d].copy_(source.tensor(b + "ffn_up_exps.weight").reshape(spec.n_experts, -1))
            rows[:, 2 * f * d:].copy_(source.tensor(b + "ffn_down_exps.weight").reshape(spec.n_experts, -1))
        self.expert_bytes = self.elems * self.data.element_size()
        self.pinned_bytes = 0
        self._registered: list[int] = []
        self.pin_note = "not pinned"

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def pin(self, limit: int, note: str) -> None:
        """Page-lock the first `limit` bytes in pieces; a failure falls back to pageable."""
        self.pin_note = note
        if limit <= 0:
            return
        cudart = torch.cuda.cudart()
        base = self.data.data_ptr()
        # Pieces hold whole experts and start on pages: a copy must never straddle two
        # registrations (the driver refuses it), and a page may not be registered twice.
        unit = math.lcm(self.expert_bytes, PAGE)
        limit = (limit // self.expert_bytes) * self.expert_bytes
        piece = max(PIN_PIECE // unit, 1) * unit if unit <= 4 * GiB else limit
        done = 0
        while done < limit:
            size = min(piece, limit - done)
            err = cudart.cudaHostRegister(base + done, size, 0)
            code = getattr(err, "value", err)
            if code != 0:
                log.warning("page-locking the expert arena stopped at %.1f GiB (cudaHostRegister error %s); "
                            "the rest stays pageable", done / GiB, code)
                self.pin_note += f"; registration failed at {done / GiB:.1f} GiB (error {code}), rest pageable"
                break
            self._registered.append(base + done)
            done += size
        # only whole experts count as pinned
        self.pinned_bytes = (done // self.expert_bytes) * self.expert_bytes
        log.info("expert arena: %.1f GiB, %.1f GiB page-locked (%s)", self.nbytes / GiB,
                 self.pinned_bytes / GiB, self.pin_note)

    def row(self, layer: int, expert: int) -> tuple[torch.Tensor, bool]:
        """An expert's host row and whether it lies in the page-locked part."""
        i = self.index[layer]
        offset = (i * self.spec.n_experts + expert) * self.expert_bytes
        return self.data[i, expert], offset + self.expert_bytes <= self.pinned_bytes

    def close(self) -> None:
        if self._registered:
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
            self._registered = []
            self.pinned_bytes = 0


class ExpertCache:
    """One device's pool of expert slots, LRU by (layer, expert)."""

    STAGING = 2  # pinned staging buffers for pageable experts

    def __init__(self, arena: HostArena, device: torch.device, n_slots: int, stats: ExpertStats) -> None:
        if n_slots < 1:
            raise ConfigError("expert_cache", f"{n_slots} slots", f"room for at least one expert "
                                                                  f"({arena.expert_bytes / 2**20:.1f} MiB)")
        self.arena = arena
        self.chunk = -1  # the chunk being computed (set by the stage), for stream events
        self.device = device
        self.n_slots = n_slots
        self.stats = stats
        stats.slots = n_slots
        self.pool = torch.empty((n_slots, arena.elems), dtype=arena.dtype, device=device)
        self.lru: OrderedDict[tuple[int, int], int] = OrderedDict()
        self.free = list(range(n_slots - 1, -1, -1))
        self.cuda = device.type == "cuda"
        self.seq = 0  # bumps once per layer call; a slot used at seq s is free after done[s]
        self.slot_seq = [-1] * n_slots
        self.done: dict[int, "torch.cuda.Event"] = {}
        self.pending: list[tuple[int, int, object, object, int, int, int]] = []  # stream timing to resolve
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.staging = [torch.empty(arena.elems, dtype=arena.dtype, pin_memory=True) for _ in range(self.STAGING)]
            self.staging_done: list[torch.cuda.Event | None] = [None] * self.STAGING
            self.last_copy: torch.cuda.Event | None = None
        self._stage_i = 0

    def views(self, f: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate [S,f,d], up [S,f,d], down [S,d,f] views of the pool."""
        p = self.pool
        s = self.n_slots
        return (p[:, : f * d].view(s, f, d), p[:, f * d: 2 * f * d].view(s, f, d), p[:, 2 * f * d:].view(s, d, f))

    def begin_layer(self) -> int:
        self.seq += 1
        return self.seq

    def end_layer(self, seq: int) -> None:
        """Called after the layer's expert compute was launched on the compute stream."""
        if self.cuda:
            ev = torch.cuda.Event()
            with torch.cuda.device(self.device):
                ev.record()
            self.done[seq] = ev
            for old in [k for k in self.done if k < seq - 64]:
                del self.done[old]

    def ensure(self, layer: int, experts: Sequence[int], chunk: int, prefetch: bool = False) -> list[int]:
        """Make `experts` of `layer` resident; returns their slots.  Misses are copied (on the
        copy stream on CUDA); the compute stream is made to wait for them."""
        assert len(experts) <= self.n_slots
        slots: list[int] = []
        misses: list[tuple[int, int]] = []
        protected = {(layer, e) for e in experts}
        for e in experts:
            key = (layer, e)
            slot = self.lru.get(key)
            if slot is not None:
                self.lru.move_to_end(key)
                if not prefetch:
                    self.stats.hits += 1
            else:
                slot = self._evict(protected)
                self.lru[key] = slot
                misses.append((e, slot))
                if not prefetch:
                    self.stats.misses += 1
            self.slot_seq[slot] = self.seq
            slots.append(slot)
        if misses:
            self._copy(layer, misses, chunk)
        if self.cuda and self.last_copy is not None and not prefetch:
            torch.cuda.current_stream(self.device).wait_event(self.last_copy)
        return slots

    def _evict(self, protected: set[tuple[int, int]]) -> int:
        if self.free:
            return self.free.pop()
        for key in self.lru:
            if key not in protected:
                slot = self.lru.pop(key)
                if self.cuda:
                    ev = self.done.get(self.slot_seq[slot])
                    if ev is not None:  # the copy must not overwrite what compute still reads
                        self.copy_stream.wait_event(ev)
                    elif self.slot_seq[slot] == self.seq:
                        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                return slot
        raise RuntimeError("expert cache: every slot is in use by this layer")

    def _copy(self, layer: int, misses: list[tuple[int, int]], chunk: int) -> None:
        pinned = pageable = 0
        if not self.cuda:
            t0 = time.perf_counter_ns()
            for e, slot in misses:
                row, is_pinned = self.arena.row(layer, e)
                self.pool[slot].copy_(row)
                pageable += row.numel() * row.element_size()
            t1 = time.perf_counter_ns()
            self.stats.bytes_pageable += pageable
            self.stats.stream_ns += t1 - t0
            self.pending.append((layer, chunk, None, None, 0, pageable, t0, t1))
            return
        with torch.cuda.stream(self.copy_stream):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(self.copy_stream)
            for e, slot in misses:
                row, is_pinned = self.arena.row(layer, e)
                nbytes = row.numel() * row.element_size()
                if is_pinned:
                    self.pool[slot].copy_(row, non_blocking=True)
                    pinned += nbytes
                else:
                    i = self._stage_i
                    self._stage_i = (i + 1) % self.STAGING
                    if self.staging_done[i] is not None:
                        self.staging_done[i].synchronize()  # its last H2D has left the buffer
                    self.staging[i].copy_(row)  # host memcpy into pinned staging
                    self.pool[slot].copy_(self.staging[i], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(self.copy_stream)
                    self.staging_done[i] = ev
                    pageable += nbytes
            end.record(self.copy_stream)
            self.last_copy = end
        self.stats.bytes_pinned += pinned
        self.stats.bytes_pageable += pageable
        self.pending.append((layer, chunk, start, end, pinned, pageable, 0, 0))

    def drain_timings(self, clock) -> list[tuple[int, int, int, int, int, int]]:
        """(layer, chunk, start_ns, end_ns, pinned, pageable) of finished copies on the host clock."""
        out = []
        keep = []
        for layer, chunk, start, end, pinned, pageable, *host in self.pending:
            if start is None:
                out.append((layer, chunk, host[0], host[1], pinned, pageable))
                continue
            if not end.query():
                keep.append((layer, chunk, start, end, pinned, pageable, 0, 0))
                continue
            self.stats.stream_ns += int(start.elapsed_time(end) * 1e6)
            out.append((layer, chunk, clock.to_host_ns(self.device, start), clock.to_host_ns(self.device, end),
                        pinned, pageable))
        self.pending = keep
        return out

    def synchronize(self) -> None:
        if self.cuda:
            self.copy_stream.synchronize()

    def reset_stats(self) -> None:
        s = self.stats
        s.hits = s.misses = s.bytes_pinned = s.bytes_pageable = s.stream_ns = 0
        self.pending = []


@dataclass
class ExpertPlan:
    """How a session holds its experts: resident (stacked weights per layer) or streamed."""

    streamed: bool
    slots_per_stage: list[int] = field(default_factory=list)
    reason: str = ""


def plan_experts(setting: str | float, spec: ModelSpec, stages, dtypes) -> ExpertPlan:
    """Decide resident vs streamed and each stage's slot count from --expert-cache."""
    if not spec.is_moe:
        return ExpertPlan(False, reason="dense model: no experts")
    elems = expert_elems(spec)
    slots, reasons = [], []
    for st in stages:
        need = (st.end - st.first) * spec.n_experts
        ebytes = elems * torch.empty((), dtype=dtypes[st.device]).element_size()
        if setting == "all":
            slots.append(need)
            continue
        if setting == "auto":
            if st.device.type != "cuda":
                slots.append(need)
                continue
            free, total = torch.cuda.mem_get_info(st.device)
            # what the stage's own weights take is loaded after this decision: keep a margin
            other = (st.end - st.first) * (spec.layer_params() - spec.n_experts * elems) * 2
            budget = free - other - int(0.15 * total) - 2 * GiB
            n = max(int(budget // ebytes), 0)
            slots.append(min(n, need))
            reasons.append(f"{st.device}: {budget / GiB:.1f} GiB free for experts")
            continue
        n = int(float(setting) * GiB // ebytes)
        if n < 1:
            raise ConfigError("expert_cache", setting, f"at least one expert's size ({ebytes / 2**20:.1f} MiB) in GiB",
                              "no expert fits")
        slots.append(min(n, need))
    streamed = any(s < (st.end - st.first) * spec.n_experts for s, st in zip(slots, stages))
    why = "every expert resident" if not streamed else "streamed from the host arena (" + ", ".join(
        f"stage {st.index}: {s} of {(st.end - st.first) * spec.n_experts} slots" for s, st in zip(slots, stages)) + ")"
    if reasons:
        why += "; " + "; ".join(reasons)
    return ExpertPlan(streamed, slots, why)
