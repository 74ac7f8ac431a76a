"""gpt-oss proven against its authors' code (issue 35): a tiny random GptOssForCausalLM (a sliding
layer with window 8, then a full one; sinks, q/k/v/o, router and expert biases, gate/up weights
large enough to hit SwiGLU's clamp, YaRN with `truncate: false`), converted by llama.cpp's
convert_hf_to_gguf.py twice (scripts/family_files.py): from the float folder (F32 experts, what
the converter writes for an unquantised checkpoint) and from the same weights in the published
MXFP4 form (the converter repacks them into ggml MXFP4 blocks).  Both files run against
transformers on the float folder, fp32 on CPU, over a prompt longer than the window and than a
chunk, at chunk sizes below and above the window."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.io import gguf_model
from engine.io.prompt import synthetic
from engine.kernels import sink_attention as sa
from engine.pipeline.session import Session

DATA = Path(__file__).parent / "data" / "families"
FILES = {"f32": "gpt-oss.gguf", "mxfp4": "gpt-oss-mxfp4.gguf"}
TOKENS = 48  # window 8, chunks 5 and 16


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(DATA / "gpt-oss"), dtype=torch.float32).eval()
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(ids: list[int]) -> torch.Tensor:
        if tuple(ids) not in cache:
            with torch.no_grad():
                cache[tuple(ids)] = model(input_ids=torch.tensor([ids])).logits[0]
        return cache[tuple(ids)]
    return logits


@pytest.mark.parametrize("kind", sorted(FILES))
def test_the_files_are_the_converters(kind):
    model = gguf_model.load(DATA / FILES[kind])
    s = model.spec
    assert s.arch == "gpt-oss" and (s.n_experts, s.n_experts_used, s.expert_ffn) == (4, 2, 32)
    assert s.sliding_window == 8 and s.sliding == (True, False)  # llama.cpp's pattern 2: even layers slide
    assert s.rope_scaling.kind == "yarn" and s.rope_scaling.factor == 32 and not s.rope_scaling.truncate
    want = "MXFP4" if kind == "mxfp4" else "F32"
    assert {model.qtype(f"blk.{i}.ffn_{p}_exps.weight").name for i in (0, 1) for p in ("gate", "up", "down")} == {want}


def _run(model, ids: list[int], **settings) -> torch.Tensor:
    sess = Session(model, EngineConfig(dtype="float32", **settings))
    try:
        return sess.run(ids, decode_tokens=0, logits_all=True).logits
    finally:
        sess.close()


@pytest.mark.parametrize("kind", sorted(FILES))
@pytest.mark.parametrize("devices,chunk,depth,main", [(["cpu"], 5, 1, False), (["cpu", "cpu"], 16, 0, False),
                                                      (["cpu", "cpu"], 16, 1, True)])
def test_logits_equal_transformers_on_the_weights_the_files_came_from(reference, kind, devices, chunk, depth, main):
    model = gguf_model.load(DATA / FILES[kind])
    ids = synthetic(TOKENS, model.spec.vocab, nonce=3)
    ours = _run(model, ids, devices=devices, chunk_tokens=chunk, pipeline_depth=depth, prefill_main=main)
    assert (ours - reference(ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("chunk", [5, 16])
def test_digest_is_the_same_over_stages_depths_executors_and_prefill_main(chunk):
    """Per chunk size (another chunk size changes the arithmetic's order in the last bits, as
    for every family: the logits test covers chunk sizes)."""
    model = gguf_model.load(DATA / FILES["mxfp4"])
    ids = synthetic(TOKENS, model.spec.vocab, nonce=4)
    digests, generated = set(), set()
    for cfg in (dict(devices=["cpu"]), dict(devices=["cpu", "cpu"]), dict(devices=["cpu", "cpu"], pipeline_depth=0),
                dict(devices=["cpu", "cpu"], prefill_main=True),
                dict(devices=["cpu", "cpu"], executor="processes")):
        sess = Session(model, EngineConfig(chunk_tokens=chunk, **cfg))
        try:
            rep = sess.run(ids, decode_tokens=2).report
        finally:
            sess.close()
        digests.add(rep.digest)
        generated.add(tuple(rep.generated))
    assert len(digests) == 1 and len(generated) == 1


def _eager_reference(q, k, v, sinks, window):
    """transformers' GptOss eager attention over the whole sequence, with its sliding mask."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    T, H, hd = q.shape
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks = H // k.shape[1], sinks
    i = torch.arange(T).view(-1, 1)
    j = torch.arange(T).view(1, -1)
    seen = (j <= i) & ((i - j < window) if window else True)
    mask = torch.zeros(T, T).masked_fill(~seen, float("-inf")).view(1, 1, T, T)
    out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], mask, scaling=hd ** -0.5)
    return out[0].reshape(T, H * hd)


