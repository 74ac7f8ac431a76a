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
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from gguf import GGMLQuantizationType

from engine.config import ConfigError
from engine.hw.machine import physical_ram  # its home before issue 37: still importable from here
from engine.models.spec import ModelSpec
from engine.quant import dequant
from engine.quant.qtensor import has_blocks, stored

log = logging.getLogger(__name__)

GiB = 1 << 30
PIN_PIECE = 1 * GiB  # registered in pieces, never one giant call
PAGE = 4096
# experts are expanded (compute dtype) in batches of at most this many bytes before their GEMMs
EXPAND_SCRATCH_BYTES = 2 * GiB


def expert_elems(spec: ModelSpec) -> int:
    return 3 * spec.expert_ffn * spec.hidden


EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass(frozen=True)
class ExpertPart:
    """One of an expert's three matrices as stored: its type, shape and place in the row."""

    qtype: GGMLQuantizationType
    shape: tuple[int, int]  # one expert's matrix, torch order
    offset: int  # bytes into the expert's row
    nbytes: int


@dataclass(frozen=True)
class ExpertLayout:
    """How one layer's expert row is laid out: gate | up | down, each in its file type."""

    parts: tuple[ExpertPart, ExpertPart, ExpertPart]

    @property
    def row_bytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @staticmethod
    def of(source, spec: ModelSpec, layer: int) -> ExpertLayout:
        """(A layer without experts, a leading dense layer: an empty row.)"""
        if not spec.has_experts(layer):
            return ExpertLayout(())  # type: ignore[arg-type]
        f, d, e = spec.expert_ffn, spec.hidden, spec.n_experts
        parts, offset = [], 0
        for part, shape in zip(EXPERT_PARTS, ((f, d), (f, d), (d, f))):
            name = f"blk.{layer}.{part}.weight"
            if has_blocks(source):
                qtype, nbytes = source.qtype(name), source.nbytes(name) // e
            else:
                qtype, nbytes = GGMLQuantizationType.F32, 4 * shape[0] * shape[1]
            parts.append(ExpertPart(qtype, shape, offset, nbytes))
            offset += nbytes
        return ExpertLayout(tuple(parts))  # type: ignore[arg-type]


def _page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def arena_bytes(layouts: Sequence[ExpertLayout], n_experts: int) -> int:
    """Bytes of an arena of these layers (each layer's region starts on a page)."""
    return sum(_page_up(lay.row_bytes * n_experts) for lay in layouts)


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
        from engine.hw import topology

        return topology.wddm_pin_cap(topology.discover())
    except Exception as exc:  # the driver query must never stop a run
        log.debug("driver-model query for the pin limit failed: %s", exc)
        return None, ""


