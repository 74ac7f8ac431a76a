"""Tiny model files made the way users' files are made (issues 34, 35): a small random model of
the family's own transformers class, `save_pretrained`, then llama.cpp's own
`convert_hf_to_gguf.py` (vendor/llama.cpp of the llama-cpp-python source package, pure Python).

    python scripts/family_files.py mixtral qwen3vlmoe qwen3next qwen35moe gpt-oss ... [--out tests/data/families] [--source DIR]

Writes DIR/<family>/ (the transformers model: config, safetensors, tokenizer) and
DIR/<family>.gguf (F32), both committed so the oracle tests need neither the network nor the
source package; gpt-oss also DIR/gpt-oss-mxfp4.gguf, the same weights converted from the
published MXFP4 form (experts as blocks and scales), as every published gpt-oss file is made.
--source (or LLAMA_CPP_SOURCE) names the vendor/llama.cpp folder; without it the sdist is
downloaded from PyPI (pip download).  The tokenizer is a byte-level BPE trained here on a
few sentences; the converter knows BPE pre-tokenizers by the hash of their output, so the script
tells it "default" for this one (no pre-tokenizer of a published model applies to it).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("family_files")
ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = "0.3.36"
VOCAB = 320
CORPUS = ["the quick brown fox jumps over the lazy dog", "layers split over GPUs, chunk by chunk",
          "experts in host RAM, prefill on the main GPU", "0123456789 +-*/=()[]{} <>!?.,;:"] * 8


def tokenizer(specials: tuple[str, ...] = ()):
    """specials: more special tokens the family's converter looks up by name (GLM's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 2, special_tokens=["<s>", "</s>", *specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=list(specials))


def mixtral(seed: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=4096, rope_theta=1e6,
                        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    return MixtralForCausalLM(cfg)


def qwen3vlmoe(seed: int):
    """Qwen3-VL-MoE: the text model is qwen3moe's with MRoPE sections; a one-block vision tower
    (the converter writes it to a separate mmproj file, the engine reads the text file)."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=4, num_experts_per_tok=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True},
                tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                  num_position_embeddings=16, deepstack_visual_indexes=[0], spatial_merge_size=2,
                  temporal_patch_size=2)
    cfg = Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    return Qwen3VLMoeForConditionalGeneration(cfg)


def qwen3next(seed: int):
    """Qwen3-Next: three gated-DeltaNet layers then one gated-attention layer, partial RoPE,
    routed plus shared experts (issue 34)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
                          linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                          linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                          num_experts=4, num_experts_per_tok=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
                          tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    return Qwen3NextForCausalLM(cfg)


def gpt_oss(seed: int):
    """gpt-oss: a sliding layer (window 8) then a full one, sinks, biases, YaRN as published
    (`truncate: false`); experts whose in-dimension is a multiple of MXFP4's 32-value block."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    return GptOssForCausalLM(cfg)


def minimax_m2(seed: int):
    """MiniMax-M2: q/k RMSNorm over the whole projection (not per head), partial RoPE (rotary_dim
    of head_dim), a sigmoid router whose score-correction bias picks the experts (issue 35)."""
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    cfg = MiniMaxM2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, rotary_dim=8,
                          num_local_experts=4, num_experts_per_tok=2, scoring_func="sigmoid",
                          max_position_embeddings=4096, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 5e6},
                          tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    return MiniMaxM2ForCausalLM(cfg)


def deepseek3(seed: int):
    """DeepSeek-V3 / Kimi-K2 (llama.cpp deepseek2): multi-head latent attention (q through the q
    LoRA and its norm, the compressed KV latent and its norm plus the shared RoPE key, k/v heads
    from the latent, v heads of another size than q/k), YaRN with mscale_all_dim, a leading dense
    layer, routed experts in groups (2 of 8 experts, from the best 1 of 2 groups of 4) by the sigmoid router
    with its correction bias, renormalised and scaled, and a shared expert (issue 35).  The
    converter wants as many KV heads as heads; `scoring_func` is the published config's key (the
    converter writes expert_gating_func from it; transformers' class always runs sigmoid)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                           num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                           num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
                           qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
                           n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
                           norm_topk_prob=True, scoring_func="sigmoid", max_position_embeddings=256,
                           rms_norm_eps=1e-6,
                           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 64, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0},
                           tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    return DeepseekV3ForCausalLM(cfg)


