"""What a run will hold where, computed before anything is loaded (shown before Run).

Per device: dense weights (expanded once to the compute dtype; norms and the router in fp32),
experts (resident as stored, or the cache's slots as stored), the KV cache for the run's
tokens, and the scratch the experts are expanded into before their GEMMs.  On the host: the
expert arena (experts as stored, when they are streamed) and how much of it the pin limit will
page-lock.  The same rules as `Session` (layer split, `plan_experts`, `resolve_pin_limit`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine import models
from engine.config import EngineConfig
from engine.models.experts import (
    EXPAND_SCRATCH_BYTES,
    ExpertLayout,
    arena_bytes,
    expert_elems,
    expert_qtypes,
    plan_experts,
    resolve_pin_limit,
)
from engine.models.layers import resolve_dtype
from engine.plan.chunking import CPU_CANDIDATES, fewest_chunks
from engine.plan.layer_ranges import split_layers
from engine.quant.dequant import gpu_temporaries
from engine.sizes import size_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _StageShape:  # what plan_experts reads of a stage
    index: int
    device: torch.device
    first: int
    end: int


@dataclass(frozen=True)
class DevicePlan:
    stage: int
    device: str
    first: int
    end: int
    dense: int
    experts: int
    expert_slots: int  # experts the device holds (resident: all of its layers')
    kv: int
    scratch: int
    attention: int = 0  # a CPU stage's attention scores at the last chunk (SDPA's math kernel holds them)
    state: int = 0  # of `kv`, what does not grow with the tokens: recurrent layers' state (GDN's conv + matrices)

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.kv + self.scratch + self.attention


def cpu_expert_batch(spec, expanded_expert: int) -> int:
    """Experts a CPU stage expands at once (routed_experts.batches' budget, whole experts)."""
    from engine.models.routed_experts import REFERENCE_SCRATCH_BYTES

    return min(spec.n_experts, max(REFERENCE_SCRATCH_BYTES // max(expanded_expert, 1), 1))


CPU_MIN_CHUNK = 16  # the smallest chunk a CPU plan picks: the lower bound when the chunk is auto


def cpu_attention_bytes(spec, config: EngineConfig, tokens: int) -> int:
    """The float32 scores a CPU stage's attention holds for the last chunk of `tokens`: heads x
    chunk x keys (PyTorch's CPU SDPA materialises them; GPU kernels do not). With chunk auto on one
    CPU stage the chunk is known (`chunking.fewest_chunks`: the fewest, of at most 2048 tokens);
    elsewhere the smallest CPU chunk is taken, so the figure is a floor, never an overstatement."""
    if isinstance(config.chunk_tokens, int):
        chunk = config.chunk_tokens
    elif fewest_chunks(torch.device(config.devices[0]), 1 if config.prefill_main else len(config.devices),
                       config.chunk_schedule):
        chunk = CPU_CANDIDATES[-1]  # auto's pick there is known: the fewest chunks (run_plan.choice)
    else:
        chunk = CPU_MIN_CHUNK
    return spec.n_heads * min(chunk, tokens) * tokens * 4


@dataclass(frozen=True)
class MemoryPlan:
    devices: tuple[DevicePlan, ...]
    streamed: bool
    host_arena: int
    pin_lock: int
    pin_note: str
    tokens: int

    def render(self) -> str:
        lines = []
        for d in self.devices:
            experts = (f"expert cache {size_text(d.experts)} ({d.expert_slots} slots)" if self.streamed
                       else f"experts {size_text(d.experts)}")
            lines.append(f"stage {d.stage} {d.device} (layers {d.first}-{d.end - 1}): dense {size_text(d.dense)}, "
                         f"{experts}, KV {size_text(d.kv)} ({self.tokens} tokens"
                         + (f"; recurrent state {size_text(d.state)} of it" if d.state else "")
                         + f"), scratch {size_text(d.scratch)}"
                         + (f", attention scores {size_text(d.attention)}" if d.attention else "")
                         + f"; total {size_text(d.total)}")
        if self.streamed:
            lines.append(f"host arena {size_text(self.host_arena)} (experts as stored), "
                         f"page-locked {size_text(self.pin_lock)} ({self.pin_note})")
        else:
            lines.append("host arena: none (every expert resident on its device)")
        return "\n".join(lines)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _dense_bytes(spec, st: _StageShape, last: bool, dsize: int) -> int:
    """What a stage holds of everything but the experts, as loaded: its layers' parts as their
    family declares them (norms and the router in float32, the rest in the stage dtype), the
    embedding on the first stage (and the last, when the head is tied), the head on the last."""
    fam = models.family_of(spec)
    dense = sum(_numel(p.shape) * (4 if p.fp32 else dsize)
                for i in range(st.first, st.end) for p in fam.layer_parts(spec, i) if not p.expert)
    embed = _numel((spec.vocab, spec.hidden)) * dsize
    if st.index == 0 or (last and spec.tied_embeddings):
        dense += embed
    if last:
        dense += spec.hidden * 4 + (0 if spec.tied_embeddings else embed)
    return dense


def plan_memory(source, config: EngineConfig, tokens: int) -> MemoryPlan:
    """The memory plan of `source` run with `config` over `tokens` tokens (prompt + decode)."""
    spec = source.spec
    devices = [torch.device(d) for d in config.devices]
    dtypes = {d: resolve_dtype(d, config.dtype) for d in devices}
    ranges = split_layers(spec.n_layers, len(devices), config.layer_split)
    stages = [_StageShape(i, d, a, b) for i, (d, (a, b)) in enumerate(zip(devices, ranges))]
    layouts = [ExpertLayout.of(source, spec, i) for i in range(spec.n_layers)] if spec.is_moe else []
    slot_bytes = max((lay.row_bytes for lay in layouts), default=0)
    eplan = plan_experts(config.expert_cache, spec, stages, dtypes, slot_bytes or None, expert_qtypes(layouts))
    out = []
    for st in stages:
        dsize = torch.empty((), dtype=dtypes[st.device]).element_size()
        dense = _dense_bytes(spec, st, st.index == len(stages) - 1, dsize)
        expanded_expert = expert_elems(spec) * dsize
        experts = slots = scratch = 0
        if spec.is_moe:
            if eplan.streamed:
                slots = eplan.slots_per_stage[st.index]
                experts = slots * slot_bytes
                batch = min(slots, spec.n_experts, max(EXPAND_SCRATCH_BYTES // expanded_expert, 1))
            else:
                slots = spec.expert_layers(st.first, st.end) * spec.n_experts
                experts = sum(layouts[i].row_bytes for i in range(st.first, st.end)) * spec.n_experts
                batch = spec.n_experts
            # the GPU expands a batch of experts for its grouped GEMM; the CPU a batch of whole
            # experts within routed_experts.REFERENCE_SCRATCH_BYTES (Layer._reference_experts)
            scratch = (batch * expanded_expert + gpu_temporaries(st.device, expert_qtypes(layouts[st.first:st.end]),
                                                                 dtypes[st.device])
                       if st.device.type == "cuda" else cpu_expert_batch(spec, expanded_expert) * expanded_expert)
            floats = all(p.qtype.name in ("F32", "F16", "BF16") for i in range(st.first, st.end)
                         for p in layouts[i].parts)
            if floats and not eplan.streamed:  # float experts are expanded once at load, as dense
                experts, scratch = spec.expert_layers(st.first, st.end) * spec.n_experts * expanded_expert, 0
        if st.end > st.first:  # a layer kind's own transient of the last chunk (MLA's expanded k/v)
            scratch += spec.attention_scratch_bytes(config.chunk_tokens if isinstance(config.chunk_tokens, int)
                                                    else None, tokens, dsize)
        kv = models.states_bytes(spec, range(st.first, st.end), tokens, dtypes[st.device])
        state = models.states_bytes(spec, range(st.first, st.end), 0, dtypes[st.device])  # none grows at 0 tokens
        attends = kv > state or not tokens  # a stage of recurrent layers only holds no attention scores
        attention = cpu_attention_bytes(spec, config, tokens) if st.device.type == "cpu" and attends else 0
        out.append(DevicePlan(st.index, str(st.device), st.first, st.end, dense, experts, slots, kv, scratch,
                              attention, state))
    host = pin = 0
    note = "no arena"
    if eplan.streamed:
        host = arena_bytes(layouts, spec.n_experts)
        pin, note = resolve_pin_limit(config.pin_limit_gib, host, any(d.type == "cuda" for d in devices))
    return MemoryPlan(tuple(out), eplan.streamed, host, pin, note, tokens)