@pytest.mark.parametrize("window", [None, 1, 6, 40])
@pytest.mark.parametrize("chunk,score_bytes", [(7, sa.SCORE_BYTES), (16, 3000), (1, sa.SCORE_BYTES)])
def test_sink_attention_over_chunks_equals_transformers_eager(monkeypatch, window, chunk, score_bytes):
    """Chunk by chunk over the cache (small score budgets cut a chunk into query blocks; chunk 1
    is decode) against one eager call over the whole sequence: sinks, window, GQA."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(sa, "SCORE_BYTES", score_bytes)
    g = torch.Generator().manual_seed(1)
    T, H, KV, hd = 37, 4, 2, 8
    q, k, v = (torch.randn(T, h, hd, generator=g) for h in (H, KV, KV))
    sinks = torch.randn(H, generator=g) * 2
    want = _eager_reference(q, k, v, sinks, window)
    got = torch.cat([sa.sink_attention(q[p:p + chunk], k[:min(T, p + chunk)], v[:min(T, p + chunk)], p, sinks, window)
                     for p in range(0, T, chunk)])
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("pos", [9, 24])
def test_a_key_no_query_sees_never_reaches_the_sliding_output(pos):
    """The window-blocked path over a cache that still holds the key just before every query's
    window: that key (here NaN, as a poisoned cache row would be) changes nothing, as in the
    row-block reference that never reads it."""
    g = torch.Generator().manual_seed(3)
    w, n, H, KV, hd = 8, 16, 4, 2, 8
    first = pos - w  # the cache starts at the key no query of the chunk sees
    q = torch.randn(n, H, hd, generator=g)
    k, v = (torch.randn(pos + n - first, KV, hd, generator=g) for _ in range(2))
    k[0], v[0] = float("nan"), float("nan")
    sinks = torch.randn(H, generator=g)
    got = sa.sink_attention(q, k, v, pos, sinks, w)
    want = sa._reference(q, k, v, pos, sinks, w, first)
    assert torch.isfinite(want).all() and torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("window,chunk", [(1, 3), (4, 1), (4, 3), (8, 10), (40, 7)])
def test_a_sliding_cache_holds_the_window_and_attends_as_the_full_one(window, chunk):
    """SlidingKV keeps window - 1 tokens, yet each chunk's attention equals the one over every
    token; a hand-off mid-sequence moves only the window's rows and the receiver carries on."""
    from engine.models.kv import LayerKV, copy_state
    from engine.models.sliding_kv import SlidingKV

    g = torch.Generator().manual_seed(2)
    T, H, KV, hd = 29, 4, 2, 8
    q, k, v = (torch.randn(T, h, hd, generator=g) for h in (H, KV, KV))
    sinks = torch.randn(H, generator=g)
    full = LayerKV(T, KV, hd, torch.device("cpu"), torch.float32)
    sliding = SlidingKV(T, window, KV, hd, torch.device("cpu"), torch.float32)
    assert sliding.nbytes == SlidingKV.bytes_for(T, window, KV, hd, torch.float32) == 2 * min(T, window - 1) * KV * hd * 4
    for p in range(0, T, chunk):
        e = min(T, p + chunk)
        if p == chunk:  # prefill-main's hand-off after the first chunk: into a fresh cache
            fresh = SlidingKV(T, window, KV, hd, torch.device("cpu"), torch.float32)
            assert copy_state(fresh, sliding) == 2 * min(p, window - 1) * KV * hd * 4
            sliding = fresh
        want = sa.sink_attention(q[p:e], *full.append(k[p:e], v[p:e], p), p, sinks, window)
        got = sa.sink_attention(q[p:e], *sliding.append(k[p:e], v[p:e], p), p, sinks, window)
        assert torch.equal(got, want)


def test_the_memory_plan_counts_the_window_on_sliding_layers_and_every_token_on_full_ones():
    from engine import models
    from engine.models.kv import LayerKV

    spec = gguf_model.load(DATA / FILES["mxfp4"]).spec
    per_token = LayerKV.bytes_for(1, spec.n_kv_heads, spec.head_dim, torch.float32)
    assert models.states_bytes(spec, [0], 1000, torch.float32) == 7 * per_token  # window 8: 7 kept
    assert models.states_bytes(spec, [1], 1000, torch.float32) == 1000 * per_token
    assert models.states_bytes(spec, [0, 1], 5, torch.float32) == 10 * per_token
    states = models.new_states(spec, [0, 1], 1000, "cpu", torch.float32)
    assert [s.nbytes for s in states] == [7 * per_token, 1000 * per_token]


