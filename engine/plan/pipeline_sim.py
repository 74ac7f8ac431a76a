"""The what-if planner's pipeline model (engine/plan/planner.py): a discrete-event simulation of the
layer-split prefill with the seeds' semantics, over a list of stages that each sit on a device
(several stages may share one: interleaved layer groups, or "cpu,cpu,cpu"), driven by a
`CostProfile` (engine/plan/plan_inputs.py):

* one layer's time per chunk size at position 0, attention's extra time per (query token x
  cached key), the host's launch time per layer (`chunking.ChunkCost`'s three figures);
* hand-off bytes per token, expert bytes streamed per layer and chunk, KV bytes per token and
  layer (prefill-main's copy), one decode step's time per layer.

The simulation follows `engine.pipeline.session` one call at a time:

* a stage's `run(c)`: compute its layers -> reap the successor's previous job (one outstanding
  job per successor) -> hand the activations over -> submit `successor.run(c)`; depth 1 returns
  right after the hand-off, depth 0 only once the successor's run of the same chunk returned;
* CPU stages ("sync"): a run's thread does the work itself; stages on a CPU do not contend
  (their threads run in parallel, as the sleep-hook tests do);
* GPU stages ("async"): the thread launches (host time, serialised across stage threads: one
  interpreter), the device computes in launch order on its ONE stream (stages sharing a device
  serialise there; runs are walked in about their threads' order, chunk c at stage j at step
  c + j, and placed first-fit on the device — an approximation of one stream's launch order),
  the copy to the next GPU starts once this chunk's compute ended and the successor's stream
  is past its previous chunk, and a stage keeps at most two chunks queued on its device
  (`Stage.throttle`);
* expert misses stream at the pinned rate for the pinned share of the arena and at the pageable
  rate for the rest, overlapped with compute layer by layer (prefetch);
* prefill-main: every layer on the main device, then the KV of layers [K, n) copied to their
  stages; decode stays split.

It emits the same `StageEvent`s a run emits, marked `predicted`, so every consumer (statistics,
Gantt, trace) takes them as they are.
"""
from __future__ import annotations

import bisect
import math

from engine.events import StageEvent, StagePlan
from engine.plan.plan_inputs import CostProfile, DeviceSpec, Machine, PlanSettings

IDLE_MIN_NS = 20_000  # as engine.pipeline.session: a GPU idle gap shorter than this is not a "wait"


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


class _Walk:
    """The times of one prefill's stage runs, per stage j and chunk c (host seconds)."""

    def __init__(self, bounds: list[tuple[int, int]], n_stages: int) -> None:
        m = len(bounds)
        self.bounds = bounds
        self.ret = [[0.0] * m for _ in range(n_stages)]  # when stage j's run(c) returned
        self.submit = [[0.0] * m for _ in range(n_stages)]  # when run(c) was submitted to stage j
        self.ready_in = [[0.0] * m for _ in range(n_stages)]  # stage j's input activations in place
        self.dev_end = [[0.0] * m for _ in range(n_stages)]  # stage j's compute of c ended
        self.joined: dict[tuple[int, int], float] = {}  # depth 0: (j, c) -> its hand-off's end

    @staticmethod
    def prev(grid: list[list[float]], j: int, c: int) -> float:
        """grid[j][c - 1], 0 before the first chunk."""
        return grid[j][c - 1] if c > 0 else 0.0


