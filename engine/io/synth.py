"""Generated models: real GGUF files with random weights (deterministic from a seed).

`write_model` makes a file any GGUF reader opens (ours, transformers, llama.cpp's tools);
`demo_model_path` makes the built-in demo model on first use in the user's cache directory.
`SyntheticSource` yields the same kind of weights straight into memory on any device, for
benchmarks whose shapes (e.g. Qwen3-30B-A3B) would take minutes to write as a file.
"""
from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from engine import models
from engine.io import quant_recipe
from engine.io.atomic_file import atomic_path
from engine.io.demo_file import DEMO_VERSION, demo_file  # noqa: F401  (DEMO_VERSION: its old home)
from engine.io.gguf_model import ModelSpec, expected_shapes, format_quant_mix, quant_mix
from engine.quant import dequant

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelRecipe:
    arch: str = "qwen3moe"
    n_layers: int = 4
    hidden: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    n_experts: int = 8
    n_experts_used: int = 2
    expert_ffn: int = 64
    ffn: int = 256
    vocab: int = 0  # 0: the byte-level vocabulary below decides
    context_length: int = 4096
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    seed: int = 0
    quant: str = "q8_0"  # quant_recipe.FTYPES (llama.cpp's mixes: q4_k_m ... iq3_xxs ... mxfp4), f16 or f32
    tied: bool = False
    rope_dim: int = 0  # partial rotary (families with Family.partial_rotary): RoPE's part of a head; 0: all
    # multi-head latent attention and its routing (deepseek2 reads them; 0: none / its default)
    q_lora_rank: int = 0  # 0: a plain q projection
    kv_lora_rank: int = 0
    v_head_dim: int = 0  # 0: head_dim - rope_dim
    dense_lead: int = 0  # leading layers with a dense FFN of `ffn`
    expert_groups: int = 0  # group-limited top-k: groups, and the groups chosen from
    expert_groups_used: int = 0
    shared_experts: int = 0  # shared experts of expert_ffn each
    expert_weights_scale: float = 1.0
    llama_experts: bool = False  # llama only: routed experts in every layer (Mixtral's layout)

    def spec(self) -> ModelSpec:
        """The spec its family makes of these shapes (engine/models/); vocab 0: the byte vocabulary's."""
        return models.family(self.arch).spec_from_recipe(replace(self, vocab=self.vocab or len(byte_vocab()[0])))


HOLE_TENSOR = "strata.hole"  # write_model(hole_bytes=...): an unused tensor left as a hole

# The demo model: 4 MoE layers, small enough for seconds on 2 CPU cores.
DEMO_RECIPE = ModelRecipe()

# Qwen3-30B-A3B shapes (fewer layers): the benchmark model.
QWEN3_30B_A3B = ModelRecipe(arch="qwen3moe", n_layers=48, hidden=2048, n_heads=32, n_kv_heads=4,
                            head_dim=128, n_experts=128, n_experts_used=8, expert_ffn=768,
                            vocab=151936, context_length=131072, quant="f16")

# gpt-oss-20b / -120b shapes (openai's config.json), experts MXFP4 as the published files store them
GPT_OSS_20B = ModelRecipe(arch="gpt-oss", n_layers=24, hidden=2880, n_heads=64, n_kv_heads=8, head_dim=64,
                          n_experts=32, n_experts_used=4, expert_ffn=2880, vocab=201088, context_length=131072,
                          rope_base=150000.0, rms_eps=1e-5, quant="mxfp4")
GPT_OSS_120B = replace(GPT_OSS_20B, n_layers=36, n_experts=128)

# MiniMax-M2 (230B-A10B): transformers' MiniMaxM2Config defaults (hidden 3072, 62 layers, 48/8
# heads of 128, 256 experts of 1536, top 8, vocab 200064, 196608 context, rope theta 5e6) with the
# checkpoint's rotary_dim 64 (llama.cpp's minimax-m2.cpp: "head_dim = 128, n_rot = 64")
MINIMAX_M2 = ModelRecipe(arch="minimax-m2", n_layers=62, hidden=3072, n_heads=48, n_kv_heads=8, head_dim=128,
                         n_experts=256, n_experts_used=8, expert_ffn=1536, vocab=200064, context_length=196608,
                         rope_base=5_000_000.0, rope_dim=64, quant="f16")
