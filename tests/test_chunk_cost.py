"""The chunk-cost probe's bookkeeping, on CPU: the KV cache holds exactly `pos` tokens before
every call, each chunk size is captured once after one eager pass, and every graph is freed.

The graph factory is the probe's parameter; a recording fake stands in for CUDA graphs and
runs the layer eagerly, so the real KV cache's own position check applies to every call."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.io.gguf_model import load
from engine.pipeline.session import Session
from engine.plan.chunk_cost import ChunkCostProbe


class RecordingGraphs:
    """Stands in for engine.models.graphs.GraphedLayers; records what the probe asks of it."""

    def __init__(self, log: list, layers, n: int, device, dtype) -> None:
        self.log, self.layers, self.n = log, list(layers), n
        self.closed = False
        log.append(("create", n))

    def capture(self) -> None:
        self.log.append(("capture", self.n))

    def forward(self, i: int, x: torch.Tensor, kv, pos: int) -> torch.Tensor:
        assert not self.closed
        self.log.append(("replay", self.n, kv.length, pos))
        return self.layers[i](x, kv, pos)  # the real layer: its KV append checks the position

    def close(self) -> None:
        self.closed = True
        self.log.append(("close", self.n))


def _probe(demo_path, monkeypatch, log: list, made: list) -> ChunkCostProbe:
    sess = Session(load(demo_path), EngineConfig(devices=["cpu"]))
    layer = sess.stages[0].layers[0]
    monkeypatch.setattr(layer, "graphable", lambda x: True)  # as on CUDA with resident experts

    def factory(layers, n, device, dtype):
        g = RecordingGraphs(log, layers, n, device, dtype)
        made.append(g)
        return g

    return ChunkCostProbe(layer, torch.device("cpu"), torch.float32, graphs=True, graph_factory=factory)


def test_every_timed_call_sees_the_cache_at_its_position_and_graphs_are_freed(demo_path, monkeypatch):
    log: list = []
    made: list[RecordingGraphs] = []
    probe = _probe(demo_path, monkeypatch, log, made)
    cost = probe.measure(sizes=(16, 32, 64), prefix=128, probe=32)

    replays = [e for e in log if e[0] == "replay"]
    assert replays and all(length == pos for _, _, length, pos in replays)
    assert {pos for *_, pos in replays} == {0, 128}  # the attention probe runs behind a prefix
    captures = [e[1] for e in log if e[0] == "capture"]
    assert sorted(captures) == [16, 32, 64]  # one capture per size, the probe size reused
    assert all(g.closed for g in made) and len(made) == 3
    assert probe.kv is None
    assert set(cost.layer_s) == {16, 32, 64} and all(t > 0 for t in cost.layer_s.values())
    assert cost.attn_s >= 0.0 and cost.host_s == 0.0  # no launch cost on CPU


def test_a_failed_capture_is_timed_eagerly_and_the_rest_still_graphed(demo_path, monkeypatch):
    log: list = []
    made: list[RecordingGraphs] = []
    probe = _probe(demo_path, monkeypatch, log, made)
    real = probe.graph_factory

    def flaky(layers, n, device, dtype):
        if n == 32:
            raise RuntimeError("capture failed: out of graph memory")
        return real(layers, n, device, dtype)

    probe.graph_factory = flaky
    cost = probe.measure(sizes=(16, 32), prefix=64, probe=16)
    assert {e[1] for e in log if e[0] == "replay"} == {16}
    assert set(cost.layer_s) == {16, 32}
    assert all(g.closed for g in made)


def test_cpu_session_measures_its_cost_without_graphs(demo_path):
    sess = Session(load(demo_path), EngineConfig(devices=["cpu"]))
    cost = sess.chunk_cost()
    assert cost.layer_s and all(t > 0 for t in cost.layer_s.values())
    # the probe leaves the session's own state alone: a run after it works
    assert sess.run(list(range(40)), 0).report.plan.prompt_tokens == 40


def test_sizes_past_the_first_that_does_not_fit_are_not_measured(demo_path, monkeypatch):
    """A small card runs out of memory at some chunk size: the probe keeps what it measured
    below it (auto then never picks a size it could not run) and frees that size's graph."""
    log: list = []
    made: list[RecordingGraphs] = []
    probe = _probe(demo_path, monkeypatch, log, made)
    real = probe._best

    def tight(x, pos):
        if x.shape[0] >= 64:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated: a 12 GB card)")
        return real(x, pos)

    monkeypatch.setattr(probe, "_best", tight)
    cost = probe.measure(sizes=(16, 32, 64, 128), prefix=64, probe=16)
    assert set(cost.layer_s) == {16, 32}
    assert all(g.closed for g in made) and probe.kv is None


def test_out_of_memory_at_the_smallest_size_is_an_error(demo_path, monkeypatch):
    probe = _probe(demo_path, monkeypatch, [], [])
    monkeypatch.setattr(probe, "_best", lambda x, pos: (_ for _ in ()).throw(torch.OutOfMemoryError("oom")))
    with pytest.raises(torch.OutOfMemoryError):
        probe.measure(sizes=(16, 32), prefix=64, probe=16)


