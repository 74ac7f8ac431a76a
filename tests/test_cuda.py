"""The same numerics and pipeline checks on CUDA (run on the device machine; skipped without GPUs).

Tolerances: fp32 on CUDA is held to the CPU bar (1e-4 against HF, identical greedy tokens);
bf16 (the engine's CUDA default) to 3% of the largest logit, with the prompt's last-position
top-1 token identical — bf16 keeps about 3 significant digits through every layer."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dequant_support import ALL_TYPES, check_type
from hf_reference import hf_model

from engine.config import EngineConfig
from engine.io import gguf_model
from engine.io.prompt import synthetic
from engine.pipeline.session import Session

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def hf_logits(path, spec, ids):
    pytest.importorskip("transformers")
    m = hf_model(path, spec)
    with torch.no_grad():
        logits = m(torch.tensor([ids])).logits[0]
        gen = m.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    return logits, gen


@cuda
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3", "qwen2", "llama"])
def test_cuda_matches_transformers(make_arch, arch):
    path = make_arch(arch)
    model = gguf_model.load(path)
    ids = synthetic(64, model.spec.vocab, nonce=7)
    ref, gen = hf_logits(path, model.spec, ids)
    fp32 = Session(model, EngineConfig(devices=["cuda:0"], dtype="float32", prefill=16)).run(
        ids, decode_tokens=8, logits_all=True)
    assert (fp32.logits - ref).abs().max().item() <= 1e-4
    assert fp32.report.generated == gen
    bf16 = Session(model, EngineConfig(devices=["cuda:0"], prefill=16)).run(ids, decode_tokens=8, logits_all=True)
    rel = (bf16.logits - ref).abs().amax(-1) / ref.abs().amax(-1)  # per position
    agree = (bf16.logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{arch}: bf16 vs HF fp32: median {rel.median().item() * 100:.2f}%, max {rel.max().item() * 100:.2f}% "
          f"of max |logit|; top-1 agreement {agree * 100:.1f}%")
    # a bf16 rounding can flip a near-tie in the MoE router for a token; most positions must agree
    assert rel.median().item() <= 0.03
    assert agree >= 0.9


@cuda
def test_grouped_mm_experts_match_the_reference_loop(demo_path):
    """The GPU's grouped GEMM and the per-expert loop compute the same MoE FFN (bf16 rounding)."""
    model = gguf_model.load(demo_path)
    sess = Session(model, EngineConfig(devices=["cuda:0"]))
    layer = sess.stages[0].layers[0]
    h = torch.randn(300, model.spec.hidden, device="cuda:0", dtype=torch.bfloat16)
    layer.use_grouped_mm = True
    grouped = layer.moe(h).float()
    layer.use_grouped_mm = False
    loop = layer.moe(h).float()
    rel = (grouped - loop).abs().max().item() / loop.abs().max().item()
    print(f"grouped_mm vs loop: {rel * 100:.3f}% of max |y|")
    assert rel <= 0.02


@two_gpus
def test_two_gpu_digests_and_handoffs(demo_path):
    model = gguf_model.load(demo_path)
    ids = synthetic(512, model.spec.vocab, nonce=3)
    out = {}
    for name, kw in {
        "1 gpu": dict(devices=["cuda:0"]),
        "join": dict(devices=["cuda:0", "cuda:1"], pf_depth=0),
        "overlap peer": dict(devices=["cuda:0", "cuda:1"], handoff="peer"),
        "overlap host": dict(devices=["cuda:0", "cuda:1"], handoff="host"),
        "prefill-main": dict(devices=["cuda:0", "cuda:1"], prefill_main=True),
        # a slow successor: stage 0 runs ahead and must not overwrite the ONE input buffer early
        "slow successor peer": dict(devices=["cuda:0", "cuda:1"], layer_split=[1, 3], handoff="peer"),
        "slow successor host": dict(devices=["cuda:0", "cuda:1"], layer_split=[1, 3], handoff="host"),
        "slow first stage": dict(devices=["cuda:0", "cuda:1"], layer_split=[3, 1]),
    }.items():
        sess = Session(model, EngineConfig(prefill=64, gpu_order="configured", **kw))
        res = sess.run(ids, decode_tokens=6)
        out[name] = (res.report.digest, tuple(res.report.generated), res.report.handoff)
        sess.close()
    assert len({d for d, _, _ in out.values()}) == 1, out
    assert len({g for _, g, _ in out.values()}) == 1, out
    assert out["overlap peer"][2] == "peer" and out["overlap host"][2] == "host"


@cuda
def test_streamed_experts_on_cuda_match_resident_and_respect_the_pin_limit(demo_path):
    model = gguf_model.load(demo_path)
    s = model.spec
    ids = synthetic(256, s.vocab, nonce=5)
    expert_gib = sum(model.nbytes(f"blk.0.{p}.weight") for p in ("ffn_gate_exps", "ffn_up_exps",
                                                                   "ffn_down_exps")) / s.n_experts / 2**30  # as stored
    resident = Session(model, EngineConfig(devices=["cuda:0"], prefill=64, expert_cache="all")).run(ids, 4)
    half_arena = s.n_layers * s.n_experts * expert_gib / 2
    for pin in (0.0, half_arena):
        sess = Session(model, EngineConfig(devices=["cuda:0"], prefill=64, expert_cache=3 * expert_gib,
                                           pin_limit_gib=pin))
        res = sess.run(ids, 4)
        assert res.report.digest == resident.report.digest
        assert res.report.generated == resident.report.generated
        assert sess.arena.pinned_bytes <= pin * 2**30
        st = res.report.expert_stats[0]
        assert st["misses"] > 0 and (st["bytes_pinned"] > 0) == (pin > 0)
        assert any(e.kind == "stream" for e in sess.events)
        sess.close()


@cuda
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3"])
def test_cuda_graphs_replay_the_eager_kernels_bit_for_bit(make_arch, arch):
    """Graph replay runs the eager path's own kernels: same logits, digest and tokens, on the
    run that captures (after the first chunk's eager pass) and on a later run that replays from
    chunk 0."""
    model = gguf_model.load(make_arch(arch))
    ids = synthetic(256, model.spec.vocab, nonce=11)
    eager = Session(model, EngineConfig(devices=["cuda:0"], prefill=64, cuda_graphs=False)).run(
        ids, decode_tokens=6, logits_all=True)
    sess = Session(model, EngineConfig(devices=["cuda:0"], prefill=64))
    notes = []
    for run in range(2):
        res = sess.run(ids, decode_tokens=6, logits_all=True)
        assert torch.equal(res.logits, eager.logits), f"run {run}"
        assert res.report.digest == eager.report.digest
        assert res.report.generated == eager.report.generated
        notes.append(" ".join(res.report.notes))
    assert sorted(k[2] for k in sess.stages[0].graph_sets) == [64]  # chunks; decode: one graph per step
    assert list(sess.stages[0].decoding.graphs) == [262]  # positions 256-261: the cache's 262 rows
    assert "CUDA graphs captured" in notes[0] and "CUDA graphs captured" not in notes[1]
    assert "decode: 1 graph per step" in notes[0] and "decode: 1 graph" not in notes[1]
    sess.close()
    assert not sess.stages[0].graph_sets and not sess.stages[0].decoding.graphs


