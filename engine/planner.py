"""A what-if planner: predict a pipeline run from measured costs (issue 22).

A discrete-event simulation of the layer-split prefill with the seeds' semantics, over a list
of stages that each sit on a device (several stages may share one: interleaved layer groups,
or "cpu,cpu,cpu"), driven by a `CostProfile`:

* one layer's time per chunk size at position 0, attention's extra time per (query token x
  cached key), the host's launch time per layer (`chunking.ChunkCost`'s three figures);
* hand-off bytes per token, expert bytes streamed per layer and chunk, KV bytes per token and
  layer (prefill-main's copy), one decode step's time per layer.

A profile is measured — fitted from a run's own compute events (`profile_from_run`), the probe's
`ChunkCost` of a run merged in where one was saved — or entered (`CostProfile.from_dict`).

The simulation follows `engine.pipeline` one call at a time:

* a stage's `run(c)`: compute its layers -> reap the successor's previous job (one outstanding
  job per successor) -> hand the activations over -> submit `successor.run(c)`; depth 1 returns
  right after the hand-off, depth 0 only once the successor's run of the same chunk returned;
* CPU stages ("sync"): a run's thread does the work itself; stages on a CPU do not contend
  (their threads run in parallel, as the sleep-hook tests do);
* GPU stages ("async"): the thread launches (host time, serialised across stage threads: one
  interpreter), the device computes in launch order on its ONE stream (stages sharing a device
  serialise there; runs are walked in about their threads' order, chunk c at stage j at step
  c + j, and placed first-fit on the device — an approximation of one stream's launch order), the copy to the
  next GPU starts once this chunk's compute ended and the
  successor's stream is past its previous chunk, and a stage keeps at most two chunks queued on
  its device (`Stage.throttle`);
* expert misses stream at the pinned rate for the pinned share of the arena and at the pageable
  rate for the rest, overlapped with compute layer by layer (prefetch);
* prefill-main: every layer on the main device, then the KV of layers [K, n) copied to their
  stages; decode stays split.

It emits the same `StageEvent`s a run emits, marked `predicted`, so every consumer (statistics,
Gantt, trace) takes them as they are.
"""
from __future__ import annotations

import ast
import bisect
import itertools
import json
import logging
import math
import re
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from . import chunking, layer_ranges, run_plan
from .config import EngineConfig
from .events import RunPlan, StageEvent, StagePlan, StageTotals, busy_histogram, stage_totals

log = logging.getLogger(__name__)

IDLE_MIN_NS = 20_000  # as engine.pipeline: a GPU idle gap shorter than this is not a "wait"


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

    def layer_time(self, tokens: int, position: int) -> float:
        return self.cost().layer_time(tokens, position)

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


# --------------------------------------------------------------------------- stages

def plan_stages(n_layers: int, devices: Sequence[str], layer_split: Sequence[int] | None = None,
                interleave: int = 1) -> list[StagePlan]:
    """The stages a run of these settings loads (engine/layer_ranges.py), as the events name them."""
    try:
        return [StagePlan(*r) for r in layer_ranges.stage_ranges(n_layers, devices, layer_split, interleave)]
    except layer_ranges.LayerSplitError as exc:
        raise PlanError(str(exc)) from None


# --------------------------------------------------------------------------- timelines

class Timeline:
    """Busy intervals of one serial resource (a GPU's stream, the interpreter): work is placed in
    the first gap at or after it is ready (launch order, as the scheduler walks the chunks)."""

    def __init__(self) -> None:
        self.busy: list[tuple[float, float]] = []

    def place(self, ready: float, dur: float) -> float:
        t = ready
        i = bisect.bisect_left(self.busy, (t, -math.inf))
        if i > 0 and self.busy[i - 1][1] > t:
            t = self.busy[i - 1][1]
        while i < len(self.busy) and self.busy[i][0] < t + dur:
            t = max(t, self.busy[i][1])
            i += 1
        if dur > 0:
            bisect.insort(self.busy, (t, t + dur))
        return t

    def total(self) -> float:
        return sum(b - a for a, b in self.busy)


# --------------------------------------------------------------------------- prediction

@dataclass
class Prediction:
    settings: PlanSettings
    stages: list[StagePlan]
    events: list[StageEvent]
    prefill_s: float
    decode_s: float
    prompt_tokens: int
    chunk: int
    bounds: list[tuple[int, int]]
    busy_histogram: list[float]
    per_stage: list[StageTotals]
    bottleneck: str
    handoff: str
    notes: list[str] = field(default_factory=list)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        steps = max(self.settings.decode_tokens - 1, 0)
        return steps / self.decode_s if steps and self.decode_s > 0 else 0.0

    def plan(self, run_id: str = "predicted") -> RunPlan:
        s = self.settings
        return RunPlan(run_id=run_id, stages=tuple(self.stages), prompt_tokens=self.prompt_tokens, chunk=self.chunk,
                       n_chunks=len(self.bounds), decode_tokens=s.decode_tokens, handoff=self.handoff,
                       prefill_main=s.prefill_main, pipeline_depth=s.pipeline_depth,
                       chunk_reason="predicted by engine.planner", schedule=s.schedule,
                       bounds=tuple(self.bounds) if s.schedule == "balanced" else ())


def handoff(p: CostProfile, m: Machine, da: DeviceSpec, db: DeviceSpec, nbytes: float) -> tuple[float, str]:
    """(seconds, kind) to hand `nbytes` of activations from a stage on `da` to one on `db`."""
    if da.name == db.name:
        return 0.0, "same-device"
    if da.kind == "cuda" and db.kind == "cuda":
        if m.peer_gbs > 0:
            return nbytes / (m.peer_gbs * 1e9), "peer"
        la, lb = da.link_gbs or p.copy_gbs, db.link_gbs or p.copy_gbs
        if la <= 0 or lb <= 0:
            return 0.0, "host"
        return nbytes / (la * 1e9) + nbytes / (lb * 1e9), "host"
    rate = p.copy_gbs if p.device_kind == "cpu" else (da.link_gbs or db.link_gbs or p.copy_gbs)
    return (nbytes / (rate * 1e9) if rate > 0 else 0.0), "host"