# GLM-4.5-Air (106B-A12B, llama.cpp's 46-layer glm4moe): transformers' Glm4MoeConfig defaults
# (hidden 4096, 46 layers, 96/8 heads, 128 experts of 1408, top 8, one shared expert, the first
# layer dense of 10944, vocab 151552, 131072 context, rms eps 1e-5), heads of 128 with half of
# them rotated (partial_rotary_factor 0.5), rope theta 1e6; the family's recipe adds the dense
# lead layer, the shared expert and sigmoid routing (glm4moe.spec_from_recipe)
GLM_45_AIR = ModelRecipe(arch="glm4moe", n_layers=46, hidden=4096, n_heads=96, n_kv_heads=8, head_dim=128,
                         n_experts=128, n_experts_used=8, expert_ffn=1408, ffn=10944, vocab=151552,
                         context_length=131072, rope_base=1_000_000.0, rms_eps=1e-5, rope_dim=64, quant="f16")

# DeepSeek-V3 / R1 shapes (config.json of deepseek-ai/DeepSeek-V3; YaRN left out: the same
# arithmetic per token), and Kimi-K2's (moonshotai/Kimi-K2-Instruct): fewer layers with n_layers=
DEEPSEEK_V3 = ModelRecipe(arch="deepseek2", n_layers=61, hidden=7168, n_heads=128, n_kv_heads=128, head_dim=192,
                          rope_dim=64, q_lora_rank=1536, kv_lora_rank=512, v_head_dim=128, n_experts=256,
                          n_experts_used=8, expert_ffn=2048, ffn=18432, dense_lead=3, expert_groups=8,
                          expert_groups_used=4, shared_experts=1, expert_weights_scale=2.5, vocab=129280,
                          context_length=163840, rope_base=10000.0, quant="f16")
KIMI_K2 = replace(DEEPSEEK_V3, n_heads=64, n_kv_heads=64, n_experts=384, dense_lead=1, expert_groups=0,
                  expert_groups_used=0, expert_weights_scale=2.827, vocab=163840, context_length=131072,
                  rope_base=50000.0)


# Qwen3-Next-80B-A3B shapes (issue 34): 48 layers, three GDN layers to one gated-attention layer
# (engine/models/qwen3next.py derives the GDN sizes, RoPE's quarter of a head and the shared
# expert from these, as the 80B has them: 16 q/k and 32 value heads of 128, 4-tap conv, 512)
QWEN3_NEXT_80B_A3B = ModelRecipe(arch="qwen3next", n_layers=48, hidden=2048, n_heads=16, n_kv_heads=2,
                                 head_dim=256, n_experts=512, n_experts_used=10, expert_ffn=512, vocab=151936,
                                 context_length=262144, rope_base=10_000_000.0, quant="f16")

# Qwen3.5-35B-A3B shapes: 40 layers of Qwen3-Next's kinds (the same derived GDN sizes), 256 experts
QWEN35_35B_A3B = ModelRecipe(arch="qwen35moe", n_layers=40, hidden=2048, n_heads=16, n_kv_heads=2, head_dim=256,
                             n_experts=256, n_experts_used=8, expert_ffn=512, vocab=248320, context_length=262144,
                             rope_base=10_000_000.0, quant="f16")

# Mixtral-8x7B shapes (mistralai/Mixtral-8x7B-v0.1 config.json): a llama file with 8 experts of
# 14336 in every layer, top 2, 32/8 heads of 128, vocab 32000, rope theta 1e6, rms eps 1e-5
MIXTRAL_8X7B = ModelRecipe(arch="llama", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                           n_experts=8, n_experts_used=2, expert_ffn=14336, vocab=32000, context_length=32768,
                           rope_base=1_000_000.0, rms_eps=1e-5, quant="f16", llama_experts=True)