class HostArena:
    """Every MoE layer's experts in host RAM, as stored in the file (never expanded).

    Layer regions start on pages; inside one, expert e's row is its gate, up and down blocks
    back to back (one copy moves an expert).  Rows of different layers may differ in size
    (Q4_K_M keeps some layers' ffn_down in Q6_K); a device slot holds the largest."""

    def __init__(self, source, spec: ModelSpec, layers: Sequence[int],
                 progress: Callable[[float], None] | None = None) -> None:
        self.spec = spec
        self.layers = list(layers)
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.layouts = {layer: ExpertLayout.of(source, spec, layer) for layer in self.layers}
        E = spec.n_experts
        self.offsets: dict[int, int] = {}
        pos = 0
        for layer in self.layers:
            self.offsets[layer] = pos
            pos += _page_up(self.layouts[layer].row_bytes * E)
        nbytes = pos
        # page-aligned, so registered pieces start on page boundaries
        self._raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
        off = (-self._raw.data_ptr()) % PAGE
        self.data = self._raw[off:off + nbytes]
        self.expert_bytes = max((lay.row_bytes for lay in self.layouts.values()), default=0)  # a slot
        for k, layer in enumerate(self.layers):
            self._fill(source, layer)
            if progress is not None:
                progress((k + 1) / len(self.layers))
        self.pinned_rows = {layer: 0 for layer in self.layers}  # leading experts page-locked
        self.pinned_bytes = 0
        self._registered: list[int] = []
        self.pin_note = "not pinned"

    def _fill(self, source, layer: int) -> None:
        """Copy the layer's blocks into expert rows once: straight from the file where the
        source reads files, else from the source's blocks."""
        lay, E = self.layouts[layer], self.spec.n_experts
        rows = self.layer_rows(layer)
        for name, part in zip(EXPERT_PARTS, lay.parts):
            full = f"blk.{layer}.{name}.weight"
            if hasattr(source, "read_into"):
                for e in range(E):
                    source.read_into(full, e * part.nbytes, rows[e, part.offset:part.offset + part.nbytes])
            else:
                blocks = stored(source, full).raw.view(E, part.nbytes)
                rows[:, part.offset:part.offset + part.nbytes].copy_(blocks)

    def layer_rows(self, layer: int) -> torch.Tensor:
        """[n_experts, row_bytes] view of one layer's region."""
        E, rb = self.spec.n_experts, self.layouts[layer].row_bytes
        start = self.offsets[layer]
        return self.data[start:start + E * rb].view(E, rb)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def pin(self, limit: int, note: str) -> None:
        """Page-lock up to `limit` bytes, layer by layer, in pieces of whole experts; a failure
        falls back to pageable."""
        self.pin_note = note
        if limit <= 0:
            return
        cudart = torch.cuda.cudart()
        left = limit
        failed = False
        for layer in self.layers:
            rb, E = self.layouts[layer].row_bytes, self.spec.n_experts
            if not rb:  # a layer without experts
                continue
            want = min(left // rb, E)  # whole experts of this layer
            if want <= 0 or failed:
                break
            base = self.data.data_ptr() + self.offsets[layer]
            # pieces of whole experts, each starting on a page (a copy never straddles two
            # registrations and no page is registered twice)
            unit = math.lcm(rb, PAGE) // rb  # experts per aligned unit
            per_piece = max(PIN_PIECE // (unit * rb), 1) * unit if unit * rb <= 4 * GiB else want
            done = 0
            while done < want:
                k = min(per_piece, want - done)
                err = cudart.cudaHostRegister(base + done * rb, k * rb, 0)
                code = getattr(err, "value", err)
                if code != 0:
                    log.warning("page-locking the expert arena stopped at %.1f GiB (cudaHostRegister error %s); "
                                "the rest stays pageable", (limit - left + done * rb) / GiB, code)
                    self.pin_note += (f"; registration failed at {(limit - left + done * rb) / GiB:.1f} GiB "
                                      f"(error {code}), rest pageable")
                    failed = True
                    break
                self._registered.append(base + done * rb)
                done += k
            self.pinned_rows[layer] = done
            self.pinned_bytes += done * rb
            left -= done * rb
        log.info("expert arena: %.2f GiB as stored, %.2f GiB page-locked (%s)", self.nbytes / GiB,
                 self.pinned_bytes / GiB, self.pin_note)

    def row(self, layer: int, expert: int) -> tuple[torch.Tensor, bool]:
        """An expert's host row (its blocks) and whether it lies in the page-locked part."""
        return self.layer_rows(layer)[expert], expert < self.pinned_rows[layer]

    def __del__(self) -> None:
        # an arena dropped without close (a run that raised): its memory must not stay
        # registered once freed, or a later pageable copy landing there fails ("invalid argument")
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown: CUDA may be gone)
            pass

    def close(self) -> None:
        if getattr(self, "_registered", None):
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
            self._registered = []
            self.pinned_bytes = 0
            self.pinned_rows = {layer: 0 for layer in self.layers}


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
        self.pool = torch.empty((n_slots, arena.expert_bytes), dtype=torch.uint8, device=device)  # as stored
        self.lru: OrderedDict[tuple[int, int], int] = OrderedDict()
        self.free = list(range(n_slots - 1, -1, -1))
        self.cuda = device.type == "cuda"
        self.seq = 0  # bumps once per layer call; a slot used at seq s is free after done[s]
        self.slot_seq = [-1] * n_slots
        self.done: dict[int, torch.cuda.Event] = {}
        self.pending: list[tuple[int, int, object, object, int, int, int]] = []  # stream timing to resolve
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.staging = [torch.empty(arena.expert_bytes, dtype=torch.uint8, pin_memory=True)
                            for _ in range(self.STAGING)]
            self.staging_done: list[torch.cuda.Event | None] = [None] * self.STAGING
            self.last_copy: torch.cuda.Event | None = None
        self._stage_i = 0

    def expand(self, layer: int, slots: Sequence[int],
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The experts in `slots` (of `layer`) expanded into a scratch in `dtype`: gate [B,f,d],
        up [B,f,d], down [B,d,f], in the order of `slots`.  Runs on the cache's device, on the
        current stream (after `ensure` made it wait for the copies)."""
        lay = self.arena.layouts[layer]
        idx = torch.tensor(list(slots), dtype=torch.int64).to(self.device, non_blocking=True)
        out = []
        for part in lay.parts:
            # [slots, part bytes], strided: the Triton dequantiser gathers the rows as it reads
            # them in place; the torch path copies them first
            raw = self.pool[:, part.offset:part.offset + part.nbytes]
            out.append(dequant.dequantize(raw, part.qtype, (len(slots), *part.shape), dtype, rows=idx))
        return out[0], out[1], out[2]

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
                self.pool[slot, :row.numel()].copy_(row)
                pageable += row.numel()
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
                nbytes = row.numel()
                if is_pinned:
                    self.pool[slot, :nbytes].copy_(row, non_blocking=True)
                    pinned += nbytes
                else:
                    i = self._stage_i
                    self._stage_i = (i + 1) % self.STAGING
                    if self.staging_done[i] is not None:
                        self.staging_done[i].synchronize()  # its last H2D has left the buffer
                    self.staging[i][:nbytes].copy_(row)  # host memcpy into pinned staging
                    self.pool[slot, :nbytes].copy_(self.staging[i][:nbytes], non_blocking=True)
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


def expert_qtypes(layouts: Iterable[ExpertLayout]) -> set[GGMLQuantizationType]:
    """The GGUF types the experts of these layers are stored in."""
    return {part.qtype for lay in layouts for part in lay.parts}


@dataclass
class ExpertPlan:
    """How a session holds its experts: resident (stacked weights per layer) or streamed."""

    streamed: bool
    slots_per_stage: list[int] = field(default_factory=list)
    reason: str = ""


def plan_experts(setting: str | float, spec: ModelSpec, stages, dtypes,
                 expert_bytes: int | None = None, qtypes: Iterable = ()) -> ExpertPlan:
    """Decide resident vs streamed and each stage's slot count from --expert-cache.

    `expert_bytes`: one expert as stored (its blocks); default: expanded to the stage dtype.
    `qtypes`: the experts' GGUF types (what the dequantiser's temporaries depend on; none
    given: the torch path's are reserved)."""
    qtypes = tuple(qtypes)
    if not spec.is_moe:
        return ExpertPlan(False, reason="dense model: no experts")
    elems = expert_elems(spec)
    slots, reasons = [], []
    # stages sharing a device (interleaved layer groups) share its free memory by layer count
    layers_on: dict = {}
    for st in stages:
        layers_on[st.device] = layers_on.get(st.device, 0) + (st.end - st.first)
    for st in stages:
        need = spec.expert_layers(st.first, st.end) * spec.n_experts
        ebytes = expert_bytes or elems * torch.empty((), dtype=dtypes[st.device]).element_size()
        if setting == "all":
            slots.append(need)
            continue
        if setting == "auto":
            if st.device.type != "cuda":
                slots.append(need)
                continue
            free, total = torch.cuda.mem_get_info(st.device)
            # what the device's own weights take is loaded after this decision: keep a margin
            other = layers_on[st.device] * (spec.layer_params() - spec.n_experts * elems) * 2
            share = (st.end - st.first) / layers_on[st.device]
            # the scratch a layer's experts are expanded into, and the dequantiser's temporaries
            dsize = torch.empty((), dtype=dtypes[st.device]).element_size()
            temps = dequant.gpu_temporaries(st.device, qtypes, dtypes[st.device]) if qtypes else dequant.STEP_BYTES_CUDA
            scratch = min(spec.n_experts * elems * dsize, EXPAND_SCRATCH_BYTES) + temps
            budget = int((free - other - int(0.15 * total) - 2 * GiB) * share) - scratch
            n = max(int(budget // ebytes), 0)
            slots.append(min(n, need))
            reasons.append(f"{st.device}: {budget / GiB:.1f} GiB free for experts")
            continue
        n = int(float(setting) * GiB // ebytes)
        if n < 1:
            raise ConfigError("expert_cache", setting, f"at least one expert's size ({ebytes / 2**20:.1f} MiB) in GiB",
                              "no expert fits")
        slots.append(min(n, need))
    streamed = any(s < spec.expert_layers(st.first, st.end) * spec.n_experts for s, st in zip(slots, stages))
    why = "every expert resident" if not streamed else "streamed from the host arena (" + ", ".join(
        f"stage {st.index}: {s} of {spec.expert_layers(st.first, st.end) * spec.n_experts} slots"
        for s, st in zip(slots, stages)) + ")"
    if reasons:
        why += "; " + "; ".join(reasons)
    return ExpertPlan(streamed, slots, why)
