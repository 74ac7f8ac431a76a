"""executor=processes: stages as processes on torch.distributed (gloo on 127.0.0.1).

The threaded executor's properties on the process executor: digests identical to threads for
depth 0/1, 2 and 3 stages, interleaved groups and prefill-main; the join/overlap order on the
events; cancel at a chunk boundary; and faults: a stage killed (-9) or stopped mid-run ends the
run with a message naming the stage, its host and its last chunk, leaves no process behind, and
the next run works.  Spawning a stage process costs seconds on 2 cores: sessions are shared."""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from typing import ClassVar

import pytest
from executor_support import Sleep, process_gone
from platform_support import posix_signals

from engine import failure
from engine.config import ConfigError, EngineConfig
from engine.io import gguf_model
from engine.io.prompt import synthetic
from engine.pipeline.executor import ProcessExecutor, StageLost, stage_timeout
from engine.pipeline.session import Cancelled, PipelineHooks, Session, StageError

TOKENS, CHUNK = 96, 16  # six chunks
SLEEP = 0.03  # per layer, in every stage process: overlap is visible on a loaded 2-core machine


@pytest.fixture(scope="module")
def demo(demo_path):
    return gguf_model.load(demo_path)


@pytest.fixture(scope="module")
def ids(demo):
    return synthetic(TOKENS, demo.spec.vocab, nonce=5)


@pytest.fixture(scope="module")
def threads_digests(demo, ids):
    """The threaded executor's digest and tokens per (devices, layer split, prefill-main)."""
    cache: dict = {}

    def get(devices, split="auto", prefill_main=False):
        key = (tuple(devices), split, prefill_main)
        if key not in cache:
            sess = Session(demo, EngineConfig(devices=list(devices), chunk_tokens=CHUNK, layer_split=split,
                                              prefill_main=prefill_main))
            res = sess.run(ids, decode_tokens=3)
            sess.close()
            cache[key] = (res.report.digest, res.report.generated)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def two(demo):
    """Two CPU stage processes, slowed per layer, shared by the tests below."""
    sess = Session(demo, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=CHUNK, executor="processes"),
                   hooks=PipelineHooks(after_layer=Sleep(SLEEP)))
    yield sess
    pids = sess.stage_pids()
    sess.close()
    assert all(process_gone(p) for p in pids)


def configure(sess, **changes):
    sess.config = dataclasses.replace(sess.config, **changes)


def compute(events, stage):
    return {e.chunk: e for e in events if e.kind == "compute" and e.stage == stage}


def test_the_setting_selects_the_executor(demo):
    assert EngineConfig.from_sources(env={"STRATA_EXECUTOR": "processes"}).executor == "processes"
    cfg = EngineConfig.from_sources({"executor": "threads"}, env={"STRATA_EXECUTOR": "processes"})
    assert cfg.executor == "threads"
    with pytest.raises(ConfigError, match="STRATA_EXECUTOR.*threads or processes"):
        EngineConfig.from_sources(env={"STRATA_EXECUTOR": "forks"})
    assert type(Session(demo, EngineConfig(devices=["cpu"]))) is Session  # threads stay the default
    for bad in ("-1", "0", "nan", "inf", "1e300"):  # 1e300 once broke later, inside timedelta
        with pytest.raises(ConfigError, match=r"STRATA_STAGE_TIMEOUT_S.*seconds in \(0, 604800\]"):
            stage_timeout({"STRATA_STAGE_TIMEOUT_S": bad})
    assert stage_timeout({"STRATA_STAGE_TIMEOUT_S": "604800"}) == 604800
    with pytest.raises(ConfigError, match="picklable"):
        Session(demo, EngineConfig(devices=["cpu", "cpu"], executor="processes"),
                hooks=PipelineHooks(after_layer=lambda s, layer, c: None))


