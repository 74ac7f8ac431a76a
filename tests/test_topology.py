"""engine.hw.topology on a machine without a GPU: fake NVML and fake torch.cuda through monkeypatch,
plus the real pynvml/torch of this machine for the no-driver path."""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml
import pytest
import torch

from engine.hw import topology
from engine.hw.topology import GpuInfo, OrderResult, TelemetrySampler, Topology

GIB = 1 << 30


# --------------------------------------------------------------------------------------------
# fakes


def _not_supported() -> pynvml.NVMLError:
    return pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


@dataclass
class FakeNvmlDevice:
    domain: int
    bus: int
    device: int
    name: str = "Fake GPU"
    gen_cur: int = 4
    width_cur: int = 16
    gen_max: int = 4
    width_max: int = 16
    gpu_gen_max: int | None = 4  # None: NotSupported
    mem_total: int = 24 * GIB
    mem_free: int = 20 * GIB
    util: int = 50
    tx_kbs: int = 1_000_000  # KB/s
    rx_kbs: int = 2_000_000
    sm_mhz: int = 1800
    power_mw: int | None = 250_000  # None: NotSupported
    temp: int = 60
    fail_throughput_every: int = 0  # raise RuntimeError on every n-th throughput call
    calls: int = 0
    driver_model: int | None = None  # NVML_DRIVER_WDDM / _WDM (TCC) / _MCDM; None: NotSupported (Linux)


class FakeNvml:
    """Replaces the pynvml functions engine.hw.topology uses; counts init/shutdown balance."""

    def __init__(self, devices: list[FakeNvmlDevice]) -> None:
        self.devices = devices
        self.refcount = 0
        self.reads = 0

    def install(self, mp: pytest.MonkeyPatch) -> FakeNvml:
        for name in dir(self):
            if name.startswith("nvml"):
                mp.setattr(pynvml, name, getattr(self, name))
        return self

    def _live(self) -> None:
        if self.refcount <= 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def nvmlInit(self) -> None:
        self.refcount += 1

    def nvmlShutdown(self) -> None:
        self._live()
        self.refcount -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._live()
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeNvmlDevice:
        self._live()
        return self.devices[i]

    def nvmlDeviceGetPciInfo(self, h: FakeNvmlDevice) -> SimpleNamespace:
        bus_id = f"{h.domain:08X}:{h.bus:02X}:{h.device:02X}.0"
        return SimpleNamespace(domain=h.domain, bus=h.bus, device=h.device, busId=bus_id)

    def nvmlDeviceGetName(self, h: FakeNvmlDevice) -> str:
        return h.name

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: FakeNvmlDevice) -> int:
        return h.gen_cur

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: FakeNvmlDevice) -> int:
        return h.width_cur

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: FakeNvmlDevice) -> int:
        return h.gen_max

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: FakeNvmlDevice) -> int:
        return h.width_max

    def nvmlDeviceGetGpuMaxPcieLinkGeneration(self, h: FakeNvmlDevice) -> int:
        if h.gpu_gen_max is None:
            raise _not_supported()
        return h.gpu_gen_max

    def nvmlDeviceGetDriverModel(self, h: FakeNvmlDevice) -> tuple[int, int]:
        if h.driver_model is None:
            raise _not_supported()
        return h.driver_model, h.driver_model

    def nvmlDeviceGetMemoryInfo(self, h: FakeNvmlDevice) -> SimpleNamespace:
        self._live()
        return SimpleNamespace(total=h.mem_total, free=h.mem_free, used=h.mem_total - h.mem_free)

    def nvmlDeviceGetUtilizationRates(self, h: FakeNvmlDevice) -> SimpleNamespace:
        self._live()
        self.reads += 1
        return SimpleNamespace(gpu=h.util, memory=10)

    def nvmlDeviceGetPcieThroughput(self, h: FakeNvmlDevice, counter: int) -> int:
        h.calls += 1
        if h.fail_throughput_every and h.calls % h.fail_throughput_every == 0:
            raise RuntimeError("driver hiccup")
        return h.tx_kbs if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else h.rx_kbs

    def nvmlDeviceGetClockInfo(self, h: FakeNvmlDevice, clock: int) -> int:
        assert clock == pynvml.NVML_CLOCK_SM
        return h.sm_mhz

    def nvmlDeviceGetPowerUsage(self, h: FakeNvmlDevice) -> int:
        if h.power_mw is None:
            raise _not_supported()
        return h.power_mw

    def nvmlDeviceGetTemperature(self, h: FakeNvmlDevice, sensor: int) -> int:
        return h.temp