@cuda
def test_a_one_chunk_prompt_captures_in_its_first_run(make_arch):
    """A benchmark's warm-up is one run: when the prompt is a single chunk, that run must capture
    the graphs (after its eager pass), or the first measured run pays the capture (seen on H200:
    +78 to +122 ms on an 8K prefill of ~70 ms)."""
    model = gguf_model.load(make_arch("qwen3moe"))
    ids = synthetic(64, model.spec.vocab, nonce=5)
    sess = Session(model, EngineConfig(devices=["cuda:0"], prefill=64))
    first = " ".join(sess.run(ids, 0).report.notes)
    second = " ".join(sess.run(ids, 0).report.notes)
    sess.close()
    assert "CUDA graphs captured for layers" in first and "at chunk 64" in first
    assert "CUDA graphs captured" not in second


@two_gpus
def test_two_gpu_graphs_match_eager(demo_path):
    model = gguf_model.load(demo_path)
    ids = synthetic(512, model.spec.vocab, nonce=4)
    digests = set()
    for graphs in (False, True):
        sess = Session(model, EngineConfig(devices=["cuda:0", "cuda:1"], prefill=64, gpu_order="configured",
                                           cuda_graphs=graphs))
        for _ in range(2):
            res = sess.run(ids, decode_tokens=4)
            digests.add((res.report.digest, tuple(res.report.generated)))
        assert bool(sess.stages[1].graph_sets) == graphs
        sess.close()
    assert len(digests) == 1, digests


def _spans(events, kind):
    return {(e.stage, e.chunk): (e.start_ns, e.end_ns) for e in events if e.kind == kind}


def _check_gpu_timeline(sess, n_chunks: int, join: bool) -> None:
    """The events of a run on CUDA stages, timed on the GPUs, obey the pipeline's order."""
    comp = _spans(sess.events, "compute")
    copy = _spans(sess.events, "copy")
    n_stages = len(sess.stages)
    assert len(comp) == n_stages * n_chunks
    for st in range(n_stages):
        ends = [comp[st, c] for c in range(n_chunks)]
        for (_a0, a1), (b0, _b1) in zip(ends, ends[1:]):
            assert a1 <= b0, f"stage {st}: two chunks computing at once"
    slack = 50_000  # 50 us: anchors of two devices are taken one after the other
    for st in range(n_stages - 1):
        for c in range(n_chunks):
            assert comp[st, c][1] <= copy[st, c][0] + slack, f"copy of chunk {c} before its compute ended"
            assert copy[st, c][1] <= comp[st + 1, c][0] + slack, f"stage {st + 1} computed chunk {c} before it arrived"
    if join:
        for c in range(n_chunks - 1):
            assert comp[n_stages - 1, c][1] <= comp[0, c + 1][0] + slack, f"join: chunk {c + 1} started early"


@cuda
def test_one_gpu_two_stages_events_are_gpu_timed_and_ordered(demo_path):
    """Two stages on one GPU (the hand-off is a same-device copy ordered on its stream)."""
    model = gguf_model.load(demo_path)
    ids = synthetic(512, model.spec.vocab, nonce=6)
    ref = Session(model, EngineConfig(devices=["cuda:0"], prefill=64)).run(ids, decode_tokens=4)
    for depth in (0, 1):
        sess = Session(model, EngineConfig(devices=["cuda:0", "cuda:0"], prefill=64, pf_depth=depth))
        res = sess.run(ids, decode_tokens=4)
        assert (res.report.digest, res.report.generated) == (ref.report.digest, ref.report.generated)
        _check_gpu_timeline(sess, 8, join=depth == 0)
        assert sess.in_flight() == 0
        sess.close()


@two_gpus
@pytest.mark.parametrize("handoff", ["peer", "host"])
def test_two_gpu_events_follow_the_pipeline_order(demo_path, handoff):
    model = gguf_model.load(demo_path)
    ids = synthetic(1024, model.spec.vocab, nonce=8)
    for depth in (0, 1):
        sess = Session(model, EngineConfig(devices=["cuda:0", "cuda:1"], prefill=128, pf_depth=depth,
                                           handoff=handoff, gpu_order="configured"))
        for _ in range(2):  # the second run replays CUDA graphs from its first chunk
            res = sess.run(ids)
            _check_gpu_timeline(sess, 8, join=depth == 0)
        busy = res.report.busy_histogram
        assert abs(sum(busy) - 1.0) < 1e-6
        sess.close()


@cuda
def test_chunk_cost_is_measured_as_runs_execute_and_frees_its_graphs(demo_path):
    """With CUDA graphs on, auto's per-size costs come from graph replays (what a fixed chunk
    runs), and measuring leaves no graph memory behind."""
    from engine.plan import chunk_cost

    model = gguf_model.load(demo_path)
    costs = {}
    for graphs in (False, True):
        sess = Session(model, EngineConfig(devices=["cuda:0"], cuda_graphs=graphs))
        sizes = []
        for _ in range(2):  # the first measurement also grows lasting caches (RoPE tables)
            chunk_cost._MEASURED.clear()
            sess._chunk_cost = None
            before = torch.cuda.memory_allocated()
            cost = sess.chunk_cost()
            sizes.append(torch.cuda.memory_allocated() - before)
        assert sizes[1] <= 2**20, f"graphs={graphs}: measuring kept {sizes} bytes"  # graph pools: 100s of MiB
        assert all(t > 0 for t in cost.layer_s.values()) and cost.host_s_per_layer > 0
        costs[graphs] = cost
        sess.close()
    # one graph replay launches far less from the host than ~50 eager ops
    assert costs[True].host_s_per_layer < costs[False].host_s_per_layer, costs


