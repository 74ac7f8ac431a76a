"""gpt-oss on CUDA (the device machine; skipped without a GPU): the converter-made files against
transformers (fp32 at the CPU bar, bf16 at test_cuda.py's), the sink attention's two CUDA paths
against the reference at gpt-oss-20b's heads, and gpt-oss-20b's full shapes through a run."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.io import gguf_model, synth
from engine.io.prompt import synthetic
from engine.kernels import sink_attention as sa
from engine.pipeline.session import Session

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DATA = Path(__file__).parent / "data" / "families"
DEV = torch.device("cuda:0")


def _logits(model, ids, **settings):
    sess = Session(model, EngineConfig(devices=["cuda:0"], **settings))
    try:
        return sess.run(ids, decode_tokens=0, logits_all=True).logits
    finally:
        sess.close()


@pytest.mark.parametrize("name", ["gpt-oss.gguf", "gpt-oss-mxfp4.gguf"])
def test_cuda_matches_transformers(name):
    transformers = pytest.importorskip("transformers")
    model = gguf_model.load(DATA / name)
    ids = synthetic(48, model.spec.vocab, nonce=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DATA / "gpt-oss"), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    for chunk in (5, 16):
        assert (_logits(model, ids, dtype="float32", chunk_tokens=chunk) - ref).abs().max().item() <= 1e-4
    bf16 = _logits(model, ids, chunk_tokens=16)
    rel = (bf16 - ref).abs().amax(-1) / ref.abs().amax(-1)
    agree = (bf16.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{name}: bf16 vs HF fp32: median {rel.median().item() * 100:.2f}%, top-1 agreement {agree * 100:.1f}%")
    assert rel.median().item() <= 0.03 and agree >= 0.9


def _qkv(pos, n, seed, H=64, KV=8, hd=64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, H, hd, generator=gen).to(DEV, torch.bfloat16)
    k = torch.randn(pos + n, KV, hd, generator=gen).to(DEV, torch.bfloat16)
    v = torch.randn(pos + n, KV, hd, generator=gen).to(DEV, torch.bfloat16)
    return q, k, v, (2 * torch.randn(H, generator=gen)).to(DEV)


@pytest.mark.parametrize("pos,n", [(0, 2048), (6144, 2048), (1024, 512)])
def test_full_layers_take_the_cudnn_split_and_match_the_reference(pos, n):
    """gpt-oss-20b's heads (64 q / 8 kv of 64): the device chose the split (H200 with torch's
    cuDNN), and it is within bf16 rounding of the fp32 reference."""
    q, k, v, sinks = _qkv(pos, n, pos + n)
    assert sa._split_ok(DEV, 64, 8, 64, torch.bfloat16)
    got = sa.sink_attention(q, k, v, pos, sinks).float()
    exact = sa._reference(q.float(), k.float(), v.float(), pos, sinks, None, 0)
    ref = sa._reference(q, k, v, pos, sinks, None, 0).float()
    err, err_ref = (got - exact).abs().max().item(), (ref - exact).abs().max().item()
    print(f"pos {pos} n {n}: split {err:.2e}, bf16 reference {err_ref:.2e} from fp32")
    assert err <= max(2 * err_ref, 4e-3)


@pytest.mark.parametrize("pos,n", [(0, 2048), (6144, 2048), (6144, 1)])
def test_sliding_layers_on_cuda_match_the_fp32_reference(pos, n):
    from engine.models.sliding_kv import SlidingKV

    q, k, v, sinks = _qkv(pos, n, 7 + pos + n)
    cache = SlidingKV(pos + n, 128, 8, 64, DEV, torch.bfloat16)
    if pos:
        cache.append(k[:pos], v[:pos], 0)
    keys, values = cache.append(k[pos:], v[pos:], pos)
    got = sa.sink_attention(q, keys, values, pos, sinks, 128).float()
    exact = sa._reference(q.float(), k.float(), v.float(), pos, sinks, 128, 0)
    assert (got - exact).abs().max().item() <= 4e-2


def test_gpt_oss_20b_shapes_run_a_prompt_of_several_chunks():
    """Two layers (one sliding, one full) at full shapes, MXFP4 experts generated on the device:
    a 6K prompt in 2K chunks, one stage and two on one GPU give one digest."""
    src = synth.SyntheticSource(synth.recipe_from_args("gpt-oss-20b", n_layers=2), "cuda:0")
    ids = synthetic(6144, src.spec.vocab, nonce=5)
    digests = set()
    for devices in (["cuda:0"], ["cuda:0", "cuda:0"]):
        sess = Session(src, EngineConfig(devices=devices, chunk_tokens=2048))
        try:
            rep = sess.run(ids, decode_tokens=4).report
        finally:
            sess.close()
        print(f"{len(devices)} stage(s): prefill {rep.prefill_s:.2f} s, digest {rep.digest[:12]}")
        digests.add(rep.digest)
    assert len(digests) == 1


def test_the_fused_moe_kernels_give_the_torch_expressions():
    """The one-pass biased clamped SwiGLU and the weighted sum with the down bias against the
    family's torch expressions in fp32, at a 2048-token chunk of gpt-oss-20b's experts."""
    from engine.kernels import moe_kernels
    from engine.models import gpt_oss_layer as gl

    assert moe_kernels.available(torch.ones(1, device=DEV)), "Triton kernels expected on the GPU machine"
    gen = torch.Generator(device=DEV).manual_seed(2)
    n, k, E, f = 2048, 4, 32, 2880
    g, u = (4 * torch.randn(n * k, f, device=DEV, generator=gen) for _ in range(2))  # past the clamp at 7
    row_e = torch.sort(torch.randint(0, E, (n * k,), device=DEV, generator=gen)).values
    gb, ub, db = (torch.randn(E, f, device=DEV, generator=gen) for _ in range(3))
    want = gl.swiglu_oai(g + gb[row_e], u + ub[row_e])
    got = moe_kernels.swiglu_oai(g.bfloat16(), u.bfloat16(), row_e, gb.bfloat16(), ub.bfloat16(),
                                 gl.SWIGLU_ALPHA, gl.SWIGLU_LIMIT).float()
    ref = gl.swiglu_oai(g.bfloat16() + gb.bfloat16()[row_e], u.bfloat16() + ub.bfloat16()[row_e]).float()
    err, err_ref = (got - want).abs().max().item(), (ref - want).abs().max().item()
    print(f"swiglu_oai: fused {err:.3g}, torch bf16 {err_ref:.3g} against fp32")
    assert err <= err_ref
    ys = torch.randn(n * k, f, device=DEV, generator=gen)
    inv = torch.randperm(n * k, device=DEV, generator=gen)
    top_i = torch.randint(0, E, (n, k), device=DEV, generator=gen)
    top_w = torch.softmax(torch.randn(n, k, device=DEV, generator=gen), -1)
    want = ((ys[inv].view(n, k, f) + db[top_i]) * top_w.unsqueeze(-1)).sum(1)
    got = moe_kernels.combine(ys.bfloat16(), inv, top_w, db.bfloat16(), top_i).float()
    err = (got - want).abs().max().item()
    print(f"combine with the down bias: {err:.3g} (max |y| {want.abs().max().item():.2f})")
    assert err <= 2 ** -7 * want.abs().max().item()


def test_cuda_streamed_experts_give_the_resident_digest():
    """bf16 on the GPU: experts streamed through a cache of half a layer take the resident path's
    grouped GEMMs and fused unit, so the digest (and the decode) is the resident one."""
    model = gguf_model.load(DATA / "gpt-oss-mxfp4.gguf")
    layer = sum(model.nbytes(f"blk.0.ffn_{p}_exps.weight") for p in ("gate", "up", "down")) / 2**30
    ids = synthetic(48, model.spec.vocab, nonce=3)
    runs = {}
    for cache in ("all", 0.5 * layer):
        sess = Session(model, EngineConfig(devices=["cuda:0"], chunk_tokens=16, expert_cache=cache))
        try:
            runs[cache] = sess.run(ids, decode_tokens=4).report
        finally:
            sess.close()
    assert runs[0.5 * layer].expert_stats[0]["misses"] > 0
    assert (runs["all"].digest, runs["all"].generated) == (runs[0.5 * layer].digest, runs[0.5 * layer].generated)


def test_cuda_sliding_layers_take_the_cudnn_block_split():
    """gpt-oss-20b's attention shapes (64 q / 8 kv heads of 64, window 128) in bf16: the sliding
    layers' block split passes its self-check against the torch reference on this GPU, and a
    4K chunk behind a 1K prefix agrees with the reference to bf16's tolerance."""
    dev = torch.device("cuda:0")
    assert sa._split_ok(dev, 64, 8, 64, torch.bfloat16, 128)
    g = torch.Generator(device="cpu").manual_seed(11)
    n, pos, w = 4096, 1024, 128
    q = torch.randn(n, 64, 64, generator=g).to(dev, torch.bfloat16)
    k, v = (torch.randn(pos + n, 8, 64, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    sinks = (2 * torch.randn(64, generator=g)).to(dev)
    got = sa._sliding_split(q, k, v, pos, sinks, w, 0)
    want = sa._reference(q, k, v, pos, sinks, w, 0)
    assert (got.float() - want.float()).abs().max().item() < 2e-2
    assert "block split" in sa.describe(dev, 64, 8, 64, torch.bfloat16, 128)