class Sim:
    """One predicted run of these stages: `prefill(bounds)`, then `decode`; the events it emits
    and the hand-off kinds it used."""

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
        self.cost = profile.cost()  # one layer's time per chunk size and position

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
        comp = (self.cost.layer_time(n, pos) + (self.p.first_chunk_s_per_layer if first else 0.0)) / max(dev.speed, 1e-9)
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
        w = _Walk(bounds, S)
        if self.s.pipeline_depth == 1:
            # walk the runs in about the order their threads get to them (a chunk enters stage j
            # at step c + j; the stage below first, as it is reaped first), so that work sharing
            # one GPU's stream or the interpreter is placed in launch order
            for j, c in sorted(((j, c) for c in range(M) for j in range(S)), key=lambda jc: (jc[0] + jc[1], -jc[0])):
                self._run(w, j, c)
        else:
            for c in range(M):
                for j in range(S):
                    self._run(w, j, c)
                self._join(w, c)
        # the finish guard: the root returns once every stage is done
        return max(max(w.dev_end[j][M - 1], w.ret[j][M - 1]) for j in range(S)) if M else 0.0

    def _run(self, w: _Walk, j: int, c: int) -> None:
        """Stage j's run of chunk c (its compute, reap, hand-off and return)."""
        gpu = self.devs[self.stages[j].stage].kind == "cuda"
        de, t_host = self._compute(w, j, c, gpu)
        if j < len(self.stages) - 1:
            self._hand_off(w, j, c, gpu, de, t_host)
        elif gpu:
            w.ret[j][c] = de if self.s.pipeline_depth == 0 else max(t_host, w.prev(w.dev_end, j, c))
        else:
            w.ret[j][c] = t_host

    def _compute(self, w: _Walk, j: int, c: int, gpu: bool) -> tuple[float, float]:
        """Stage j computes chunk c: (its device's end, the host's time after it)."""
        st = self.stages[j]
        pos, n = w.bounds[c]
        L = st.n_layers
        h = w.ret[0][c - 1] if (j == 0 and c > 0) else (w.submit[j][c] if j > 0 else 0.0)
        if c > 0:
            h = max(h, w.ret[j][c - 1])
        work, strm = self.work(st, L, n, pos, first=c == 0)
        if gpu:
            launch = L * self.p.host_s_per_layer
            ls = self.host.place(h, launch)
            le = ls + launch
            ds = self.device_place(st, max(ls, w.ready_in[j][c]), work)
            de = max(ds + work, le)
            if c > 0 and ds - w.dev_end[j][c - 1] >= IDLE_MIN_NS / 1e9:
                self.ev(st, c, "wait", w.dev_end[j][c - 1], ds, note="idle")
            t_host = le
        else:
            if j == 0 and c > 0:
                h += self.p.root_gap_s  # the root's own time between chunks
            ds = self.device_place(st, max(h, w.ready_in[j][c]), work)
            de = ds + work
            t_host = de
        w.dev_end[j][c] = de
        self.ev(st, c, "compute", ds, de, tokens=n)
        if strm > 0:
            self.ev(st, c, "stream", ds, ds + strm, nbytes=int(L * self.p.stream_bytes_per_layer_chunk),
                    note=f"{L} layers, {self.stream_share:.0%} pinned")
        return de, t_host

    def _hand_off(self, w: _Walk, j: int, c: int, gpu: bool, de: float, t_host: float) -> None:
        """Stage j reaps its successor's previous job, hands chunk c over and returns (depth 1)
        or waits for the join (depth 0)."""
        st, nxt = self.stages[j], self.stages[j + 1]
        n = w.bounds[c][1]
        reap_until = w.prev(w.ret, j + 1, c)
        t = max(t_host, reap_until)
        if not gpu and reap_until > t_host:
            self.ev(st, c, "wait", t_host, reap_until, note="reap")
        nbytes = n * self.p.handoff_bytes_per_token
        dur, kind = self.handoff(st, nxt, nbytes)
        self.handoffs.append(kind)
        if gpu and self.devs[nxt.stage].kind == "cuda":
            cs = max(de, w.prev(w.dev_end, j + 1, c))
            w.ready_in[j + 1][c] = cs + dur
            self.ev(st, c, "copy", cs, cs + dur, tokens=n, nbytes=int(nbytes), note=kind)
            w.submit[j + 1][c] = t
            after = t
        else:
            self.ev(st, c, "copy", t, t + dur, tokens=n, nbytes=int(nbytes), note=kind)
            w.ready_in[j + 1][c] = t + dur + self.p.dispatch_s  # the worker thread wakes up
            w.submit[j + 1][c] = t + dur
            after = t + dur
        if self.s.pipeline_depth == 0:
            w.joined[(j, c)] = after  # ret = the successor's return, filled in by _join
        else:
            w.ret[j][c] = max(after, w.dev_end[j][c - 1] if (gpu and c > 0) else 0.0)

    def _join(self, w: _Walk, c: int) -> None:
        """Depth 0: each stage returns chunk c once the chain below it returned."""
        for j in range(len(self.stages) - 2, -1, -1):
            after = w.joined[(j, c)]
            w.ret[j][c] = max(after, w.ret[j + 1][c])
            if self.devs[self.stages[j].stage].kind != "cuda" and w.ret[j][c] > after:
                self.ev(self.stages[j], c, "wait", after, w.ret[j][c], note="join")

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