def test_two_stage_processes_match_threads_at_both_depths_and_prefill_main(two, ids, threads_digests):
    assert isinstance(two.executor, ProcessExecutor) and len(two.stage_pids()) == 2
    assert len(set(two.stage_pids()) | {os.getpid()}) == 3
    want = threads_digests(("cpu", "cpu"))
    assert want == threads_digests(("cpu",))  # the threaded executor's own identity
    for depth in (1, 0):
        configure(two, pipeline_depth=depth, prefill_main=False)
        res = two.run(ids, decode_tokens=3)
        assert (res.report.digest, res.report.generated) == want, f"depth {depth}"
        assert two.in_flight() == 0
        assert {e.stage for e in two.events if e.kind == "compute"} == {0, 1}
        assert {e.run_id for e in two.events} == {res.report.run_id}
    configure(two, pipeline_depth=1, prefill_main=True)
    res = two.run(ids, decode_tokens=3)
    configure(two, prefill_main=False)
    assert (res.report.digest, res.report.generated) == want
    kv = [e for e in two.events if e.kind == "copy" and e.chunk == -1]
    assert [e.stage for e in kv] == [1] and kv[0].nbytes > 0 and "kv layers 2-3" in kv[0].note
    assert {e.stage for e in two.events if e.kind == "compute"} == {0}  # the whole prefill on the main stage
    assert any("clock offset" in n for n in res.report.notes)


def test_join_and_overlap_order_on_the_process_events(two, ids):
    configure(two, pipeline_depth=0)
    join = two.run(ids)
    first, last = compute(two.events, 0), compute(two.events, 1)
    assert len(first) == len(last) == TOKENS // CHUNK
    for c in range(len(first) - 1):
        assert first[c + 1].start_ns >= last[c].end_ns, f"join: stage 0 started C{c + 1} before stage 1 ended C{c}"
    assert any(e.kind == "wait" and e.note == "join" for e in two.events)
    configure(two, pipeline_depth=1)
    over = two.run(ids)
    s0, s1 = compute(two.events, 0), compute(two.events, 1)
    overlapping = [c for c in range(len(s0) - 1)
                   if s0[c + 1].start_ns < s1[c].end_ns and s1[c].start_ns < s0[c + 1].end_ns]
    assert overlapping, "overlap: stage 0's C(c+1) never ran beside stage 1's Cc"
    # one-for-one reaping: stage 0 hands C(c+1) over only once stage 1's run of Cc ended
    copies = {e.chunk: e for e in two.events if e.kind == "copy" and e.stage == 0}
    for c in range(1, len(s0) - 1):
        assert copies[c + 1].end_ns >= s1[c].end_ns, f"C{c + 1} handed over before stage 1 finished C{c}"
    # (no wall-time ratio here: on a shared 2-core machine the processes' compute dominates the
    # sleeps; the threaded test_pipeline keeps the speed-up check)
    assert over.report.digest == join.report.digest
    hist = over.report.busy_histogram
    assert len(hist) == 3 and hist[2] > 0 and abs(sum(hist) - 1) < 1e-9


def test_cancel_stops_at_a_chunk_boundary_and_the_next_run_works(two, ids, threads_digests):
    configure(two, pipeline_depth=1)
    stop = threading.Event()
    seen = []

    def sink(ev):
        if ev.kind == "compute" and ev.stage == 0:
            seen.append(ev.chunk)
            if ev.chunk == 1:
                stop.set()

    with pytest.raises(Cancelled) as info:
        two.run(ids, cancel=stop, sink=sink)
    assert max(seen) <= 2, f"stage 0 ran chunks {seen} after the stop at C1"
    assert info.value.report.cancelled and two.in_flight() == 0
    assert two.run(ids, decode_tokens=3).report.digest == threads_digests(("cpu", "cpu"))[0]


