"""Model families proven against their authors' code (issues 34, 35): tiny random models of
transformers' own classes, converted by llama.cpp's convert_hf_to_gguf.py
(scripts/family_files.py made tests/data/families), run by the engine on the GGUF file and by
transformers on the safetensors it was converted from, fp32 on CPU, prompts of several chunks.

The hybrids' files (Qwen3-Next, Qwen3.5-MoE) are sensitive to rounding (random weights; a GDN
layer amplifies a perturbation of its input about tenfold): transformers' own fp32 logits differ
from its fp64 ones by 2e-5 over a few tokens to 1.5e-4 over 96; each of our layers alone is as
close to fp64 as transformers' is.  The 48-token cases hold ours to 1e-4 of transformers' fp32
logits; the 96-token ones to twice transformers' own fp32 error."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import torch_linear_attention
from session_support import SAME_DIGEST, run_digest

from engine.config import EngineConfig
from engine.io import gguf_model
from engine.io.prompt import synthetic
from engine.pipeline.session import Session

DATA = Path(__file__).parent / "data" / "families"
# family -> (transformers auto class, the architecture the file says)
FAMILIES = {"mixtral": ("AutoModelForCausalLM", "llama"), "qwen3vlmoe": ("AutoModelForImageTextToText", "qwen3vlmoe"),
            "minimax-m2": ("AutoModelForCausalLM", "minimax-m2"), "glm4moe": ("AutoModelForCausalLM", "glm4moe"),
            "qwen3next": ("AutoModelForCausalLM", "qwen3next"), "qwen35moe": ("AutoModelForCausalLM", "qwen35moe")}
# what each file's spec must say beyond the shapes: the features its oracle test proves
FEATURES = {"minimax-m2": dict(rope_dim=8, expert_gating="sigmoid", expert_bias=True, expert_weights_norm=True),
            # block_count 4 counts the MTP block; the model is the other 3, the first with a dense FFN
            "glm4moe": dict(n_layers=3, dense_lead=1, ffn=96, shared_ffn=24, rope_dim=8, qk_norm=True, qkv_bias=True,
                            expert_gating="sigmoid", expert_bias=True, expert_weights_norm=True,
                            expert_weights_scale=2.5),
            # three GDN layers then gated attention, RoPE over a quarter of the head, the gated shared expert
            "qwen3next": dict(recurrent=(True, True, True, False), rope_dim=4, shared_ffn=32, shared_gate=True,
                              v_tiled=False),
            "qwen35moe": dict(recurrent=(True, True, True, False), rope_dim=4, shared_ffn=32, shared_gate=True,
                              v_tiled=True)}
HYBRIDS = ["qwen3next", "qwen35moe"]  # their layers run the reference path on every device (no fast path)
TOKENS = 48


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param


def reference_logits(family: str, ids: list[int], fp64: bool = False) -> torch.Tensor:
    """transformers' logits on the file's source weights, fp32 (or fp64: the exact ones, within
    fp32's own error)."""
    transformers = pytest.importorskip("transformers")
    auto = getattr(transformers, FAMILIES[family][0])
    extra = dict(experts_implementation="eager") if fp64 else {}  # grouped GEMMs take no fp64
    model = auto.from_pretrained(str(DATA / family), dtype=torch.float32, **extra).eval()
    if fp64:
        model = model.double()
    with torch.no_grad(), torch_linear_attention():
        return model(input_ids=torch.tensor([ids])).logits[0]


def assert_agrees(family: str, ids: list[int], ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Ours within 1e-4 of transformers' fp32 logits; or, on a machine whose fp32 kernels are
    themselves further than 1e-4 from the exact logits (an AVX2 CPU's are, for Qwen3-Next's
    file: 1.5e-4 over 48 tokens), at most twice as far from transformers' fp64 logits as
    transformers' own fp32 ones are."""
    err = (ours - ref).abs().max().item()
    if err <= 1e-4:
        return
    exact = reference_logits(family, ids, fp64=True)
    own = (ref.double() - exact).abs().max().item()
    assert own > 1e-4, f"{err:.3g} from transformers, whose own fp32 error is only {own:.3g}"
    assert (ours.double() - exact).abs().max().item() <= 2 * own


def test_the_file_is_the_converters(family):
    model = gguf_model.load(DATA / f"{family}.gguf")
    assert model.spec.arch == FAMILIES[family][1]
    assert model.spec.n_experts == 4 and model.spec.n_experts_used == 2
    assert {k: getattr(model.spec, k) for k in FEATURES.get(family, {})} == FEATURES.get(family, {})


@pytest.mark.parametrize("devices,chunk,depth,main", [(["cpu"], 16, 1, False), (["cpu", "cpu"], 16, 0, False),
                                                      (["cpu", "cpu"], 32, 1, True)])
def test_logits_equal_transformers_on_the_weights_the_file_came_from(family, devices, chunk, depth, main):
    model = gguf_model.load(DATA / f"{family}.gguf")
    ids = synthetic(TOKENS, model.spec.vocab, nonce=3)
    ref = reference_logits(family, ids)
    sess = Session(model, EngineConfig(devices=devices, dtype="float32", chunk_tokens=chunk, pipeline_depth=depth,
                                       prefill_main=main))
    try:
        ours = sess.run(ids, decode_tokens=0, logits_all=True).logits
    finally:
        sess.close()
    assert_agrees(family, ids, ours, ref)


def test_digest_is_the_same_over_stages_depths_executors_and_prefill_main(family):
    """(Chunk sizes change the arithmetic's order, so the logits test above covers them.)"""
    model = gguf_model.load(DATA / f"{family}.gguf")
    ids = synthetic(TOKENS, model.spec.vocab, nonce=4)
    assert len({run_digest(model, ids, **cfg) for cfg in SAME_DIGEST}) == 1


def test_the_gpu_paths_code_run_on_the_cpu_agrees_with_transformers(family, monkeypatch):
    """The GPU path's own code — fused q/k/v (`fuse_weights`), `pre_attention` (a family's own,
    MiniMax-M2's wide q/k norm), `post_attention`, the fast router branch, the dense lead layer —
    run in fp32 on the CPU by letting every layer take it (`fast_ok`), against transformers.
    Its kernels fall back to their torch expressions here (qk_norm_rope, the MoE combine) and no
    grouped GEMM runs: tests/test_triton_kernels.py and tests/test_cuda.py cover those."""
    from engine.models.layers import Layer

    monkeypatch.setattr(Layer, "fast_ok", lambda self, x: self.spec.rope_style == "neox")
    model = gguf_model.load(DATA / f"{family}.gguf")
    if model.spec.rope_style != "neox":
        pytest.skip("llama's adjacent-pair RoPE has no GPU fast path")
    if family in HYBRIDS:
        pytest.skip("GDN and gated-attention layers have no GPU fast path (the reference path runs everywhere)")
    ids = synthetic(TOKENS, model.spec.vocab, nonce=3)
    sess = Session(model, EngineConfig(devices=["cpu"], dtype="float32", chunk_tokens=16))
    try:
        ours = sess.run(ids, decode_tokens=0, logits_all=True).logits
        assert all(layer.fused is not None for st in sess.stages for layer in st.layers)  # the path ran
    finally:
        sess.close()
    assert (ours - reference_logits(family, ids)).abs().max().item() <= 1e-4


# ------------------------------------------------ Qwen3-Next and Qwen3.5-MoE: the state across chunks


@pytest.mark.parametrize("hybrid", HYBRIDS)
@pytest.mark.parametrize("chunk,devices", [(8, ["cpu"]), (70, ["cpu", "cpu"])])
def test_hybrid_logits_over_chunks_across_the_delta_rules_blocks(hybrid, chunk, devices):
    """96 tokens: 12 chunks of 8 (each GDN layer restarts its recurrence twelve times from the
    carried state), or a chunk of 70 (two of the delta rule's 64-token blocks in one chunk, and
    the cut off their grid) then 26 on a second stage.  At this length fp32 itself is about
    1.5e-4 from the exact logits (transformers' fp32 run against its fp64 run), so the bound is
    that: ours at most twice as far from transformers' fp64 logits as its own fp32 ones are."""
    transformers = pytest.importorskip("transformers")
    model = gguf_model.load(DATA / f"{hybrid}.gguf")
    ids = synthetic(96, model.spec.vocab, nonce=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DATA / hybrid), dtype=torch.float32,
                                                           experts_implementation="eager").eval()
    with torch.no_grad(), torch_linear_attention():
        fp32 = hf(input_ids=torch.tensor([ids])).logits[0].double()
        exact = hf.double()(input_ids=torch.tensor([ids])).logits[0]
    sess = Session(model, EngineConfig(devices=devices, dtype="float32", chunk_tokens=chunk))
    try:
        ours = sess.run(ids, decode_tokens=0, logits_all=True).logits.double()
    finally:
        sess.close()
    fp32_error = (fp32 - exact).abs().max().item()
    assert 0 < fp32_error < 1e-3
    assert (ours - exact).abs().max().item() <= 2 * fp32_error


@pytest.mark.parametrize("hybrid", HYBRIDS)
@pytest.mark.parametrize("cfg", [dict(devices=["cpu"]), dict(devices=["cpu", "cpu"], prefill_main=True)])
def test_hybrid_decode_continues_transformers_greedy_generation(hybrid, cfg):
    """Decode steps one token at a time through every layer's carried state (GDN conv tail and
    matrices, attention KV): the tokens transformers' generate picks (its own cache)."""
    transformers = pytest.importorskip("transformers")
    model = gguf_model.load(DATA / f"{hybrid}.gguf")
    ids = synthetic(TOKENS, model.spec.vocab, nonce=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DATA / hybrid), dtype=torch.float32).eval()
    with torch.no_grad(), torch_linear_attention():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    sess = Session(model, EngineConfig(dtype="float32", chunk_tokens=16, **cfg))
    try:
        got = sess.run(ids, decode_tokens=6).report.generated
    finally:
        sess.close()
    assert list(got) == want