@cuda
def test_two_stages_capture_a_remainder_chunk_concurrently_and_match_eager(demo_path):
    """96 tokens at chunk 64: both stages capture sizes 64 and 32 in their first run, from two
    threads at once (one capture at a time in the process), and every run matches eager."""
    model = gguf_model.load(demo_path)
    ids = synthetic(96, model.spec.vocab, nonce=12)
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() > 1 else ["cuda:0", "cuda:0"]
    eager = Session(model, EngineConfig(devices=devices, prefill=64, cuda_graphs=False, gpu_order="configured")
                    ).run(ids, decode_tokens=4)
    sess = Session(model, EngineConfig(devices=devices, prefill=64, gpu_order="configured"))
    for _ in range(3):
        res = sess.run(ids, decode_tokens=4)
        assert (res.report.digest, res.report.generated) == (eager.report.digest, eager.report.generated)
    for st in sess.stages:
        assert sorted(k[2] for k in st.graph_sets) == [32, 64]
        assert len(st.decoding.graphs) == 1  # each stage's decode step: one graph
    sess.close()


@cuda
@pytest.mark.parametrize("pos,n", [(0, 2048), (6144, 2048), (1024, 512)])
def test_chunk_attention_split_matches_the_masked_reference(pos, n):
    """The cuDNN prefix+diagonal split gives the lower-right-masked SDPA's result (bf16 rounding),
    on Qwen3-30B-A3B's heads (32 q / 4 kv of 128), and the device chose it."""
    from engine.kernels.attention import CUDNN_SPLIT, SDPA, AttentionKernel, chunk_attention, kernel_for

    dev = torch.device("cuda:0")
    kernel = kernel_for(dev, 32, 4, 128, torch.bfloat16)
    print(f"attention kernel: {kernel.describe()}")
    assert kernel.name == CUDNN_SPLIT, kernel  # H200 with torch's cuDNN: the fast path
    gen = torch.Generator().manual_seed(pos + n)
    q = torch.randn(n, 32, 128, generator=gen).to(dev, torch.bfloat16)
    k = torch.randn(pos + n, 4, 128, generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(pos + n, 4, 128, generator=gen).to(dev, torch.bfloat16)
    got = chunk_attention(q, k, v, pos, kernel).float()
    want = chunk_attention(q, k, v, pos, AttentionKernel(SDPA)).float()
    exact = chunk_attention(q.float(), k.float(), v.float(), pos, AttentionKernel(SDPA))
    err_split = (got - exact).abs().max().item()
    err_ref = (want - exact).abs().max().item()
    print(f"pos {pos} n {n}: split {err_split:.2e}, masked SDPA {err_ref:.2e} from fp32")
    assert err_split <= max(2 * err_ref, 4e-3)


@cuda
def test_run_report_names_the_attention_kernel(demo_path):
    model = gguf_model.load(demo_path)
    sess = Session(model, EngineConfig(devices=["cuda:0"], prefill=64))
    rep = sess.run(synthetic(128, model.spec.vocab, nonce=3), 0).report
    print(f"attention: {rep.attention}")
    assert rep.attention.startswith("cuda:0: ") and ("cuDNN" in rep.attention or "SDPA" in rep.attention)
    sess.close()


@cuda
def test_moe_kernels_match_the_torch_expressions():
    """The Triton SwiGLU and gather-weighted sum give the torch expressions' values (one bf16
    rounding instead of two or three) at a 2048-token chunk of Qwen3-30B-A3B's experts."""
    from engine.kernels import moe_kernels

    dev = torch.device("cuda:0")
    x = torch.randn(1, device=dev)
    assert moe_kernels.available(x), "Triton kernels expected on the GPU machine"
    gen = torch.Generator(device=dev).manual_seed(1)
    n, k, hidden, f = 2048, 8, 2048, 768
    gu = torch.randn(n * k, 2 * f, device=dev, generator=gen).to(torch.bfloat16)
    want = (torch.nn.functional.silu(gu[:, :f].float()) * gu[:, f:].float())
    got = moe_kernels.swiglu(gu, f).float()
    assert (got - want).abs().max().item() <= 2 ** -7 * want.abs().max().item()
    ys = torch.randn(n * k, hidden, device=dev, generator=gen).to(torch.bfloat16)
    inv = torch.randperm(n * k, device=dev, generator=gen)
    w = torch.softmax(torch.randn(n, k, device=dev, generator=gen), -1)
    want = (ys[inv].view(n, k, hidden).float() * w.unsqueeze(-1)).sum(1)
    got = moe_kernels.combine(ys, inv, w).float()
    err = (got - want).abs().max().item()
    print(f"combine vs fp32 torch: {err:.2e} (max |y| {want.abs().max().item():.2f})")
    assert err <= 2 ** -7 * want.abs().max().item()
    assert torch.equal(moe_kernels.combine(ys, inv, w), moe_kernels.combine(ys, inv, w))  # deterministic


@cuda
def test_interleaved_groups_on_one_gpu_match_the_contiguous_split(make_arch):
    """interleave:2 over two stages of one GPU: GPU-ordered hand-offs per hop, graphs per group,
    the contiguous split's digest and tokens."""
    model = gguf_model.load(make_arch("qwen3moe", n_layers=8))
    ids = synthetic(192, model.spec.vocab, nonce=21)
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() > 1 else ["cuda:0", "cuda:0"]
    base = Session(model, EngineConfig(devices=devices, prefill=64, gpu_order="configured")).run(ids, 4).report
    sess = Session(model, EngineConfig.from_sources({"devices": ",".join(devices), "prefill": "64",
                                                     "gpu_order": "configured", "layer_split": "interleave:2"}))
    for _ in range(2):  # the second run replays the graphs captured in the first
        rep = sess.run(ids, 4).report
        assert rep.digest == base.digest and rep.generated == base.generated
    assert len(rep.plan.stages) == 4 and len(rep.busy_histogram) == 3
    computes = sorted((e.stage, e.chunk) for e in sess.events if e.kind == "compute" and e.chunk >= 0)
    assert computes == [(s, c) for s in range(4) for c in range(3)]
    sess.close()


@cuda
def test_balanced_chunks_are_graphed_and_match_eager(demo_path):
    model = gguf_model.load(demo_path)
    ids = synthetic(1536, model.spec.vocab, nonce=8)
    runs = {}
    for graphs in (False, True):
        sess = Session(model, EngineConfig(devices=["cuda:0", "cuda:0"], prefill=256, chunk_schedule="balanced",
                                           cuda_graphs=graphs))
        sess.run(ids, 0)  # warm-up: captures every size of the plan
        run = sess.run(ids, 0)
        runs[graphs] = run.report
        if graphs:
            sizes = {n for _, n in runs[graphs].plan.chunk_bounds()}
            assert sizes <= run.graph_sizes and any(st.graph_sets for st in sess.stages)
        sess.close()
    assert runs[True].plan.bounds == runs[False].plan.bounds and runs[True].digest == runs[False].digest


@cuda
@pytest.mark.parametrize("rot", [128, 64])  # full RoPE; partial rotary (GLM-4.5, MiniMax-M2: half the head)
def test_qk_norm_rope_kernel_matches_torch_and_lays_q_out_heads_first(monkeypatch, rot):
    from engine.kernels import qk_rope
    from engine.models.layers import Rope

    monkeypatch.delenv(qk_rope.ENV, raising=False)  # on by default where Triton runs

    dev = torch.device("cuda:0")
    n, H, KV, hd = 4096, 32, 4, 128
    gen = torch.Generator(device=dev).manual_seed(3)
    qkv = torch.randn(n, (H + 2 * KV) * hd, device=dev, generator=gen).to(torch.bfloat16)
    qk = qkv[:, : (H + KV) * hd].view(n, H + KV, hd)
    w = (1 + 0.1 * torch.randn(H + KV, hd, device=dev, generator=gen)).to(torch.bfloat16)
    cos, sin = Rope(hd, 1e6, "neox", dev, rot_dim=rot).lowp_tables(1000, n, torch.bfloat16)
    q, k = qk_rope.qk_norm_rope(qk, w, cos, sin, 1e-6, H)
    assert q.shape == (n, H, hd) and q.transpose(0, 1).is_contiguous() and k.is_contiguous()
    rq, rk = qk_rope._torch(qk.float(), w.float(), cos.float(), sin.float(), 1e-6, H)  # fp32 reference
    for got, want in ((q, rq), (k, rk)):
        err = (got.float() - want).abs().max().item()
        assert err <= 2 ** -6 * want.abs().max().item(), err


@cuda
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_dequant_bit_exact(qtype):
    """The GPU expands every type bit for bit as gguf's numpy dequantiser (random blocks)."""
    for seed in range(3):
        check_type(qtype, "cuda:0", rows=64, blocks_per_row=9, seed=seed)


@cuda
def test_cuda_quantized_q4_k_m_resident_and_streamed(make_arch):
    """A Q4_K_M MoE file on the GPU: experts stay as stored (resident or streamed through a
    cache of 5 slots), expanded per layer into bf16/fp32 scratch; fp32 agrees with HF, streamed
    gives the resident digest."""
    path = make_arch("qwen3moe", quant="q4_k_m", hidden=256, head_dim=64, n_experts=16, expert_ffn=256, ffn=512)
    model = gguf_model.load(path)
    ids = synthetic(64, model.spec.vocab, nonce=7)
    ref, gen = hf_logits(path, model.spec, ids)
    one = sum(model.nbytes(f"blk.3.{p}.weight") for p in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    one /= model.spec.n_experts
    for dtype in ("float32", "bfloat16"):
        resident = Session(model, EngineConfig(devices=["cuda:0"], dtype=dtype, prefill=16)).run(
            ids, decode_tokens=8, logits_all=True)
        sess = Session(model, EngineConfig(devices=["cuda:0"], dtype=dtype, prefill=16,
                                           expert_cache=5.5 * one / 2**30))
        streamed = sess.run(ids, decode_tokens=8, logits_all=True)
        assert streamed.report.expert_stats[0]["misses"] > 0
        assert streamed.report.digest == resident.report.digest, dtype
        if dtype == "float32":
            assert (resident.logits - ref).abs().max().item() <= 1e-4
            assert resident.report.generated == gen
        sess.close()


@cuda
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_cuda_dequant_in_steps_into_bf16(monkeypatch):
    """Large tensors expand in steps on the GPU; the bf16 scratch is the cast of the exact
    float32 values."""
    from dequant_support import random_blocks
    from gguf import GGMLQuantizationType as T
    from gguf import quants as gguf_quants

    from engine.quant import dequant

    monkeypatch.setattr(dequant, "CHUNK_BLOCKS_CUDA", 7)
    for qtype in (T.Q4_K, T.Q6_K, T.IQ4_XS, T.Q8_0):
        raw, shape = random_blocks(qtype, 40, 3, seed=4)
        ref = torch.from_numpy(gguf_quants.dequantize(raw, qtype)).to(torch.bfloat16).float()
        got = dequant.dequantize(torch.from_numpy(raw).cuda(), qtype, shape, dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and got.is_cuda
        a = got.float().cpu()
        assert ((a == ref) | (a.isnan() & ref.isnan())).all(), qtype.name


TRITON_DEQUANT_TYPES = ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q5_0", "Q4_1", "Q5_1", "Q2_K", "Q3_K",
                        "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "MXFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S",
                        "IQ1_M", "NVFP4", "TQ1_0", "TQ2_0"]


@cuda
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", TRITON_DEQUANT_TYPES)
def test_cuda_triton_dequant_bit_exact_casts_strided_and_graphed(monkeypatch, name):
    """The compiled Triton dequantiser (engine/quant/dequant_triton.py): float32 output bit for bit
    gguf's (this is where FMA contraction would show: `dl * q - ml` fused rounds once), bf16 and
    fp16 outputs the casts of it, the torch path's bits, a strided [rows, bytes] slice read in
    place (also gathered by a row index), and a CUDA-graph replay (no host synchronisation in the launch)."""
    pytest.importorskip("triton")
    from dequant_support import assert_bit_exact, random_blocks
    from gguf import GGMLQuantizationType as T
    from gguf import quants as gguf_quants

    from engine.quant import dequant, dequant_triton

    qtype = T[name]
    monkeypatch.delenv(dequant_triton.ENV, raising=False)
    dequant_triton._kernels.cache_clear()
    assert dequant.backend("cuda:0", qtype, torch.bfloat16) == "triton"

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool(((a == b) | (a.isnan() & b.isnan())).all())

    for seed, (rows, bpr) in enumerate([(64, 9), (1, 1), (300, 17)]):  # partial and many programs
        raw, shape = random_blocks(qtype, rows, bpr, seed)
        ref = gguf_quants.dequantize(raw, qtype)
        t = torch.from_numpy(raw).cuda()
        f32 = dequant.dequantize(t, qtype, shape)
        assert_bit_exact(f32, ref, f"{name} Triton fp32, seed {seed}")
        for dtype in (torch.bfloat16, torch.float16):
            low = dequant.dequantize(t, qtype, shape, dtype=dtype)
            assert low.dtype == dtype and same(low, f32.to(dtype)), (name, dtype, seed)
        strided = torch.zeros(rows, raw.shape[1] + 29, dtype=torch.uint8, device="cuda:0")
        strided[:, 13:13 + raw.shape[1]] = t
        got = dequant.dequantize(strided[:, 13:13 + raw.shape[1]], qtype, shape)
        assert_bit_exact(got, ref, f"{name} Triton strided rows, seed {seed}")
        idx = torch.arange(rows - 1, -1, -1, device="cuda:0")  # the expert cache's slot gather
        gathered = dequant.dequantize(strided[:, 13:13 + raw.shape[1]], qtype, shape, rows=idx)
        assert_bit_exact(gathered, ref.reshape(rows, -1)[::-1], f"{name} Triton gathered rows, seed {seed}")
    monkeypatch.setenv(dequant_triton.ENV, "torch")
    dequant_triton._kernels.cache_clear()
    assert dequant.backend("cuda:0", qtype) == "torch"
    assert_bit_exact(f32, dequant.dequantize(t, qtype, shape).cpu().numpy(), f"{name} Triton vs torch on CUDA")
    monkeypatch.delenv(dequant_triton.ENV)
    dequant_triton._kernels.cache_clear()

    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiled) on a side stream, as torch's graph docs do
        dequant.dequantize(t, qtype, shape, dtype=torch.bfloat16)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        graphed = dequant.dequantize(t, qtype, shape, dtype=torch.bfloat16)
    g.replay()
    torch.cuda.synchronize()
    assert same(graphed, f32.to(torch.bfloat16)), f"{name} graph replay"
    dequant_triton._kernels.cache_clear()


# code-book types: their Triton kernels gather from the torch path's device tables
LATTICE_AND_FP4_DEQUANT_TYPES = ["IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "MXFP4",
                                 "NVFP4", "TQ1_0", "TQ2_0"]


@cuda
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", LATTICE_AND_FP4_DEQUANT_TYPES)
def test_cuda_lattice_and_fp4_types_take_the_torch_path_bit_exact(monkeypatch, name):
    """The IQ1/IQ2/IQ3 lattice types and the 4-bit float / ternary types with STRATA_DEQUANT=torch
    (or where triton does not import): on CUDA the dispatcher picks the torch path for them, and
    that path gives gguf's bits for valid blocks and every bit pattern, in steps, gathered by a
    row index (the expert cache's slots) and cast to bf16; with the kernels on, the same
    finite blocks expand through Triton to the same bits."""
    from dequant_support import assert_bit_exact, random_blocks
    from gguf import GGMLQuantizationType as T
    from gguf import quants as gguf_quants

    from engine.quant import dequant, dequant_triton

    qtype = T[name]
    monkeypatch.setenv(dequant_triton.ENV, "torch")
    dequant_triton._kernels.cache_clear()
    assert dequant.backend("cuda:0", qtype, torch.bfloat16) == "torch"
    assert dequant.gpu_temporaries("cuda:0", [qtype], torch.bfloat16) == dequant.STEP_BYTES_CUDA
    for seed, finite in ((0, False), (1, True), (2, True)):
        raw, shape = random_blocks(qtype, 64, 9, seed, finite=finite)
        ref = gguf_quants.dequantize(raw, qtype)
        t = torch.from_numpy(raw).cuda()
        f32 = dequant.dequantize(t, qtype, shape)
        assert f32.is_cuda
        assert_bit_exact(f32, ref, f"{name} on CUDA, seed {seed}")
        if finite and dequant_triton.triton is not None:
            monkeypatch.delenv(dequant_triton.ENV)
            dequant_triton._kernels.cache_clear()
            assert dequant.backend("cuda:0", qtype) == "triton"
            assert_bit_exact(dequant.dequantize(t, qtype, shape), ref, f"{name} Triton, finite, seed {seed}")
            monkeypatch.setenv(dequant_triton.ENV, "torch")
            dequant_triton._kernels.cache_clear()
        bf = dequant.dequantize(t, qtype, shape, dtype=torch.bfloat16)
        assert torch.equal(bf.float().nan_to_num(), f32.to(torch.bfloat16).float().nan_to_num()), name
        idx = torch.arange(63, -1, -1, device="cuda:0")
        gathered = dequant.dequantize(t, qtype, shape, rows=idx)
        assert_bit_exact(gathered, ref[::-1], f"{name} gathered rows on CUDA, seed {seed}")
    # resident experts of these types expand inside a captured layer: the torch path makes no
    # host-to-device copy after its first (eager) call, so it captures and replays
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dequant.dequantize(t, qtype, shape, dtype=torch.bfloat16)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        graphed = dequant.dequantize(t, qtype, shape, dtype=torch.bfloat16)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed.float().nan_to_num(), bf.float().nan_to_num()), f"{name} graph replay"
    monkeypatch.setattr(dequant, "CHUNK_BLOCKS_CUDA", 7)
    stepped = dequant.dequantize(t, qtype, shape)
    assert_bit_exact(stepped, ref, f"{name} in steps on CUDA")
    dequant_triton._kernels.cache_clear()


