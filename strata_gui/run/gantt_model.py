"""The Gantt's data: every StageEvent of a run in numpy columns, one lane per (kind, stage).

No widgets here (the mnelab habit): `gantt.py` draws what this module answers, and the tests
query it without a GUI.  A lane holds the blocks of one kind on one stage in growable arrays;
lanes are kept sorted by start time (events of one stage arrive almost in order; a batch that
breaks the order marks the lane for one lazy re-sort), so a visible-range query is two binary
searches and a mask, and a pixel-sized level of detail is one vectorised pass.

Times stay integer nanoseconds on the engine's clock (`time.perf_counter_ns()`); `origin_ns` is
the instant the run started, and the view shows seconds since then.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.events import KINDS, StageEvent

log = logging.getLogger(__name__)

_INT = np.int64


@dataclass(frozen=True)
class Blocks:
    """Columns of some blocks of one kind (any number of stages), in lane order."""

    kind: str
    stage: np.ndarray  # int32
    chunk: np.ndarray  # int32 (decode: token step; -1: not a chunk, e.g. the finish guard)
    start_ns: np.ndarray  # int64
    end_ns: np.ndarray  # int64
    tokens: np.ndarray  # int64
    nbytes: np.ndarray  # int64

    def __len__(self) -> int:
        return int(self.start_ns.size)

    @classmethod
    def empty(cls, kind: str) -> Blocks:
        z = np.zeros(0, dtype=_INT)
        zi = np.zeros(0, dtype=np.int32)
        return cls(kind, zi, zi, z, z, z, z)


@dataclass(frozen=True)
class Block:
    """One block, for a tooltip."""

    kind: str
    stage: int
    device: str
    chunk: int
    start_ns: int
    end_ns: int
    tokens: int
    nbytes: int
    note: str

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True)
class Runs:
    """Blocks merged for drawing: neighbours closer than a pixel become one rectangle."""

    stage: np.ndarray
    start_ns: np.ndarray
    end_ns: np.ndarray
    merged: bool = False  # True when some lane was merged (one rectangle may be many blocks)

    def __len__(self) -> int:
        return int(self.start_ns.size)


class _Lane:
    """Growable, start-sorted columns of one (kind, stage)."""

    _COLS = ("chunk", "start", "end", "tokens", "nbytes", "note")

    def __init__(self, capacity: int = 256) -> None:
        self.n = 0
        self.chunk = np.empty(capacity, dtype=np.int32)
        self.start = np.empty(capacity, dtype=_INT)
        self.end = np.empty(capacity, dtype=_INT)
        self.tokens = np.empty(capacity, dtype=_INT)
        self.nbytes = np.empty(capacity, dtype=_INT)
        self.note = np.empty(capacity, dtype=np.int32)
        self.sorted = True
        self.max_dur = 0

    def _reserve(self, extra: int) -> None:
        need = self.n + extra
        cap = self.start.size
        if need <= cap:
            return
        new_cap = max(need, 2 * cap)
        for name in self._COLS:
            old = getattr(self, name)
            arr = np.empty(new_cap, dtype=old.dtype)
            arr[: self.n] = old[: self.n]
            setattr(self, name, arr)

    def append(self, chunk: np.ndarray, start: np.ndarray, end: np.ndarray, tokens: np.ndarray,
               nbytes: np.ndarray, note: np.ndarray) -> None:
        k = int(start.size)
        if k == 0:
            return
        self._reserve(k)
        a, b = self.n, self.n + k
        self.chunk[a:b] = chunk
        self.start[a:b] = start
        self.end[a:b] = end
        self.tokens[a:b] = tokens
        self.nbytes[a:b] = nbytes
        self.note[a:b] = note
        if self.sorted:
            in_order = bool(np.all(start[1:] >= start[:-1])) if k > 1 else True
            if not in_order or (a > 0 and start[0] < self.start[a - 1]):
                self.sorted = False
        self.max_dur = max(self.max_dur, int((end - start).max()))
        self.n = b

    def ensure_sorted(self) -> None:
        if self.sorted:
            return
        order = np.argsort(self.start[: self.n], kind="stable")
        for name in self._COLS:
            col = getattr(self, name)
            col[: self.n] = col[: self.n][order]
        self.sorted = True

    def window(self, a_ns: int, b_ns: int) -> np.ndarray:
        """Indices of blocks that overlap [a_ns, b_ns]."""
        self.ensure_sorted()
        start, end = self.start[: self.n], self.end[: self.n]
        lo = int(np.searchsorted(start, a_ns - self.max_dur, side="left"))
        hi = int(np.searchsorted(start, b_ns, side="right"))
        idx = np.arange(lo, hi)
        return idx[end[lo:hi] >= a_ns]


class EventStore:
    """All blocks of one run, per kind and stage; plain data, safe to test without Qt."""

    def __init__(self) -> None:
        self.run_id = ""
        self.origin_ns = 0
        self.stage_devices: dict[int, str] = {}
        self.stage_layers: dict[int, tuple[int, int]] = {}
        self.interleave = 1  # layer groups per device (see reset)
        self.n_rows = 0
        self._lanes: dict[tuple[str, int], _Lane] = {}
        self._notes: list[str] = [""]
        self._note_ids: dict[str, int] = {"": 0}
        self._end_ns = 0
        self.dropped = 0  # events of another run, refused

    # ------------------------------------------------------------------ set-up
    def reset(self, run_id: str = "", origin_ns: int = 0, stages: Sequence[tuple[int, str, int, int]] = (),
              interleave: int = 1) -> None:
        """Forget everything; `stages` are (stage, device, first_layer, end_layer).  With
        `interleave` V > 1 the stages are layer groups, group j on device lane j mod D: the
        Gantt draws one row per device (see `row_of`)."""
        self.run_id = run_id
        self.origin_ns = origin_ns
        self.interleave = max(int(interleave), 1)
        self.n_rows = max(len(stages) // self.interleave, 1) if self.interleave > 1 else 0
        self.stage_devices = {s: d for s, d, _, _ in stages}
        self.stage_layers = {s: (a, b) for s, _, a, b in stages}
        self._lanes.clear()
        self._notes = [""]
        self._note_ids = {"": 0}
        self._end_ns = origin_ns
        self.dropped = 0

    def row_of(self, stage: int) -> int:
        """The row a stage's blocks are drawn in: its device lane when interleaved, else itself."""
        return stage % self.n_rows if self.interleave > 1 else stage

    def rows(self, stages: np.ndarray) -> np.ndarray:
        return stages % self.n_rows if self.interleave > 1 else stages

    def stages_in_row(self, row: int) -> list[int]:
        if self.interleave <= 1:
            return [row]
        return [s for s in range(self.n_stages) if s % self.n_rows == row]

    def block_in_row(self, row: int, t_ns: int, tolerance_ns: int = 0,
                     kinds: Sequence[str] = KINDS) -> Block | None:
        """The block under time t in a drawn row (any of its stages), nearest first."""
        found = [b for b in (self.block_at(s, t_ns, tolerance_ns, kinds) for s in self.stages_in_row(row))
                 if b is not None]
        if not found:
            return None
        return min(found, key=lambda b: (0 if b.start_ns <= t_ns <= b.end_ns
                                         else min(abs(t_ns - b.start_ns), abs(t_ns - b.end_ns))))

    @property
    def n_stages(self) -> int:
        stages = set(self.stage_devices) | {s for _, s in self._lanes}
        return max(stages) + 1 if stages else 0

    def _lane(self, kind: str, stage: int) -> _Lane:
        lane = self._lanes.get((kind, stage))
        if lane is None:
            if kind not in KINDS:
                raise ValueError(f"unknown event kind {kind!r}: allowed {', '.join(KINDS)}")
            lane = self._lanes[(kind, stage)] = _Lane()
        return lane

    def _note_id(self, note: str) -> int:
        i = self._note_ids.get(note)
        if i is None:
            i = self._note_ids[note] = len(self._notes)
            self._notes.append(note)
        return i

    # ------------------------------------------------------------------ adding
    def add(self, events: Iterable[StageEvent]) -> int:
        """Add engine events (one coalesced batch); events of another run are refused.

        Returns how many were added."""
        groups: dict[tuple[str, int], list[tuple[int, int, int, int, int, int]]] = {}
        added = 0
        for ev in events:
            if self.run_id and ev.run_id != self.run_id:
                self.dropped += 1
                continue
            if ev.stage not in self.stage_devices:
                self.stage_devices[ev.stage] = ev.device
            groups.setdefault((ev.kind, ev.stage), []).append(
                (ev.chunk, ev.start_ns, ev.end_ns, ev.tokens, ev.nbytes, self._note_id(ev.note)))
            added += 1
        for (kind, stage), rows in groups.items():
            cols = np.array(rows, dtype=_INT).T
            self._lane(kind, stage).append(cols[0].astype(np.int32), cols[1], cols[2], cols[3], cols[4],
                                           cols[5].astype(np.int32))
            self._end_ns = max(self._end_ns, int(cols[2].max()))
        return added

    def add_columns(self, kind: str, stage: np.ndarray, chunk: np.ndarray, start_ns: np.ndarray,
                    end_ns: np.ndarray, tokens: np.ndarray | None = None, nbytes: np.ndarray | None = None,
                    note: str = "") -> None:
        """Bulk path (recorded timelines, benchmarks): columns of one kind, any stages."""
        stage = np.asarray(stage, dtype=np.int32)
        start_ns = np.asarray(start_ns, dtype=_INT)
        end_ns = np.asarray(end_ns, dtype=_INT)
        chunk = np.asarray(chunk, dtype=np.int32)
        tokens = np.zeros_like(start_ns) if tokens is None else np.asarray(tokens, dtype=_INT)
        nbytes = np.zeros_like(start_ns) if nbytes is None else np.asarray(nbytes, dtype=_INT)
        note_id = self._note_id(note)
        for s in np.unique(stage):
            m = stage == s
            self._lane(kind, int(s)).append(chunk[m], start_ns[m], end_ns[m], tokens[m], nbytes[m],
                                            np.full(int(m.sum()), note_id, dtype=np.int32))
            self.stage_devices.setdefault(int(s), "")
        if end_ns.size:
            self._end_ns = max(self._end_ns, int(end_ns.max()))

    # ----------------------------------------------------------------- queries
    def count(self, kind: str | None = None, stage: int | None = None) -> int:
        return sum(lane.n for (k, s), lane in self._lanes.items()
                   if (kind is None or k == kind) and (stage is None or s == stage))

    def __len__(self) -> int:
        return self.count()

    @property
    def end_ns(self) -> int:
        """The latest end of any block (the live edge); origin_ns when empty."""
        return self._end_ns

    def span_ns(self) -> tuple[int, int]:
        """(earliest start, latest end) over all blocks; (origin, origin) when empty."""
        starts = [int(lane.start[: lane.n].min()) for lane in self._lanes.values() if lane.n]
        if not starts:
            return self.origin_ns, self.origin_ns
        return min(starts), self._end_ns

    def blocks(self, kind: str, stage: int | None = None) -> Blocks:
        """Every block of a kind (optionally one stage)."""
        return self.visible(kind, np.iinfo(_INT).min // 2, np.iinfo(_INT).max // 2, stage)

    def visible(self, kind: str, a_ns: int, b_ns: int, stage: int | None = None) -> Blocks:
        """Blocks of `kind` overlapping [a_ns, b_ns] (absolute ns), lane by lane."""
        parts = []
        for (k, s), lane in sorted(self._lanes.items()):
            if k != kind or (stage is not None and s != stage) or lane.n == 0:
                continue
            idx = lane.window(a_ns, b_ns)
            if idx.size:
                parts.append((s, lane, idx))
        if not parts:
            return Blocks.empty(kind)
        return Blocks(
            kind,
            np.concatenate([np.full(idx.size, s, dtype=np.int32) for s, _, idx in parts]),
            np.concatenate([lane.chunk[idx] for _, lane, idx in parts]),
            np.concatenate([lane.start[idx] for _, lane, idx in parts]),
            np.concatenate([lane.end[idx] for _, lane, idx in parts]),
            np.concatenate([lane.tokens[idx] for _, lane, idx in parts]),
            np.concatenate([lane.nbytes[idx] for _, lane, idx in parts]),
        )

    def visible_runs(self, kind: str, a_ns: int, b_ns: int, min_gap_ns: int, merge_above: int = 0) -> Runs:
        """What to draw for [a_ns, b_ns] when a pixel is `min_gap_ns` wide: the visible blocks of
        each stage, where a stage with more than `merge_above` of them has neighbours less than a
        pixel apart merged into one rectangle.  A zoomed-out view of 100,000 blocks then draws at
        most about one rectangle per pixel column and row."""
        stages, starts, ends = [], [], []
        merged = False
        for (k, s), lane in sorted(self._lanes.items()):
            if k != kind or lane.n == 0:
                continue
            idx = lane.window(a_ns, b_ns)
            if idx.size == 0:
                continue
            st, en = lane.start[idx], lane.end[idx]
            if min_gap_ns > 0 and idx.size > max(merge_above, 1):
                merged = True
                reach = np.maximum.accumulate(en)
                brk = np.flatnonzero(st[1:] - reach[:-1] > min_gap_ns) + 1
                first = np.concatenate(([0], brk))
                st = st[first]
                en = np.maximum.reduceat(en, first)
            stages.append(np.full(st.size, s, dtype=np.int32))
            starts.append(st)
            ends.append(en)
        if not starts:
            z = np.zeros(0, dtype=_INT)
            return Runs(np.zeros(0, dtype=np.int32), z, z)
        return Runs(np.concatenate(stages), np.concatenate(starts), np.concatenate(ends), merged)

    def block_at(self, stage: int, t_ns: int, tolerance_ns: int = 0,
                 kinds: Sequence[str] = KINDS) -> Block | None:
        """The block of `stage` under time t (within `tolerance_ns`), first by `kinds` order."""
        best: tuple[int, int, Block] | None = None
        for rank, kind in enumerate(kinds):
            lane = self._lanes.get((kind, stage))
            if lane is None or lane.n == 0:
                continue
            idx = lane.window(t_ns - tolerance_ns, t_ns + tolerance_ns)
            if idx.size == 0:
                continue
            st, en = lane.start[idx], lane.end[idx]
            dist = np.where(t_ns < st, st - t_ns, np.where(t_ns > en, t_ns - en, 0))
            j = int(np.argmin(dist))
            cand = (int(dist[j]), rank)
            if best is None or cand < best[:2]:
                i = int(idx[j])
                best = (*cand, Block(kind, stage, self.stage_devices.get(stage, ""), int(lane.chunk[i]),
                                     int(lane.start[i]), int(lane.end[i]), int(lane.tokens[i]),
                                     int(lane.nbytes[i]), self._notes[int(lane.note[i])]))
        return best[2] if best is not None else None

    def compute_pairs(self) -> np.ndarray:
        """(stage, chunk) of every prefill compute block (chunk >= 0), one row each."""
        b = self.blocks("compute")
        m = b.chunk >= 0
        return np.stack([b.stage[m], b.chunk[m]], axis=1) if b.stage.size else np.zeros((0, 2), dtype=np.int32)

    def one_compute_per_stage_chunk(self, n_stages: int, n_chunks: int) -> tuple[bool, str]:
        """True when the compute blocks are exactly one per (stage, chunk), and what was found."""
        pairs = self.compute_pairs()
        want = n_stages * n_chunks
        uniq = {(int(s), int(c)) for s, c in pairs}
        expected = {(s, c) for s in range(n_stages) for c in range(n_chunks)}
        if len(pairs) == want and uniq == expected:
            return True, f"{want} compute blocks, one per (stage, chunk) for {n_stages} stages x {n_chunks} chunks"
        missing = sorted(expected - uniq)[:5]
        extra = sorted(uniq - expected)[:5]
        return False, (f"{len(pairs)} compute blocks ({len(uniq)} distinct) for {n_stages} stages x "
                       f"{n_chunks} chunks = {want}; missing {missing or 'none'}, unexpected {extra or 'none'}")