class _Sim:
    def __init__(self, profile: CostProfile, machine: Machine, settings: PlanSettings, stages: list[StagePlan],
                 run_id: str) -> None:
        self.p, self.m, self.s, self.stages, self.run_id = profile, machine, settings, stages, run_id
        self.events: list[StageEvent] = []
        self.devs = {st.stage: machine.device(st.device) for st in stages}
        self.timelines: dict[str, Timeline] = {}
        self.host = Timeline()  # one interpreter: every GPU stage thread's launches
        self.notes: list[str] = []
        self.handoffs: list[str] = []
        self.stream_share = self._pinned_share()

    # ---------------------------------------------------------------- costs
    def _pinned_share(self) -> float:
        s = self.s
        if s.pin_limit_gib is None or s.arena_gib <= 0:
            return 1.0
        return max(0.0, min(1.0, s.pin_limit_gib / s.arena_gib))

    def streams(self, st: StagePlan, n_layers: int) -> bool:
        p, dev = self.p, self.devs[st.stage]
        if p.stream_bytes_per_layer_chunk <= 0 or dev.kind != "cuda":
            return False
        if dev.vram_gib > 0 and p.expert_layer_bytes > 0:
            # resident when every expert of its layers fits in 85% of VRAM (the rest: weights, KV, buffers)
            return n_layers * p.expert_layer_bytes > 0.85 * dev.vram_gib * 2**30
        return True

    def stream_s(self, dev: DeviceSpec) -> float:
        """Seconds to stream one layer's misses for one chunk on this device."""
        b = self.p.stream_bytes_per_layer_chunk
        pinned = dev.link_gbs or self.p.copy_gbs
        if pinned <= 0:
            return 0.0
        pageable = dev.pageable_gbs or pinned / 2
        f = self.stream_share
        return b * f / (pinned * 1e9) + b * (1 - f) / (pageable * 1e9)

    def work(self, st: StagePlan, layers: int, n: int, pos: int, first: bool = False) -> tuple[float, float]:
        """(compute seconds, of which streaming-bound extra) of `layers` layers for one chunk."""
        dev = self.devs[st.stage]
        comp = (self.p.layer_time(n, pos) + (self.p.first_chunk_s_per_layer if first else 0.0)) / max(dev.speed, 1e-9)
        if self.streams(st, layers):
            strm = self.stream_s(dev)
            return layers * max(comp, strm), layers * strm
        return layers * comp, 0.0

    def handoff(self, a: StagePlan, b: StagePlan, nbytes: float) -> tuple[float, str]:
        return handoff(self.p, self.m, self.devs[a.stage], self.devs[b.stage], nbytes)

    # ---------------------------------------------------------------- events
    def ev(self, st: StagePlan, chunk: int, kind: str, t0: float, t1: float, tokens: int = 0, nbytes: int = 0,
           note: str = "") -> None:
        a, b = int(round(t0 * 1e9)), int(round(t1 * 1e9))
        if b > a:
            self.events.append(StageEvent(self.run_id, st.stage, st.device, chunk, kind, a, b, tokens, nbytes,
                                          note, predicted=True))

    def device_place(self, st: StagePlan, ready: float, dur: float) -> float:
        dev = self.devs[st.stage]
        if dev.kind != "cuda":
            return ready  # CPU stage threads run side by side
        return self.timelines.setdefault(dev.name, Timeline()).place(ready, dur)

    # ---------------------------------------------------------------- prefill
    def prefill(self, bounds: list[tuple[int, int]]) -> float:
        if self.s.prefill_main and len(self.stages) > 1:
            return self._prefill_main(bounds)
        S, M = len(self.stages), len(bounds)
        depth = self.s.pipeline_depth
        ret = [[0.0] * M for _ in range(S)]  # when stage j's run(c) returned (host time)
        submit = [[0.0] * M for _ in range(S)]
        ready_in = [[0.0] * M for _ in range(S)]  # input activations in place
        dev_end = [[0.0] * M for _ in range(S)]
        joined: dict[tuple[int, int], float] = {}

        def item(j: int, c: int) -> None:
            """Stage j's run of chunk c (its compute, reap, hand-off and return)."""
            st = self.stages[j]
            pos, n = bounds[c]
            gpu = self.devs[st.stage].kind == "cuda"
            L = st.n_layers
            h = ret[0][c - 1] if (j == 0 and c > 0) else (submit[j][c] if j > 0 else 0.0)
            if c > 0:
                h = max(h, ret[j][c - 1])
            w, strm = self.work(st, L, n, pos, first=c == 0)
            if gpu:
                launch = L * self.p.host_s_per_layer
                ls = self.host.place(h, launch)
                le = ls + launch
                ds = self.device_place(st, max(ls, ready_in[j][c]), w)
                de = max(ds + w, le)
                if c > 0 and ds - dev_end[j][c - 1] >= IDLE_MIN_NS / 1e9:
                    self.ev(st, c, "wait", dev_end[j][c - 1], ds, note="idle")
                t_host = le
            else:
                if j == 0 and c > 0:
                    h += self.p.root_gap_s  # the root's own time between chunks
                ds = self.device_place(st, max(h, ready_in[j][c]), w)
                de = ds + w
                t_host = de
            dev_end[j][c] = de
            self.ev(st, c, "compute", ds, de, tokens=n)
            if strm > 0:
                self.ev(st, c, "stream", ds, ds + strm, nbytes=int(L * self.p.stream_bytes_per_layer_chunk),
                        note=f"{L} layers, {self.stream_share:.0%} pinned")
            if j == S - 1:
                if gpu:
                    ret[j][c] = de if depth == 0 else max(t_host, dev_end[j][c - 1] if c > 0 else 0.0)
                else:
                    ret[j][c] = t_host
                return
            nxt = self.stages[j + 1]
            reap_until = ret[j + 1][c - 1] if c > 0 else 0.0
            t = max(t_host, reap_until)
            if not gpu and reap_until > t_host:
                self.ev(st, c, "wait", t_host, reap_until, note="reap")
            nbytes = n * self.p.handoff_bytes_per_token
            dur, kind = self.handoff(st, nxt, nbytes)
            self.handoffs.append(kind)
            if gpu and self.devs[nxt.stage].kind == "cuda":
                cs = max(de, dev_end[j + 1][c - 1] if c > 0 else 0.0)
                ready_in[j + 1][c] = cs + dur
                self.ev(st, c, "copy", cs, cs + dur, tokens=n, nbytes=int(nbytes), note=kind)
                submit[j + 1][c] = t
                after = t
            else:
                self.ev(st, c, "copy", t, t + dur, tokens=n, nbytes=int(nbytes), note=kind)
                ready_in[j + 1][c] = t + dur + self.p.dispatch_s  # the worker thread wakes up
                submit[j + 1][c] = t + dur
                after = t + dur
            if depth == 0:
                joined[(j, c)] = after  # ret = the successor's return, filled in below
            else:
                ret[j][c] = max(after, dev_end[j][c - 1] if (gpu and c > 0) else 0.0)
        if depth == 1:
            # walk the runs in about the order their threads get to them (a chunk enters stage j
            # at step c + j; the stage below first, as it is reaped first), so that work sharing
            # one GPU's stream or the interpreter is placed in launch order
            for j, c in sorted(((j, c) for c in range(M) for j in range(S)), key=lambda jc: (jc[0] + jc[1], -jc[0])):
                item(j, c)
        else:
            for c in range(M):
                for j in range(S):
                    item(j, c)
                for j in range(S - 2, -1, -1):  # the join: each stage returns once the chain below returned
                    after = joined[(j, c)]
                    ret[j][c] = max(after, ret[j + 1][c])
                    if self.devs[self.stages[j].stage].kind != "cuda" and ret[j][c] > after:
                        self.ev(self.stages[j], c, "wait", after, ret[j][c], note="join")
        # the finish guard: the root returns once every stage is done
        return max(max(dev_end[j][M - 1], ret[j][M - 1]) for j in range(S)) if M else 0.0

    def _prefill_main(self, bounds: list[tuple[int, int]]) -> float:
        main = self.stages[0]
        n_layers = self.stages[-1].end_layer
        dev = self.devs[main.stage]
        gpu = dev.kind == "cuda"
        t_host, prev_end = 0.0, 0.0
        note = f"prefill-main: layers 0-{n_layers - 1}"
        for c, (pos, n) in enumerate(bounds):
            w, strm = self.work(main, n_layers, n, pos, first=c == 0)
            if gpu:
                launch = n_layers * self.p.host_s_per_layer
                ls = self.host.place(t_host, launch)
                ds = self.device_place(main, ls, w)
                de = max(ds + w, ls + launch)
                if c > 0 and ds - prev_end >= IDLE_MIN_NS / 1e9:
                    self.ev(main, c, "wait", prev_end, ds, note="idle")
                t_host = max(ls + launch, prev_end)  # throttle: at most two chunks queued
            else:
                ds = t_host
                de = ds + w
                t_host = de
            self.ev(main, c, "compute", ds, de, tokens=n, note=note)
            if strm > 0:
                self.ev(main, c, "stream", ds, ds + strm, nbytes=int(n_layers * self.p.stream_bytes_per_layer_chunk),
                        note=f"{n_layers} layers, {self.stream_share:.0%} pinned")
            prev_end = de
        t = max(prev_end, t_host)
        total = bounds[-1][0] + bounds[-1][1] if bounds else 0
        if self.p.kv_bytes_per_token_layer <= 0:
            self.notes.append("prefill-main: the KV copy is not modelled (the profile has no KV bytes per token)")
        for st in self.stages[1:]:
            nbytes = self.p.kv_bytes_per_token_layer * total * st.n_layers
            dur, kind = self.handoff(main, st, nbytes)
            self.handoffs.append(kind)
            self.ev(st, -1, "copy", t, t + dur, nbytes=int(nbytes),
                    note=f"kv layers {st.first_layer}-{st.end_layer - 1} from {main.device}")
            t += dur
        return t

    # ---------------------------------------------------------------- decode
    def decode(self, t0: float, steps: int) -> float:
        t = t0
        per = self.p.decode_s_per_layer
        if per <= 0 and steps > 1:
            self.notes.append("decode not modelled: the profile has no decode time per layer")
            return 0.0
        for i in range(1, steps):
            for j, st in enumerate(self.stages):
                d = st.n_layers * per / max(self.devs[st.stage].speed, 1e-9)
                if j > 0:
                    d += self.handoff(self.stages[j - 1], st, self.p.handoff_bytes_per_token)[0]
                self.ev(st, i, "decode", t, t + d, tokens=1)
                t += d
        return t - t0