def test_the_presets_have_gpt_oss_shapes():
    """openai's published sizes: 20.9B and 116.8B parameters (embedding and head included)."""
    from engine.io import synth

    for preset, billions in (("gpt-oss-20b", 20.91), ("gpt-oss-120b", 116.83)):
        s = synth.recipe_from_args(preset).spec()
        total = s.n_layers * s.layer_params() + 2 * s.vocab * s.hidden + s.hidden
        assert round(total / 1e9, 2) == billions
        assert s.sliding_window == 128 and s.sliding[:4] == (True, False, True, False)
    assert synth.recipe_from_args("gpt-oss-20b", n_layers=2).spec().n_layers == 2


def test_a_made_file_reads_back_as_its_recipe_and_keeps_biases_as_floats(tmp_path):
    """make-model --arch gpt-oss: the spec read from the file is the recipe's (window, pattern,
    YaRN); experts MXFP4, the 2-D expert biases F32 (llama.cpp quantises only weights)."""
    from engine.io import synth

    recipe = synth.recipe_from_args("demo", arch="gpt-oss", quant="mxfp4", n_layers=3)
    model = gguf_model.load(synth.write_model(tmp_path / "g.gguf", recipe))
    assert replace(model.spec, rms_eps=recipe.rms_eps) == recipe.spec()  # (the file's eps is a float32)
    assert model.qtype("blk.0.ffn_up_exps.weight").name == "MXFP4"
    assert model.qtype("blk.0.ffn_up_exps.bias").name == "F32"


def test_the_file_names_which_layers_slide(tmp_path):
    from engine.io import synth

    recipe = synth.recipe_from_args("demo", arch="gpt-oss", n_layers=4)
    flags = [False, True, True, False]  # an array: llama.cpp reads it flag by flag
    for pattern, sliding in ((3, (True, True, False, True)), (0, (True,) * 4), (1, (False,) * 4),
                             (flags, tuple(flags))):
        path = synth.write_model(tmp_path / f"p{len(str(pattern))}{sliding}.gguf", recipe,
                                 metadata={"{a}.attention.sliding_window_pattern": pattern})
        assert gguf_model.load(path).spec.sliding == sliding
    short = synth.write_model(tmp_path / "short.gguf", recipe, metadata={"{a}.attention.sliding_window_pattern": flags[:3]})
    with pytest.raises(gguf_model.GGUFError, match=r"sliding_window_pattern holds 3 entries: one flag per layer \(4\)"):
        gguf_model.load(short)


def test_another_rope_base_on_sliding_layers_is_refused_by_name(tmp_path):
    from engine.io import synth

    recipe = synth.recipe_from_args("demo", arch="gpt-oss", n_layers=2)
    path = synth.write_model(tmp_path / "b.gguf", recipe, metadata={"{a}.rope.freq_base_swa": 10000.0})
    with pytest.raises(gguf_model.GGUFError, match=r"gpt-oss\.rope\.freq_base_swa is 10000"):
        gguf_model.load(path)
    same = synth.write_model(tmp_path / "s.gguf", recipe, metadata={"{a}.rope.freq_base_swa": recipe.rope_base})
    assert gguf_model.load(same).spec.rope_base == recipe.rope_base


def test_streamed_experts_give_transformers_logits_and_the_resident_digest(reference):
    """Experts from an ExpertCache of 2 slots (half a layer's), biases resident with the layer."""
    model = gguf_model.load(DATA / FILES["mxfp4"])
    layer = sum(model.nbytes(f"blk.0.ffn_{p}_exps.weight") for p in ("gate", "up", "down")) / 2**30
    ids = synthetic(TOKENS, model.spec.vocab, nonce=3)
    streamed = _run(model, ids, devices=["cpu"], chunk_tokens=16, expert_cache=0.5 * layer)
    assert (streamed - reference(ids)).abs().max().item() <= 1e-4
    digests = set()
    for cache in ("all", 0.5 * layer):
        sess = Session(model, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=16, expert_cache=cache))
        try:
            rep = sess.run(ids, decode_tokens=2).report
        finally:
            sess.close()
        digests.add(rep.digest)
        st = rep.expert_stats[0]
        assert st["resident"] == (cache == "all") and (cache == "all" or (st["slots"] == 2 and st["misses"] > 0))
    assert len(digests) == 1