@posix_signals
def test_killed_stage_process_ends_the_run_names_it_and_leaves_nothing(two, ids, threads_digests):
    configure(two, pipeline_depth=1)
    old = two.stage_pids()
    victim = old[1]

    def sink(ev):
        if ev.kind == "compute" and ev.stage == 0 and ev.chunk == 2:  # stage 1 has computed C0 by then
            os.kill(victim, signal.SIGKILL)

    t0 = time.monotonic()
    with pytest.raises(StageError) as info:
        two.run(ids, sink=sink)
    took = time.monotonic() - t0
    msg = str(info.value)
    assert isinstance(info.value.__cause__, StageLost)
    assert failure.is_user_error(info.value)  # a killed process is what the machine did, not a bug
    assert "stage 1" in msg and "host" in msg and f"pid {victim}" in msg and "signal 9" in msg, msg
    assert "last chunk computed: C" in msg, msg
    assert took < 10, f"the kill took {took:.1f} s to surface"
    assert two.stage_pids() == [] and all(process_gone(p) for p in old), "a stage process was left behind"
    res = two.run(ids, decode_tokens=3)  # rebuilt
    assert (res.report.digest, res.report.generated) == threads_digests(("cpu", "cpu"))
    assert not set(two.stage_pids()) & set(old)


@posix_signals
def test_hung_stage_process_ends_the_run_within_the_timeout(two, ids, threads_digests):
    configure(two, pipeline_depth=0)
    old = two.stage_pids()
    victim = old[1]
    two.executor.timeout_s = 3.0

    def sink(ev):
        if ev.kind == "compute" and ev.stage == 1 and ev.chunk == 1:
            os.kill(victim, signal.SIGSTOP)

    t0 = time.monotonic()
    try:
        with pytest.raises(StageError) as info:
            two.run(ids, sink=sink)
    finally:
        two.executor.timeout_s = 60.0
        configure(two, pipeline_depth=1)
    took = time.monotonic() - t0
    msg = str(info.value)
    assert "stage 1" in msg and "no progress for 3 s" in msg and "last chunk computed: C1" in msg, msg
    # Not a speed figure: at least the timeout (it did wait), and far less than a hang would take;
    # the upper bound is loose so that a loaded machine (respawning a stage costs seconds) passes.
    assert 3 <= took < 45, took
    assert all(process_gone(p) for p in old), "the stopped stage process was left behind"
    assert two.run(ids).report.digest == threads_digests(("cpu", "cpu"))[0]


@pytest.mark.parametrize("devices, split", [
    (("cpu", "cpu", "cpu"), "auto"),
    (("cpu", "cpu"), "interleave:2"),
])
def test_three_stages_and_interleaved_groups_match_threads(demo, ids, threads_digests, devices, split):
    want = threads_digests(devices, split)
    sess = Session(demo, EngineConfig(devices=list(devices), chunk_tokens=CHUNK, layer_split=split,
                                      executor="processes"))
    try:
        n = len(sess.stages)
        assert len(sess.stage_pids()) == n == (3 if split == "auto" else 4)
        for depth in (1, 0):
            configure(sess, pipeline_depth=depth)
            res = sess.run(ids, decode_tokens=3)
            assert (res.report.digest, res.report.generated) == want, f"depth {depth}"
            assert {e.stage for e in sess.events if e.kind == "compute"} == set(range(n))
            if depth == 0:
                first, last = compute(sess.events, 0), compute(sess.events, n - 1)
                assert all(first[c + 1].start_ns >= last[c].end_ns for c in range(len(first) - 1))
        if split == "auto":  # prefill-main hands KV to two stages down the chain
            configure(sess, pipeline_depth=1, prefill_main=True)
            res = sess.run(ids, decode_tokens=3)
            assert (res.report.digest, res.report.generated) == want, "prefill-main"
            kv = [e for e in sess.events if e.kind == "copy" and e.chunk == -1]
            assert sorted(e.stage for e in kv) == [1, 2]
        pids = sess.stage_pids()
    finally:
        sess.close()
    assert all(process_gone(p) for p in pids)


CONTROLLER = """
import os, sys
sys.path[:0] = {paths!r}
from engine.io import gguf_model
from engine.config import EngineConfig
from engine.pipeline.session import Session

def main():
    cfg = EngineConfig(devices=["cpu", "cpu"], chunk_tokens=16, executor="processes")
    sess = Session(gguf_model.load({model!r}), cfg)
    print(" ".join(str(p) for p in sess.stage_pids()), flush=True)
    sys.stdin.read()  # until the test kills this controller

if __name__ == "__main__":
    main()
"""