@cuda
def test_yarn_rope_on_cuda_matches_transformers_and_the_cpu(tmp_path):
    """YaRN only changes the RoPE tables (frequencies, and cos/sin times its attention factor):
    the CUDA paths that take them (eager, CUDA graphs, the Triton q/k-norm+RoPE kernel in bf16)
    give transformers' yarn logits (issue 39)."""
    from engine.io import synth

    meta = {"{a}.rope.scaling.type": "yarn", "{a}.rope.scaling.factor": 4.0,
            "{a}.rope.scaling.original_context_length": 64}
    path = synth.write_model(tmp_path / "yarn.gguf", synth.recipe_from_args("demo", rope_base=10000.0),
                             metadata=meta)
    model = gguf_model.load(path)
    assert model.spec.rope_scaling is not None
    ids = synthetic(96, model.spec.vocab, nonce=7)
    pytest.importorskip("transformers")
    ref_model = hf_model(path, model.spec, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 64,
                                                            "rope_theta": model.spec.rope_base})
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    fp32 = Session(model, EngineConfig(devices=["cuda:0"], dtype="float32", chunk_tokens=32)).run(
        ids, decode_tokens=0, logits_all=True)
    assert (fp32.logits - ref).abs().max().item() <= 1e-4
    bf16 = Session(model, EngineConfig(devices=["cuda:0"], chunk_tokens=32)).run(ids, decode_tokens=0,
                                                                               logits_all=True)
    rel = (bf16.logits.float() - ref).abs().amax(-1) / ref.abs().amax(-1)  # per position, as above
    assert rel.median().item() <= 0.03
    assert (bf16.logits.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


def _q4_k_m_source(device: str, n_layers: int = 2):
    from engine.io import synth
    shapes = dict(hidden=256, head_dim=64, n_experts=16, expert_ffn=256, ffn=512)
    return synth.SyntheticSource(synth.recipe_from_args("demo", quant="q4_k_m", n_layers=n_layers, **shapes), device)


@cuda
def test_cuda_compact_experts_match_full_and_replay_in_a_graph(monkeypatch):
    """Resident Q4_K_M experts on the grouped-GEMM path (bf16): gathering only the routed experts
    (engine/models/routed_experts.py) gives the full expansion's output for a decode token and small
    chunks, and a CUDA graph captured at one token replays it correctly for other routings."""
    from engine.models import routed_experts
    from engine.models.layers import Layer, Rope
    from engine.models.loading import load_layer_weights
    from engine.quant.qtensor import QTensor

    src = _q4_k_m_source("cuda:0")
    dev = torch.device("cuda:0")
    spec = src.spec
    w = load_layer_weights(src, 1, dev, torch.bfloat16)
    assert isinstance(w.gate_exps, QTensor)
    layer = Layer(spec, 1, w, Rope(spec.head_dim, spec.rope_base, spec.rope_style, dev))
    layer.use_grouped_mm = True

    def force(compact: bool) -> None:
        monkeypatch.setitem(routed_experts.COMPACT_MAX_FRACTION, "cuda", 2.0 if compact else 0.0)

    g = torch.Generator(device=dev).manual_seed(2)
    for n in (1, 3, 5):
        h = torch.randn(n, spec.hidden, device=dev, dtype=torch.bfloat16, generator=g)
        force(False)
        full = layer.moe(h)
        force(True)
        compact = layer.moe(h)
        diff = (compact.float() - full.float()).abs().max().item()
        print(f"n={n}: compact vs full max |diff| {diff:.3g} (exact: {torch.equal(compact, full)})")
        assert diff <= 1e-2 * full.float().abs().max().item()
    force(True)
    static = torch.randn(1, spec.hidden, device=dev, dtype=torch.bfloat16, generator=g)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer.moe(static)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.moe(static)
    for _ in range(4):  # new tokens route to other experts: the graph's compact slots follow
        static.copy_(torch.randn(1, spec.hidden, device=dev, dtype=torch.bfloat16, generator=g))
        graph.replay()
        assert torch.equal(out, layer.moe(static))
    graph.reset()


@cuda
@pytest.mark.parametrize("quant", ["q4_k_m", "q6_k", "q8_0"])
def test_cuda_stored_block_experts_match_the_scratch_path_and_replay_in_a_graph(monkeypatch, quant):
    """Decode's routed experts from their stored blocks (engine/models/routed_matvec.py, the
    Triton matrix-vector kernels) give the compact-scratch grouped GEMMs' output up to the order
    of a float32 sum, and a CUDA graph captured at one token replays them for other routings."""
    from engine.io import synth
    from engine.models import routed_matvec
    from engine.models.layers import Layer, Rope
    from engine.models.loading import load_layer_weights

    shapes = dict(hidden=256, head_dim=64, n_experts=16, expert_ffn=256, ffn=512)
    src = synth.SyntheticSource(synth.recipe_from_args("demo", quant=quant, n_layers=2, **shapes), "cuda:0")
    dev, spec = torch.device("cuda:0"), src.spec
    w = load_layer_weights(src, 1, dev, torch.bfloat16)
    layer = Layer(spec, 1, w, Rope(spec.head_dim, spec.rope_base, spec.rope_style, dev))
    layer.use_grouped_mm = True
    assert routed_matvec.wanted(w, spec.n_experts_used, torch.empty(1, device=dev)), quant
    g = torch.Generator(device=dev).manual_seed(3)
    for n in (1, 2):
        h = torch.randn(n, spec.hidden, device=dev, dtype=torch.bfloat16, generator=g)
        monkeypatch.setattr(routed_matvec, "MATVEC_MAX_ROWS", 0)
        scratch = layer.moe(h)
        monkeypatch.setattr(routed_matvec, "MATVEC_MAX_ROWS", 64)
        stored = layer.moe(h)
        diff = (stored.float() - scratch.float()).abs().max().item()
        print(f"{quant} n={n}: stored-block vs scratch max |diff| {diff:.3g}")
        assert diff <= 2e-2 * scratch.float().abs().max().item()
    static = torch.randn(1, spec.hidden, device=dev, dtype=torch.bfloat16, generator=g)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer.moe(static)  # warm-up (and Triton's compile) off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.moe(static)
    for _ in range(4):
        static.copy_(torch.randn(1, spec.hidden, device=dev, dtype=torch.bfloat16, generator=g))
        graph.replay()
        assert torch.equal(out, layer.moe(static))
    graph.reset()


@cuda
@pytest.mark.parametrize("quant,dtype", [("f16", "bfloat16"), ("q4_k_m", "bfloat16"), ("q4_k_m", "float32")])
def test_cuda_greedy_decode_is_the_prefill_argmax(quant, dtype):
    """Greedy decode (graphed steps of one token, compact experts) equals the argmax of one
    prefill pass over prompt + generated; in bf16 a disagreement must be a rounding near-tie
    (within 3% of the largest logit), in fp32 none is allowed."""
    from decode_support import decode_and_prefill, disagreements

    from engine.io import synth
    shapes = dict(hidden=256, head_dim=64, n_experts=16, expert_ffn=256, ffn=512)
    src = synth.SyntheticSource(synth.recipe_from_args("demo", quant=quant, n_layers=2, **shapes), "cuda:0")
    gen, logits = decode_and_prefill(src, ["cuda:0"], dtype, decode=8)
    argmax = logits.argmax(-1).tolist()
    print(f"{quant} {dtype}: decode {gen}, prefill argmax {argmax}")
    if dtype == "float32":
        assert gen == argmax
    else:
        assert not disagreements(gen, logits, 0.03), (gen, argmax)


@cuda
@pytest.mark.parametrize("quant", ["q4_k_m", "f16"])
@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0", "cuda:0"]], ids=["one-stage", "two-stages"])
def test_cuda_graphed_decode_is_the_eager_decode_and_the_prefill_argmax(quant, devices):
    """Issue 32 item 2: each stage's decode step is ONE CUDA graph (its layers, the routed-expert
    gather, and the greedy head on the last stage), replaying the eager static-shape step bit for
    bit: graphs on and off decode the same tokens after the same digest (bf16; Q4_K_M experts and
    F16 weights; one stage, and two stages on one GPU).  The decode crosses a KV span (positions
    250-264: span 256, then the cache's 266 rows), so every stage captures twice in the first run
    and replays in the second; the tokens are the prefill argmax continuation (a bf16 near-tie
    within 3% of the largest logit allowed, as above)."""
    from decode_support import disagreements

    from engine.io import synth
    shapes = dict(hidden=256, head_dim=64, n_experts=16, expert_ffn=256, ffn=512)
    src = synth.SyntheticSource(synth.recipe_from_args("demo", quant=quant, n_layers=4, **shapes), "cuda:0")
    ids = synthetic(250, src.spec.vocab, nonce=6)
    decode = 16
    eager_sess = Session(src, EngineConfig(devices=devices, chunk_tokens=64, cuda_graphs=False))
    eager = eager_sess.run(ids, decode_tokens=decode).report
    eager_sess.close()
    sess = Session(src, EngineConfig(devices=devices, chunk_tokens=64))
    try:
        runs = [sess.run(ids, decode_tokens=decode).report for _ in range(2)]
        for k, rep in enumerate(runs):
            assert (rep.digest, rep.generated) == (eager.digest, eager.generated), (k, rep.generated, eager.generated)
        captured = [n for n in runs[0].notes if n.startswith("decode: 1 graph per step")]
        print("\n".join(captured))
        assert len(captured) == 2 * len(devices), runs[0].notes  # two spans per stage
        assert not any(n.startswith("decode:") for n in runs[1].notes), runs[1].notes
        assert all(sorted(st.decoding.graphs) == [256, 266] for st in sess.stages)
        print(f"{quant} {devices}: decode {runs[0].decode_tok_s:.0f} tok/s graphed, {eager.decode_tok_s:.0f} eager")
    finally:
        sess.close()
    full = Session(src, EngineConfig(devices=["cuda:0"], chunk_tokens=512))
    logits = full.run(list(ids) + eager.generated[:-1], logits_all=True).logits[len(ids) - 1:]
    full.close()
    assert not disagreements(eager.generated, logits, 0.03), (eager.generated, logits.argmax(-1).tolist())


@cuda
def test_cuda_split_k_decode_attention_matches_torch_and_replays_in_a_graph():
    """engine/kernels/decode_attention.py on the GPU (Qwen3-30B-A3B's 32/4 heads of 128, bf16):
    the Triton split-K kernels give the torch expression's output at positions across a 4224-key
    span, skip what lies past the position (NaN there changes nothing), and a CUDA graph captured
    at one position replays any other bit for bit."""
    pytest.importorskip("triton")
    from engine.kernels import decode_attention as da

    dev, H, KV, hd, span = torch.device("cuda:0"), 32, 4, 128, 4224
    g = torch.Generator(device=dev).manual_seed(3)
    q = torch.randn(1, H, hd, device=dev, dtype=torch.bfloat16, generator=g)
    keys = torch.randn(span, KV, hd, device=dev, dtype=torch.bfloat16, generator=g)
    values = torch.randn(span, KV, hd, device=dev, dtype=torch.bfloat16, generator=g)
    index = torch.zeros(1, dtype=torch.int64, device=dev)
    assert da.status()[0].startswith("Triton")

    def masked() -> torch.Tensor:
        return torch.arange(span, device=dev) > index

    for pos in (0, 127, 128, 1000, 4095, 4223):
        index.fill_(pos)
        m = masked()
        want = da._torch(q, keys.masked_fill(m[:, None, None], 0), values.masked_fill(m[:, None, None], 0), m)
        tail_k, tail_v = keys[pos + 1:].clone(), values[pos + 1:].clone()
        keys[pos + 1:], values[pos + 1:] = float("nan"), float("nan")
        got = da.decode_attention(q, keys, values, m, index)
        keys[pos + 1:], values[pos + 1:] = tail_k, tail_v
        rel = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
        print(f"pos {pos}: split-K vs torch {rel * 100:.3f}% of max |o|")
        assert rel <= 1e-2, pos
    index.fill_(7)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        da.decode_attention(q, keys, values, masked(), index)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = da.decode_attention(q, keys, values, masked(), index)
    for pos in (9, 300, 4000):
        index.fill_(pos)
        graph.replay()
        assert torch.equal(out, da.decode_attention(q, keys, values, masked(), index)), pos
    graph.reset()


@cuda
def test_the_report_names_triton_kernels_and_the_selftest_exercise_runs_one(demo_path):
    """engine/pipeline/kernel_report.py on a CUDA machine with triton: what the run report and the frozen
    self-test say there (issue 36)."""
    pytest.importorskip("triton")
    from engine.pipeline import kernel_report

    ok, what = kernel_report.exercise("cuda")
    assert ok and "matches torch" in what, what
    sess = Session(gguf_model.load(demo_path), EngineConfig(devices=["cuda:0"]))
    try:
        report = sess.run(synthetic(256, sess.spec.vocab, nonce=3)).report
    finally:
        sess.close()
    assert "MoE: Triton" in report.kernels and "q/k-norm+RoPE: Triton" in report.kernels, report.kernels
    assert "decode attention: Triton" in report.kernels, report.kernels
    assert not any(n.startswith("fast kernel missing") for n in report.notes)


@cuda
def test_cuda_memory_bandwidth_is_derived_for_the_roofline():
    """The decode roofline's bandwidth: memory clock x bus width, from torch or NVML (an H200's
    HBM3e is ~4.8 TB/s; any GPU this runs on has more than 100 GB/s)."""
    from engine.plan import roofline

    bw, how = roofline.cuda_bandwidth("cuda:0")
    print(f"cuda:0 memory bandwidth: {bw / 1e9 if bw else 0:.0f} GB/s ({how})")
    assert bw is not None and 100e9 < bw < 20e12, how


def _nvtx_names(monkeypatch) -> list[str]:
    names: list[str] = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: names.append(name) or 0)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: 0)
    return names


