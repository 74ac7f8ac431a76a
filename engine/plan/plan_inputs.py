"""What a what-if prediction is asked for and computed from (engine/plan/planner.py): the cost
profile (seconds and bytes a run spends), the machine (its devices and links) and the settings.

A profile is measured (engine/plan/profile_fit.py: fitted from a run's own compute events, the
probe's `ChunkCost` of a run merged in where one was saved) or entered (`CostProfile.from_dict`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from engine.plan import chunking


class PlanError(ValueError):
    """A planner input that cannot be used; the message says which and why."""


# --------------------------------------------------------------------------- inputs

@dataclass
class CostProfile:
    """What a prediction is computed from (seconds, bytes).  See the module doc."""

    layer_s: dict[int, float]  # chunk tokens -> one layer at position 0
    attn_s_per_token_key: float = 0.0
    host_s_per_layer: float = 0.0  # GPU stages: launch time per layer (0 on CPU: the thread computes)
    n_layers: int = 0
    device_kind: str = "cuda"  # the kind of device the costs were measured on: cuda or cpu
    handoff_bytes_per_token: int = 0
    copy_gbs: float = 0.0  # measured hand-off rate of the source run (0: unknown)
    stream_bytes_per_layer_chunk: float = 0.0  # expert bytes a streaming stage moved per layer and chunk
    expert_layer_bytes: float = 0.0  # all experts of one layer (resident test against VRAM)
    kv_bytes_per_token_layer: float = 0.0
    decode_s_per_layer: float = 0.0
    dispatch_s: float = 0.0  # CPU stages: a hand-off's end to the successor's compute start (thread wake-up)
    first_chunk_s_per_layer: float = 0.0  # a stage's first chunk of a run costs this much more per layer
    root_gap_s: float = 0.0  # CPU: the root thread's own time between its chunks (embedding, interpreter)
    source: str = "entered"
    fit_note: str = ""
    fitted_sizes: tuple[int, ...] = ()  # chunk sizes measured (others interpolated or from a probe curve)

    def extrapolated(self, tokens: int) -> bool:
        """Whether a chunk of this size is priced from other sizes than its own measurement."""
        sizes = self.fitted_sizes or tuple(self.layer_s)
        return tokens not in sizes

    def cost(self) -> chunking.ChunkCost:
        return chunking.ChunkCost(dict(self.layer_s), self.attn_s_per_token_key, self.host_s_per_layer, 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_s"] = {str(k): v for k, v in self.layer_s.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostProfile:
        if not isinstance(d, dict) or not d.get("layer_s"):
            raise PlanError("a cost profile needs layer_s: {chunk tokens: seconds per layer}")
        known = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in d.items() if k in known}
        kw["layer_s"] = {int(k): float(v) for k, v in d["layer_s"].items()}
        kw["fitted_sizes"] = tuple(int(x) for x in kw.get("fitted_sizes", ()) or ())
        return cls(**kw)


@dataclass
class DeviceSpec:
    """One device of the machine a prediction is for."""

    name: str  # cuda:0, cpu
    link_gbs: float = 0.0  # pinned host<->device GB/s per direction (0: no link cost, e.g. CPU)
    pageable_gbs: float = 0.0  # pageable host->device (0: half the pinned rate, as measured on H200)
    vram_gib: float = 0.0  # 0: unknown (experts stream as the source run's did)
    speed: float = 1.0  # compute speed relative to the profile's device

    @property
    def kind(self) -> str:
        return "cuda" if self.name.startswith("cuda") else "cpu"


@dataclass
class Machine:
    devices: list[DeviceSpec]
    peer_gbs: float = 0.0  # device-to-device copies where peer access exists; 0: staged through the host

    def device(self, name: str) -> DeviceSpec:
        for d in self.devices:
            if d.name == name:
                return d
        raise PlanError(f"device {name!r} is not one of {', '.join(d.name for d in self.devices)}")


@dataclass
class PlanSettings:
    prompt_tokens: int
    chunk_tokens: int | str = "auto"  # tokens, or auto (chosen from the profile as the engine would)
    schedule: str = "fixed"
    pipeline_depth: int = 1
    prefill_main: bool = False
    pin_limit_gib: float | None = None  # None: the whole arena page-locked
    decode_tokens: int = 0
    layer_split: list[int] | None = None  # layers per device (contiguous) or None: balanced
    interleave: int = 1  # V groups per device (issue 21): stage j on device j mod D
    arena_gib: float = 0.0  # expert arena size (pin share); 0: every stream at the pinned rate

    def describe(self) -> str:
        parts = [f"chunk {self.chunk_tokens}", self.schedule, f"depth {self.pipeline_depth}"]
        if self.prefill_main:
            parts.append("prefill-main")
        if self.pin_limit_gib is not None:
            parts.append(f"pin {self.pin_limit_gib:g} GiB")
        if self.interleave > 1:
            parts.append(f"interleave:{self.interleave}")
        return ", ".join(parts)