@dataclass(frozen=True)
class _Kind:
    type: str  # as torch.device.type: cuda or cpu


@dataclass(frozen=True)
class _Shape:
    n_layers: int


class WhatIf:
    """A run of these settings on this machine as `run_plan.choice` reads a Session: the config
    it would run with, its stages' devices and layer groups, the profile's costs (one layer; the
    most layers a device runs per chunk, as `Session.chunk_cost`) and the hand-off between the
    first two stages (as `Session.hop_s_per_token`).  So a prediction chunks a prompt the way
    the engine's run of the same settings would (auto, balanced, a user's size)."""

    def __init__(self, profile: CostProfile, machine: Machine, settings: PlanSettings, devices: Sequence[str],
                 stages: Sequence[StagePlan]) -> None:
        c = settings.chunk_tokens
        if isinstance(c, str) and c.isdigit():
            c = int(c)
        if isinstance(c, int) and c <= 0:
            raise PlanError(f"chunk {c}: a positive number of tokens or auto")
        if not isinstance(c, int) and c != "auto":
            raise PlanError(f"chunk {c!r}: a number of tokens or auto")
        split: str | list[int] = list(settings.layer_split) if settings.layer_split else (
            f"interleave:{settings.interleave}" if settings.interleave > 1 else "auto")
        self.config = EngineConfig(devices=list(devices), chunk_tokens=c, chunk_schedule=settings.schedule,
                                   pipeline_depth=settings.pipeline_depth, prefill_main=settings.prefill_main,
                                   layer_split=split)
        self.devices = [_Kind(machine.device(d).kind) for d in devices]
        self.interleave = max(1, settings.interleave)
        self.spec = _Shape(profile.n_layers)
        per_device: dict[int, int] = {}  # interleaved groups of a device all run on it
        for st in stages:
            lane = st.stage % len(devices)
            per_device[lane] = per_device.get(lane, 0) + st.n_layers
        self._cost = replace(profile.cost(), layers_per_stage=max(per_device.values()))
        self._hop = 0.0
        if len(stages) > 1:
            da, db = machine.device(stages[0].device), machine.device(stages[1].device)
            self._hop = handoff(profile, machine, da, db, profile.handoff_bytes_per_token)[0]

    @property
    def measured_chunk_cost(self) -> chunking.ChunkCost:
        return self._cost

    def chunk_cost(self, n_tokens: int | None = None) -> chunking.ChunkCost:
        return self._cost

    def hop_s_per_token(self) -> float:
        return self._hop