def deepseek3_lite(seed: int):
    """DeepSeek's other layout (V2-Lite's): a plain q projection (no q LoRA), no RoPE scaling, no
    expert groups, no dense lead layer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                           num_hidden_layers=2, first_k_dense_replace=0, num_attention_heads=4,
                           num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                           qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                           n_group=1, topk_group=1, n_shared_experts=2, routed_scaling_factor=1.0,
                           norm_topk_prob=False, scoring_func="sigmoid", max_position_embeddings=4096,
                           rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    return DeepseekV3ForCausalLM(cfg)


def glm4moe(seed: int):
    """GLM-4.5: a leading dense layer then routed experts plus a shared expert, sigmoid routing
    with the selection bias and a routed scaling factor, q/k/v biases, per-head q/k norm (the
    355B model's; Air has none), partial RoPE (half the head), and one MTP (nextn) block in the
    checkpoint, as published (`_mtp_block`)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    cfg = Glm4MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                        num_nextn_predict_layers=1, max_position_embeddings=4096, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    return Glm4MoeForCausalLM(cfg)


def qwen35moe(seed: int):
    """Qwen3.5-MoE's text model: Qwen3-Next's layers with q/k/v, z, b and a projected apart,
    interleaved MRoPE sections (text positions: plain RoPE); fewer k than v heads, so the
    converter's reordering of the value heads (grouped to tiled) is exercised (issue 34)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                               linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                               moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                                                "mrope_section": [1, 1, 0], "mrope_interleaved": True},
                               tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    return Qwen3_5MoeForCausalLM(cfg)


FAMILIES: dict[str, Callable] = {"mixtral": mixtral, "qwen3vlmoe": qwen3vlmoe, "qwen3next": qwen3next,
                                 "gpt-oss": gpt_oss, "minimax-m2": minimax_m2, "glm4moe": glm4moe,
                                 "deepseek3": deepseek3, "deepseek3-lite": deepseek3_lite, "qwen35moe": qwen35moe}
# special tokens a family's converter looks up by name
SPECIALS: dict[str, tuple[str, ...]] = {"glm4moe": ("[gMASK]", "<|user|>", "<|endoftext|>", "<|observation|>")}
# the converter's flags a family's file needs: Qwen3-Next's MTP block is a draft model, left out
CONVERT_ARGS: dict[str, tuple[str, ...]] = {"qwen3next": ("--no-mtp",), "qwen35moe": ("--no-mtp",)}


def _published_layout(hf_dir: Path, names: tuple[str, ...]) -> None:
    """Store the fused expert tensors as the published checkpoints do ([experts, in, out]: what
    llama.cpp's converter reads); transformers 5 saves them [experts, out, in] and transposes a
    published file on load (its conversion mapping), so the folder stays the oracle."""
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    tensors = load_file(path)
    for k in list(tensors):
        if k.endswith(names):
            tensors[k] = tensors[k].transpose(1, 2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def _mtp_block(hf_dir: Path) -> None:
    """GLM-4.5's checkpoints hold their MTP (nextn) block as one more layer after the model's:
    a decoder layer plus eh_proj, enorm, hnorm and shared_head.norm.  transformers builds no
    such layer and skips those tensors on load; llama.cpp's converter counts it in block_count
    and writes nextn_predict_layers.  The block here: the last layer's tensors under the next
    index, and the extra ones drawn."""
    import torch
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    tensors = load_file(path)
    n = json.loads((hf_dir / "config.json").read_text())["num_hidden_layers"]
    d = tensors["model.norm.weight"].shape[0]
    g = torch.Generator().manual_seed(7)
    last = f"model.layers.{n - 1}."
    for k in [k for k in tensors if k.startswith(last)]:
        tensors[f"model.layers.{n}." + k[len(last):]] = tensors[k].clone()
    extra = {"eh_proj.weight": torch.randn(d, 2 * d, generator=g) / (2 * d) ** 0.5,
             "enorm.weight": 1 + 0.1 * torch.randn(d, generator=g), "hnorm.weight": 1 + 0.1 * torch.randn(d, generator=g),
             "shared_head.norm.weight": 1 + 0.1 * torch.randn(d, generator=g)}
    tensors.update({f"model.layers.{n}.{k}": v for k, v in extra.items()})
    save_file(tensors, path, metadata={"format": "pt"})


# what a family's published checkpoint stores otherwise than transformers saves it
LAYOUTS: dict[str, Callable[[Path], None]] = {
    "qwen3vlmoe": lambda d: _published_layout(d, ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
    "glm4moe": _mtp_block,
}


def _check_oracle(model, hf_dir: Path) -> None:
    """The folder, read back by transformers, is the model made here (same logits)."""
    import torch

    ids = torch.tensor([list(range(2, 40))])
    back = type(model).from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (model.eval()(input_ids=ids).logits - back(input_ids=ids).logits).abs().max().item()
    if diff > 1e-5:  # (the same weights: fp32 reassociation differs between calls of some kernels)
        raise SystemExit(f"{hf_dir}: transformers reads back another model (logits differ by {diff:.3g})")


def _scaled(model, seed: int) -> None:
    """Weights of std 0.02 (transformers' init) leave every layer near the identity; a larger,
    seeded spread makes the logits depend on every weight (norms stay near 1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / max(p.shape[-1], 1)) ** 0.5)
        for name, b in model.named_buffers():  # the router's score-correction bias (a buffer, zero at init)
            if name.endswith("e_score_correction_bias"):  # as large as the sigmoid scores: it changes the choice
                b.copy_(0.3 * torch.randn(b.shape, generator=g))


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _mxfp4_blocks(w):
    """The published checkpoints' MXFP4 form of experts [E, in, out]: blocks [E, out, in/32, 16]
    (two E2M1 codes a byte, the even element in the low nibble) and E8M0 scales [E, out, in/32]:
    each 32 inputs share 2^(scale-127), the largest magnitude lands in [4, 8) (6 at most)."""
    import torch

    t = w.detach().transpose(1, 2).reshape(*w.shape[0:1], w.shape[2], w.shape[1] // 32, 32).float()
    amax = t.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -100)
    exp = torch.floor(torch.log2(amax)) - 2
    lut = torch.tensor(FP4_VALUES[:8])
    code = (t.abs() / torch.exp2(exp)).unsqueeze(-1).sub(lut).abs().argmin(-1)
    code = code + 8 * (t < 0)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exp.squeeze(-1) + 127).to(torch.uint8)


def _gpt_oss_prepare(model, seed: int) -> None:
    """Gate/up weights 8x (so activations reach SwiGLU's clamp at 7), sinks of a size that takes
    a real share of attention, and experts rounded to MXFP4 by transformers' own dequantiser of
    their published form: the F32 and the MXFP4 file hold the same weights, one oracle serves both."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                p.copy_(1.0 + torch.randn(p.shape, generator=g))
            if name.endswith(MXFP4_EXPERTS):
                if name.endswith("gate_up_proj"):
                    p.mul_(8.0)
                blocks, scales = _mxfp4_blocks(p)
                p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))


def _gpt_oss_mxfp4_file(hf_dir: Path, out_dir: Path, src: Path) -> None:
    """gpt-oss-mxfp4.gguf: the folder rewritten as the published checkpoints are (experts as
    `*_blocks`/`*_scales`, quantization_config mxfp4), converted: the converter repacks them
    into ggml's MXFP4 blocks, as for every published gpt-oss file."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    with tempfile.TemporaryDirectory() as scratch:
        pub = Path(scratch) / "published"
        shutil.copytree(hf_dir, pub)
        tensors = load_file(pub / "model.safetensors")
        for k in [k for k in tensors if k.endswith(MXFP4_EXPERTS)]:
            blocks, scales = _mxfp4_blocks(tensors[k])
            back = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            if not torch.equal(back, tensors[k]):
                raise SystemExit(f"{k}: not MXFP4-exact, the two files would hold different weights")
            tensors[k + "_blocks"], tensors[k + "_scales"] = blocks, scales
            del tensors[k]
        save_file(tensors, pub / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((pub / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        (pub / "config.json").write_text(json.dumps(cfg, indent=2))
        convert(src, pub, out_dir / "gpt-oss-mxfp4.gguf")


# a family's weights changed after the spread (before saving), and files made besides the F32 one
PREPARE: dict[str, Callable] = {"gpt-oss": _gpt_oss_prepare}
EXTRA_FILES: dict[str, Callable[[Path, Path, Path], None]] = {"gpt-oss": _gpt_oss_mxfp4_file}


def source(given: str | None, scratch: Path) -> Path:
    if given:
        return Path(given)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(scratch)], check=True)
    with tarfile.open(scratch / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as t:
        t.extractall(scratch, filter="data")
    return scratch / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


SHIM = """
import runpy, sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(src: Path, hf_dir: Path, out: Path, *extra: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the converter's own gguf-py
    subprocess.run([sys.executable, "-c", SHIM, str(src), str(hf_dir), "--outtype", "f32", "--outfile", str(out), *extra],
                   check=True, env=env)


def make(family: str, out_dir: Path, src: Path, seed: int = 0) -> Path:
    import torch

    torch.manual_seed(seed)
    model = FAMILIES[family](seed)
    _scaled(model, seed)
    if family in PREPARE:
        PREPARE[family](model, seed)
    hf_dir = out_dir / family
    model.save_pretrained(hf_dir, safe_serialization=True)
    if family in LAYOUTS:
        LAYOUTS[family](hf_dir)
    _check_oracle(model, hf_dir)
    tokenizer(SPECIALS.get(family, ())).save_pretrained(hf_dir)
    gguf_path = out_dir / f"{family}.gguf"
    convert(src, hf_dir, gguf_path, *CONVERT_ARGS.get(family, ()))
    if family in EXTRA_FILES:
        EXTRA_FILES[family](hf_dir, out_dir, src)
    (hf_dir / "made_by.json").write_text(json.dumps({"script": "scripts/family_files.py", "family": family,
                                                     "seed": seed, "llama_cpp_python": LLAMA_CPP_PYTHON}) + "\n")
    return gguf_path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("families", nargs="+", choices=sorted(FAMILIES))
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "families")
    ap.add_argument("--source", default=os.environ.get("LLAMA_CPP_SOURCE"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        src = source(args.source, Path(scratch))
        for family in args.families:
            log.info("%s -> %s", family, make(family, args.out, src))
    return 0


if __name__ == "__main__":
    sys.exit(main())