def test_stage_processes_exit_when_their_controller_is_killed(demo_path, tmp_path):
    """A controller killed with -9 cannot tear its stages down: they notice and exit."""
    import subprocess
    import sys

    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER.format(paths=[str(p) for p in sys.path if p], model=str(demo_path)))
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # blocks until the stages are up (or the controller died)
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, line
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10  # the watch wakes when the controller's sentinel closes
        while time.monotonic() < deadline and not all(process_gone(p) or _zombie(p) for p in pids):
            time.sleep(0.1)
        assert all(process_gone(p) or _zombie(p) for p in pids), "stage processes outlived their controller"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _zombie(pid: int) -> bool:
    """Exited, waiting for init to reap it (the controller that would have is gone); Linux only:
    elsewhere `process_gone` alone decides (a test that cannot look must not pass for that)."""
    import sys
    from pathlib import Path

    if not sys.platform.startswith("linux"):
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True  # gone between the two looks
    except (OSError, IndexError):
        return False


# ------------------------------------------------------------------ streamed experts
def _tiny_cache(demo) -> float:
    """GiB for 3 of a layer's 8 experts as stored: every chunk streams."""
    from engine.models.experts import EXPERT_PARTS

    return 0.4 * sum(demo.nbytes(f"blk.0.{p}.weight") for p in EXPERT_PARTS) / 2**30


@pytest.mark.parametrize("n_stages", [2, 3])
def test_streamed_experts_in_stage_processes_match_threads(demo, ids, n_stages):
    cfg = EngineConfig(devices=["cpu"] * n_stages, prefill=CHUNK, expert_cache=_tiny_cache(demo))
    threaded = Session(demo, cfg)
    want = threaded.run(ids, decode_tokens=3).report
    threaded.close()
    assert want.expert_stats[0]["misses"] > 0
    sess = Session(demo, cfg.replace(executor="processes"))
    try:
        assert sess.expert_plan.streamed
        rep = sess.run(ids, decode_tokens=3).report
        assert (rep.digest, rep.generated) == (want.digest, want.generated)
        assert len(rep.expert_stats) == n_stages
        for got, ref in zip(rep.expert_stats, want.expert_stats):
            assert not got["resident"] and got["slots"] == ref["slots"] == 3
            assert got["misses"] > 0 and got["bytes_pageable"] > 0 and got["stream_ns"] > 0, got
            # the same routing through the same LRU: the same hits and misses as the threads
            assert (got["hits"], got["misses"], got["bytes_pageable"]) == (ref["hits"], ref["misses"],
                                                                           ref["bytes_pageable"])
        streams = [e for e in sess.events if e.kind == "stream"]
        assert {e.stage for e in streams} == set(range(n_stages)) and all(e.nbytes > 0 for e in streams)
        assert {e.chunk for e in streams} >= {0, -1}  # prompt chunks and decode steps
        arena = [n for n in rep.notes if "a host arena per stage process" in n]
        assert arena and all(f"stage {r} " in arena[0] for r in range(n_stages)), rep.notes
        # a second run: the stats are this run's, not a sum over runs
        again = sess.run(ids, decode_tokens=3).report
        assert again.digest == want.digest
        assert again.expert_stats[0]["misses"] + again.expert_stats[0]["hits"] == \
            want.expert_stats[0]["misses"] + want.expert_stats[0]["hits"]
        if n_stages == 2:  # prefill-main: stage 0's cache serves every layer, as the threads' main device
            configure(sess, prefill_main=True)
            main = sess.run(ids, decode_tokens=3).report
            assert (main.digest, main.generated) == (want.digest, want.generated)
            layers = {int(e.note.split()[1].rstrip(":")) for e in sess.events
                      if e.kind == "stream" and e.stage == 0 and e.chunk >= 0}
            assert layers == set(range(demo.spec.n_layers))
            assert any("arena now holds the experts of layers 0-3" in n for n in main.notes)
        pids = sess.stage_pids()
    finally:
        sess.close()
    assert all(process_gone(p) for p in pids)


