"""DeepSeek-V3 / Kimi-K2 files (llama.cpp `deepseek2`, issue 35): multi-head latent attention,
YaRN with mscale_all_dim, a leading dense layer, grouped sigmoid routing with the correction bias,
routed scaling and a shared expert, proven against transformers' DeepseekV3ForCausalLM on the
weights llama.cpp's converter made the file from (scripts/family_files.py deepseek3), fp32 on CPU,
over prompts of several chunks; the latent cache's size in the plan and the hand-off; the older
files' unsplit attn_kv_b."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from session_support import SAME_DIGEST, run_digest

from engine import models
from engine.config import EngineConfig
from engine.io import gguf_model, synth
from engine.io.prompt import synthetic
from engine.models import loading, mla, routing
from engine.models.layers import Rope, load_head
from engine.models.mla import LatentCache
from engine.pipeline.session import Session

DATA = Path(__file__).parent / "data" / "families"
FILE = DATA / "deepseek3.gguf"
TOKENS = 48


def reference_logits(ids: list[int], folder: Path = DATA / "deepseek3") -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def run(model, ids, decode=0, **cfg):
    sess = Session(model, EngineConfig(**{"devices": ["cpu"], "dtype": "float32", **cfg}))
    try:
        return sess.run(ids, decode_tokens=decode, logits_all=True)
    finally:
        sess.close()


def test_the_file_is_the_converters():
    s = gguf_model.load(FILE).spec
    assert (s.arch, s.n_layers, s.n_heads, s.head_dim, s.rope_dim, s.v_head_dim) == ("deepseek2", 2, 4, 24, 8, 12)
    assert (s.q_lora_rank, s.kv_lora_rank, s.kv_b_split, s.dense_lead, s.ffn) == (24, 16, True, 1, 48)
    assert (s.n_experts, s.n_experts_used, s.expert_groups, s.expert_groups_used, s.shared_ffn) == (8, 2, 2, 1, 16)
    assert (s.expert_gating, s.expert_bias, s.expert_weights_norm, s.expert_weights_scale) == ("sigmoid", True, True,
                                                                                               2.5)
    assert s.rope_style == "norm" and s.rope_scaling.kind == "yarn" and s.rope_scaling.attention_factor == 1.0
    assert s.kq_factor == pytest.approx((1 + 0.1 * np.log(4.0)) ** 2, rel=1e-6)  # mscale_all_dim 1, factor 4


@pytest.fixture(params=["expanded", "absorbed"])
def attention_form(request, monkeypatch):
    """Each of MLA's two forms (per-head k/v from the latents, or attention in the latent space)
    for every chunk, whatever mla.absorbed_wanted would pick (the tiny file's ranks pick absorbed)."""
    monkeypatch.setattr(mla, "absorbed_wanted", lambda s, n: request.param == "absorbed")
    return request.param


@pytest.mark.parametrize("devices,chunk,depth,main", [(["cpu"], 16, 1, False), (["cpu", "cpu"], 16, 0, False),
                                                      (["cpu", "cpu"], 32, 1, True)])
def test_logits_equal_transformers_on_the_weights_the_file_came_from(attention_form, devices, chunk, depth, main):
    model = gguf_model.load(FILE)
    ids = synthetic(TOKENS, model.spec.vocab, nonce=3)
    ours = run(model, ids, devices=devices, chunk_tokens=chunk, pipeline_depth=depth, prefill_main=main).logits
    assert (ours - reference_logits(ids)).abs().max().item() <= 1e-4


def test_digest_is_the_same_over_stages_depths_executors_and_prefill_main():
    """(Chunk sizes change the routed experts' GEMM shapes — a one-row GEMM rounds otherwise than
    a taller one on the CPU — so the logits test covers them; the attention's own chunk-size
    invariance is the next test.)"""
    model = gguf_model.load(FILE)
    ids = synthetic(TOKENS, model.spec.vocab, nonce=4)
    settings = SAME_DIGEST + (dict(devices=["cpu", "cpu"], executor="processes", prefill_main=True),)
    assert len({run_digest(model, ids, **cfg) for cfg in settings}) == 1


def test_latent_attention_is_the_same_over_chunk_sizes(attention_form):
    """Each layer's attention over a prompt in chunks of 16, 32 and 48 tokens, bit for bit: the
    cache gives every chunk the same latents and RoPE keys of the tokens before it.  (Chunks of
    12 or 24 rows differ in the last bit: the CPU's GEMMs block rows by 16, for every family.)"""
    model = gguf_model.load(FILE)
    s, cpu = model.spec, torch.device("cpu")
    rope = Rope.for_spec(s, cpu)
    x = load_head(model, cpu, torch.float32, True, False).embed_tokens(torch.tensor(synthetic(TOKENS, s.vocab, nonce=6)))
    for i in range(s.n_layers):
        layer = loading.new_layer(s, i, loading.load_layer_weights(model, i, cpu, torch.float32), rope)
        outs = []
        for chunk in (16, 32, TOKENS):
            cache = models.new_states(s, [i], TOKENS, cpu, torch.float32)[0]
            outs.append(torch.cat([layer.attention(x[p:p + chunk], cache, p) for p in range(0, TOKENS, chunk)]))
        assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_decoded_tokens_are_the_prefills_argmax_continuation():
    """Each decode step reads the latent cache the prefill (and the steps before) wrote."""
    model = gguf_model.load(FILE)
    ids = synthetic(40, model.spec.vocab, nonce=5)
    gen = run(model, ids, decode=5, devices=["cpu", "cpu"], chunk_tokens=16).report.generated
    logits = run(model, ids + gen[:-1], chunk_tokens=16).logits
    assert gen == [int(t) for t in logits[len(ids) - 1:].argmax(-1)]


def test_the_cache_holds_the_latent_and_the_rope_key():
    """kv_lora_rank + rope values a token and layer, in the plan's figure and the states made."""
    s = gguf_model.load(FILE).spec
    per_token = (s.kv_lora_rank + s.rope_dim) * 4
    assert models.states_bytes(s, range(s.n_layers), 100, torch.float32) == s.n_layers * 100 * per_token
    states = models.new_states(s, range(s.n_layers), 100, "cpu", torch.float32)
    assert all(isinstance(st, LatentCache) for st in states) and sum(st.nbytes for st in states) == 2 * 100 * per_token


def _unsplit(src: Path, dst: Path) -> None:
    """The file as converters before llama.cpp's MLA change wrote it: attn_kv_b whole
    ([heads x (nope + v)] rows over the latent), per-head key/value lengths, KV heads = heads."""
    gguf = pytest.importorskip("gguf")
    r = gguf.GGUFReader(src)
    a = "deepseek2"
    s = gguf_model.load(src).spec
    w = gguf.GGUFWriter(dst, a)
    skip = {f"{a}.attention.key_length_mla", f"{a}.attention.value_length_mla", "general.architecture",
            "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    new = {f"{a}.attention.key_length": s.head_dim, f"{a}.attention.value_length": s.v_head_dim,
           f"{a}.attention.head_count_kv": s.n_heads}
    for key, field in r.fields.items():
        if key in skip:
            continue
        if key in new:
            w.add_uint32(key, new[key])
            continue
        vtype = field.types[0]
        value = field.contents()
        w.add_key_value(key, value, vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    tensors = {t.name: np.array(t.data) for t in r.tensors}
    for name, data in tensors.items():
        if name.endswith("attn_v_b.weight"):
            continue
        if name.endswith("attn_k_b.weight"):
            k_b = data  # [H, rank, nope]
            v_b = tensors[name.replace("attn_k_b", "attn_v_b")]  # [H, v, rank]
            kv_b = np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1).reshape(-1, k_b.shape[1])
            w.add_tensor(name.replace("attn_k_b", "attn_kv_b"), np.ascontiguousarray(kv_b))
            continue
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_an_older_files_unsplit_kv_b_runs_the_same_model(attention_form, tmp_path):
    path = tmp_path / "legacy.gguf"
    _unsplit(FILE, path)
    model = gguf_model.load(path)
    assert not model.spec.kv_b_split and model.spec.head_dim == 24 and model.spec.v_head_dim == 12
    ids = synthetic(TOKENS, model.spec.vocab, nonce=3)
    ours = run(model, ids, devices=["cpu", "cpu"], chunk_tokens=16).logits
    assert (ours - reference_logits(ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("groups,used,biased", [(4, 2, True), (8, 3, True), (4, 1, False)])
def test_grouped_routing_is_deepseek_v3s_router(groups, used, biased):
    """Group-limited top-k (routing.limit_to_groups) against transformers' DeepseekV3TopkRouter:
    16 experts, top 4, groups scored by their best two biased scores."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=groups,
                                        topk_group=used, norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(groups + used)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 16, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.5 if biased else torch.zeros(16))
    h = torch.randn(40, 16, generator=g)
    _, want_w, want_i = router(h)
    s = gguf_model.load(FILE).spec
    spec = replace(s, n_experts=16, n_experts_used=4, expert_groups=groups, expert_groups_used=used)
    got_w, got_i = routing.route(torch.nn.functional.linear(h, router.weight), spec,
                                 router.e_score_correction_bias if biased else None)
    o1, o2 = got_i.sort(-1), want_i.sort(-1)
    assert torch.equal(o1.values, o2.values)
    assert torch.allclose(got_w.gather(-1, o1.indices), want_w.gather(-1, o2.indices), atol=1e-6)
    plain = routing.route(torch.nn.functional.linear(h, router.weight), replace(spec, expert_groups=0),
                          router.e_score_correction_bias if biased else None)[1].sort(-1).values
    assert not torch.equal(plain, o1.values)  # the groups changed some token's experts


def test_streamed_experts_give_the_resident_digest():
    """Experts from a cache smaller than one layer's (the leading dense layer has none to stream)."""
    from engine.models.experts import EXPERT_PARTS

    model = gguf_model.load(FILE)
    ids = synthetic(TOKENS, model.spec.vocab, nonce=7)
    layer = model.spec.dense_lead  # the first expert layer
    tiny = 0.4 * sum(model.nbytes(f"blk.{layer}.{p}.weight") for p in EXPERT_PARTS) / 2**30
    resident = run(model, ids, decode=3, devices=["cpu", "cpu"], chunk_tokens=16, expert_cache="all").report
    streamed = run(model, ids, decode=3, devices=["cpu", "cpu"], chunk_tokens=16, expert_cache=tiny).report
    assert (streamed.digest, streamed.generated) == (resident.digest, resident.generated)
    assert any(st["misses"] > 0 and not st["resident"] for st in streamed.expert_stats)


def test_a_plain_q_without_rope_scaling_or_groups(attention_form):
    """The other layout (V2-Lite's): attn_q without a q LoRA, no YaRN (softmax scale head_dim^-0.5),
    no expert groups, every layer routed, the top k not renormalised, two shared experts."""
    model = gguf_model.load(DATA / "deepseek3-lite.gguf")
    s = model.spec
    assert (s.q_lora_rank, s.rope_scaling, s.kq_factor, s.expert_groups, s.dense_lead) == (0, None, 1.0, 0, 0)
    assert (s.head_dim, s.v_head_dim, s.shared_ffn, s.expert_weights_norm) == (16, 16, 32, False)
    ids = synthetic(TOKENS, s.vocab, nonce=3)
    ours = run(model, ids, devices=["cpu", "cpu"], chunk_tokens=16).logits
    assert (ours - reference_logits(ids, DATA / "deepseek3-lite")).abs().max().item() <= 1e-4


SMALL = dict(n_layers=3, hidden=64, n_heads=4, n_kv_heads=4, head_dim=48, rope_dim=16, q_lora_rank=32,
             kv_lora_rank=32, v_head_dim=32, n_experts=8, expert_ffn=32, ffn=96, dense_lead=1, expert_groups=4,
             expert_groups_used=2, vocab=0, context_length=4096, quant="q8_0")


def test_the_presets_are_deepseek_v3_and_kimi_k2_at_full_shapes():
    for preset, heads, experts in (("deepseek-v3", 128, 256), ("kimi-k2", 64, 384)):
        s = synth.recipe_from_args(preset, n_layers=16).spec()
        assert (s.n_layers, s.hidden, s.n_heads, s.n_experts, s.n_experts_used) == (16, 7168, heads, experts, 8)
        assert (s.q_lora_rank, s.kv_lora_rank, s.head_dim, s.rope_dim, s.v_head_dim) == (1536, 512, 192, 64, 128)
        # the latent cache: 576 values a token and layer, against 128 x (192 + 128) expanded
        assert models.states_bytes(s, range(16), 1000, torch.bfloat16) == 16 * 1000 * 576 * 2


def test_a_written_recipe_reads_back_and_runs_and_so_does_its_synthetic_source(tmp_path):
    """make-model's file (the MLA form the converter writes) reads back as the recipe's spec and
    runs alike on one stage and two; the in-memory source of the recipe runs too."""
    recipe = synth.recipe_from_args("deepseek-v3", **SMALL)
    model = gguf_model.load(synth.write_model(tmp_path / "ds.gguf", recipe))
    assert replace(model.spec, rms_eps=1e-6) == recipe.spec()  # (eps is written as float32)
    ids = synthetic(40, model.spec.vocab, nonce=2)
    one = run(model, ids, decode=2, chunk_tokens=16)
    two = run(model, ids, decode=2, devices=["cpu", "cpu"], chunk_tokens=16)
    assert (one.report.digest, one.report.generated) == (two.report.digest, two.report.generated)
    assert torch.isfinite(run(synth.SyntheticSource(recipe), ids, chunk_tokens=16).logits).all()


def test_the_plan_counts_the_expanded_keys_and_values_where_a_chunk_expands():
    from engine.plan.memory_plan import plan_memory

    model = gguf_model.load(FILE)
    s = model.spec
    expanded = 1000 * s.n_heads * (s.qk_nope_dim + s.v_head_dim + 2 * s.head_dim) * 4
    base = plan_memory(model, EngineConfig(devices=["cpu"], chunk_tokens=16), tokens=1000).devices[0].scratch
    big = plan_memory(model, EngineConfig(devices=["cpu"], chunk_tokens=512), tokens=1000).devices[0].scratch
    assert mla.absorbed_wanted(s, 16) and not mla.absorbed_wanted(s, 512) and big - base == expanded
    v3 = synth.recipe_from_args("deepseek-v3", n_layers=4).spec()
    assert mla.absorbed_wanted(v3, 1) and mla.absorbed_wanted(v3, 128) and not mla.absorbed_wanted(v3, 512)