@dataclass
class FakeCuda:
    """torch.cuda as seen by topology: devices in torch's order, by PCI id."""

    props: list[SimpleNamespace]
    peer: set[tuple[int, int]] = field(default_factory=set)
    free: int = 11 * GIB

    def install(self, mp: pytest.MonkeyPatch) -> FakeCuda:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "device_count", lambda: len(self.props))
        mp.setattr(torch.cuda, "get_device_properties", lambda i: self.props[i])
        mp.setattr(torch.cuda, "can_device_access_peer", lambda i, j: (i, j) in self.peer)
        mp.setattr(torch.cuda, "mem_get_info", lambda i: (self.free, self.props[i].total_memory))
        return self


def cuda_props(name: str, domain: int, bus: int, device: int, total: int = 24 * GIB) -> SimpleNamespace:
    return SimpleNamespace(name=name, total_memory=total, pci_domain_id=domain, pci_bus_id=bus,
                           pci_device_id=device)


def gpu(index: int, gen: int | None, width: int | None, **kw) -> GpuInfo:
    """A GpuInfo as discover() would build it from a link of max gen x width."""
    base = dict(index=index, torch_name=f"cuda:{index}", name=f"GPU{index}",
                pci_bus_id=f"00000000:{index + 1:02X}:00.0", vram_total=24 * GIB, vram_free=20 * GIB,
                pcie_gen_cur=gen, pcie_width_cur=width, pcie_gen_max=gen, pcie_width_max=width,
                gpu_gen_max=gen, link_class_gbs=topology.link_class_gbs(gen, width))
    base.update(kw)
    return GpuInfo(**base)


def topo_of(*gpus: GpuInfo, probed: bool = False, reason: str = "") -> Topology:
    n = len(gpus)
    peer = [[i == j for j in range(n)] for i in range(n)]
    return Topology(list(gpus), peer, nvml_ok=True, reason=reason, probed=probed)


@pytest.fixture(autouse=True)
def _fresh_probe_cache():
    topology.clear_probe_cache()
    yield
    topology.clear_probe_cache()


@pytest.fixture
def two_gpus_swapped(monkeypatch):
    """NVML index 0 is bus 7 (Gen5 x16); torch cuda:0 is bus 6 (Gen4 x4, a TB enclosure)."""
    nvml = FakeNvml([
        FakeNvmlDevice(0, 7, 0, name="Fast", gen_cur=5, gen_max=5, width_cur=16, width_max=16,
                       gpu_gen_max=5, mem_total=80 * GIB, mem_free=30 * GIB, util=77),
        FakeNvmlDevice(0, 6, 0, name="Slow", gen_cur=4, gen_max=4, width_cur=4, width_max=4,
                       gpu_gen_max=None, mem_free=5 * GIB, util=66, power_mw=None),
    ]).install(monkeypatch)
    cuda = FakeCuda([cuda_props("Slow", 0, 6, 0), cuda_props("Fast", 0, 7, 0)],
                    peer={(0, 1)}).install(monkeypatch)
    return nvml, cuda


# --------------------------------------------------------------------------------------------
# (a) mapping by PCI id, never by index


def test_discover_maps_by_pci_bus_not_index(two_gpus_swapped):
    nvml, _ = two_gpus_swapped
    topo = topology.discover()
    assert topo.nvml_ok and topo.reason == ""
    slow, fast = topo.devices
    assert (slow.torch_name, slow.name, slow.pci_bus_id) == ("cuda:0", "Slow", "00000000:06:00.0")
    assert (slow.pcie_gen_max, slow.pcie_width_max, slow.pcie_width_cur) == (4, 4, 4)
    assert slow.link_class_gbs == pytest.approx(4 * 1.969)
    assert slow.gpu_gen_max is None  # NotSupported -> None, not a crash
    assert slow.vram_free == 5 * GIB
    assert (fast.torch_name, fast.pci_bus_id, fast.pcie_gen_max, fast.pcie_width_max) == (
        "cuda:1", "00000000:07:00.0", 5, 16)
    assert fast.link_class_gbs == pytest.approx(16 * 3.938)
    assert fast.vram_free == 30 * GIB and fast.vram_total == 24 * GIB
    assert fast.h2d_gbs is None and fast.d2h_gbs is None  # not probed
    assert topo.peer == [[True, True], [False, True]]
    assert nvml.refcount == 0  # every nvmlInit was paired with nvmlShutdown