def test_streamed_experts_take_the_resident_grouped_arithmetic_in_bf16(monkeypatch):
    """Where grouped GEMMs run (CUDA; forced here on the CPU, whose torch has them too), streamed
    experts go through the same per-row arithmetic as resident ones, so a bf16 run gives one digest
    either way.  (They once ran one expert at a time with the unit in eager bf16: an H100's 8K/32K
    runs of gpt-oss-20b gave other digests streamed than resident, at the same chunks.)"""
    from engine.models import gpt_oss_layer

    monkeypatch.setattr(gpt_oss_layer, "_grouped_mm_ok", lambda x: True)
    model = gguf_model.load(DATA / FILES["mxfp4"])
    layer = sum(model.nbytes(f"blk.0.ffn_{p}_exps.weight") for p in ("gate", "up", "down")) / 2**30
    ids = synthetic(TOKENS, model.spec.vocab, nonce=3)
    grouped = []
    real = gpt_oss_layer.GptOssLayer._grouped
    monkeypatch.setattr(gpt_oss_layer.GptOssLayer, "_grouped",
                        lambda self, *a, **k: grouped.append(1) or real(self, *a, **k))
    digests = {}
    for cache in ("all", 0.5 * layer):
        sess = Session(model, EngineConfig(devices=["cpu"], dtype="bfloat16", chunk_tokens=16, expert_cache=cache))
        try:
            rep = sess.run(ids, decode_tokens=2).report
        finally:
            sess.close()
        digests[cache] = (rep.digest, rep.generated)
        assert rep.expert_stats[0]["resident"] == (cache == "all")
    assert grouped, "the resident run did not take the grouped GEMMs"
    assert digests["all"] == digests[0.5 * layer]


def _cudnn_stand_in(q, k, v, causal):
    """What `attention._cudnn` returns (output [1, H, n, hd], natural log-sum-exp [1, H, n]),
    computed in torch: the CUDA split's merge runs on the CPU with it."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@pytest.mark.parametrize("native_gqa", [True, False])
@pytest.mark.parametrize("pos", [0, 13])
def test_the_cuda_splits_sink_merge_equals_the_reference(monkeypatch, native_gqa, pos):
    """The full layers' CUDA path (prefix and diagonal blocks merged with the sink through their
    log-sum-exps), with cuDNN's call stood in for: the merge and the GQA expansion are the
    reference's arithmetic.  (The cuDNN call itself is checked on the GPU, against the reference,
    before a device uses it.)"""
    from engine.kernels import attention

    monkeypatch.setattr(attention, "_cudnn", _cudnn_stand_in)
    monkeypatch.setattr(attention, "kernel_for",
                        lambda *a: attention.AttentionKernel(attention.CUDNN_SPLIT, native_gqa=native_gqa))
    g = torch.Generator().manual_seed(3)
    n, H, KV, hd = 9, 4, 2, 8
    q, k, v = (torch.randn(t, h, hd, generator=g) for t, h in ((n, H), (pos + n, KV), (pos + n, KV)))
    sinks = 2 * torch.randn(H, generator=g)
    got = sa._split(q, k, v, pos, sinks)
    want = sa._reference(q, k, v, pos, sinks, None, 0)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("native_gqa", [True, False])
@pytest.mark.parametrize("n,pos,first", [(8, 0, 0), (20, 0, 0), (16, 8, 1), (21, 24, 17), (19, 9, 0), (40, 30, 23)])
def test_the_cuda_sliding_block_split_equals_the_reference(monkeypatch, native_gqa, n, pos, first):
    """A sliding layer's CUDA path (each query block's own block causally, the previous block's
    later keys through the reversed causal call, merged with the sink by their log-sum-exps), with
    cuDNN's call stood in for: chunks at position 0 and behind a prefix, a ragged last block, a
    cache holding more than the window or just the window."""
    from engine.kernels import attention

    monkeypatch.setattr(attention, "_cudnn", _cudnn_stand_in)
    monkeypatch.setattr(attention, "kernel_for",
                        lambda *a: attention.AttentionKernel(attention.CUDNN_SPLIT, native_gqa=native_gqa))
    g = torch.Generator().manual_seed(5)
    H, KV, hd, w = 4, 2, 8, 8
    total = pos + n - first
    q, k, v = (torch.randn(t, h, hd, generator=g) for t, h in ((n, H), (total, KV), (total, KV)))
    sinks = 2 * torch.randn(H, generator=g)
    got = sa._sliding_split(q, k, v, pos, sinks, w, first)
    want = sa._reference(q, k, v, pos, sinks, w, first)
    assert (got - want).abs().max().item() <= 1e-5


def test_the_report_names_the_sink_attention():
    model = gguf_model.load(DATA / FILES["f32"])
    sess = Session(model, EngineConfig(devices=["cpu"], chunk_tokens=16))
    try:
        rep = sess.run(synthetic(20, model.spec.vocab, nonce=1), decode_tokens=0).report
    finally:
        sess.close()
    assert rep.attention == "cpu: torch with sinks, window 8 on sliding layers"