@pytest.mark.parametrize("hybrid", HYBRIDS)
def test_hybrid_prefill_main_hands_each_stage_its_state_bytes(hybrid):
    """Prefill-main copies each later stage's states from the main device: its GDN layers' fixed
    conv tail and matrices and its attention layers' KV of the prompt; the memory plan counts the
    same bytes; and the digest is the one stage's, with threads and with processes."""
    from engine import models
    from engine.plan.memory_plan import plan_memory

    model = gguf_model.load(DATA / f"{hybrid}.gguf")
    spec = model.spec
    ids = synthetic(TOKENS, spec.vocab, nonce=4)
    one = run_digest(model, ids, devices=["cpu"])
    for executor in ("threads", "processes"):
        cfg = dict(devices=["cpu", "cpu"], chunk_tokens=16, prefill_main=True, executor=executor)
        sess = Session(model, EngineConfig(**cfg))
        try:
            run = sess.run(ids, decode_tokens=2)
            first, end = sess.stages[1].first, sess.stages[1].end
        finally:
            sess.close()
        assert run.report.digest == one
        copies = [e for e in run.events if e.kind == "copy" and e.note.startswith("kv layers")]
        assert [e.nbytes for e in copies] == [models.states_bytes(spec, range(first, end), TOKENS, torch.float32)]
    gdn = [i for i in range(spec.n_layers) if spec.recurrent[i]]
    assert models.states_bytes(spec, gdn, 1, torch.float32) == models.states_bytes(spec, gdn, 10_000, torch.float32)
    plan = plan_memory(model, EngineConfig(devices=["cpu", "cpu"], chunk_tokens=16), tokens=TOKENS)
    assert [d.kv for d in plan.devices] == [models.states_bytes(spec, range(d.first, d.end), TOKENS, torch.float32)
                                            for d in plan.devices]
    # stage 0 holds GDN layers only: its state is all recurrent, and it holds no attention scores
    first = plan.devices[0]
    assert not any(not spec.recurrent[i] for i in range(first.first, first.end))
    assert first.state == first.kv > 0 and first.attention == 0
    assert 0 < plan.devices[1].state < plan.devices[1].kv and "recurrent state" in plan.render()