def test_discover_matches_on_pci_device_id_as_in_firecracker_vm(monkeypatch):
    # docs/design.md: H200 VM, both on bus 0, told apart only by PCI device 6 / 7; NVML lists 7 first.
    FakeNvml([FakeNvmlDevice(0, 0, 7, gen_max=5, width_max=16),
              FakeNvmlDevice(0, 0, 6, gen_max=3, width_max=8)]).install(monkeypatch)
    FakeCuda([cuda_props("H200", 0, 0, 6), cuda_props("H200", 0, 0, 7)]).install(monkeypatch)
    topo = topology.discover()
    assert [d.pci_bus_id for d in topo.devices] == ["00000000:00:06.0", "00000000:00:07.0"]
    assert [(d.pcie_gen_max, d.pcie_width_max) for d in topo.devices] == [(3, 8), (5, 16)]


def test_cuda_device_without_nvml_match_has_no_link_figures(monkeypatch):
    FakeNvml([FakeNvmlDevice(0, 7, 0, gen_max=5, width_max=16)]).install(monkeypatch)
    FakeCuda([cuda_props("A", 0, 6, 0), cuda_props("B", 0, 7, 0)]).install(monkeypatch)
    topo = topology.discover()
    assert topo.devices[0].link_class_gbs is None and topo.devices[0].pcie_gen_max is None
    assert topo.devices[0].vram_free == 11 * GIB  # from torch.cuda.mem_get_info instead
    assert topo.devices[1].link_class_gbs == pytest.approx(63.008)
    assert "cuda:0" in topo.reason and "00000000:06:00.0" in topo.reason


def test_cuda_without_nvml_lists_devices_with_reason(monkeypatch):
    def no_lib():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_lib)
    FakeCuda([cuda_props("A", 0, 6, 0), cuda_props("B", 0, 7, 0)]).install(monkeypatch)
    topo = topology.discover()
    assert not topo.nvml_ok
    assert "NVML not found" in topo.reason
    assert [d.torch_name for d in topo.devices] == ["cuda:0", "cuda:1"]
    assert all(d.pcie_gen_max is None and d.link_class_gbs is None for d in topo.devices)
    assert topo.devices[1].vram_free == 11 * GIB


# --------------------------------------------------------------------------------------------
# (b) idle links downshift: class by max


def test_idle_downshifted_link_is_classed_by_its_max(monkeypatch):
    FakeNvml([FakeNvmlDevice(0, 1, 0, gen_cur=1, gen_max=5, width_cur=16, width_max=16)]
             ).install(monkeypatch)
    FakeCuda([cuda_props("Idle", 0, 1, 0)]).install(monkeypatch)
    (g,) = topology.discover().devices
    assert (g.pcie_gen_cur, g.pcie_gen_max) == (1, 5)
    assert g.link_class_gbs == pytest.approx(63.0, abs=0.05)
    assert topology.link_class_gbs(g.pcie_gen_cur, g.pcie_width_cur) == pytest.approx(4.0)


def test_link_class_table():
    assert topology.link_class_gbs(4, 4) == pytest.approx(7.876)
    assert topology.link_class_gbs(3, 16) == pytest.approx(15.76)
    assert topology.link_class_gbs(6, 16) == pytest.approx(121.008)
    assert topology.link_class_gbs(None, 16) is None
    assert topology.link_class_gbs(9, 16) is None  # unknown generation: no guess


# --------------------------------------------------------------------------------------------
# (c) missing information keeps the configured order, with the reason