def simulate(profile: CostProfile, machine: Machine, settings: PlanSettings,
             devices: Sequence[str] | None = None, run_id: str = "predicted") -> Prediction:
    """Predict one run: its events (marked predicted), prefill time, busy histogram, bottleneck."""
    if settings.prompt_tokens <= 0:
        raise PlanError("prompt tokens: at least one")
    if settings.pipeline_depth not in (0, 1):
        raise PlanError(f"pipeline_depth {settings.pipeline_depth}: 0 (join) or 1 (overlap); one buffer set per stage")
    if profile.n_layers <= 0:
        raise PlanError("the profile does not say how many layers the model has")
    names = list(devices) if devices is not None else [d.name for d in machine.devices]
    stages = plan_stages(profile.n_layers, names, settings.layer_split, settings.interleave)
    chosen = run_plan.choice(WhatIf(profile, machine, settings, names, stages), settings.prompt_tokens)
    bounds = list(chosen.bounds)
    chunk = max(n for _, n in bounds)
    settings = replace(settings, chunk_tokens=min(chosen.chunk, settings.prompt_tokens), schedule=chosen.kind)
    sim = _Sim(profile, machine, settings, stages, run_id)
    prefill_s = sim.prefill(bounds)
    decode_s = sim.decode(prefill_s, settings.decode_tokens)
    pre = [e for e in sim.events if e.kind != "decode"]
    hist = busy_histogram(pre, len(stages))
    totals = stage_totals(pre, len(stages))
    kinds = sorted(set(sim.handoffs))
    handoff = "none (one stage)" if not kinds else ",".join(kinds)
    pred = Prediction(settings, stages, sorted(sim.events, key=lambda e: (e.start_ns, e.stage)), prefill_s,
                      decode_s, settings.prompt_tokens, chunk, bounds, hist, totals, "", handoff, sim.notes)
    pred.bottleneck = bottleneck(pred, sim)
    return pred


def bottleneck(pred: Prediction, sim: _Sim | None = None) -> str:
    """What sets the pace, in words, from the predicted events."""
    wall = pred.prefill_s
    if wall <= 0:
        return "nothing ran"
    if sim is not None and sim.host.total() >= 0.9 * wall:
        return f"host launches: the interpreter launches every stage's layers ({sim.host.total() / wall:.0%} of wall)"
    busiest = max(pred.per_stage, key=lambda t: t.compute_ns, default=None)
    if busiest is None:
        return "nothing ran"
    share = busiest.compute_ns / 1e9 / wall
    streamed = sum(t.stream_ns for t in pred.per_stage if t.stage == busiest.stage) / 1e9
    copy = sum(t.copy_ns for t in pred.per_stage) / 1e9
    what = f"stage {busiest.stage} ({busiest.device}) computes {share:.0%} of wall"
    if streamed >= 0.8 * busiest.compute_ns / 1e9 and streamed > 0:
        what += ", bound by streaming experts over its link"
    if copy >= 0.2 * wall:
        what += f"; hand-offs take {copy / wall:.0%} of wall"
    n = len(pred.stages)
    if n > 1 and pred.busy_histogram and pred.busy_histogram[-1] < 0.7 and not pred.settings.prefill_main:
        fill = (n - 1) / (len(pred.bounds) + n - 1) if pred.bounds else 0
        what += f"; all {n} stages compute together {pred.busy_histogram[-1]:.0%} of wall (fill/drain bound {1 - fill:.0%})"
    return what


# --------------------------------------------------------------------------- profiles from runs

@dataclass
class MeasuredRun:
    """What the planner needs of a recorded run: its plan, its figures and its events."""

    name: str
    plan: RunPlan
    prefill_s: float
    prefill_tok_s: float
    busy_histogram: list[float]
    events: list[StageEvent]
    expert_stats: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cost_profile: dict = field(default_factory=dict)  # the probe's ChunkCost when the run saved it

    @property
    def devices(self) -> list[str]:
        return [s.device for s in self.plan.stages]


