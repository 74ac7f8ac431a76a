"""Devices, PCIe links, GPU ordering and telemetry.

Each torch CUDA device is matched to its NVML handle by PCI (domain, bus, device) -- never by
index: CUDA and NVML number devices differently (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER,
nvidia-smi numbering that floats between sessions).

The link class of a device is the theoretical bandwidth per direction of its link at *max*
generation x *max* width: idle links downshift (a Gen5 card at rest reports Gen1), so the current
figures say little about what the link can carry.

Ordering "pcie" puts the widest link first, because the main device carries the prompt path and
that path is bound by streaming from host memory (seed 004). It falls back to the configured order
whenever any device lacks the information, and always says why.

No NVIDIA driver, or torch without CUDA: `discover` returns no devices with the reason, and the
telemetry sampler reports itself unavailable. Nothing here raises for a missing driver.

`torch.cuda` and `pynvml` functions are looked up at call time (torch is imported by the functions
that use it, so the app's window and the CLI's checks import this module without torch), and tests
can replace them with fakes.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:  # nvidia-ml-py; absent on some installs
    import pynvml
except ImportError:  # pragma: no cover - exercised only without nvidia-ml-py
    pynvml = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

# GB/s per lane and direction, after line coding (PCIe 1/2: 8b/10b; 3-5: 128b/130b; 6: FLIT).
PCIE_LANE_GBS: dict[int, float] = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}

GPU_ORDER_MODES = ("pcie", "configured")
DEFAULT_PROBE_BYTES = 256 << 20

PciKey = tuple[int, int, int]  # (domain, bus, device)


# --------------------------------------------------------------------------------------------
# data


@dataclass
class GpuInfo:
    """One torch CUDA device and what NVML says about its link. None: unknown / unsupported."""

    index: int  # torch index
    torch_name: str  # "cuda:0"
    name: str
    pci_bus_id: str  # "00000000:07:00.0"
    vram_total: int | None = None  # bytes
    vram_free: int | None = None  # bytes
    pcie_gen_cur: int | None = None
    pcie_width_cur: int | None = None
    pcie_gen_max: int | None = None  # link max (device and system)
    pcie_width_max: int | None = None
    gpu_gen_max: int | None = None  # what the GPU itself supports
    link_class_gbs: float | None = None  # per direction, at max gen x max width
    h2d_gbs: float | None = None  # measured with pinned host memory (probe only)
    d2h_gbs: float | None = None
    driver_model: str = "n/a"  # WDDM | TCC | MCDM on Windows (NVML's driver-model query); n/a elsewhere


@dataclass
class Topology:
    """The devices of this process, their peer-access matrix, and why anything is missing."""

    devices: list[GpuInfo] = field(default_factory=list)
    peer: list[list[bool]] = field(default_factory=list)  # peer[i][j]: i can access j; diag True
    nvml_ok: bool = False
    reason: str = ""  # why NVML / CUDA / the probe is unavailable; empty if all is fine
    probed: bool = False  # discover(probe=True) was asked for

    def device(self, index: int) -> GpuInfo | None:
        for gpu in self.devices:
            if gpu.index == index:
                return gpu
        return None


@dataclass
class OrderResult:
    devices: list[str]
    reordered: bool
    reason: str


@dataclass
class TelemetrySample:
    """One reading of one GPU; t_ns is time.perf_counter_ns(), the clock of stage events."""

    t_ns: int
    gpu: int  # torch index
    util_pct: int | None = None
    mem_used: int | None = None  # bytes
    pcie_tx_gbs: float | None = None
    pcie_rx_gbs: float | None = None
    sm_clock_mhz: int | None = None
    power_w: float | None = None
    temp_c: int | None = None


# --------------------------------------------------------------------------------------------
# small helpers


def link_class_gbs(gen: int | None, width: int | None) -> float | None:
    """Theoretical GB/s per direction of a PCIe link; None when gen or width is unknown."""
    if not gen or not width or gen not in PCIE_LANE_GBS:
        return None
    return PCIE_LANE_GBS[gen] * width


def format_pci_bus_id(domain: int, bus: int, device: int) -> str:
    """NVML's spelling: "00000000:07:00.0"."""
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