def test_missing_link_info_keeps_configured_order(caplog):
    topo = topo_of(gpu(0, 4, 4), gpu(1, None, None), reason="cuda:1: no NVML device at PCI x")
    with caplog.at_level(logging.INFO, logger="engine.hw.topology"):
        res = topology.order_devices(["cuda:0", "cuda:1"], "pcie", topo)
    assert res == OrderResult(["cuda:0", "cuda:1"], False, res.reason)
    assert "no PCIe link information for cuda:1" in res.reason
    assert "configured order kept" in caplog.text and "cuda:1" in caplog.text
    assert any(r.levelno == logging.WARNING for r in caplog.records)


def test_failed_probe_keeps_configured_order_even_if_link_classes_differ(monkeypatch, caplog):
    FakeNvml([FakeNvmlDevice(0, 6, 0, gen_max=4, width_max=4),
              FakeNvmlDevice(0, 7, 0, gen_max=5, width_max=16)]).install(monkeypatch)
    FakeCuda([cuda_props("Slow", 0, 6, 0), cuda_props("Fast", 0, 7, 0)]).install(monkeypatch)

    def measure(index, nbytes):
        if index == 1:
            raise RuntimeError("cudaHostAlloc failed")
        return 5.3, 5.1

    monkeypatch.setattr(topology, "_measure_bandwidth", measure)
    with caplog.at_level(logging.INFO, logger="engine.hw.topology"):
        topo = topology.discover(probe=True)
        res = topology.order_devices(["cuda:0", "cuda:1"], "pcie", topo)
    assert topo.probed and topo.devices[0].h2d_gbs == 5.3 and topo.devices[1].h2d_gbs is None
    assert "bandwidth probe failed on cuda:1: cudaHostAlloc failed" in topo.reason
    assert res.devices == ["cuda:0", "cuda:1"] and not res.reordered
    assert "bandwidth probe failed for cuda:1" in res.reason
    assert "configured order kept" in caplog.text and "cudaHostAlloc failed" in caplog.text


def test_no_topology_without_driver_keeps_configured_order(monkeypatch, caplog):
    def no_lib():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_lib)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="engine.hw.topology"):
        res = topology.order_devices(["cuda:1", "cuda:0"], "pcie", None)  # discovers: no driver
    assert res.devices == ["cuda:1", "cuda:0"] and not res.reordered
    assert "cuda:1 not found" in res.reason and "NVML not found" in res.reason
    assert res.reason in caplog.text


# --------------------------------------------------------------------------------------------
# (d) pcie ordering: widest first, stable, logged


def test_slower_link_is_moved_behind_faster_and_logged(caplog):
    topo = topo_of(gpu(0, 4, 4), gpu(1, 5, 16))
    with caplog.at_level(logging.INFO, logger="engine.hw.topology"):
        res = topology.order_devices(["cuda:0", "cuda:1"], "pcie", topo)
    assert res.devices == ["cuda:1", "cuda:0"] and res.reordered
    msg = "cuda:1 (Gen5 x16, 63.0 GB/s) moved before cuda:0 (Gen4 x4, 7.9 GB/s)"
    assert msg in res.reason
    assert msg in caplog.text and "link class" in caplog.text


def test_ties_keep_configured_order():
    topo = topo_of(gpu(0, 4, 16), gpu(1, 5, 16), gpu(2, 4, 16))
    res = topology.order_devices(["cuda:2", "cuda:0", "cuda:1"], "pcie", topo)
    assert res.devices == ["cuda:1", "cuda:2", "cuda:0"]
    res = topology.order_devices(["cuda:2", "cuda:0"], "pcie", topo)
    assert res.devices == ["cuda:2", "cuda:0"] and not res.reordered


def test_already_widest_first_is_not_reordered(caplog):
    topo = topo_of(gpu(0, 5, 16), gpu(1, 4, 4))
    with caplog.at_level(logging.INFO, logger="engine.hw.topology"):
        res = topology.order_devices(["cuda:0", "cuda:1"], "pcie", topo)
    assert res.devices == ["cuda:0", "cuda:1"] and not res.reordered
    assert "moved before" not in caplog.text


