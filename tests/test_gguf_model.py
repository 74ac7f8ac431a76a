"""Every defect of a model file is a GGUFError naming the file and the problem."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFWriter

from engine.io import gguf_model, synth
from engine.io.gguf_model import GGUFError


def test_demo_model_spec(demo_path):
    m = gguf_model.load(demo_path)
    s = m.spec
    assert (s.arch, s.n_layers, s.hidden, s.n_heads, s.n_kv_heads, s.head_dim) == ("qwen3moe", 4, 128, 4, 2, 32)
    assert (s.n_experts, s.n_experts_used, s.expert_ffn) == (8, 2, 64)
    assert s.rope_base == 1_000_000.0 and s.rms_eps == pytest.approx(1e-6)
    assert s.vocab == len(synth.byte_vocab()[0]) and s.context_length == 4096
    assert m.tensor_type("blk.0.ffn_up_exps.weight") == "Q8_0"  # some tensors quantised
    assert m.tensor("blk.0.ffn_down_exps.weight").shape == (8, 128, 64)
    assert "qwen3moe" in m.describe() and "8 experts" in m.describe()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_dense_architectures_load(make_arch, arch):
    s = gguf_model.load(make_arch(arch)).spec
    assert s.arch == arch and not s.is_moe and s.ffn == 256
    assert s.rope_style == ("norm" if arch == "llama" else "neox")
    assert s.qkv_bias == (arch == "qwen2") and s.qk_norm == (arch == "qwen3")


def _expect(path, *words):
    with pytest.raises(GGUFError) as ei:
        gguf_model.load(path)
    msg = str(ei.value)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_missing_file(tmp_path):
    _expect(tmp_path / "nope.gguf", "file not found")


def test_bad_magic(tmp_path, demo_path):
    p = tmp_path / "magic.gguf"
    data = bytearray(demo_path.read_bytes())
    data[:4] = b"GGML"
    p.write_bytes(bytes(data))
    _expect(p, "bad magic", "not a GGUF file")


@pytest.mark.parametrize("keep", [10, 100, 3000, -1000])
def test_truncated_file(tmp_path, demo_path, keep):
    data = demo_path.read_bytes()
    p = tmp_path / f"trunc{keep}.gguf"
    p.write_bytes(data[:keep])
    _expect(p, "truncated")


def test_unsupported_architecture(tmp_path):
    p = tmp_path / "mamba.gguf"
    w = GGUFWriter(p, "mamba")
    w.add_uint32("mamba.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _expect(p, "unsupported architecture 'mamba'", "qwen3moe")


def test_missing_tensor(tmp_path):
    p = synth.write_model(tmp_path / "missing.gguf", synth.DEMO_RECIPE,
                          edit=lambda name, d: None if name == "blk.2.attn_k.weight" else d)
    _expect(p, "missing tensor blk.2.attn_k.weight")


def test_wrong_shape(tmp_path):
    def edit(name, d):
        return np.zeros((7, 128), dtype=np.float32) if name == "blk.1.ffn_gate_inp.weight" else d
    p = synth.write_model(tmp_path / "shape.gguf", synth.DEMO_RECIPE, edit=edit)
    _expect(p, "blk.1.ffn_gate_inp.weight", "shape [7, 128]", "expected [8, 128]")


def test_unsupported_tensor_type(tmp_path):
    def edit(name, d):
        return np.zeros(128, dtype=np.int32) if name == "blk.0.attn_norm.weight" else d
    p = synth.write_model(tmp_path / "i32.gguf", synth.DEMO_RECIPE, edit=edit)
    _expect(p, "unsupported type I32 in tensor blk.0.attn_norm.weight; supported: BF16, F16, F32, IQ1_M, IQ1_S, "
               "IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, IQ4_NL, IQ4_XS, MXFP4, NVFP4, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, "
               "Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, TQ1_0, TQ2_0")


def test_missing_metadata_key(tmp_path):
    p = tmp_path / "nokey.gguf"
    w = GGUFWriter(p, "qwen3moe")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _expect(p, "missing metadata key qwen3moe.embedding_length")


@pytest.mark.parametrize("raw_type", [139, 2**31 + 5])  # ik_llama.cpp's IQ*_K ids sit above ggml's
def test_unknown_type_id_is_one_line_naming_tensor_id_and_supported_list(tmp_path, demo_path, capsys, raw_type):
    """A type id gguf does not know (ik_llama.cpp's IQ2_K..., a newer ggml's) is refused at scan,
    before any tensor is read: the file's path, the tensor, the id and the supported types, in
    one line; the CLI says it with exit code 2 and no traceback."""
    import struct

    from engine import failure
    from engine.cli import bench

    data = bytearray(demo_path.read_bytes())
    layout = gguf_model.scan_buffer(bytes(data), demo_path)
    t = next(t for t in layout.tensors if t.name == "blk.1.ffn_up_exps.weight")
    struct.pack_into("<I", data, t.type_at, raw_type)
    p = tmp_path / "ik.gguf"
    p.write_bytes(bytes(data))
    msg = _expect(p, "tensor blk.1.ffn_up_exps.weight", f"unknown tensor type {raw_type}", "ik_llama.cpp",
                  "supported: BF16", "IQ3_XXS", "MXFP4")
    assert "\n" not in msg
    rc = bench.main(["run", "--model", str(p), "--devices", "cpu", "--prompt-tokens", "8", "--warmup", "0"])
    err = capsys.readouterr().err
    assert rc == failure.BAD_INPUT == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    assert f"unknown tensor type {raw_type}" in lines[0] and "blk.1.ffn_up_exps.weight" in lines[0]

