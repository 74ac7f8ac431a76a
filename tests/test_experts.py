"""Expert streaming on CPU: the arena, the LRU cache, the pin limit, and identical outputs."""
from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, EngineConfig
from engine.io import gguf_model
from engine.io.prompt import synthetic
from engine.models.experts import EXPERT_PARTS, ExpertCache, ExpertStats, HostArena, physical_ram, resolve_pin_limit
from engine.pipeline.session import Session
from engine.quant import dequant


@pytest.fixture(scope="module")
def demo(demo_path):
    return gguf_model.load(demo_path)


def one_layer_of_experts(demo) -> float:
    """GiB of one layer's experts as stored (the cache holds them so)."""
    return sum(demo.nbytes(f"blk.0.{p}.weight") for p in EXPERT_PARTS) / 2**30


def test_arena_rows_hold_each_experts_blocks_as_stored(demo):
    """An arena row is the expert's gate, up and down blocks exactly as in the file (never
    expanded); expanded, they are the expert's weights."""
    s = demo.spec
    arena = HostArena(demo, s, range(s.n_layers))
    row, pinned = arena.row(2, 5)
    assert not pinned and row.is_contiguous() and row.dtype == torch.uint8
    lay = arena.layouts[2]
    assert row.numel() == lay.row_bytes == sum(demo.nbytes(f"blk.2.{p}.weight") for p in EXPERT_PARTS) // 8
    assert arena.nbytes == 3 * s.n_layers * s.n_experts * s.expert_ffn * s.hidden * 34 // 32  # Q8_0 blocks
    for part, name in zip(lay.parts, EXPERT_PARTS):
        full = f"blk.2.{name}.weight"
        blocks = row[part.offset:part.offset + part.nbytes]
        assert torch.equal(blocks, demo.raw(full).view(8, -1)[5])
        assert torch.equal(dequant.dequantize(blocks, part.qtype, part.shape), demo.tensor(full)[5])


def test_lru_hits_and_misses_follow_a_hand_computed_sequence(demo):
    s = demo.spec
    arena = HostArena(demo, s, range(s.n_layers))
    stats = ExpertStats()
    cache = ExpertCache(arena, torch.device("cpu"), 3, stats)
    steps = [  # (layer, experts) -> expected (hits, misses) after the step
        ((0, [1, 2]), (0, 2)),  # cold: [1, 2]
        ((0, [2, 3]), (1, 3)),  # 2 hit, 3 miss: [1, 2, 3] full
        ((0, [4]), (1, 4)),  # evicts LRU = 1: [2, 3, 4]
        ((0, [2]), (2, 4)),  # hit, 2 becomes MRU: [3, 4, 2]
        ((0, [1]), (2, 5)),  # 1 was evicted: miss, evicts 3: [4, 2, 1]
        ((0, [3, 4]), (3, 6)),  # 3 miss (evicts 2), 4 hit
        ((1, [4]), (3, 7)),  # same expert id, other layer: a different key
    ]
    for (layer, experts), (hits, misses) in steps:
        slots = cache.ensure(layer, experts, chunk=0)
        assert (stats.hits, stats.misses) == (hits, misses)
        for e, sl in zip(experts, slots):  # the slot holds exactly that expert's row
            row = arena.row(layer, e)[0]
            assert torch.equal(cache.pool[sl, :row.numel()], row)
    assert list(cache.lru) == [(0, 1), (0, 3), (0, 4), (1, 4)][-3:]


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_cache_smaller_than_a_layer_gives_the_resident_digest(demo, devices):
    ids = synthetic(96, demo.spec.vocab, nonce=4)
    resident = Session(demo, EngineConfig(devices=devices, chunk_tokens=32, expert_cache="all")).run(ids,
                                                                                                     decode_tokens=4)
    tiny = 0.4 * one_layer_of_experts(demo)  # 3 of a layer's 8 experts
    sess = Session(demo, EngineConfig(devices=devices, chunk_tokens=32, expert_cache=tiny))
    streamed = sess.run(ids, decode_tokens=4)
    assert streamed.report.digest == resident.report.digest
    assert streamed.report.generated == resident.report.generated
    st = streamed.report.expert_stats[0]
    assert st["slots"] == 3 and st["misses"] > 0 and st["bytes_pageable"] > 0 and not st["resident"]
    streams = [e for e in sess.events if e.kind == "stream"]
    assert streams and all(e.nbytes > 0 for e in streams)
    assert resident.report.expert_stats[0]["resident"]


def test_pinning_is_skipped_without_cuda_and_never_exceeds_the_limit(demo):
    limit, note = resolve_pin_limit(0.5, 10 * 2**30, cuda=False)
    assert limit == 0 and "pinning skipped" in note
    limit, note = resolve_pin_limit(0.5, 10 * 2**30, cuda=True)
    assert limit == 2**29  # what would be registered: never above the limit
    limit, _ = resolve_pin_limit(4.0, 2**20, cuda=True)
    assert limit == 2**20  # nor above the arena
    sess = Session(demo, EngineConfig(expert_cache=0.0005, pin_limit_gib=0.001))
    assert sess.arena.pinned_bytes == 0
    assert any("pinning skipped" in n for n in sess.run(synthetic(32, demo.spec.vocab)).report.notes)


def test_bad_pin_limits_and_caches_are_refused(demo):
    with pytest.raises(ConfigError, match="pin_limit_gib"):
        EngineConfig.from_sources({"pin_limit_gib": "-1"}, env={})
    too_much = physical_ram() / 2**30 * 2
    with pytest.raises(ConfigError) as ei:
        Session(demo, EngineConfig(pin_limit_gib=too_much, expert_cache=0.001))
    assert "pin_limit_gib" in str(ei.value) and "RAM" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        Session(demo, EngineConfig(expert_cache=1e-9))
    assert "expert_cache" in str(ei.value) and "no expert fits" in str(ei.value)


def test_prefill_main_streams_every_layer_through_the_main_cache(demo):
    ids = synthetic(64, demo.spec.vocab, nonce=2)
    split = Session(demo, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=32)).run(ids, decode_tokens=3)
    sess = Session(demo, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=32, prefill_main=True,
                                      expert_cache=0.4 * one_layer_of_experts(demo)))
    main = sess.run(ids, decode_tokens=3)
    assert main.report.digest == split.report.digest and main.report.generated == split.report.generated
    layers = {int(e.note.split()[1].rstrip(":")) for e in sess.events if e.kind == "stream" and e.stage == 0
              and e.chunk >= 0}
    assert layers == {0, 1, 2, 3}  # the main device's cache served every layer during the prompt