def test_measured_bandwidth_beats_link_class_when_probed(monkeypatch, caplog):
    # Same link class on paper; measured pinned H2D says cuda:1 is the better main device.
    FakeNvml([FakeNvmlDevice(0, 6, 0, gen_max=5, width_max=8),
              FakeNvmlDevice(0, 7, 0, gen_max=5, width_max=8)]).install(monkeypatch)
    FakeCuda([cuda_props("A", 0, 6, 0), cuda_props("B", 0, 7, 0)]).install(monkeypatch)
    calls = []

    def measure(index, nbytes):
        calls.append(index)
        return {0: (5.3, 5.0), 1: (26.7, 25.0)}[index]

    monkeypatch.setattr(topology, "_measure_bandwidth", measure)
    with caplog.at_level(logging.INFO, logger="engine.hw.topology"):
        topo = topology.discover(probe=True)
        res = topology.order_devices(["cuda:0", "cuda:1"], "pcie", topo)
    assert res.devices == ["cuda:1", "cuda:0"]
    assert "cuda:1 (Gen5 x8, 26.7 GB/s) moved before cuda:0 (Gen5 x8, 5.3 GB/s)" in caplog.text
    assert "measured H2D" in res.reason
    # probe results are cached per process: a second probe does not measure again
    assert topology.probe_bandwidth(1) == (26.7, 25.0)
    assert calls == [0, 1]


def test_cpu_entries_stay_in_place_and_configured_mode_keeps_order():
    topo = topo_of(gpu(0, 4, 4), gpu(1, 5, 16))
    res = topology.order_devices(["cpu", "cuda:0", "cuda:1"], "pcie", topo)
    assert res.devices == ["cpu", "cuda:1", "cuda:0"]
    assert topology.order_devices(["cpu"], "pcie", topo) == OrderResult(
        ["cpu"], False, topology.order_devices(["cpu"], "pcie", topo).reason)
    res = topology.order_devices(["cuda:0", "cuda:1"], "configured", topo)
    assert res.devices == ["cuda:0", "cuda:1"] and not res.reordered


def test_invalid_order_mode_names_setting_value_and_choices():
    with pytest.raises(ValueError) as err:
        topology.order_devices(["cuda:0"], "fastest", None)
    msg = str(err.value)
    for part in ("gpu_order", "STRATA_GPU_ORDER", "'fastest'", "pcie", "configured"):
        assert part in msg


# --------------------------------------------------------------------------------------------
# (e) telemetry sampler with a fake NVML