def test_same_shape_in_another_quant_is_measured_again(make_arch, monkeypatch):
    """One process (the app, a benchmark) opening the same shape as F16 and as Q4_K_M measures
    each: a Q4_K_M layer dequantises its experts and streams fewer bytes, so planning its chunks
    from the F16 measurement (it was, before the key held the expert types) mispredicts."""
    from engine.plan import chunk_cost
    monkeypatch.setattr(chunk_cost, "_MEASURED", {})
    calls: list[str] = []
    real = Session._measure_layer

    def counting(self, shape):
        calls.append(self.source.path.name if hasattr(self.source, "path") else "?")
        return real(self, shape)

    monkeypatch.setattr(Session, "_measure_layer", counting)
    shape = dict(hidden=256, head_dim=64, n_experts=8, expert_ffn=256, ffn=512)
    for quant in ("f16", "q4_k_m", "f16"):
        sess = Session(load(make_arch("qwen3moe", quant=quant, **shape)), EngineConfig(devices=["cpu"]))
        try:
            sess.chunk_cost()
        finally:
            sess.close()
    assert len(calls) == 2  # F16 once (its second session reuses it), Q4_K_M once


def test_probe_shape_never_passes_the_prompt():
    """The sizes, and the attention probe's chunk behind its prefix, stay within the prompt; a
    prompt at or past the largest size gets the full probe."""
    from engine.plan import chunk_cost, chunking

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert chunk_cost.probe_shape(cpu) == (chunking.CPU_CANDIDATES[2:6], 256, 64, 4)
    assert chunk_cost.probe_shape(cpu, 512) == chunk_cost.probe_shape(cpu, 4096) == chunk_cost.probe_shape(cpu)
    assert chunk_cost.probe_shape(cpu, 200) == ((64, 128, 200), 136, 64, 4)
    assert chunk_cost.probe_shape(cpu, 40) == ((40,), 20, 20, 4)
    assert chunk_cost.probe_shape(gpu, 1500) == ((1024, 1500), 750, 750, 2)
    for n in (2, 17, 63, 64, 65, 300, 511, 513):
        for dev in (cpu, gpu):
            sizes, prefix, probe, _ = chunk_cost.probe_shape(dev, n)
            assert max(sizes) <= n and prefix + probe <= max(n, 512 if dev is cpu else 10240), (dev, n)
    assert chunking.one_chunk_only(cpu, 16) and not chunking.one_chunk_only(cpu, 17)
    assert chunking.one_chunk_only(gpu, 1024) and not chunking.one_chunk_only(gpu, 1025)


def test_a_prompt_is_never_probed_past_its_length(demo_path, monkeypatch):
    """Issue 33: a 16-token prompt was probed with 64- to 512-token chunks.  Every call the
    probe makes runs at most the prompt's positions; a 16-token prompt (one chunk whatever the
    costs) is not probed at all; a shorter prompt reuses a longer one's measurement; a longer
    one measures again, up to its own length."""
    from engine.plan import chunk_cost

    monkeypatch.setattr(chunk_cost, "_MEASURED", {})
    calls: list[tuple[int, int]] = []  # (chunk tokens, position) of every layer call of the probe
    real = ChunkCostProbe._call

    def recording(self, x, pos):
        calls.append((x.shape[0], pos))
        return real(self, x, pos)

    monkeypatch.setattr(ChunkCostProbe, "_call", recording)
    model = load(demo_path)

    def run(n: int, devices=("cpu",)) -> tuple[list[tuple[int, int]], object]:
        calls.clear()
        sess = Session(model, EngineConfig(devices=list(devices)))
        try:
            rep = sess.run([i % 300 for i in range(n)], 0).report
        finally:
            sess.close()
        return list(calls), rep

    got, rep = run(16)
    assert got == [] and rep.plan.n_chunks == 1 and "whole prompt (16 tokens)" in rep.plan.chunk_reason
    got, rep = run(40, ("cpu", "cpu"))
    assert got and max(n + pos for n, pos in got) <= 40 and {n for n, pos in got if pos == 0} >= {40}
    assert {n for n, _ in got} <= {40, 20}
    got, rep = run(200)  # one CPU stage: nothing to overlap, the fewest chunks, no probe
    assert got == [] and rep.plan.n_chunks == 1 and "one CPU stage" in rep.plan.chunk_reason
    got, rep = run(5000)
    assert got == [] and rep.plan.chunk == 2048 and rep.plan.n_chunks == 3
    two = ("cpu", "cpu")
    got, _ = run(200, two)
    assert got and max(n + pos for n, pos in got) <= 200
    assert {n for n, _ in got} == {64, 128, 200}  # the sizes (the attention probe: 64 behind 136)
    got, _ = run(100, two)
    assert got == []  # the 200-token measurement serves
    got, _ = run(1000, two)
    assert got and max(n for n, _ in got) == 512 and max(n + pos for n, pos in got) <= 512


def test_a_hybrid_stage_is_probed_through_one_layer_of_each_kind():
    """Qwen3-Next's stage 0 holds GDN and attention layers, which cost differently: the probe times
    the first of each and weights them by their share of the model (three GDN to one); a stage of
    one kind, and every other family, is probed through its first layer alone."""
    from pathlib import Path

    from engine.plan import chunk_cost

    path = Path(__file__).parent / "data" / "families" / "qwen3next.gguf"
    sess = Session(load(path), EngineConfig(devices=["cpu"], chunk_tokens=16))
    try:
        layers = sess.stages[0].layers
        picked = chunk_cost.representatives(layers)
        assert [(layer.index, w) for layer, w in picked] == [(0, 0.75), (3, 0.25)]
        assert [(layer.index, w) for layer, w in chunk_cost.representatives(layers[1:3])] == [(1, 1.0)]
        layer_s, attn_s, host_s = chunk_cost.measure_layers(layers, torch.device("cpu"), torch.float32, False,
                                                            ((8, 16), 16, 8, 1))
        assert sorted(layer_s) == [8, 16] and all(t > 0 for t in layer_s.values()) and attn_s >= 0
    finally:
        sess.close()
