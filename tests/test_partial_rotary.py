"""Partial rotary (`rope.dimension_count` below the head size: GLM-4.5, MiniMax-M2, Qwen3-Next):
RoPE turns each head's first rot dimensions, paired within them as the family pairs them, and
passes the rest through, on every path: the fp32 tables (`Rope.apply`), the low-precision
tables the GPU path, its CUDA graphs and the Triton q/k-norm+RoPE kernel take
(`qk_rope.rotate_lowp` / `qk_norm_rope`'s torch expressions; the kernel itself in
tests/test_triton_kernels.py and tests/test_cuda.py), and a family that reads the key through
the whole pipeline."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine import models
from engine.config import EngineConfig
from engine.io import gguf_model, synth
from engine.io.prompt import synthetic
from engine.kernels import qk_rope
from engine.models.layers import Rope, rms_norm
from engine.pipeline.session import Session

CPU = torch.device("cpu")


def _hf_partial(x: torch.Tensor, pos: int, rot: int, base: float) -> torch.Tensor:
    """transformers' own partial rotary (glm4_moe's apply_rotary_pos_emb) on x [n, heads, hd]."""
    glm = pytest.importorskip("transformers.models.glm4_moe.modeling_glm4_moe")
    inv = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
    t = torch.arange(pos, pos + x.shape[0], dtype=torch.float32)
    emb = torch.cat((torch.outer(t, inv),) * 2, dim=-1)
    q = x.transpose(0, 1)[None]  # [1, heads, n, hd]
    out, _ = glm.apply_rotary_pos_emb(q, q, emb.cos()[None], emb.sin()[None])
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("rot", [8, 4, 16])
def test_rope_turns_the_first_dimensions_as_transformers_does(rot):
    torch.manual_seed(0)
    x = torch.randn(12, 3, 16)
    ours = Rope(16, 10000.0, "neox", CPU, rot_dim=rot).apply(x, 5)
    assert torch.allclose(ours, _hf_partial(x, 5, rot, 10000.0), atol=1e-5)
    if rot < 16:
        assert torch.equal(ours[..., rot:], x[..., rot:])


def test_full_rotary_is_unchanged_by_the_field():
    x = torch.randn(9, 2, 16)
    assert torch.equal(Rope(16, 1e6, "neox", CPU).apply(x, 3), Rope(16, 1e6, "neox", CPU, rot_dim=16).apply(x, 3))
    with pytest.raises(ValueError):
        Rope(16, 1e6, "neox", CPU, rot_dim=18)


def test_norm_style_pairs_adjacent_dimensions_within_the_rotated_part():
    x = torch.randn(6, 2, 16)
    full8 = Rope(8, 500.0, "norm", CPU).apply(x[..., :8].contiguous(), 2)
    ours = Rope(16, 500.0, "norm", CPU, rot_dim=8).apply(x, 2)
    assert torch.equal(ours[..., :8], full8) and torch.equal(ours[..., 8:], x[..., 8:])


@pytest.mark.parametrize("norm", [True, False])
def test_the_gpu_paths_torch_expressions_match_the_fp32_rope(norm):
    """What the GPU path runs where Triton does not (and what CUDA graphs capture)."""
    torch.manual_seed(1)
    n, H, KV, hd, rot = 10, 4, 2, 16, 8
    qk = torch.randn(n, H + KV, hd)
    w = 1 + 0.1 * torch.randn(H + KV, hd) if norm else None
    rope = Rope(hd, 1e4, "neox", CPU, rot_dim=rot)
    cos, sin = rope.lowp_tables(7, n, torch.float32)
    assert cos.shape == (n, 1, rot)
    q, k = qk_rope.qk_norm_rope(qk, w, cos, sin, 1e-6, H)  # CPU tensors: the torch expressions
    want = qk if w is None else torch.stack([rms_norm(qk[:, h], w[h], 1e-6) for h in range(H + KV)], 1)
    want = rope.apply(want, 7)
    assert torch.allclose(q, want[:, :H], atol=1e-5) and torch.allclose(k, want[:, H:], atol=1e-5)


TOY = "partialtoy"


@pytest.fixture()
def files(tmp_path):
    models.register(models.Family(TOY, moe=True, qk_norm=True, partial_rotary=True))
    try:
        recipe = synth.recipe_from_args("demo", arch=TOY, n_layers=2, quant="f32", rope_dim=16)
        yield (gguf_model.load(synth.write_model(tmp_path / "partial.gguf", recipe)),
               gguf_model.load(synth.write_model(tmp_path / "full.gguf", replace(recipe, rope_dim=0))))
    finally:
        models.unregister(TOY)


def _logits(model, devices, chunk):
    sess = Session(model, EngineConfig(devices=devices, dtype="float32", chunk_tokens=chunk))
    try:
        return sess.run(synthetic(40, model.spec.vocab, nonce=2), decode_tokens=0, logits_all=True).logits
    finally:
        sess.close()


def test_a_partial_rotary_file_is_read_and_run_over_chunks_and_stages(files):
    partial, full = files
    assert (partial.spec.rope_dim, partial.spec.rotary_dim, full.spec.rope_dim) == (16, 16, 0)
    assert partial.metadata[f"{TOY}.rope.dimension_count"] == 16
    one = _logits(partial, ["cpu"], 40)
    for devices, chunk in ((["cpu"], 16), (["cpu", "cpu"], 8)):
        assert (_logits(partial, devices, chunk) - one).abs().max().item() <= 1e-5
    assert (_logits(full, ["cpu"], 40) - one).abs().max().item() > 1e-3  # the same weights, all turned


@pytest.mark.parametrize("count", [15, 64])
def test_a_rotary_count_the_head_cannot_hold_is_refused_naming_the_key(tmp_path, count):
    models.register(models.Family(TOY, moe=True, partial_rotary=True))
    try:
        path = synth.write_model(tmp_path / "bad.gguf", synth.recipe_from_args("demo", arch=TOY, n_layers=1),
                                 metadata={"{a}.rope.dimension_count": count})
        with pytest.raises(gguf_model.GGUFError, match=rf"{TOY}\.rope\.dimension_count is {count}"):
            gguf_model.load(path)
    finally:
        models.unregister(TOY)