def _wait_for(pred, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


def test_sampler_collects_and_leaves_no_thread(two_gpus_swapped):
    nvml, _ = two_gpus_swapped
    nvml.devices[0].fail_throughput_every = 3  # an exception now and then must not kill it
    before = set(threading.enumerate())
    t0 = time.perf_counter_ns()
    sampler = TelemetrySampler([0, 1], interval_s=0.01, capacity=1000)
    assert sampler.available and sampler.reason == ""
    sampler.start()
    sampler.start()  # second start: no second thread
    assert len(set(threading.enumerate()) - before) == 1
    _wait_for(lambda: len(sampler.samples(gpu=1)) >= 5)
    sampler.stop()
    sampler.stop()  # idempotent
    t1 = time.perf_counter_ns()
    assert set(threading.enumerate()) == before
    assert nvml.refcount == 0

    samples = sampler.samples()
    stamps = [s.t_ns for s in samples]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    assert t0 < stamps[0] and stamps[-1] < t1  # the perf_counter_ns clock of stage events
    by_gpu = {g: sampler.samples(gpu=g) for g in (0, 1)}
    assert all(len(v) >= 5 for v in by_gpu.values())
    # cuda:0 is bus 6 ("Slow", NVML index 1): matched by PCI id, not by index
    assert {s.util_pct for s in by_gpu[0]} == {66} and {s.util_pct for s in by_gpu[1]} == {77}
    assert {s.power_w for s in by_gpu[0]} == {None}  # NotSupported -> None
    assert {s.power_w for s in by_gpu[1]} == {250.0}  # mW -> W
    fast = by_gpu[1]
    assert any(s.pcie_tx_gbs is None or s.pcie_rx_gbs is None for s in fast)  # hiccups -> None
    assert {s.pcie_tx_gbs for s in fast} - {None} == {1.0}  # 1e6 KB/s -> 1.0 GB/s
    assert {s.pcie_rx_gbs for s in fast} - {None} == {2.0}
    assert {s.mem_used for s in fast} == {50 * GIB}
    assert {(s.sm_clock_mhz, s.temp_c) for s in fast} == {(1800, 60)}
    newer = sampler.samples(since_ns=stamps[len(stamps) // 2])
    assert newer and all(s.t_ns > stamps[len(stamps) // 2] for s in newer)


def test_sampler_ring_buffer_is_bounded_and_context_manager_stops(two_gpus_swapped):
    nvml, _ = two_gpus_swapped
    before = set(threading.enumerate())
    topo = topology.discover()
    with TelemetrySampler(topo, interval_s=0.002, capacity=4) as sampler:
        assert sampler.running
        _wait_for(lambda: nvml.reads >= 20)  # 10+ sweeps over 2 GPUs
    assert not sampler.running and set(threading.enumerate()) == before
    assert len(sampler.samples(gpu=0)) == 4 and len(sampler.samples(gpu=1)) == 4
    assert nvml.refcount == 0


def test_sampler_unavailable_when_no_nvml_device_matches(monkeypatch):
    FakeNvml([FakeNvmlDevice(0, 9, 0)]).install(monkeypatch)
    FakeCuda([cuda_props("A", 0, 6, 0)]).install(monkeypatch)
    sampler = TelemetrySampler([0])
    assert not sampler.available
    assert "cuda:0" in sampler.reason and sampler.reason.startswith("unavailable")


# --------------------------------------------------------------------------------------------
# (f) the real thing on this machine: no NVIDIA driver


def _driver_present() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_driver_present(), reason="an NVIDIA driver is present")
def test_no_driver_gives_no_devices_and_unavailable_sampler():
    before = set(threading.enumerate())
    topo = topology.discover(probe=True)
    assert topo.devices == [] and topo.peer == [] and not topo.nvml_ok
    assert "NVML" in topo.reason and "CUDA" in topo.reason
    for target in (topo, [0]):
        sampler = TelemetrySampler(target)
        assert sampler.available is False
        assert sampler.reason.startswith("unavailable") and "NVML not found" in sampler.reason
        sampler.start()
        assert not sampler.running and sampler.samples() == []
        sampler.stop()
    assert set(threading.enumerate()) == before


# --------------------------------------------------------------------------------------------
# (g) rendering


def test_render_markdown_table_and_peer_matrix():
    topo = topo_of(gpu(0, 5, 16, pcie_gen_cur=1, name="RTX 5090", h2d_gbs=26.7, d2h_gbs=25.04),
                   gpu(1, 4, 4, vram_free=None))
    topo.peer[0][1] = True
    md = topology.render_devices(topo)
    lines = md.splitlines()
    assert lines[0].startswith("| # | name | PCI bus | VRAM total/free GiB | PCIe cur | PCIe max")
    assert "| cuda:0 | RTX 5090 | 00000000:01:00.0 | 24.0 / 20.0 | Gen1 x16 | Gen5 x16 | 63.0 | 26.7 | 25.0 |" in lines
    assert "| cuda:1 | GPU1 | 00000000:02:00.0 | 24.0 / — | Gen4 x4 | Gen4 x4 | 7.9 | — | — |" in lines
    assert "| | cuda:0 | cuda:1 |" in lines
    assert "| cuda:0 | — | yes |" in lines and "| cuda:1 | no | — |" in lines


def test_render_json_roundtrips():
    topo = topo_of(gpu(0, 5, 16), gpu(1, 4, 4))
    data = json.loads(topology.render_devices(topo, fmt="json"))
    assert data == dataclasses.asdict(topo)
    assert data["devices"][1]["link_class_gbs"] == pytest.approx(7.876)
    assert Topology(**{**data, "devices": [GpuInfo(**d) for d in data["devices"]]}) == topo


def test_render_without_gpus_says_so_with_reason():
    md = topology.render_devices(Topology([], [], False, "NVML not found (no NVIDIA driver)"))
    assert "No CUDA GPUs" in md and "NVML not found (no NVIDIA driver)" in md
    with pytest.raises(ValueError, match="fmt"):
        topology.render_devices(Topology(), fmt="html")


def test_a_run_keeps_exactly_the_samples_its_caller_showed(two_gpus_swapped, demo_path):
    """The app's worker hands its sampler to the run: the report (what the history replays)
    holds the very samples the live plot read, not a second sampler's."""
    from engine.config import EngineConfig
    from engine.io import gguf_model
    from engine.io.prompt import synthetic
    from engine.pipeline.session import PipelineHooks, Session

    sampler = TelemetrySampler([0, 1], interval_s=0.005, capacity=10_000)
    sess = Session(gguf_model.load(demo_path), EngineConfig(devices=["cpu"], chunk_tokens=16),
                   hooks=PipelineHooks(after_layer=lambda *a: time.sleep(0.01)))
    res = sess.run(synthetic(64, sess.spec.vocab), 0, sampler=sampler)
    assert not sampler.running  # the run stopped it
    shown = [dataclasses.asdict(s) for s in sampler.samples()]
    assert len(shown) >= 4 and res.report.telemetry == shown and res.report.telemetry_status == "sampled"
    sess.close()


# --------------------------------------------------------------------------------------------
# Windows driver models (WDDM / TCC / MCDM) and what follows from them


def test_driver_model_per_gpu_from_nvml_and_na_off_windows(monkeypatch):
    FakeNvml([
        FakeNvmlDevice(0, 6, 0, name="A", driver_model=pynvml.NVML_DRIVER_WDDM),
        FakeNvmlDevice(0, 7, 0, name="B", driver_model=pynvml.NVML_DRIVER_WDM),
        FakeNvmlDevice(0, 8, 0, name="C", driver_model=pynvml.NVML_DRIVER_MCDM),
        FakeNvmlDevice(0, 9, 0, name="D"),  # Linux: the query is not supported
    ]).install(monkeypatch)
    FakeCuda([cuda_props(n, 0, b, 0) for n, b in (("A", 6), ("B", 7), ("C", 8), ("D", 9))]).install(monkeypatch)
    topo = topology.discover()
    assert [g.driver_model for g in topo.devices] == ["WDDM", "TCC", "MCDM", "n/a"]


def test_two_wddm_gpus_without_peer_access_are_host_staged_and_cap_the_auto_pin_limit(monkeypatch):
    from engine.models import experts

    FakeNvml([FakeNvmlDevice(0, 6, 0, name="A", driver_model=pynvml.NVML_DRIVER_WDDM),
              FakeNvmlDevice(0, 7, 0, name="B", driver_model=pynvml.NVML_DRIVER_WDDM)]).install(monkeypatch)
    FakeCuda([cuda_props("A", 0, 6, 0), cuda_props("B", 0, 7, 0)], peer=set()).install(monkeypatch)
    topo = topology.discover()
    facts = " ".join(topology.driver_facts(topo))
    assert "cuda:0, cuda:1 under WDDM" in facts
    assert "Peer access off (cuda:0↔cuda:1)" in facts and "host-staged" in facts
    assert "capped at 22 GiB" in facts and "seed 004" in facts
    monkeypatch.setattr(experts, "physical_ram", lambda: 128 * GIB)
    limit, why = experts.resolve_pin_limit("auto", 60 * GIB, cuda=True)
    assert limit == 22 * GIB and "2 GPUs under WDDM" in why
    assert experts.resolve_pin_limit(30.0, 60 * GIB, cuda=True)[0] == 30 * GIB  # asked for: not capped


def test_tcc_or_linux_gpus_with_peer_access_have_no_cap_and_no_host_staging(monkeypatch):
    from engine.models import experts

    FakeNvml([FakeNvmlDevice(0, 6, 0, name="A", driver_model=pynvml.NVML_DRIVER_WDM),
              FakeNvmlDevice(0, 7, 0, name="B")]).install(monkeypatch)
    FakeCuda([cuda_props("A", 0, 6, 0), cuda_props("B", 0, 7, 0)], peer={(0, 1), (1, 0)}).install(monkeypatch)
    topo = topology.discover()
    assert topology.driver_facts(topo) == []
    assert topology.wddm_pin_cap(topo) == (None, "")
    monkeypatch.setattr(experts, "physical_ram", lambda: 128 * GIB)
    assert experts.resolve_pin_limit("auto", 60 * GIB, cuda=True)[0] == 60 * GIB