def _plan_from(d: dict[str, Any]) -> RunPlan:
    stages = tuple(StagePlan(int(s["stage"]), str(s["device"]), int(s["first_layer"]), int(s["end_layer"]))
                   for s in d["stages"])
    return RunPlan(run_id=str(d.get("run_id", "")), stages=stages, prompt_tokens=int(d["prompt_tokens"]),
                   chunk=int(d["chunk"]), n_chunks=int(d["n_chunks"]), decode_tokens=int(d.get("decode_tokens", 0)),
                   handoff=str(d.get("handoff", "")), prefill_main=bool(d.get("prefill_main", False)),
                   pipeline_depth=int(d.get("pipeline_depth", d.get("pf_depth", 1))),
                   chunk_reason=str(d.get("chunk_reason", "")),
                   schedule=str(d.get("schedule", "fixed")),
                   bounds=tuple((int(a), int(n)) for a, n in d.get("bounds", ()) or ()))


REPORT_REPR_MAX = 1 << 20  # characters of an older trace's report repr the planner parses


def _report_dict(meta_report: Any) -> dict[str, Any]:
    """A trace's report: a dict, or (older exports) its Python repr; the fields the planner reads."""
    if isinstance(meta_report, dict):
        return meta_report
    text = str(meta_report)
    if len(text) > REPORT_REPR_MAX:  # literal_eval only reads literals, but its parse is not bounded
        raise PlanError(f"the trace's report text is {len(text)} characters (at most {REPORT_REPR_MAX} are read)")
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, RecursionError, MemoryError, TypeError):
        pass
    out: dict[str, Any] = {}
    m = re.search(r"'plan': (\{.*?'chunk_reason': '(?:[^'\\]|\\.)*'[^}]*\})", text)
    if m:
        out["plan"] = ast.literal_eval(m.group(1))
    for key in ("prefill_s", "prefill_tok_s"):
        m = re.search(rf"'{key}': ([0-9.e+-]+)", text)
        if m:
            out[key] = float(m.group(1))
    m = re.search(r"'busy_histogram': (\[[^\]]*\])", text)
    if m:
        out["busy_histogram"] = ast.literal_eval(m.group(1))
    m = re.search(r"'expert_stats': (\[[^\]]*\])", text)
    if m:
        try:
            out["expert_stats"] = ast.literal_eval(m.group(1))
        except (ValueError, SyntaxError):
            pass
    if "plan" not in out:
        raise PlanError("the trace's report has no readable plan (stages and layer ranges)")
    return out


def measured_from_report(name: str, report: dict[str, Any], events: list[StageEvent]) -> MeasuredRun:
    plan = _plan_from(report["plan"])
    return MeasuredRun(name, plan, float(report.get("prefill_s", 0.0)), float(report.get("prefill_tok_s", 0.0)),
                       [float(x) for x in report.get("busy_histogram", [])], events,
                       list(report.get("expert_stats", []) or []), list(report.get("notes", []) or []),
                       dict(report.get("cost_profile", {}) or {}))


def load_trace_run(path: Path | str) -> MeasuredRun:
    from . import trace

    events, meta = trace.load(path)
    if "report" not in meta:
        raise PlanError(f"{path}: the trace carries no engine report (layer ranges unknown)")
    return measured_from_report(Path(path).name, _report_dict(meta["report"]), events)


def load_history_run(db: Path | str, run: int) -> MeasuredRun:
    """A run of the app's history file (read-only; the schema of strata_gui/history.py)."""
    path = Path(db)
    if not path.exists():
        raise PlanError(f"no history file at {path}")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT report_json FROM runs WHERE id = ?", (int(run),)).fetchone()
        if row is None:
            raise PlanError(f"no run #{run} in {path}")
        rows = conn.execute("SELECT run_id, stage, device, chunk, kind, start_ns, end_ns, tokens, nbytes, note "
                            "FROM events WHERE run = ? ORDER BY seq", (int(run),)).fetchall()
    finally:
        conn.close()
    return measured_from_report(f"run #{run}", json.loads(row[0]), [StageEvent(*r) for r in rows])


def probe_dict(cost: chunking.ChunkCost | None) -> dict[str, Any]:
    """A run's chunk-cost probe as JSON for `RunReport.cost_profile` ({} when it measured none).

    The hook for engine/pipeline.py: `cost_profile=planner.probe_dict(self._chunk_cost)` in the
    RunReport of `Session._run_inner`."""
    if cost is None:
        return {}
    return {"layer_s": {str(k): v for k, v in cost.layer_s.items()},
            "attn_s_per_token_key": cost.attn_s_per_token_key, "host_s_per_layer": cost.host_s_per_layer}


def _layers_of(ev: StageEvent, plan: RunPlan) -> int:
    m = re.match(r"prefill-main: layers (\d+)-(\d+)", ev.note)
    if m:
        return int(m.group(2)) - int(m.group(1)) + 1
    for s in plan.stages:
        if s.stage == ev.stage:
            return s.n_layers
    return 0