def test_the_pin_limit_is_split_so_the_total_never_exceeds_it():
    from engine.pipeline.executor import split_pin_limit

    assert split_pin_limit(10, [3, 3, 4], [True, True, True]) == [3, 3, 4]
    shares = split_pin_limit(7, [3, 3, 4], [True, True, True])
    assert sum(shares) <= 7 and shares == [2, 2, 2]  # rounded down
    assert split_pin_limit(1000, [3, 5], [True, True]) == [3, 5]  # never above an arena
    assert split_pin_limit(8, [4, 4, 4], [True, False, True]) == [4, 0, 4]  # CPU stages pin nothing
    assert split_pin_limit(0, [4, 4], [True, True]) == [0, 0]
    assert split_pin_limit(5, [4, 4], [False, False]) == [0, 0]
    for limit in (1, 99, 2**33 + 7):
        sizes = [2**30 + 13, 3 * 2**29 + 1, 12345]
        assert sum(split_pin_limit(limit, sizes, [True] * 3)) <= limit


# ------------------------------------------------------------ CUDA graphs: the policy
@dataclasses.dataclass
class _FakeLayer:
    index: int
    can_graph: bool = True

    def graphable(self, x) -> bool:
        return self.can_graph


class _FakeGraphed:
    """Stands for GraphedLayers (the policy's bookkeeping is tested on CPU)."""

    fail_sizes: ClassVar[set] = set()

    def __init__(self, layers, n, device, dtype) -> None:
        self.n, self.closed, self.capture_s, self.reserved_bytes = n, False, 0.002, 3 * 2**20

    def capture(self) -> None:
        if self.n in self.fail_sizes:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")

    def close(self) -> None:
        self.closed = True


def test_graph_sizes_are_the_runs_chunk_sizes_and_one_for_decode():
    from engine.pipeline.stage_graphs import MAX_GRAPHED_SIZES, graph_sizes

    assert graph_sizes([(0, 16), (16, 16), (32, 8)], True) == {16, 8, 1}
    assert graph_sizes([(0, 16), (16, 8)], False) == set()
    many = [(i * 100, 10 + i) for i in range(10)]
    got = graph_sizes(many, True)
    assert got == set(range(19, 19 - MAX_GRAPHED_SIZES, -1)) | {1}


def test_stage_graphs_capture_after_the_first_eager_pass_fall_back_and_free():
    import torch

    from engine.pipeline.stage_graphs import StageGraphs

    notes: list[str] = []
    layers = [_FakeLayer(2), _FakeLayer(3)]
    x16, x8, x1 = torch.zeros(16, 4), torch.zeros(8, 4), torch.zeros(1, 4)
    cpu = StageGraphs(torch.device("cpu"), "cpu", notes.append, factory=_FakeGraphed)
    cpu.plan({16, 1})
    assert cpu.lookup(x16, layers) == (None, False) and not cpu.active  # a no-op without CUDA
    g = StageGraphs(torch.device("cuda", 0), "cuda:0", notes.append, factory=_FakeGraphed)
    _FakeGraphed.fail_sizes = {1}
    try:
        g.plan({16, 1})
        assert g.lookup(x16, layers) == (None, True)  # first pass of a size: eager, then capture
        g.after_eager(layers, x16)
        graphed, capture = g.lookup(x16, layers)
        assert isinstance(graphed, _FakeGraphed) and graphed.n == 16 and not capture
        assert notes[-1].startswith("CUDA graphs captured for layers 2-3 on cuda:0 at chunk 16")
        assert g.lookup(x8, layers) == (None, False)  # not a size of this run: eager
        assert g.lookup(x16, layers[:1])[1]  # another layer run (prefill-main) is its own set
        g.after_eager(layers, x1)  # the capture fails: eager from now on, with a note
        assert "capture failed (operation not permitted when stream is capturing)" in notes[-1]
        assert g.lookup(x1, layers) == (None, False)
        g.after_eager([_FakeLayer(0, can_graph=False)], x16)  # e.g. streamed experts: never captured
        assert g.lookup(x16, [_FakeLayer(0)]) == (None, True)
        g.plan({8, 1})  # size 16 left the plan: its graphs are freed; the failure of 1 is kept
        assert graphed.closed and g.lookup(x16, layers) == (None, False) and g.lookup(x1, layers) == (None, False)
        g.plan({8})
        g.plan({8, 1})
        assert g.lookup(x1, layers) == (None, True)  # a size that left and came back is retried
        g.drop()
        assert not g.sets
    finally:
        _FakeGraphed.fail_sizes = set()