def parse_pci_bus_id(bus_id: str) -> PciKey:
    """"00000000:07:00.0" or "0000:07:00.0" -> (domain, bus, device)."""
    dom, bus, rest = bus_id.strip().split(":")
    dev = rest.split(".")[0]
    return int(dom, 16), int(bus, 16), int(dev, 16)


def cuda_index(name: str) -> int | None:
    """"cuda:1" -> 1, "cuda" -> 0, anything else (cpu, mps...) -> None."""
    name = name.strip().lower()
    if name == "cuda":
        return 0
    if name.startswith("cuda:"):
        try:
            return int(name[5:])
        except ValueError:
            return None
    return None


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _try(fn: Callable[..., Any], *args: Any) -> Any:
    """Call an NVML/CUDA query; None when it fails or is unsupported."""
    try:
        return fn(*args)
    except Exception as exc:  # NVMLError_NotSupported, NoPermission, GpuIsLost, ...
        log.debug("%s%r failed: %s", getattr(fn, "__name__", fn), args, exc)
        return None


# --------------------------------------------------------------------------------------------
# NVML session


def _nvml_init() -> str:
    """Initialise NVML; returns "" on success, else why it is unavailable."""
    if pynvml is None:
        return "NVML unavailable: nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        not_found = getattr(pynvml, "NVMLError_LibraryNotFound", None)
        if isinstance(not_found, type) and isinstance(exc, not_found):
            return f"NVML not found (no NVIDIA driver): {exc}"
        return f"NVML unavailable: {exc}"
    return ""


def _nvml_shutdown() -> None:
    try:
        pynvml.nvmlShutdown()
    except Exception as exc:
        log.debug("nvmlShutdown failed: %s", exc)


def _nvml_handles_by_pci() -> dict[PciKey, Any]:
    """All NVML devices this process may open, keyed by PCI (domain, bus, device)."""
    handles: dict[PciKey, Any] = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            pci = pynvml.nvmlDeviceGetPciInfo(h)
        except Exception as exc:  # e.g. a device hidden by cgroups: NoPermission
            log.debug("NVML device %d skipped: %s", i, exc)
            continue
        handles[(int(pci.domain), int(pci.bus), int(pci.device))] = h
    return handles


