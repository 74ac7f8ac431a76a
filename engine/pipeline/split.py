"""The threaded executor's chain: a session's stages (see engine/pipeline/session.py for the order).

`Split.prefill` is the root prefill loop: stage 0 runs each chunk in the caller's thread and
the chain hands it on; a guard drains every chunk in flight on every path (the finish guard).
`Split.prefill_main` runs the whole prefill on the main device, then copies the later layers'
KV to the stages that own them.  `Split.decode` runs greedy decode steps through the chain.
The stage workers are kept from run to run until `stop`.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from engine.errors import Cancelled
from engine.models.kv import LayerKV, copy_state
from engine.models.layers import Head, Layer
from engine.pipeline.stage import Stage, StageContext, _Worker

log = logging.getLogger(__name__)


class Split:
    def __init__(self, stages: Sequence[Stage], devices: Sequence[torch.device]) -> None:
        self.stages = list(stages)
        self.devices = list(devices)

    def reset(self) -> None:
        """Before a prefill: no compute of an earlier run orders this one's."""
        for st in self.stages:
            st.done = st.prev_end = None

    def prefill(self, ctx: StageContext, bounds: Sequence[tuple[int, int]], cancel: threading.Event | None) -> None:
        """Every chunk through the chain; never returns (or raises) with chunks in flight."""
        self.start_workers()
        try:
            for c, (pos, n) in enumerate(bounds):
                if cancel is not None and cancel.is_set():
                    raise Cancelled()
                self.stages[0].run(ctx, c, pos, n)
            self.finish(ctx)
        except BaseException:
            self.guard(ctx)  # the finish guard: never return with chunks in flight
            raise
        self.guard(ctx)

    def prefill_main(self, ctx: StageContext, bounds: Sequence[tuple[int, int]], cancel: threading.Event | None,
                     layers: list[Layer], kvs: list[LayerKV], head: Head) -> None:
        """Prefill-main: every chunk through all `layers` on the main device, then the KV of the
        later layers to the stages that own them (peer copy where available)."""
        main = self.stages[0]
        note = f"prefill-main: layers 0-{len(layers) - 1}"
        try:
            for c, (pos, n) in enumerate(bounds):
                if cancel is not None and cancel.is_set():
                    raise Cancelled()
                prev = main.done
                x = main.head.embed_tokens(ctx.prompt_ids[pos:pos + n])
                x = main.compute(ctx, x, layers, kvs, pos, c, n, note=note)
                main.finish_chunk(ctx, x, pos, n, head)
                main.throttle(prev)
            extra = kvs[len(main.layers):]
            for st in self.stages[1:]:
                st.receive_kv(ctx, lambda i, kv: copy_state(kv, extra[i - main.end]), main.name)  # noqa: B023  (called now)
        except BaseException:
            self.guard(ctx)
            raise
        self.drain_devices()

    def decode(self, ctx: StageContext, first_token: int, steps: int, pos: int,
               cancel: threading.Event | None) -> list[int]:
        """Greedy decode through the chain; generated[0] = first_token."""
        out = [first_token]
        tok = first_token
        for i in range(1, steps):
            if cancel is not None and cancel.is_set():
                raise Cancelled()
            x: torch.Tensor | None = None
            for st in self.stages:
                x = st.head.embed_tokens(torch.tensor([tok])) if st.index == 0 else x.to(st.device)
                x, last_tok = st.decode_step(ctx, x, pos, i)
                if last_tok is not None:
                    tok = last_tok
            out.append(tok)
            pos += 1
        return out

    # ----------------------------------------------------------------- workers
    def start_workers(self) -> None:
        """One worker thread per stage after the first, kept from run to run until `stop`: a
        fresh thread pays CUDA's per-thread set-up inside the first chunk (measured 50-70 ms of
        stage 1's first chunk on H200)."""
        for st in self.stages[1:]:
            if st.worker is None or not st.worker.thread.is_alive():
                st.worker = _Worker(f"strata-stage{st.index}")

    def finish(self, ctx: StageContext | None = None) -> None:
        """Join the whole chain: each stage reaps its outstanding job, first to last, then every
        device finishes what was queued (GPU timings are delivered by the timer's `flush()`)."""
        for st in self.stages:
            st.finish(ctx)
        self.drain_devices()

    def drain_devices(self) -> None:
        for d in dict.fromkeys(self.devices):
            if d.type == "cuda":
                torch.cuda.synchronize(d)

    def guard(self, ctx: StageContext | None = None) -> None:
        """Drain every in-flight chunk whatever happened; the idle workers stay for the next run."""
        for st in self.stages:
            try:
                st.finish(ctx)
            except BaseException as exc:  # already surfacing (or secondary): never leave chunks running
                log.debug("drained stage %d after error: %s", st.index, exc)
        try:
            self.drain_devices()
        except BaseException as exc:
            log.debug("draining devices after error: %s", exc)

    def in_flight(self) -> int:
        """Chunks submitted and not yet reaped, or still running (0 whenever prefill returned)."""
        return sum((st.pending is not None) + (st.worker is not None and st.worker.busy.is_set())
                   for st in self.stages)

    def worker_threads(self) -> list[threading.Thread]:
        """The stage workers' threads (alive between runs, stopped by `stop`)."""
        return [st.worker.thread for st in self.stages if st.worker is not None and st.worker.thread.is_alive()]

    def stop(self) -> None:
        self.guard()
        for st in self.stages[1:]:
            if st.worker is not None:
                st.worker.stop()
                st.worker = None