PRESETS = {"demo": DEMO_RECIPE, "mixtral-8x7b": MIXTRAL_8X7B, "qwen3-30b-a3b": QWEN3_30B_A3B, "gpt-oss-20b": GPT_OSS_20B,
           "gpt-oss-120b": GPT_OSS_120B, "minimax-m2-230b-a10b": MINIMAX_M2, "glm-4.5-air": GLM_45_AIR,
           "deepseek-v3": DEEPSEEK_V3, "kimi-k2": KIMI_K2, "qwen3-next-80b-a3b": QWEN3_NEXT_80B_A3B,
           "qwen3.5-35b-a3b": QWEN35_35B_A3B}


class RecipeError(ValueError):
    """A recipe whose file the loader would refuse: names the field, its value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}={value!r}: allowed {allowed}")


def check_recipe(recipe: ModelRecipe) -> None:
    """Refuse the shapes `gguf_model.load` refuses (spec_from_metadata), before a file is written."""
    r = recipe
    if r.arch not in models.names():
        raise RecipeError("arch", r.arch, ", ".join(models.names()))
    if r.quant not in QUANTS:
        raise RecipeError("quant", r.quant, ", ".join(QUANTS))
    for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "context_length"):
        v = getattr(r, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise RecipeError(name, v, "an integer >= 1")
    if r.head_dim % 2:
        raise RecipeError("head_dim", r.head_dim, "an even integer (RoPE rotates pairs of dimensions)")
    if r.rope_dim and (r.rope_dim % 2 or not 0 < r.rope_dim <= r.head_dim or not models.family(r.arch).partial_rotary):
        raise RecipeError("rope_dim", r.rope_dim, f"0, or an even number up to head_dim={r.head_dim} for a family with "
                                                  f"partial rotary")
    if r.n_heads % r.n_kv_heads:
        raise RecipeError("n_kv_heads", r.n_kv_heads, f"a divisor of n_heads={r.n_heads}")
    if models.family(r.arch).has_experts(r):
        if r.n_experts < 1:
            raise RecipeError("n_experts", r.n_experts, "an integer >= 1")
        if not 1 <= r.n_experts_used <= r.n_experts:
            raise RecipeError("n_experts_used", r.n_experts_used, f"1..n_experts ({r.n_experts})")
        if r.expert_ffn < 1:
            raise RecipeError("expert_ffn", r.expert_ffn, "an integer >= 1")
    elif r.ffn < 1:
        raise RecipeError("ffn", r.ffn, "an integer >= 1")
    base = len(byte_vocab()[0])
    if r.vocab and r.vocab < base:
        raise RecipeError("vocab", r.vocab, f"0 (the byte vocabulary) or at least {base}, its size")
    if not 0 < r.rope_base < float("inf"):  # NaN fails both comparisons
        raise RecipeError("rope_base", r.rope_base, "a finite number above 0")
    if not 0 <= r.rms_eps < float("inf"):
        raise RecipeError("rms_eps", r.rms_eps, "a finite number >= 0")
    try:  # what the family itself refuses of a recipe (deepseek2's MLA sizes)
        r.spec()
    except ValueError as exc:
        raise RecipeError("arch", r.arch, str(exc)) from None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_MERGE_WORDS = ["the", "and", "ing", "ion", "GPU", "chunk", "stage", "token", "layer", "expert",
                "prefill", "pipeline", "split", "model", "hello", "world"]


def byte_vocab() -> tuple[list[str], list[int], list[str]]:
    """A minimal gpt2-style vocabulary: 256 byte tokens, merges of a few words, control tokens."""
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges: list[str] = []
    have = set(tokens)
    for word in _MERGE_WORDS:
        for w in (word, "Ġ" + word):
            cur = w[0]
            for ch in w[1:]:
                nxt = cur + ch
                if nxt not in have:
                    merges.append(f"{cur} {ch}")
                    tokens.append(nxt)
                    have.add(nxt)
                cur = nxt
    types = [1] * len(tokens)
    for ctl in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        tokens.append(ctl)
        types.append(3)
    return tokens, types, merges


# The spread of a router's score-correction bias (exp_probs_b: GLM-4.5, MiniMax-M2, DeepSeek-V3).
# It only selects, and the sigmoid scores of the top experts under the router's logits (spread 4)
# lie within about 1e-3 of 1, so a bias of a plain bias's 0.1 decided every token's top k alone:
# the same high-bias experts for every token, under half of a layer's ever used, and a cache of
# those held "every" expert (tests/test_streamed_families.py).  This small a bias breaks near
# ties and leaves every expert its share, as a trained model's load balancing does.
ROUTER_BIAS_STD = 1e-4


def _kind(name: str) -> str:
    """Which spread a tensor's random weights take: norm, bias, router (and its bias), embedding
    or matrix."""
    if name.endswith("norm.weight"):
        return "norm"
    if name.endswith("exp_probs_b.bias"):
        return "router_bias"
    if name.endswith(".bias"):
        return "bias"
    if "ffn_gate_inp" in name:
        return "router"
    if name.endswith(".ssm_a"):
        return "decay"  # a GDN layer's -exp(A_log): negative, or its state would grow
    return "embedding" if name == "token_embd.weight" else "matrix"


def _std(name: str, shape: tuple[int, ...]) -> float:
    """The standard deviation of a tensor's random weights (what random K-quant blocks match)."""
    kind = _kind(name)
    if kind in ("norm", "bias"):
        return 0.1
    if kind == "router_bias":
        return ROUTER_BIAS_STD
    if kind == "decay":
        return 1.0
    if kind == "embedding":
        return 1.0
    return (4.0 if kind == "router" else 1.0) / float(np.sqrt(shape[-1]))


