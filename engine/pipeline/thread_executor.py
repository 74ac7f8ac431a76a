"""The threaded executor (`executor=threads`): every stage in this process, one thread each.

`ThreadExecutor` is what a `Session` holds when its stages run as threads: it loads each
stage's layers and head into this process (engine/pipeline/stage_runtime.py, through the session's
fault hook), fills the streamed-expert arena, chooses the hand-off between neighbours, sizes the
stages' buffers and runs prefills and decodes through the chain (engine/pipeline/split.py `Split`).
`engine.pipeline.executor.ProcessExecutor` is the same interface over stage processes.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
from typing import TYPE_CHECKING

import torch

from engine import models
from engine.config import ConfigError
from engine.errors import Cancelled
from engine.models.experts import ExpertStats, HostArena, arena_bytes, resolve_pin_limit
from engine.models.kv import LayerKV
from engine.models.layers import Head, Layer, Rope
from engine.pipeline.split import Split
from engine.pipeline.stage import PipelineHooks, StageContext
from engine.plan import chunk_cost

if TYPE_CHECKING:
    from engine.pipeline.run import Run
    from engine.pipeline.session import Session

log = logging.getLogger(__name__)


class ThreadExecutor:
    """The stages of a session as threads of this process (see the module doc)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.split = Split(session.stages, session.devices)
        self.arena: HostArena | None = None
        self._main_extra: list[Layer] | None = None  # prefill-main: later layers on the main device
        self._main_head: Head | None = None

    # ------------------------------------------------------------------- set-up
    def load(self) -> None:
        """The streamed-expert arena (when the plan streams), then every stage's layers and head."""
        s = self.session
        if s.expert_plan.streamed:
            self._build_arena()
        layer_bytes, embed_bytes, out_bytes = self._load_shares()
        total = max(1, sum(layer_bytes.values()) + embed_bytes + out_bytes)
        done = 0
        ropes: dict[torch.device, Rope] = {}
        streamed = self.arena is not None
        for st in s.stages:
            rope = ropes.setdefault(st.device, Rope.for_spec(s.spec, st.device))

            def before(i: int) -> None:
                if s._load_cancel is not None and s._load_cancel.is_set():
                    raise Cancelled(f"loading cancelled before layer {i}")
                s._progress(f"loading layer {i} to {st.name}", done / total)  # noqa: B023  (called in this loop)

            def after(i: int) -> None:
                nonlocal done
                done += layer_bytes.get(i, 0)

            st.layers = st.load_layers(s.source, rope, range(st.first, st.end), streamed, s._alloc, before, after)
            parts = [p for p, on in (("the token embedding", st.index == 0 and embed_bytes),
                                     ("the output head", st.last and out_bytes)) if on]
            if parts:
                s._progress(f"loading {' and '.join(parts)} to {st.name}", done / total)
            st.head = st.load_head(s.source, embed=st.index == 0, final=st.last)
            done += (embed_bytes if st.index == 0 else 0) + (out_bytes if st.last else 0)
            s._progress(f"loaded the layers of {st.name}", done / total)

    def _build_arena(self) -> None:
        """Streamed experts: the host arena (pinned up to the limit) and a cache per stage."""
        s = self.session
        cuda = any(d.type == "cuda" for d in s.devices)
        n_bytes = arena_bytes(s.expert_layouts, s.spec.n_experts)  # the experts as stored
        limit, note = resolve_pin_limit(s.config.pin_limit_gib, n_bytes, cuda)  # refuses before allocating
        s._progress("filling the host expert arena", 0.0)
        self.arena = HostArena(s.source, s.spec, range(s.spec.n_layers),
                               lambda frac: s._progress("filling the host expert arena", frac))
        self.arena.pin(limit, note)
        s.setup_notes.append(f"experts {s.expert_plan.reason}; arena {self.arena.nbytes / 2**30:.2f} GiB, "
                             f"{self.arena.pinned_bytes / 2**30:.2f} GiB page-locked ({self.arena.pin_note})")
        for st, n_slots in zip(s.stages, s.expert_plan.slots_per_stage):
            st.use_cache(self.arena, n_slots, ExpertStats(st.index, st.name), s._alloc)

    def _load_shares(self) -> tuple[dict[int, int], int, int]:
        """Bytes of each layer in the file (its experts left out when they stream), of the token
        embedding and of the output head as expanded (dequantised at load): the load's progress is
        the share of these done, so a big embedding or head (151,936 x 2,048 in Qwen3, tens of
        seconds to dequantise on a CPU) is a named step of its size, not a stall after the last
        layer's percentage."""
        s = self.session
        nbytes = getattr(s.source, "nbytes", None)
        names = list(s.source.tensor_names()) if hasattr(s.source, "tensor_names") else []
        if nbytes is None or not names:
            return {i: 1 for i in range(s.spec.n_layers)}, 0, 0
        streamed = s.expert_plan.streamed
        layer = dict.fromkeys(range(s.spec.n_layers), 0)
        for name in names:
            head, _, rest = name.partition(".")
            if head == "blk" and rest.split(".")[0].isdigit() and not (streamed and "_exps" in name):
                i = int(rest.split(".")[0])
                if i in layer:
                    layer[i] += nbytes(name)

        def expanded(name: str) -> int:  # the heads are dequantised at load: that, not the read, is their cost
            return max(nbytes(name), 4 * math.prod(s.source.shape(name)))

        embed = expanded("token_embd.weight") if "token_embd.weight" in names else 0
        out = expanded("output.weight") if "output.weight" in names else embed
        return layer, embed, out

    def choose_handoffs(self) -> None:
        want = self.session.config.handoff
        for a in self.session.stages[:-1]:
            b = a.successor
            if a.device == b.device:
                a.handoff = "same-device"
            elif a.device.type == "cuda" and b.device.type == "cuda":
                peer = torch.cuda.can_device_access_peer(a.device.index or 0, b.device.index or 0)
                if want == "peer" and not peer:
                    raise ConfigError("handoff", "peer", "auto or host",
                                      f"{a.name} cannot access {b.name} peer-to-peer")
                a.handoff = "peer" if (peer and want != "host") else "host"
            else:
                a.handoff = "host"

    def measure_layer(self, shape: chunk_cost.ProbeShape) -> chunk_cost.Measured:
        st = self.session.stages[0]
        return chunk_cost.measure_layers(st.layers, st.device, st.dtype, self.session.config.cuda_graphs, shape)

    # ------------------------------------------------------------------ buffers
    def prepare(self, capacity: int, chunk: int, hooks: PipelineHooks | None = None) -> None:
        """Every stage's KV for `capacity` tokens and buffers for `chunk`-token chunks."""
        s = self.session
        spec = s.spec

        def alloc(what, device, nbytes, advice, make):
            return s._alloc(what, device, nbytes, advice, make, hooks)

        for st in s.stages:
            st.prepare(capacity, chunk, spec.n_kv_heads, spec.head_dim, spec.hidden, alloc)

    def free_run_buffers(self) -> None:
        """After a failed run: drop per-run buffers so device memory returns to its level."""
        for st in self.session.stages:
            st.free_buffers()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _prepare_main(self, capacity: int, hooks: PipelineHooks) -> tuple[list[Layer], list[LayerKV]]:
        """Prefill-main: every later layer also on the main device, with main-device KV."""
        s = self.session
        main, spec = s.stages[0], s.spec
        dt = main.dtype

        def alloc(what, device, nbytes, advice, make):
            return s._alloc(what, device, nbytes, advice, make, hooks)

        if self._main_extra is None:
            self._main_extra = main.load_layers(s.source, main.layers[0].rope, range(main.end, spec.n_layers),
                                                self.arena is not None, alloc)
            last = s.stages[-1]
            self._main_head = main.head if last is main else main.load_head(s.source, True, True)
        idx = range(main.end, spec.n_layers)
        kvs = alloc(f"prefill-main KV for layers {main.end}-{spec.n_layers - 1}", main.device,
                    models.states_bytes(spec, idx, capacity, dt), "turn prefill-main off or shorten the prompt",
                    lambda: models.new_states(spec, idx, capacity, main.device, dt))
        return main.layers + self._main_extra, main.kvs + kvs

    # -------------------------------------------------------------------- running
    def prefill(self, run: Run, ctx: StageContext) -> None:
        """Every chunk of the run's plan through the stages, or through the main device with
        prefill-main; the last layer's output goes to `ctx.output`."""
        s = self.session
        bounds = run.plan.chunk_bounds()
        ctx = dataclasses.replace(ctx, prompt_ids=run.ids.to(s.devices[0]))
        self.split.reset()
        if s.config.prefill_main and len(s.stages) > 1:
            layers, kvs = self._prepare_main(run.n_prompt + 1, run.hooks)
            self.split.prefill_main(ctx, bounds, run.cancel, layers, kvs, self._main_head)
        else:
            self.split.prefill(ctx, bounds, run.cancel)

    def decode(self, ctx: StageContext, first_token: int, steps: int, pos: int,
               cancel: threading.Event | None) -> list[int]:
        return self.split.decode(ctx, first_token, steps, pos, cancel)

    def finish(self) -> None:
        self.split.finish()

    def in_flight(self) -> int:
        return self.split.in_flight()

    def worker_threads(self) -> list[threading.Thread]:
        return self.split.worker_threads()

    def stage_pids(self) -> list[int]:
        return []

    def close(self) -> None:
        """Stop the stage workers and free what the stages hold."""
        self.split.stop()
        for st in self.session.stages:
            st.release()
            st.host_buf = None
        self._main_extra = None
        self._main_head = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