@cuda
def test_nvtx_ranges_name_stages_and_chunks_as_the_gantt_does(demo_path, monkeypatch):
    """Issue 37: `nsys profile` shows a range per (stage, chunk) compute, hand-off and decode step,
    named by RunPlan.stage_names (the Gantt's and the trace's names)."""
    names = _nvtx_names(monkeypatch)
    n_dev = min(torch.cuda.device_count(), 2)
    devices = [f"cuda:{i}" for i in range(n_dev)] if n_dev > 1 else ["cuda:0", "cuda:0"]
    sess = Session(gguf_model.load(demo_path), EngineConfig(devices=devices, prefill=16))
    try:
        names.clear()
        res = sess.run(synthetic(48, sess.spec.vocab, nonce=1), decode_tokens=3)
    finally:
        sess.close()
    plan = res.report.plan
    stage = plan.stage_names()
    for s in plan.stages:
        for c in range(plan.n_chunks):
            assert f"{stage[s.stage]} C{c} compute" in names, (stage[s.stage], names[:8])
    assert sum(n.endswith(("copy peer", "copy host", "copy same-device")) for n in names) == plan.n_chunks
    assert f"{stage[plan.stages[-1].stage]} decode 1" in names


@pytest.mark.parametrize("split", ["auto", "interleave:2"])
def test_no_nvtx_range_on_the_cpu(demo_path, monkeypatch, split):
    names = _nvtx_names(monkeypatch)
    sess = Session(gguf_model.load(demo_path), EngineConfig(devices=["cpu", "cpu"], prefill=16, layer_split=split))
    try:
        res = sess.run(synthetic(32, sess.spec.vocab, nonce=1), decode_tokens=2)
    finally:
        sess.close()
    assert names == []
    want = res.report.plan.stage_names()
    assert {st.index: st.label for st in sess.stages} == want  # the names a CUDA run's ranges carry