def _floats(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's random float32 weights (norms around 1, everything else around 0, scaled so
    activations stay tame), the next draw of `rng`.  The arithmetic is the first writer's, so
    files of float and gguf-quantised types keep their bytes from one version to the next."""
    kind = _kind(name)
    arr = rng.standard_normal(shape, dtype=np.float32)
    if kind == "norm":
        arr = 1.0 + 0.1 * arr
    elif kind == "bias":
        arr = 0.1 * arr
    elif kind == "router_bias":
        arr = ROUTER_BIAS_STD * arr
    elif kind == "router":
        arr = arr / np.sqrt(shape[-1]) * 4.0
    elif kind == "decay":
        arr = -np.exp(0.5 * arr)
    elif kind == "matrix":
        arr = arr / np.sqrt(shape[-1])
    return arr.astype(np.float32, copy=False)


QUANTS = (*quant_recipe.FTYPES, "f16", "f32")
# the types gguf can quantise from floats; the others are random valid blocks
_GGUF_QUANTIZES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
                             GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0})
_F32, _F16 = GGMLQuantizationType.F32, GGMLQuantizationType.F16
# gguf's quantiser is single-threaded numpy (minutes for gpt-oss-20b's 579M-value Q8_0 embedding):
# a tensor past this many values is random valid blocks of the same spread instead
QUANTISE_LIMIT = 1 << 26


def _from_floats(qt: GGMLQuantizationType, shape: tuple[int, ...]) -> bool:
    """Whether the writer draws the tensor's floats (a cast, or gguf's quantiser), not random blocks."""
    if qt in (_F32, _F16):
        return True
    return qt in _GGUF_QUANTIZES and int(np.prod(shape, dtype=np.float64)) <= QUANTISE_LIMIT


def _stored_type(name: str, quant: str, shape: tuple[int, ...], spec: ModelSpec) -> GGMLQuantizationType:
    """How a tensor is stored: f16/f32 for the large matrices (norms, biases and the router stay
    F32), or the type llama.cpp's mix `quant` gives it (`quant_recipe.tensor_type`)."""
    if quant in ("f16", "f32"):
        big = len(shape) >= 2 and "ffn_gate_inp" not in name and name != "token_embd.weight"
        return _F16 if big and quant == "f16" else _F32
    if quant not in quant_recipe.FTYPES:
        raise ValueError(f"unknown storage {quant!r}: use {', '.join(QUANTS)}")
    return quant_recipe.tensor_type(name, shape, quant, spec)