def _torch_pci_key(index: int) -> PciKey | None:
    import torch

    props = torch.cuda.get_device_properties(index)
    parts = [getattr(props, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(p is None for p in parts):
        return None
    return int(parts[0]), int(parts[1]), int(parts[2])


def _cuda_reason() -> str:
    """"" when torch sees CUDA devices, else why not."""
    import torch

    if getattr(torch.version, "cuda", None) is None and not torch.cuda.is_available():
        return f"torch {torch.__version__} is built without CUDA"
    try:
        if not torch.cuda.is_available():
            return "CUDA not available (no NVIDIA driver or no GPU visible)"
        if torch.cuda.device_count() == 0:
            return "CUDA reports no devices"
    except Exception as exc:
        return f"CUDA unavailable: {exc}"
    return ""


# --------------------------------------------------------------------------------------------
# discovery


def discover(probe: bool = False) -> Topology:
    """Describe the CUDA devices torch sees, with their PCIe links from NVML.

    probe=True also measures pinned host<->device bandwidth per device (cached per process).
    Never raises for a missing driver or CUDA: the reason is in `Topology.reason`.
    """
    import torch

    reasons: list[str] = []
    nvml_reason = _nvml_init()
    nvml_ok = not nvml_reason
    if nvml_reason:
        reasons.append(nvml_reason)
    try:
        cuda_reason = _cuda_reason()
        if cuda_reason:
            reasons.insert(0, f"no CUDA devices: {cuda_reason}")
            return Topology([], [], nvml_ok, "; ".join(reasons), probe)
        handles = _nvml_handles_by_pci() if nvml_ok else {}
        devices = [_gpu_info(i, handles, nvml_ok, reasons) for i in range(torch.cuda.device_count())]
    finally:
        if nvml_ok:
            _nvml_shutdown()
    peer = _peer_matrix(len(devices))
    if probe:
        for gpu in devices:
            _probe_into(gpu, reasons)
    topo = Topology(devices, peer, nvml_ok, "; ".join(reasons), probe)
    log.debug("discovered %d CUDA device(s); reason=%r", len(devices), topo.reason)
    return topo


def _gpu_info(index: int, handles: dict[PciKey, Any], nvml_ok: bool, reasons: list[str]) -> GpuInfo:
    import torch

    props = torch.cuda.get_device_properties(index)
    key = _torch_pci_key(index)
    gpu = GpuInfo(
        index=index,
        torch_name=f"cuda:{index}",
        name=_text(getattr(props, "name", "?")),
        pci_bus_id=format_pci_bus_id(*key) if key else "",
        vram_total=getattr(props, "total_memory", None),
    )
    handle = handles.get(key) if key else None
    if handle is not None:
        _fill_from_nvml(gpu, handle)
        return gpu
    if nvml_ok:
        why = "torch gives no PCI id" if key is None else f"no NVML device at PCI {gpu.pci_bus_id}"
        reasons.append(f"{gpu.torch_name}: {why}")
    free_total = _try(torch.cuda.mem_get_info, index)
    if free_total is not None:
        gpu.vram_free = int(free_total[0])
    return gpu


def _fill_from_nvml(gpu: GpuInfo, h: Any) -> None:
    gpu.pcie_gen_cur = _try(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h)
    gpu.pcie_width_cur = _try(pynvml.nvmlDeviceGetCurrPcieLinkWidth, h)
    gpu.pcie_gen_max = _try(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h)
    gpu.pcie_width_max = _try(pynvml.nvmlDeviceGetMaxPcieLinkWidth, h)
    gpu.gpu_gen_max = _try(pynvml.nvmlDeviceGetGpuMaxPcieLinkGeneration, h)
    gpu.link_class_gbs = link_class_gbs(gpu.pcie_gen_max, gpu.pcie_width_max)
    gpu.driver_model = driver_model_name(_try(pynvml.nvmlDeviceGetDriverModel, h))
    mem = _try(pynvml.nvmlDeviceGetMemoryInfo, h)
    if mem is not None:
        gpu.vram_free = int(mem.free)
        if gpu.vram_total is None:
            gpu.vram_total = int(mem.total)
    if gpu.name in ("", "?"):
        nvml_name = _try(pynvml.nvmlDeviceGetName, h)
        gpu.name = _text(nvml_name) if nvml_name is not None else gpu.name


# --------------------------------------------------------------------------------------------
# Windows driver models and what follows from them

# NVML's nvmlDriverModel_t: WDDM (a display driver; the OS schedules the GPU and its memory), WDM
# (shown as TCC, the compute-only driver), MCDM (the compute driver model of newer Windows)
_DRIVER_MODELS = {0: "WDDM", 1: "TCC", 2: "MCDM"}
# seed 004: with two CUDA contexts under WDDM, page-locking stopped at about 22 GiB
WDDM_PIN_CEILING_GIB = 22.0


def driver_model_name(value: Any) -> str:
    """NVML's (current, pending) driver model, or the current one alone, as WDDM/TCC/MCDM; "n/a"
    when NVML has no answer (every driver off Windows: the query is not supported there)."""
    if isinstance(value, (tuple, list)):
        value = value[0] if value else None
    if value is None:
        return "n/a"
    return _DRIVER_MODELS.get(int(value), f"unknown ({value})")


def wddm_pin_cap(topo: Topology, n_contexts: int | None = None) -> tuple[int | None, str]:
    """(bytes, why) the auto pin limit is capped at, or (None, "") when nothing caps it.

    Two or more CUDA contexts on WDDM GPUs (seed 004: ~22 GiB page-locked at most, then
    cudaHostRegister failed)."""
    wddm = [g for g in topo.devices if g.driver_model == "WDDM"]
    n = len(wddm) if n_contexts is None else min(n_contexts, len(wddm))
    if n < 2:
        return None, ""
    return int(WDDM_PIN_CEILING_GIB * (1 << 30)), (
        f"auto capped at {WDDM_PIN_CEILING_GIB:g} GiB: {n} GPUs under WDDM (seed 004 measured a "
        f"~{WDDM_PIN_CEILING_GIB:g} GiB page-locking ceiling with two contexts)")


def driver_facts(topo: Topology) -> list[str]:
    """What the driver models and peer access mean for a run, one sentence each."""
    facts = []
    models = {g.driver_model for g in topo.devices}
    if "WDDM" in models:
        names = ", ".join(g.torch_name for g in topo.devices if g.driver_model == "WDDM")
        facts.append(f"{names} under WDDM: the OS schedules GPU memory, and peer access between WDDM GPUs is "
                     "usually off.")
    n = len(topo.devices)
    off = [(a, b) for a in range(n) for b in range(n) if a < b and topo.peer and
           not (topo.peer[a][b] and topo.peer[b][a])]
    if off:
        pairs = ", ".join(f"{topo.devices[a].torch_name}↔{topo.devices[b].torch_name}" for a, b in off)
        facts.append(f"Peer access off ({pairs}): hand-offs between those GPUs are host-staged (device → pinned "
                     "host buffer → device), chosen per stage pair when the session starts.")
    cap, why = wddm_pin_cap(topo)
    if cap is not None:
        facts.append(f"Pin limit {why}.")
    return facts


def _peer_matrix(n: int) -> list[list[bool]]:
    """peer[i][j]: device i can access device j directly. The diagonal is True (same device)."""
    import torch

    peer = [[i == j for j in range(n)] for i in range(n)]
    for i in range(n):
        for j in range(n):
            if i != j:
                peer[i][j] = bool(_try(torch.cuda.can_device_access_peer, i, j))
    return peer


def _probe_into(gpu: GpuInfo, reasons: list[str]) -> None:
    try:
        gpu.h2d_gbs, gpu.d2h_gbs = probe_bandwidth(gpu.index)
    except Exception as exc:
        log.warning("bandwidth probe failed on %s: %s", gpu.torch_name, exc)
        reasons.append(f"bandwidth probe failed on {gpu.torch_name}: {exc}")


# --------------------------------------------------------------------------------------------
# bandwidth probe

_probe_cache: dict[tuple[int, int], tuple[float, float]] = {}
_probe_lock = threading.Lock()


def probe_bandwidth(device_index: int, nbytes: int = DEFAULT_PROBE_BYTES) -> tuple[float, float]:
    """Measured (h2d_gbs, d2h_gbs) between pinned host memory and one device, best of 3.

    Timed with CUDA events on a side stream. Cached per process and (device, nbytes): a second
    call returns the first result without touching the device.
    """
    key = (device_index, nbytes)
    with _probe_lock:
        if key not in _probe_cache:
            _probe_cache[key] = _measure_bandwidth(device_index, nbytes)
            log.info("%s pinned bandwidth: H2D %.1f GB/s, D2H %.1f GB/s (%d MiB)",
                     f"cuda:{device_index}", *_probe_cache[key], nbytes >> 20)
        return _probe_cache[key]


def clear_probe_cache() -> None:
    with _probe_lock:
        _probe_cache.clear()


def _measure_bandwidth(device_index: int, nbytes: int, reps: int = 3) -> tuple[float, float]:
    import torch

    dev = torch.device("cuda", device_index)
    with torch.cuda.device(dev):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        stream = torch.cuda.Stream(dev)
        with torch.cuda.stream(stream):
            h2d = _best_copy_gbs(lambda: buf.copy_(host, non_blocking=True), stream, nbytes, reps)
            d2h = _best_copy_gbs(lambda: host.copy_(buf, non_blocking=True), stream, nbytes, reps)
        buf = host = None  # noqa: F841  (freed before the cache is emptied)
        torch.cuda.empty_cache()  # give the probe's VRAM back before caches are sized
    return h2d, d2h


def _best_copy_gbs(copy: Callable[[], Any], stream: Any, nbytes: int, reps: int) -> float:
    import torch

    copy()  # warm-up: first touch, DMA mapping
    stream.synchronize()
    best_ms = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        copy()
        end.record(stream)
        end.synchronize()
        best_ms = min(best_ms, start.elapsed_time(end))
    if not best_ms > 0:
        raise RuntimeError(f"copy of {nbytes} bytes timed at {best_ms} ms")
    return nbytes / (best_ms / 1e3) / 1e9


# --------------------------------------------------------------------------------------------
# ordering


def order_devices(devices: list[str], mode: str, topo: Topology | None = None) -> OrderResult:
    """Order the split's devices: "configured" keeps them, "pcie" puts the widest link first.

    "pcie" ranks CUDA devices by measured H2D bandwidth when the topology was probed, else by link
    class; ties keep the configured order. CUDA entries are reordered among the positions they
    occupy; "cpu" and other non-CUDA entries stay where they are. Any missing information (NVML
    unavailable, probe failed, device unknown) keeps the configured order, logged with the reason.
    topo None: `discover()` is called (no probe).
    """
    norm = mode.strip().lower() if isinstance(mode, str) else mode
    if norm not in GPU_ORDER_MODES:
        raise ValueError(
            f"invalid gpu_order={mode!r} (STRATA_GPU_ORDER / --gpu-order): "
            f"allowed {' or '.join(repr(m) for m in GPU_ORDER_MODES)}"
        )
    devices = list(devices)
    if norm == "configured":
        return OrderResult(devices, False, "gpu_order=configured: configured order kept")
    slots = [i for i, d in enumerate(devices) if cuda_index(d) is not None]
    if len(slots) < 2:
        return OrderResult(devices, False, "gpu_order=pcie: fewer than two CUDA devices, nothing to order")
    if topo is None:
        topo = discover()
    cuda_names = [devices[i] for i in slots]
    ranking = _ranking(cuda_names, topo)
    if isinstance(ranking, str):
        reason = f"gpu_order=pcie: configured order kept: {ranking}"
        log.warning("%s", reason)
        return OrderResult(devices, False, reason)
    metric, by = ranking
    ranked = sorted(cuda_names, key=lambda d: -metric[d])  # stable: ties keep configured order
    if ranked == cuda_names:
        reason = f"gpu_order=pcie: configured order is already widest first (by {by})"
        log.debug("%s", reason)
        return OrderResult(devices, False, reason)
    result = list(devices)
    for slot, name in zip(slots, ranked):
        result[slot] = name
    moves = _describe_moves(cuda_names, ranked, metric, topo)
    reason = f"gpu_order=pcie: reordered by {by}, widest first: {moves}; order {', '.join(result)}"
    log.info("%s", reason)
    return OrderResult(result, True, reason)


def split_order(devices: list[str], gpu_order: str) -> tuple[list[str], str]:
    """A split's device order from its `gpu_order` setting and why (never raises: a PCIe probe
    that fails keeps the configured order and says so).  Two or more distinct GPUs are ordered
    by `order_devices`; a device named twice (two stages on one GPU) keeps the configured order."""
    cudas = [d for d in devices if d.startswith("cuda")]
    if gpu_order != "pcie" or len(cudas) < 2 or len(set(devices)) != len(devices):
        return list(devices), ("configured order" if gpu_order == "configured"
                               else "order kept (fewer than two distinct GPUs)")
    try:
        res = order_devices(list(devices), "pcie", discover())
        return list(res.devices), res.reason
    except Exception as exc:  # ordering must never break a run
        reason = f"configured order kept: PCIe probe failed ({exc})"
        log.warning(reason)
        return list(devices), reason


def _ranking(names: list[str], topo: Topology) -> tuple[dict[str, float], str] | str:
    """(metric per device name, what it is) or, when any device lacks it, why not."""
    gpus: dict[str, GpuInfo] = {}
    for name in names:
        gpu = topo.device(cuda_index(name))  # type: ignore[arg-type]
        if gpu is None:
            why = f"{name} not found among {len(topo.devices)} discovered CUDA device(s)"
            return f"{why} ({topo.reason})" if topo.reason else why
        gpus[name] = gpu
    if topo.probed:
        missing = [n for n, g in gpus.items() if g.h2d_gbs is None]
        if missing:
            why = f"bandwidth probe failed for {', '.join(missing)}"
            return f"{why} ({topo.reason})" if topo.reason else why
        return {n: g.h2d_gbs for n, g in gpus.items()}, "measured H2D bandwidth"  # type: ignore[misc]
    missing = [n for n, g in gpus.items() if g.link_class_gbs is None]
    if missing:
        why = f"no PCIe link information for {', '.join(missing)}"
        return f"{why} ({topo.reason})" if topo.reason else why
    return {n: g.link_class_gbs for n, g in gpus.items()}, "PCIe link class"  # type: ignore[misc]


def _describe(name: str, value: float, topo: Topology) -> str:
    gpu = topo.device(cuda_index(name))  # type: ignore[arg-type]
    link = f"Gen{gpu.pcie_gen_max} x{gpu.pcie_width_max}" if gpu and gpu.pcie_gen_max else "link ?"
    return f"{name} ({link}, {value:.1f} GB/s)"


def _describe_moves(before: list[str], after: list[str], metric: dict[str, float], topo: Topology) -> str:
    """"cuda:1 (Gen5 x16, 63.0 GB/s) moved before cuda:0 (Gen4 x4, 7.9 GB/s)" for each overtake."""
    parts = []
    for pos, name in enumerate(after):
        overtaken = [o for o in after[pos + 1:] if before.index(o) < before.index(name)]
        if overtaken:
            others = ", ".join(_describe(o, metric[o], topo) for o in overtaken)
            parts.append(f"{_describe(name, metric[name], topo)} moved before {others}")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# telemetry


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU (NVML's compute and graphics processes), as nvitop lists it."""

    gpu: int  # torch index
    pid: int
    name: str  # the executable's name ("" when it cannot be read, e.g. another user's or container's)
    used_bytes: int | None  # None: NVML does not say (e.g. under some virtualisation)


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def gpu_processes(topo: Topology) -> tuple[list[GpuProcess], str]:
    """The processes on the topology's GPUs and their memory, and "" or why there is no list."""
    if not topo.devices:
        return [], f"no GPUs ({topo.reason})" if topo.reason else "no GPUs"
    why = _nvml_init()
    if why:
        return [], why
    out: list[GpuProcess] = []
    try:
        by_pci = _nvml_handles_by_pci()
        for g in topo.devices:
            h = by_pci.get(_safe_parse(g.pci_bus_id))
            if h is None:
                continue
            seen: set[int] = set()
            for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                for p in _try(getattr(pynvml, fn, lambda _h: []), h) or []:
                    if p.pid in seen:
                        continue
                    seen.add(p.pid)
                    used = getattr(p, "usedGpuMemory", None)
                    out.append(GpuProcess(g.index, int(p.pid), _process_name(int(p.pid)),
                                          int(used) if isinstance(used, int) and used >= 0 else None))
    except Exception as exc:
        return out, f"NVML process list failed: {exc}"
    finally:
        _nvml_shutdown()
    return out, ""


class TelemetrySampler:
    """Background reader of per-GPU NVML telemetry into bounded ring buffers.

    Give it torch device indices or a Topology. Samples are stamped with time.perf_counter_ns(),
    the clock of the engine's stage events. Without NVML (or without any device it can match by
    PCI) it is `available == False`, says why in `reason`, and `start()` starts no thread.
    """

    def __init__(self, devices: Topology | Iterable[int], interval_s: float = 0.2,
                 capacity: int = 3000) -> None:
        if interval_s <= 0:
            raise ValueError(f"telemetry interval_s must be > 0, got {interval_s!r}")
        self.interval_s = interval_s
        self.capacity = capacity
        self._targets, setup_reason = self._resolve_targets(devices)
        self._buffers: dict[int, collections.deque[TelemetrySample]] = {
            i: collections.deque(maxlen=capacity) for i in self._targets
        }
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed: set[tuple[int, str]] = set()
        self.available, self.reason = self._check_available(setup_reason)

    # -- setup

    @staticmethod
    def _resolve_targets(devices: Topology | Iterable[int]) -> tuple[dict[int, PciKey | None], str]:
        """torch index -> PCI key, and why there is nothing to sample ("" when there is)."""
        if isinstance(devices, Topology):
            if not devices.devices:
                return {}, f"no GPUs ({devices.reason})" if devices.reason else "no GPUs"
            return {g.index: _safe_parse(g.pci_bus_id) for g in devices.devices}, ""
        targets = {int(i): _try(_torch_pci_key, int(i)) for i in devices}
        return targets, "" if targets else "no GPUs given"

    def _check_available(self, setup_reason: str) -> tuple[bool, str]:
        why = _nvml_init()
        if why:
            return False, f"unavailable: {why}"
        if setup_reason:
            _nvml_shutdown()
            return False, f"unavailable: {setup_reason}"
        try:
            handles = self._match_handles()
        except Exception as exc:
            return False, f"unavailable: NVML device enumeration failed: {exc}"
        finally:
            _nvml_shutdown()
        unmatched = [f"cuda:{i}" for i in self._targets if i not in handles]
        if not handles:
            return False, f"unavailable: no NVML device matches {', '.join(unmatched)} by PCI id"
        if unmatched:
            return True, f"partial: no NVML device matches {', '.join(unmatched)} by PCI id"
        return True, ""

    def _match_handles(self) -> dict[int, Any]:
        by_pci = _nvml_handles_by_pci()
        return {i: by_pci[k] for i, k in self._targets.items() if k is not None and k in by_pci}

    # -- lifecycle

    def start(self) -> None:
        """Start sampling; a no-op when unavailable or already running."""
        if not self.available:
            log.info("GPU telemetry %s", self.reason)
            return
        if self._thread is not None and self._thread.is_alive():
            return
        why = _nvml_init()
        if why:
            self.available, self.reason = False, f"unavailable: {why}"
            log.warning("GPU telemetry %s", self.reason)
            return
        try:
            handles = self._match_handles()
        except Exception as exc:
            _nvml_shutdown()
            self.available, self.reason = False, f"unavailable: NVML device enumeration failed: {exc}"
            log.warning("GPU telemetry %s", self.reason)
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(handles,), name="strata-telemetry",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop and join the thread; safe to call any number of times."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning("GPU telemetry thread did not stop within %.1f s", timeout_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> TelemetrySampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- data

    def samples(self, gpu: int | None = None, since_ns: int | None = None) -> list[TelemetrySample]:
        """Buffered samples in time order; optionally one GPU only and/or newer than since_ns."""
        with self._lock:
            bufs = [self._buffers[gpu]] if gpu is not None else list(self._buffers.values())
            out = [s for b in bufs for s in b if since_ns is None or s.t_ns > since_ns]
        out.sort(key=lambda s: s.t_ns)
        return out

    def clear(self) -> None:
        with self._lock:
            for b in self._buffers.values():
                b.clear()

    # -- the thread

    def _run(self, handles: dict[int, Any]) -> None:
        try:
            next_t = time.perf_counter()
            while not self._stop.is_set():
                for gpu, h in handles.items():
                    self._record(self._read(gpu, h))
                next_t += self.interval_s
                now = time.perf_counter()
                if next_t < now:  # fell behind (slow NVML calls): don't burst to catch up
                    next_t = now
                self._stop.wait(next_t - now)
        finally:
            _nvml_shutdown()

    def _record(self, sample: TelemetrySample) -> None:
        with self._lock:
            self._buffers[sample.gpu].append(sample)

    def _read(self, gpu: int, h: Any) -> TelemetrySample:
        t0 = time.perf_counter_ns()
        util = self._call(gpu, "util", pynvml.nvmlDeviceGetUtilizationRates, h)
        mem = self._call(gpu, "mem", pynvml.nvmlDeviceGetMemoryInfo, h)
        tx = self._call(gpu, "pcie_tx", pynvml.nvmlDeviceGetPcieThroughput, h,
                        pynvml.NVML_PCIE_UTIL_TX_BYTES)
        rx = self._call(gpu, "pcie_rx", pynvml.nvmlDeviceGetPcieThroughput, h,
                        pynvml.NVML_PCIE_UTIL_RX_BYTES)
        sm = self._call(gpu, "sm_clock", pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM)
        power = self._call(gpu, "power", pynvml.nvmlDeviceGetPowerUsage, h)
        temp = self._call(gpu, "temp", pynvml.nvmlDeviceGetTemperature, h,
                          pynvml.NVML_TEMPERATURE_GPU)
        t1 = time.perf_counter_ns()
        return TelemetrySample(
            t_ns=(t0 + t1) // 2,  # the throughput counters cover a ~20 ms window inside the reads
            gpu=gpu,
            util_pct=_attr_int(util, "gpu"),
            mem_used=_attr_int(mem, "used"),
            pcie_tx_gbs=tx * 1e3 / 1e9 if tx is not None else None,  # KB/s -> GB/s
            pcie_rx_gbs=rx * 1e3 / 1e9 if rx is not None else None,
            sm_clock_mhz=int(sm) if sm is not None else None,
            power_w=power / 1e3 if power is not None else None,  # mW -> W
            temp_c=int(temp) if temp is not None else None,
        )

    def _call(self, gpu: int, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML query; a failure gives None and is logged once per (gpu, what)."""
        try:
            return fn(*args)
        except Exception as exc:
            if (gpu, what) not in self._failed:
                self._failed.add((gpu, what))
                log.info("telemetry cuda:%d %s unavailable: %s", gpu, what, exc)
            return None


def _attr_int(obj: Any, name: str) -> int | None:
    value = getattr(obj, name, None) if obj is not None else None
    return int(value) if value is not None else None


def _safe_parse(bus_id: str) -> PciKey | None:
    try:
        return parse_pci_bus_id(bus_id)
    except (ValueError, AttributeError):
        return None


# --------------------------------------------------------------------------------------------
# rendering

_GIB = float(1 << 30)


def render_devices(topo: Topology, fmt: str = "md") -> str:
    """The devices as a markdown table plus the peer matrix (fmt="md"), or JSON (fmt="json")."""
    if fmt == "json":
        return json.dumps(dataclasses.asdict(topo), indent=2)
    if fmt != "md":
        raise ValueError(f"render_devices: invalid fmt={fmt!r}: allowed 'md' or 'json'")
    if not topo.devices:
        return f"No CUDA GPUs found; stages run on the CPU.\n\nReason: {topo.reason or 'unknown'}\n"
    lines = list(_device_table(topo.devices))
    lines += ["", "Peer access (row can access column):", ""]
    lines += list(_peer_table(topo))
    if topo.reason:
        lines += ["", f"Note: {topo.reason}"]
    return "\n".join(lines) + "\n"


def _device_table(devices: list[GpuInfo]) -> Iterator[str]:
    yield ("| # | name | PCI bus | VRAM total/free GiB | PCIe cur | PCIe max | link class GB/s "
           "| H2D GB/s | D2H GB/s |")
    yield "|---|---|---|---:|---|---|---:|---:|---:|"
    for g in devices:
        vram = f"{_num(g.vram_total, _GIB)} / {_num(g.vram_free, _GIB)}"
        yield (f"| {g.torch_name} | {g.name} | {g.pci_bus_id or '—'} | {vram} "
               f"| {_link(g.pcie_gen_cur, g.pcie_width_cur)} | {_link(g.pcie_gen_max, g.pcie_width_max)} "
               f"| {_num(g.link_class_gbs)} | {_num(g.h2d_gbs)} | {_num(g.d2h_gbs)} |")


def _peer_table(topo: Topology) -> Iterator[str]:
    names = [g.torch_name for g in topo.devices]
    yield "| | " + " | ".join(names) + " |"
    yield "|---|" + "---|" * len(names)
    for i, row_name in enumerate(names):
        row = topo.peer[i] if i < len(topo.peer) else []
        cells = ["—" if i == j else ("yes" if j < len(row) and row[j] else "no")
                 for j in range(len(names))]
        yield f"| {row_name} | " + " | ".join(cells) + " |"


def _num(value: float | None, scale: float = 1.0) -> str:
    return "—" if value is None else f"{value / scale:.1f}"


def _link(gen: int | None, width: int | None) -> str:
    return "—" if gen is None or width is None else f"Gen{gen} x{width}"