@pytest.mark.parametrize("hybrid", HYBRIDS)
def test_hybrid_digest_with_interleaved_groups(hybrid):
    """interleave:2 makes each layer its own stage (GDN, GDN, GDN, attention, on alternating
    devices): each stage keeps its one layer's state across chunks; depth 0/1 and prefill-main."""
    model = gguf_model.load(DATA / f"{hybrid}.gguf")
    ids = synthetic(TOKENS, model.spec.vocab, nonce=4)
    one = run_digest(model, ids, devices=["cpu"])
    for extra in (dict(), dict(pipeline_depth=0), dict(prefill_main=True)):
        assert run_digest(model, ids, devices=["cpu", "cpu"], layer_split="interleave:2", **extra) == one


def test_the_hybrid_oracle_runs_transformers_torch_delta_rule():
    """transformers binds flash-linear-attention's kernels at import where `fla` imports (they
    crash on CPU tensors and take TF32 in fp32); the reference swaps in the torch functions its
    wrappers keep (functools' __wrapped__, inside kernels' function modules from 5.25), and puts
    the wrappers back after.  Fails if transformers stops keeping them."""
    pytest.importorskip("transformers")
    import importlib
    import inspect

    module = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    name = next(n for n in ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule") if hasattr(module, n))
    wrapper = getattr(module, name)
    with torch_linear_attention():
        inside = getattr(module, name)
        assert inside is not wrapper and inspect.isfunction(inside) and not hasattr(inside, "__wrapped__")
        assert inside.__module__ == module.__name__ and inside.__name__ == name  # transformers' own torch code
        assert "for i in range" in inspect.getsource(inside)  # the chunked torch loop, not a kernel call
    assert getattr(module, name) is wrapper
