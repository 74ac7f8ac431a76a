"""Decode's memory roofline: the bytes of weights one decode token reads, against the bandwidth of
the devices that read them (issue 32 item 4).

A decode token reads every dense weight once (attention, norms, router, the output head), one
row of the token embedding and, per MoE layer, the top-k experts it routes to.  Counted as the
file stores them (quantized experts at their quantized size): the bytes the ideal decoder reads,
and so the floor under a token's time on a memory-bound device.  The engine itself reads more
(dense weights expanded to the compute dtype at load, experts expanded into a scratch before
their GEMMs), which is the gap the column shows.  The KV cache read per token (it grows with
the context) is not included.

Bandwidth: CUDA from the device's memory clock and bus width (torch's device properties where
they have them, else NVML): 2 transfers per clock x bus width / 8.  A CPU's is unknown unless the
user measured it (`strata-bench run --mem-gbs`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.io.gguf_model import ModelSpec, expected_shapes

log = logging.getLogger(__name__)

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass(frozen=True)
class DecodeBytes:
    """Bytes of weights a decode token reads, as stored: the embedding row, each layer, the head."""

    embed: int
    layers: tuple[int, ...]
    head: int

    @property
    def total(self) -> int:
        return self.embed + sum(self.layers) + self.head

    def of_stage(self, first: int, end: int, with_embed: bool, with_head: bool) -> int:
        """The bytes a stage holding layers [first, end) reads (plus the embedding row on the first
        stage and the head on the last)."""
        return sum(self.layers[first:end]) + (self.embed if with_embed else 0) + (self.head if with_head else 0)


def _stored_bytes(source, name: str, shape: tuple[int, ...]) -> int:
    """A tensor's bytes as the source stores it (its blocks; a float-only source: fp32)."""
    if hasattr(source, "nbytes") and hasattr(source, "qtype"):
        return int(source.nbytes(name))
    n = 1
    for x in shape:
        n *= x
    return 4 * n


def decode_weight_bytes(source, spec: ModelSpec | None = None) -> DecodeBytes:
    """The weight bytes one decode token reads from `source` (a loaded file or a synthetic
    source): dense tensors whole, experts top-k of E, the embedding one row (whole when tied:
    the output head reads it)."""
    s = spec or source.spec
    shapes = expected_shapes(s)
    layers = [0] * s.n_layers
    embed = head = 0
    for name, shape in shapes.items():
        nbytes = _stored_bytes(source, name, shape)
        if name == "token_embd.weight":
            embed = nbytes // s.vocab
            if s.tied_embeddings:
                head += nbytes
            continue
        if not name.startswith("blk."):
            head += nbytes  # output_norm, output
            continue
        layer = int(name.split(".")[1])
        if any(f".{part}." in name for part in EXPERT_TENSORS):
            nbytes = nbytes * s.n_experts_used // s.n_experts
        layers[layer] += nbytes
    return DecodeBytes(embed, tuple(layers), head)


def cuda_bandwidth(device: torch.device | str) -> tuple[float | None, str]:
    """(bytes/s, how it was found) of a CUDA device's memory: memory clock x bus width x 2 / 8;
    (None, why) when neither torch nor NVML says."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None, f"{dev}: not a CUDA device"
    try:
        props = torch.cuda.get_device_properties(dev)
        clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
        if clock_khz and bus_bits:
            return clock_khz * 1e3 * 2 * bus_bits / 8, "torch device properties (memory clock x bus width)"
    except Exception as exc:  # never fails a run
        log.debug("device properties for %s: %s", dev, exc)
    from engine.hw import topology  # the torch device's NVML handle by PCI id (indices may differ)

    why = topology._nvml_init()
    if why:
        return None, f"{dev}: unknown ({why})"
    try:
        key = topology._torch_pci_key(dev.index or 0)
        h = topology._nvml_handles_by_pci().get(key) if key is not None else None
        if h is None:
            return None, f"{dev}: unknown (no NVML device at its PCI id)"
        clock_mhz = topology.pynvml.nvmlDeviceGetMaxClockInfo(h, topology.pynvml.NVML_CLOCK_MEM)
        bus_bits = topology.pynvml.nvmlDeviceGetMemoryBusWidth(h)
    except Exception as exc:  # an old NVML without the bus width, a device NVML may not open
        log.debug("NVML memory clock for %s: %s", dev, exc)
        return None, f"{dev}: unknown ({type(exc).__name__})"
    finally:
        topology._nvml_shutdown()
    if clock_mhz and bus_bits:
        return clock_mhz * 1e6 * 2 * bus_bits / 8, "NVML (max memory clock x bus width)"
    return None, f"{dev}: unknown"


@dataclass(frozen=True)
class Roofline:
    """A decode token's weight bytes against its devices' bandwidth (None: a device's is unknown)."""

    weight_bytes: int
    limit_tok_s: float | None  # tokens/s if every weight byte moved at the devices' bandwidth
    how: str

    def share(self, decode_tok_s: float) -> float | None:
        """The measured decode rate as a share of the limit (None when the limit is unknown)."""
        if not self.limit_tok_s or not decode_tok_s:
            return None
        return decode_tok_s / self.limit_tok_s


def roofline(db: DecodeBytes, stages: Sequence[tuple[str, int, int]],
             bandwidth: Callable[[str], tuple[float | None, str]]) -> Roofline:
    """The roofline of decode through `stages` ((device, first layer, end layer), in order): a
    token passes the stages one after another, so its floor is the sum over stages of the bytes
    each reads over its device's bandwidth.  `bandwidth(device)` gives (bytes/s or None, how)."""
    seconds = 0.0
    hows = []
    for j, (device, first, end) in enumerate(stages):
        bw, how = bandwidth(device)
        if not bw:
            return Roofline(db.total, None, how)
        seconds += db.of_stage(first, end, j == 0, j == len(stages) - 1) / bw
        hows.append(f"{device} {bw / 1e9:.0f} GB/s ({how})")
    return Roofline(db.total, 1.0 / seconds if seconds else None, "; ".join(dict.fromkeys(hows)))


def bandwidth_of(measured_gbs: float = 0.0) -> Callable[[str], tuple[float | None, str]]:
    """The bandwidth lookup `roofline` takes: a figure the user measured (GB/s, every device),
    else CUDA's derived one; a CPU without a measured figure is unknown."""
    found: dict[str, tuple[float | None, str]] = {}  # asked once per device

    def lookup(device: str) -> tuple[float | None, str]:
        if measured_gbs > 0:
            return measured_gbs * 1e9, "--mem-gbs"
        if str(device).startswith("cuda"):
            if str(device) not in found:
                found[str(device)] = cuda_bandwidth(device)
            return found[str(device)]
        return None, f"{device}: unknown (pass a measured --mem-gbs)"
    return lookup