def _stored(name: str, qt: GGMLQuantizationType, shape: tuple[int, ...], floats: Callable[[], np.ndarray],
            seed: int) -> np.ndarray:
    """The tensor's bytes as stored in `qt`: its floats (drawn only where the type is made from
    them) cast or quantised by gguf (up to QUANTISE_LIMIT values), or random valid blocks of the
    floats' spread."""
    if qt == _F32:
        return floats()
    if qt == _F16:
        return floats().astype(np.float16)
    if _from_floats(qt, shape):
        return gguf.quants.quantize(floats(), qt)
    g = np.random.default_rng(zlib.crc32(name.encode()) ^ seed)
    raw = quant_recipe.random_blocks(qt, shape, _std(name, shape), g).numpy()
    return raw.reshape(_byte_shape(qt, shape))


def _put_vocab(w: GGUFWriter, tokens: list[str], types: list[int], merges: list[str]) -> None:
    """The byte-level BPE vocabulary every generated file carries (eos = bos = padding)."""
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    eos = tokens.index("<|endoftext|>")
    w.add_uint32("tokenizer.ggml.eos_token_id", eos)
    w.add_uint32("tokenizer.ggml.bos_token_id", eos)
    w.add_uint32("tokenizer.ggml.padding_token_id", eos)


def _put(w: GGUFWriter, key: str, value: Any) -> None:
    """One metadata entry, replacing a value the writer already holds for that key."""
    for kv in w.kv_data:
        kv.pop(key, None)
    if value is None:  # None: the key is left out
        return
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, (list, tuple)):  # an array of ints (e.g. qwen35moe's rope.dimension_sections)
        w.add_array(key, [int(v) for v in value])
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        w.add_array(key, list(value))
    elif isinstance(value, int):
        w.add_uint32(key, value)
    else:
        w.add_float32(key, float(value))