# ---- issue 35's families on CUDA (the families helper): partial rotary through the Triton
# q/k-norm+RoPE kernel (ROT < head_dim), MiniMax-M2's whole-projection q/k norm on the GPU path,
# sigmoid routing with the selection bias (fp32 router on the GPU), GLM's dense lead layer and
# shared expert, all captured in CUDA graphs
FAMILY_FILES = Path(__file__).parent / "data" / "families"


@cuda
@pytest.mark.parametrize("family", ["minimax-m2", "glm4moe"])
def test_cuda_families_match_transformers_and_graphs_replay_eager(family):
    transformers = pytest.importorskip("transformers")
    cls = {"minimax-m2": "MiniMaxM2ForCausalLM", "glm4moe": "Glm4MoeForCausalLM"}[family]
    if not hasattr(transformers, cls):
        pytest.skip(f"transformers {transformers.__version__} has no {cls}")
    model = gguf_model.load(FAMILY_FILES / f"{family}.gguf")
    ids = synthetic(96, model.spec.vocab, nonce=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(FAMILY_FILES / family), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    fp32 = Session(model, EngineConfig(devices=["cuda:0"], dtype="float32", chunk_tokens=32)).run(
        ids, decode_tokens=0, logits_all=True)
    assert (fp32.logits - ref).abs().max().item() <= 1e-4
    eager = Session(model, EngineConfig(devices=["cuda:0"], chunk_tokens=32, cuda_graphs=False)).run(
        ids, decode_tokens=4, logits_all=True)
    sess = Session(model, EngineConfig(devices=["cuda:0"], chunk_tokens=32))
    graphed = sess.run(ids, decode_tokens=4, logits_all=True)
    assert any(sess.stages[0].graph_sets), "the family's layers were not captured"
    sess.close()
    assert torch.equal(graphed.logits, eager.logits) and graphed.report.digest == eager.report.digest
    rel = (eager.logits - ref).abs().amax(-1) / ref.abs().amax(-1)
    agree = (eager.logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{family}: bf16 vs HF fp32: median {rel.median().item() * 100:.2f}%, max {rel.max().item() * 100:.2f}%; "
          f"top-1 agreement {agree * 100:.1f}%")
    assert rel.median().item() <= 0.03 and agree >= 0.9


# ---- DeepSeek-V3 / Kimi-K2 (llama.cpp deepseek2, the deepseek helper): multi-head latent attention
# on the GPU (its own layer class: one eager path, no CUDA graph; v heads padded to the q/k width
# for the attention kernel chosen for heads of nope + rope), both attention forms, the latent
# cache across two GPUs (prefill-main's hand-off), streamed experts beside a dense lead layer
@cuda
@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_cuda_deepseek2_matches_transformers_in_both_attention_forms(form, monkeypatch):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no DeepseekV3ForCausalLM")
    from engine.models import mla

    monkeypatch.setattr(mla, "absorbed_wanted", lambda s, n: form == "absorbed")
    model = gguf_model.load(FAMILY_FILES / "deepseek3.gguf")
    ids = synthetic(96, model.spec.vocab, nonce=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(FAMILY_FILES / "deepseek3"), dtype=torch.float32)
    with torch.no_grad():
        ref = hf.eval()(input_ids=torch.tensor([ids])).logits[0]
    fp32 = Session(model, EngineConfig(devices=["cuda:0"], dtype="float32", chunk_tokens=32)).run(
        ids, decode_tokens=0, logits_all=True)
    assert (fp32.logits - ref).abs().max().item() <= 1e-4
    bf16 = Session(model, EngineConfig(devices=["cuda:0"], chunk_tokens=32)).run(ids, decode_tokens=4, logits_all=True)
    rel = (bf16.logits - ref).abs().amax(-1) / ref.abs().amax(-1)
    agree = (bf16.logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"deepseek2 {form}: bf16 vs HF fp32: median {rel.median().item() * 100:.2f}%, "
          f"max {rel.max().item() * 100:.2f}%; top-1 agreement {agree * 100:.1f}%")
    assert rel.median().item() <= 0.03 and agree >= 0.9


@cuda
@two_gpus
def test_cuda_deepseek2_latent_cache_hand_off_and_streamed_experts():
    model = gguf_model.load(FAMILY_FILES / "deepseek3.gguf")
    ids = synthetic(96, model.spec.vocab, nonce=6)
    base = dict(devices=["cuda:0", "cuda:1"], dtype="float32", chunk_tokens=32)
    one = Session(model, EngineConfig(**base)).run(ids, decode_tokens=4).report
    main = Session(model, EngineConfig(**base, prefill_main=True)).run(ids, decode_tokens=4).report
    assert (main.digest, main.generated) == (one.digest, one.generated)
    from engine.models.experts import EXPERT_PARTS

    layer = model.spec.dense_lead
    tiny = 0.4 * sum(model.nbytes(f"blk.{layer}.{p}.weight") for p in EXPERT_PARTS) / 2**30
    streamed = Session(model, EngineConfig(**base, expert_cache=tiny)).run(ids, decode_tokens=4).report
    assert (streamed.digest, streamed.generated) == (one.digest, one.generated)
