"""Live progress of one run, from its RunPlan and the engine's events (no Qt).

A prefill chunk is done when the stage that finishes chunks has computed it: the last stage, or
stage 0 with prefill-main (it runs every layer).  A decode step is done when the last stage has
run it.  Rates come from the events' own times, so the figures are the engine's clock.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.events import RunPlan, StageEvent


@dataclass(frozen=True)
class ProgressSnapshot:
    phase: str  # "prefill" | "decode" | "done"
    chunks_done: int
    n_chunks: int
    decode_done: int
    decode_total: int
    tokens_done: int
    tok_s: float | None  # live rate of the current phase
    seconds_left: float | None

    @property
    def done(self) -> int:
        return self.chunks_done + self.decode_done

    @property
    def total(self) -> int:
        return self.n_chunks + self.decode_total

    def text(self) -> str:
        if self.phase == "decode":
            head = f"decode {self.decode_done}/{self.decode_total} steps"
            rate = f"{self.tok_s:,.1f} tok/s" if self.tok_s else "— tok/s"
        else:
            head = f"prefill {self.chunks_done}/{self.n_chunks} chunks"
            rate = f"{self.tok_s:,.0f} tok/s" if self.tok_s else "— tok/s"
        left = "—" if self.seconds_left is None else _fmt_seconds(self.seconds_left)
        return f"{head} · {rate} · {left} left"


def _fmt_seconds(s: float) -> str:
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    return f"{int(s // 60)} min {int(s % 60):02d} s"


class RunProgress:
    def __init__(self, plan: RunPlan) -> None:
        self.plan = plan
        n_stages = len(plan.stages)
        self.finisher = 0 if plan.prefill_main else n_stages - 1
        self.last_stage = n_stages - 1
        self.decode_total = max(plan.decode_tokens - 1, 0)
        self._chunks: set[int] = set()
        self._tokens = 0
        self._prefill_start: int | None = None
        self._prefill_end = 0
        self._decode_steps: set[int] = set()
        self._decode_start: int | None = None
        self._decode_end = 0

    def add(self, events: Iterable[StageEvent]) -> None:
        for ev in events:
            if ev.run_id != self.plan.run_id:
                continue
            if ev.kind == "compute" and ev.chunk >= 0:
                if self._prefill_start is None or ev.start_ns < self._prefill_start:
                    self._prefill_start = ev.start_ns
                if ev.stage == self.finisher and ev.chunk not in self._chunks:
                    self._chunks.add(ev.chunk)
                    self._tokens += ev.tokens
                    self._prefill_end = max(self._prefill_end, ev.end_ns)
            elif ev.kind == "decode":
                if self._decode_start is None or ev.start_ns < self._decode_start:
                    self._decode_start = ev.start_ns
                if ev.stage == self.last_stage and ev.chunk not in self._decode_steps:
                    self._decode_steps.add(ev.chunk)
                    self._decode_end = max(self._decode_end, ev.end_ns)

    def snapshot(self) -> ProgressSnapshot:
        n_chunks = self.plan.n_chunks
        chunks = len(self._chunks)
        steps = len(self._decode_steps)
        if chunks < n_chunks or self.decode_total == 0:
            phase = "prefill" if chunks < n_chunks else "done"
            rate = left = None
            if chunks and self._prefill_start is not None and self._prefill_end > self._prefill_start:
                elapsed = (self._prefill_end - self._prefill_start) / 1e9
                rate = self._tokens / elapsed
                left = elapsed / chunks * (n_chunks - chunks)  # decode time is unknown until it starts
            return ProgressSnapshot(phase, chunks, n_chunks, steps, self.decode_total, self._tokens, rate, left)
        phase = "decode" if steps < self.decode_total else "done"
        rate = left = None
        if steps and self._decode_start is not None and self._decode_end > self._decode_start:
            elapsed = (self._decode_end - self._decode_start) / 1e9
            rate = steps / elapsed
            left = elapsed / steps * (self.decode_total - steps)
        return ProgressSnapshot(phase, chunks, n_chunks, steps, self.decode_total, self._tokens, rate, left)