class _EagerGraphed(_FakeGraphed):
    """A 'graph set' that runs its layers eagerly and counts the replays (the CPU seam)."""

    replays: ClassVar[list] = []

    def __init__(self, layers, n, device, dtype) -> None:
        super().__init__(layers, n, device, dtype)
        self.layers = list(layers)

    def forward(self, i, x, kv, pos):
        self.replays.append((self.layers[i].index, self.n))
        return self.layers[i](x, kv, pos)


class _Out:
    def __init__(self) -> None:
        self.msgs: list = []

    def send(self, msg) -> None:
        self.msgs.append(msg)


def test_a_stage_process_forward_captures_after_the_first_pass_replays_and_notes(demo_path, monkeypatch):
    """The stage process's side of the graph policy, in this process (world 1, gloo): the run's
    sizes come from its RunOrder, the first pass of a size is eager and captures, later passes
    replay with the same output, and the capture note goes to the controller tagged with the run."""
    import torch
    import torch.distributed as dist

    from engine.models.layers import Layer
    from engine.pipeline.stage_graphs import StageGraphs
    from engine.pipeline.stage_messages import Note
    from engine.pipeline.stage_process import RunOrder, SourceRef, StageProcess, StageSpec

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    spec = StageSpec(rank=0, world=1, device="cpu", first=0, end=4, source=SourceRef("gguf", path=str(demo_path)),
                     dtype="float32", store_host="127.0.0.1", store_port=store.port, backend="gloo", threads=1,
                     timeout_s=30.0, parent_pid=0)
    out = _Out()
    sp = StageProcess(spec, out)
    try:
        sp.graphs = StageGraphs(torch.device("cuda", 0), "cuda:0", sp.note, factory=_EagerGraphed)
        monkeypatch.setattr(Layer, "graphable", lambda self, x: True)
        _EagerGraphed.replays.clear()
        order = RunOrder(run_id="r1", ids=list(range(32)), bounds=[(0, 16), (16, 16)], capacity=40, chunk=16,
                         depth=1, logits_all=False, events=False, check_nan=True, prefill_main=False,
                         graph_sizes=(1, 16))
        sp.begin(order)
        with torch.inference_mode():
            x = sp.head.embed_tokens(sp.ids[:16])
            eager = sp.forward_layers(sp.ctx, x, sp.layers, sp.kvs, 0, 0).clone()
            assert not _EagerGraphed.replays
            notes = [m for m in out.msgs if isinstance(m, Note)]
            assert len(notes) == 1 and notes[0].run_id == "r1" and "layers 0-3 on cuda:0 at chunk 16" in notes[0].text
            for kv in sp.kvs:
                kv.reset()
            replayed = sp.forward_layers(sp.ctx, x, sp.layers, sp.kvs, 0, 0)
            assert _EagerGraphed.replays == [(i, 16) for i in range(4)]
            assert torch.equal(replayed, eager)
            sp.forward_layers(sp.ctx, sp.head.embed_tokens(sp.ids[16:24]), sp.layers, sp.kvs, 16, 1)  # 8: not a graph size
            assert len(_EagerGraphed.replays) == 4 and len([m for m in out.msgs if isinstance(m, Note)]) == 1
        graphed = next(iter(sp.graphs.sets.values()))
        sp.begin(dataclasses.replace(order, run_id="r2", graph_sizes=(1, 8)))  # 16 left the plan
        assert graphed.closed and not sp.graphs.sets
    finally:
        sp.close()
        dist.destroy_process_group()