def _byte_shape(qt: GGMLQuantizationType, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A tensor's shape in bytes as stored in `qt` (floats included: F32 is 4 bytes a value)."""
    return tuple(gguf.quants.quant_shape_to_byte_shape(shape, qt))


def write_needs(recipe: ModelRecipe) -> tuple[int, int, str]:
    """(bytes of the file, host bytes the writer holds at its peak, the tensor of that peak) of
    `write_model(recipe)`, computed before anything is drawn: tensors are made one at a time,
    from float32 draws where the type is cast or quantised by gguf (random blocks otherwise)."""
    spec = recipe.spec()
    file_bytes = peak = 0
    peak_name = ""
    for name, shape in expected_shapes(spec).items():
        qt = _stored_type(name, recipe.quant, shape, spec)
        stored = int(np.prod(_byte_shape(qt, shape), dtype=np.float64))
        floats = int(np.prod(shape, dtype=np.float64)) * 4 if _from_floats(qt, shape) else 0
        file_bytes += stored
        held = 2 * floats + 2 * stored  # the draws and their product (a cast or quantisation), the bytes
        if held > peak:
            peak, peak_name = held, name
    return file_bytes, peak, peak_name


def write_model(path: Path | str, recipe: ModelRecipe = DEMO_RECIPE,
                edit: Callable[[str, np.ndarray], np.ndarray | None] | None = None,
                progress: Callable[[str, float], None] | None = None,
                metadata: Mapping[str, Any] | None = None, checked: bool = True,
                hole_bytes: int = 0) -> Path:
    """Write a GGUF file with random weights; atomic (temp file + rename).

    Tensors are made and written one at a time (host memory stays about one tensor, whatever
    the file's size); floats are drawn only for the tensors stored as floats or quantised by
    gguf, K-quants get random valid blocks of the same spread.  `progress(tensor, fraction of
    the bytes written)` is called after each tensor.  `edit(name, data)` may replace a
    tensor's stored data or drop it (None): how tests and the fuzzer make defective files
    through the same writer (every tensor is then made before the header is written).
    `metadata`: more keys ("{a}." is the architecture's prefix), or other values for the usual
    ones (a str is written as a string, a bool as a bool, an int as uint32, a float as float32,
    a list as an array; None leaves the key out).
    checked=False writes a recipe `check_recipe` refuses (tests of the loader's refusals).
    hole_bytes: one more tensor (HOLE_TENSOR, I8, unused by the engine) of that many bytes, left
    as a hole in the file (sparse where the file system allows): a file larger than a memory
    limit without writing its bytes (tests of how the file is mapped)."""
    path = Path(path)
    if checked:
        check_recipe(recipe)
    spec = recipe.spec()
    tokens, types, merges = byte_vocab()
    if spec.vocab != len(tokens):
        # a larger vocabulary is padded with unused tokens, as real models do
        pad = spec.vocab - len(tokens)
        tokens = tokens + [f"<|unused_{i}|>" for i in range(pad)]
        types = types + [5] * pad
    a = spec.arch
    with atomic_path(path) as tmp:
        w = GGUFWriter(str(tmp), a)
        w.add_name(f"strata-{a}-random-seed{recipe.seed}")
        for key, value in models.family_of(spec).file_metadata(spec):
            _put(w, key, value)
        _put_vocab(w, tokens, types, merges)
        for key, value in (metadata or {}).items():
            _put(w, key.replace("{a}", a), value)
        rng = np.random.default_rng(recipe.seed)
        shapes = expected_shapes(spec)
        stored_types = {name: _stored_type(name, recipe.quant, shape, spec) for name, shape in shapes.items()}
        total = sum(int(np.prod(_byte_shape(stored_types[n], shape))) for n, shape in shapes.items())
        done = 0
        if edit is None:  # streamed: tensor infos first, then one tensor in memory at a time
            for name, shape in shapes.items():
                qt = stored_types[name]
                stored_shape = _byte_shape(qt, shape)
                w.add_tensor_info(name, stored_shape, np.dtype(np.uint8), int(np.prod(stored_shape)), raw_dtype=qt)
            if hole_bytes:
                w.add_tensor_info(HOLE_TENSOR, (hole_bytes,), np.dtype(np.int8), hole_bytes,
                                  raw_dtype=GGMLQuantizationType.I8)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for name, shape in shapes.items():
                data = _stored(name, stored_types[name], shape, lambda: _floats(rng, name, shape), recipe.seed)  # noqa: B023
                w.write_tensor_data(data)
                done += data.nbytes
                if progress is not None:
                    progress(name, done / total)
            if hole_bytes:  # the last tensor: its bytes are a hole up to the file's end
                fout = w.fout[0]
                w.write_padding(fout, fout.tell())
                fout.flush()
                end = fout.tell() + hole_bytes
                fout.truncate(end)
                fout.seek(end)
                w.tensors[0].pop(HOLE_TENSOR)
        else:  # an edit may drop or replace a tensor: every tensor is made before the header
            if hole_bytes:
                raise ValueError("hole_bytes is for the streamed writer (no edit)")
            _write_edited(w, shapes, stored_types, rng, recipe.seed, edit)
        w.close()
    log.info("wrote %s (%s, %.1f MiB)", path, a, path.stat().st_size / 2**20)
    return path


def _write_edited(w: GGUFWriter, shapes: dict[str, tuple[int, ...]], stored_types: dict[str, GGMLQuantizationType],
                  rng: np.random.Generator, seed: int, edit: Callable[[str, np.ndarray], np.ndarray | None]) -> None:
    """write_model's tensors through `edit`: each made, then kept, replaced or dropped, before
    the header (which lists only what is kept)."""
    for name, shape in shapes.items():
        qt = stored_types[name]
        data = _stored(name, qt, shape, lambda: _floats(rng, name, shape), seed)  # noqa: B023
        raw = None if qt in (_F32, _F16) else qt
        edited = edit(name, data)
        if edited is None:
            continue
        if edited is not data:
            data, raw = edited, None
        if raw is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()


def demo_model_path(cache_dir: Path | None = None) -> Path:
    """The built-in demo model, generated on first use into the user's cache directory."""
    path = demo_file(cache_dir)
    if not path.exists():
        log.info("generating the demo model at %s", path)
        write_model(path, DEMO_RECIPE)
    return path


class SyntheticSource:
    """Random weights of a recipe generated on a device, without a file (benchmarks only).

    Same scaling as the files `write_model` writes; generated per tensor on `device`, so a
    model with Qwen3-30B-A3B shapes is ready in seconds on a GPU."""

    def __init__(self, recipe: ModelRecipe, device: str = "cpu") -> None:
        self.recipe = recipe
        self.spec = recipe.spec()
        self.device = torch.device(device)
        self.path = Path(f"synthetic:{recipe.arch}-{recipe.n_layers}L")
        self._shapes = expected_shapes(self.spec)

    def describe(self) -> str:
        s = self.spec
        mix = format_quant_mix(self.quant_mix())
        return f"synthetic {s.arch}: {s.n_layers} layers, hidden {s.hidden}, {s.n_experts} experts; {mix}"

    def quant_mix(self) -> list[tuple[str, float]]:
        return quant_mix((self.qtype(n).name, self.nbytes(n)) for n in self._shapes)

    def qtype(self, name: str) -> GGMLQuantizationType:
        """The tensor's type: the recipe's quant mix, or F32 (weights made as floats)."""
        if self.recipe.quant in quant_recipe.FTYPES:
            return quant_recipe.tensor_type(name, self._shapes[name], self.recipe.quant, self.spec)
        big = len(self._shapes[name]) >= 2 and "ffn_gate_inp" not in name and name != "token_embd.weight"
        return GGMLQuantizationType.F16 if big and self.recipe.quant == "f16" else GGMLQuantizationType.F32

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def has(self, name: str) -> bool:
        """Whether the recipe makes this tensor (as a file's `has`: a leading dense layer has no experts)."""
        return name in self._shapes

    def tensor_names(self) -> list[str]:
        """Every tensor the recipe makes (as a file's tensor_names)."""
        return list(self._shapes)

    def nbytes(self, name: str) -> int:
        n = 1
        for x in self._shapes[name]:
            n *= x
        return dequant.nbytes_of(self.qtype(name), n)

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's blocks, generated on the source's device (uint8)."""
        qt = self.qtype(name)
        if qt in quant_recipe.QUANTIZED:
            g = self._generator(name)
            std = 1.0 if name == "token_embd.weight" else self._shapes[name][-1] ** -0.5
            return quant_recipe.random_blocks(qt, self._shapes[name], std, g, self.device)
        t = self._float(name)
        return (t.to(torch.float16) if qt == GGMLQuantizationType.F16 else t).contiguous().reshape(-1).view(torch.uint8)

    def tensor(self, name: str, device: torch.device | str | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        dev = self.device if device is None else torch.device(device)
        qt = self.qtype(name)
        if qt in quant_recipe.QUANTIZED:
            return dequant.dequantize(self.raw(name), qt, self._shapes[name], dtype).to(dev)
        t = self._float(name)
        if qt == GGMLQuantizationType.F16:  # as stored: what a file of this recipe holds
            t = t.to(torch.float16)
        return t.to(device=dev, dtype=dtype)

    def _generator(self, name: str) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(zlib.crc32(name.encode()) ^ self.recipe.seed)
        return g

    def _float(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        g = self._generator(name)
        t = torch.randn(shape, generator=g, device=self.device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            return 1.0 + 0.1 * t
        if _kind(name) == "router_bias":
            return ROUTER_BIAS_STD * t
        if name.endswith(".bias"):
            return 0.1 * t
        if "ffn_gate_inp" in name:
            return t * (4.0 / shape[-1] ** 0.5)
        if name.endswith(".ssm_a"):
            return -(0.5 * t).exp()
        if name == "token_embd.weight":
            return t
        return t / shape[-1] ** 0.5


def recipe_from_args(preset: str = "demo", **changes) -> ModelRecipe:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: choose from {', '.join(PRESETS)}")
    changes = {k: v for k, v in changes.items() if v is not None}
    return replace(PRESETS[preset], **changes)