def profile_from_run(run: MeasuredRun) -> CostProfile:
    """Fit a cost profile to a run's own compute events.

    Each compute event of a chunk of n tokens at position p over L layers gives one layer's time
    y = dur / L = t0(n) + e x n x p; e is fitted across every chunk size at once (pooled least
    squares within sizes), t0(n) per size.  Sizes the run did not execute come from the probe's
    curve the run saved (scaled to agree at the measured sizes), else from `ChunkCost.t0`'s
    interpolation.  Copies give the hand-off bytes and rate, stream events the expert bytes per
    layer and chunk, decode events one decode step per layer."""
    plan = run.plan
    bounds = plan.chunk_bounds()
    starts = {c: b[0] for c, b in enumerate(bounds)}
    n_layers = max((s.end_layer for s in plan.stages), default=0)
    groups: dict[int, list[tuple[float, float]]] = {}
    firsts: list[tuple[int, float, float]] = []
    kind = "cpu"
    for e in run.events:
        if e.kind != "compute" or e.chunk < 0 or e.chunk not in starts:
            continue
        L = _layers_of(e, plan)
        if L <= 0 or e.dur_ns <= 0:
            continue
        if e.device.startswith("cuda"):
            kind = "cuda"
        n = e.tokens or bounds[e.chunk][1]
        point = (n * starts[e.chunk], e.dur_ns / 1e9 / L)
        if e.chunk == 0:
            firsts.append((n, *point))  # a stage's first chunk also pays its warm-up: fitted apart
        else:
            groups.setdefault(n, []).append(point)
    if not groups:  # one chunk only: its cost is all there is
        for n, x, y in firsts:
            groups.setdefault(n, []).append((x, y))
        firsts = []
    if not groups:
        raise PlanError(f"{run.name}: no compute events to fit costs to")
    sxy = sxx = 0.0
    for pts in groups.values():
        if len(pts) < 2:
            continue
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        sxy += sum((x - mx) * (y - my) for x, y in pts)
        sxx += sum((x - mx) ** 2 for x, _ in pts)
    attn = max(sxy / sxx, 0.0) if sxx > 0 else 0.0
    fitted = {n: max(sum(y - attn * x for x, y in pts) / len(pts), 1e-9) for n, pts in groups.items()}
    layer_s = dict(fitted)
    note = f"fitted to {sum(len(p) for p in groups.values())} compute events at {sorted(fitted)} tokens"
    extras = sorted(y - (fitted[n] + attn * x) for n, x, y in firsts if n in fitted)
    first_extra = max(extras[(len(extras) - 1) // 2], 0.0) if extras else 0.0  # the lower median
    if first_extra > 0:
        note += f"; a stage's first chunk {first_extra * 1e3:.3f} ms more per layer (warm-up)"
    probe = run.cost_profile
    if probe.get("layer_s"):
        curve = {int(k): float(v) for k, v in probe["layer_s"].items()}
        common = [n for n in fitted if n in curve and curve[n] > 0]
        ratio = (sum(fitted[n] / curve[n] for n in common) / len(common)) if common else 1.0
        for n, v in curve.items():
            layer_s.setdefault(n, v * ratio)
        note += f"; other sizes from the run's probe curve x {ratio:.3f}"
    host = float(probe.get("host_s_per_layer", 0.0)) if kind == "cuda" else 0.0
    if kind == "cuda" and not probe:
        note += "; host launch time unknown (0)"
    copies = [e for e in run.events if e.kind == "copy" and e.chunk >= 0 and e.tokens > 0]
    per_tok = int(round(sum(e.nbytes for e in copies) / sum(e.tokens for e in copies))) if copies else 0
    cdur = sum(e.dur_ns for e in copies)
    copy_gbs = sum(e.nbytes for e in copies) / cdur if cdur > 0 else 0.0  # bytes/ns = GB/s
    streams = [e for e in run.events if e.kind == "stream"]
    stream_layer_chunk = 0.0
    if streams:
        by_stage: dict[int, set[int]] = {}
        for e in streams:
            by_stage.setdefault(e.stage, set()).add(e.chunk)
        n_lc = 0
        for stage, chunks in by_stage.items():
            ev0 = next(e for e in run.events if e.kind == "compute" and e.stage == stage)
            n_lc += _layers_of(ev0, plan) * len([c for c in chunks if c >= 0])
        stream_layer_chunk = sum(e.nbytes for e in streams if e.chunk >= 0) / max(n_lc, 1)
    sdur = sum(e.dur_ns for e in streams)
    stream_gbs = sum(e.nbytes for e in streams) / sdur if sdur > 0 else 0.0
    kv = 0.0
    kv_copies = [e for e in run.events if e.kind == "copy" and e.chunk < 0 and e.note.startswith("kv layers")]
    if kv_copies:
        layers = sum(_layers_of(e, plan) for e in kv_copies)
        kv = sum(e.nbytes for e in kv_copies) / max(layers * plan.prompt_tokens, 1)
    dispatch = 0.0
    if kind == "cpu" and copies:
        comp = {(e.stage, e.chunk): e for e in run.events if e.kind == "compute"}
        gaps = sorted((comp[(e.stage + 1, e.chunk)].start_ns - e.end_ns) / 1e9 for e in copies
                      if (e.stage + 1, e.chunk) in comp)
        if gaps:
            dispatch = max(gaps[len(gaps) // 2], 0.0)
            note += f"; hand-off to successor start {dispatch * 1e3:.2f} ms (median of {len(gaps)})"
    root_gap = 0.0
    if kind == "cpu":  # stage 0 never waits for input: what its events leave out between chunks is its own
        comp0 = sorted((e for e in run.events if e.kind == "compute" and e.stage == 0 and e.chunk >= 0),
                       key=lambda e: e.chunk)
        other0 = [e for e in run.events if e.stage == 0 and e.kind in ("wait", "copy", "stream")]
        gaps = []
        for a, b in zip(comp0, comp0[1:]):
            covered = sum(min(o.end_ns, b.start_ns) - max(o.start_ns, a.end_ns) for o in other0
                          if o.end_ns > a.end_ns and o.start_ns < b.start_ns)
            gaps.append(max(b.start_ns - a.end_ns - covered, 0) / 1e9)
        if gaps:
            root_gap = sorted(gaps)[len(gaps) // 2]
            note += f"; the root's own time between chunks {root_gap * 1e3:.2f} ms (median of {len(gaps)})"
    dec = [e for e in run.events if e.kind == "decode"]
    dec_layer = 0.0
    if dec:
        layers_total = sum(_layers_of(e, plan) for e in dec)
        dec_layer = sum(e.dur_ns for e in dec) / 1e9 / max(layers_total, 1)
    return CostProfile(layer_s=layer_s, attn_s_per_token_key=attn, host_s_per_layer=host, n_layers=n_layers,
                       device_kind=kind, handoff_bytes_per_token=per_tok,
                       copy_gbs=copy_gbs if kind == "cpu" else (stream_gbs or 0.0),
                       stream_bytes_per_layer_chunk=stream_layer_chunk,
                       expert_layer_bytes=stream_layer_chunk, kv_bytes_per_token_layer=kv,
                       decode_s_per_layer=dec_layer, dispatch_s=dispatch, first_chunk_s_per_layer=first_extra,
                       root_gap_s=root_gap, source=f"measured: {run.name}", fit_note=note,
                       fitted_sizes=tuple(sorted(fitted)))


@dataclass(frozen=True)
class MeasuredTotal:
    """One measured one-stage prefill: prompt tokens, fixed chunk, layers, seconds."""

    prompt_tokens: int
    chunk: int
    n_layers: int
    prefill_s: float


def profile_from_totals(points: Sequence[MeasuredTotal], probe: CostProfile | None = None,
                        source: str = "measured totals") -> CostProfile:
    """Fit t0(chunk) per chunk size and one attention slope e to one-stage prefill times.

    A one-stage prefill of chunks (p_i, n_i) over L layers takes L x sum_i (t0(n_i) + e n_i p_i):
    linear in the unknowns, solved by least squares (normal equations).  A remainder chunk costs
    t0 of its own size, taken from the full size's per-token rate when unmeasured.  Sizes not
    measured come from `probe`'s curve scaled to agree at the measured ones."""
    sizes = sorted({p.chunk for p in points})
    if not sizes:
        raise PlanError("no measurements to fit")
    idx = {c: i for i, c in enumerate(sizes)}
    k = len(sizes) + 1
    rows, ys = [], []
    for p in points:
        if p.prefill_s <= 0 or p.n_layers <= 0:
            continue
        row = [0.0] * k
        for pos, n in chunking.chunk_bounds(p.prompt_tokens, p.chunk):
            row[idx[p.chunk]] += n / p.chunk  # a remainder chunk at the full size's rate per token
            row[-1] += n * pos
        rows.append(row)
        ys.append(p.prefill_s / p.n_layers)
    if len(rows) < k:
        raise PlanError(f"{len(rows)} measurements for {k} unknowns: measure more prompt sizes")
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(k)]
    sol = _solve(ata, aty)
    layer_s = {c: max(sol[idx[c]], 1e-9) for c in sizes}
    attn = max(sol[-1], 0.0)
    note = f"fitted to {len(rows)} one-stage prefill times at {sizes} tokens"
    base = probe or CostProfile(layer_s={})
    if probe is not None and probe.layer_s:
        common = [c for c in sizes if c in probe.layer_s]
        ratio = sum(layer_s[c] / probe.layer_s[c] for c in common) / len(common) if common else 1.0
        for c, v in probe.layer_s.items():
            layer_s.setdefault(c, v * ratio)
        note += f"; other sizes from the probe curve x {ratio:.3f}"
    return replace(base, layer_s=layer_s, attn_s_per_token_key=attn, n_layers=points[0].n_layers,
                   source=source, fit_note=note, fitted_sizes=tuple(sizes))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (small dense systems)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = [max(abs(v) for v in row[:n]) or 1.0 for row in m]
    m = [[v / s for v in row] for row, s in zip(m, scale)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            raise PlanError("the measurements cannot separate the costs (a singular fit)")
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def parse_chunk_cost_log(text: str) -> CostProfile | None:
    """The probe's costs from a log line `chunk cost on DEV: ChunkCost(layer_s={...}, ...)`."""
    m = re.search(r"chunk cost on (\S+): ChunkCost\(layer_s=(\{[^}]*\}), attn_s_per_token_key=([0-9.e+-]+), "
                  r"host_s_per_layer=([0-9.e+-]+), layers_per_stage=(\d+)", text)
    if not m:
        return None
    dev = m.group(1).rstrip(":")
    return CostProfile(layer_s={int(k): float(v) for k, v in ast.literal_eval(m.group(2)).items()},
                       attn_s_per_token_key=float(m.group(3)), host_s_per_layer=float(m.group(4)),
                       device_kind="cuda" if dev.startswith("cuda") else "cpu",
                       source=f"probe on {dev}", fit_note="the chunk-cost probe's own figures")


def machine_of_run(run: MeasuredRun, profile: CostProfile, link_gbs: float = 0.0, peer_gbs: float = 0.0) -> Machine:
    """The machine a run ran on, as far as its events tell (links from its copies and streams)."""
    devs, seen = [], set()
    for s in run.plan.stages:
        if s.device not in seen:
            seen.add(s.device)
            devs.append(DeviceSpec(s.device, link_gbs=link_gbs))
    peer = peer_gbs
    if not peer and "peer" in run.plan.handoff:
        copies = [e for e in run.events if e.kind == "copy" and e.chunk >= 0 and e.nbytes > 0]
        dur = sum(e.dur_ns for e in copies)
        peer = sum(e.nbytes for e in copies) / dur if dur > 0 else 0.0
    return Machine(devs, peer_gbs=peer)


def settings_of_run(run: MeasuredRun) -> PlanSettings:
    """The settings a recorded run ran with: its layer ranges, chunks, depth, prefill-main."""
    p = run.plan
    chunk = p.chunk if p.schedule == "fixed" else -(-p.prompt_tokens // max(p.n_chunks, 1))
    return PlanSettings(prompt_tokens=p.prompt_tokens, chunk_tokens=chunk, schedule=p.schedule,
                        pipeline_depth=max(p.pipeline_depth, 0),
                        prefill_main=p.prefill_main, decode_tokens=p.decode_tokens,
                        layer_split=[s.n_layers for s in p.stages])


def predict_run(profile: CostProfile, run: MeasuredRun, machine: Machine | None = None) -> Prediction:
    """Predict `run`'s own configuration (its stages and devices, chunks, depth) from `profile`."""
    machine = machine or machine_of_run(run, profile)
    return simulate(profile, machine, settings_of_run(run), devices=run.devices)


# --------------------------------------------------------------------------- honesty

@dataclass
class ErrorRow:
    profile_from: str
    predicted: str
    measured_tok_s: float
    predicted_tok_s: float
    measured_hist: list[float]
    predicted_hist: list[float]

    @property
    def error(self) -> float:
        return self.predicted_tok_s / self.measured_tok_s - 1 if self.measured_tok_s > 0 else float("nan")

    @property
    def hist_points(self) -> float:
        """The largest difference of the two busy histograms, in percentage points."""
        n = max(len(self.measured_hist), len(self.predicted_hist))
        a = list(self.measured_hist) + [0.0] * (n - len(self.measured_hist))
        b = list(self.predicted_hist) + [0.0] * (n - len(self.predicted_hist))
        return 100 * max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def measured_tok_s(run: MeasuredRun) -> float:
    if run.prefill_tok_s > 0:
        return run.prefill_tok_s
    pre = [e for e in run.events if e.kind != "decode"]
    span = (max(e.end_ns for e in pre) - min(e.start_ns for e in pre)) / 1e9 if pre else 0
    return run.plan.prompt_tokens / span if span > 0 else 0.0


def error_rows(runs: Sequence[MeasuredRun], cross: bool = True) -> list[ErrorRow]:
    """Each run predicted from its own profile, and (cross) from every other run of the same model."""
    profiles = {}
    for r in runs:
        try:
            profiles[r.name] = profile_from_run(r)
        except PlanError as exc:
            log.info("no profile from %s: %s", r.name, exc)
    out = []
    for src in runs:
        prof = profiles.get(src.name)
        if prof is None:
            continue
        for dst in runs:
            if dst is not src and (not cross or profiles.get(dst.name) is None
                                   or profiles[dst.name].n_layers != prof.n_layers
                                   or profiles[dst.name].device_kind != prof.device_kind):
                continue
            machine = machine_of_run(dst, prof)
            pred = predict_run(prof, dst, machine)
            hist = dst.busy_histogram or busy_histogram([e for e in dst.events if e.kind != "decode"],
                                                        len(dst.plan.stages))
            out.append(ErrorRow(src.name, dst.name, measured_tok_s(dst), pred.prefill_tok_s, hist, pred.busy_histogram))
    return out


# --------------------------------------------------------------------------- sweep

@dataclass
class Candidate:
    settings: PlanSettings
    devices: list[str]
    prediction: Prediction

    def describe(self) -> str:
        return f"{self.settings.describe()}, devices {','.join(self.devices)}"


def sweep(profile: CostProfile, machine: Machine, base: PlanSettings, chunks: Iterable[int] | None = None,
          orders: bool = True, pin_limits: Sequence[float | None] = (),
          devices: Sequence[str] | None = None) -> list[Candidate]:
    """Every combination of chunk, schedule, depth, prefill-main, pin limit and device order,
    best predicted prefill first.  `devices`: the stages' devices (default: one stage per device
    of the machine; a name may repeat, e.g. cpu,cpu: stages sharing a device)."""
    n = base.prompt_tokens
    # only sizes the profile prices from a measurement (its fit or a probe curve), never a blind extrapolation
    priced = sorted(profile.layer_s)
    sizes = sorted({min(c, n) for c in (chunks or priced) if c > 0})
    schedules = ("fixed", "balanced") if len(priced) >= 3 else ("fixed",)  # balancing needs a cost curve
    names = list(devices) if devices else [d.name for d in machine.devices]
    perms = [list(p) for p in itertools.permutations(names)] if orders and len(names) <= 4 else [names]
    seen_orders = []
    for p in perms:  # orders that differ only between identical devices are one order
        key = [(machine.device(d).link_gbs, machine.device(d).vram_gib, machine.device(d).speed) for d in p]
        if key not in [k for k, _ in seen_orders]:
            seen_orders.append((key, p))
    pins = list(pin_limits) or [base.pin_limit_gib]
    out: list[Candidate] = []
    for (_, order), c, sched, depth, pm, pin in itertools.product(seen_orders, sizes, schedules, (0, 1),
                                                                  (False, True), pins):
        if len(order) == 1 and (pm or depth == 0 or sched == "balanced"):
            continue
        if pm and (depth == 0 or sched == "balanced"):
            continue  # prefill-main runs one stage: depth and balancing do nothing there
        if sched == "balanced" and c >= n:
            continue
        s = replace(base, chunk_tokens=c, schedule=sched, pipeline_depth=depth, prefill_main=pm, pin_limit_gib=pin,
                    layer_split=None if base.layer_split is None else base.layer_split)
        try:
            pred = simulate(profile, machine, s, devices=order)
        except PlanError:
            continue
        out.append(Candidate(s, order, pred))
    out.sort(key=lambda k: k.prediction.prefill_s)
    return out


def parse_link(text: str) -> float:
    """GB/s per direction: a number, or PCIe as genGxW (gen4x4), the link class of topology."""
    t = str(text).strip().lower()
    m = re.fullmatch(r"(?:pcie\s*)?gen\s*(\d)\s*x\s*(\d+)", t)
    if m:
        from .topology import link_class_gbs

        gbs = link_class_gbs(int(m.group(1)), int(m.group(2)))
        if gbs is None:
            raise PlanError(f"link {text!r}: PCIe gen 1-6")
        return gbs
    try:
        v = float(t.removesuffix("gb/s").strip())
    except ValueError:
        raise PlanError(f"link {text!r}: GB/s (e.g. 5.3) or PCIe genGxW (e.g. gen4x4)") from None
    if v <= 0:
        raise PlanError(f"link {text!r}: more than 0 GB/s")
    return v
