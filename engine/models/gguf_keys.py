"""Every model-metadata key llama.cpp's loader reads for the families the engine runs, and what
the engine does with it: uses it, refuses a value it cannot honour (naming the key), or knows it
does not change the arithmetic.  Nothing a file says about the arithmetic is ignored in silence.

The key list follows llama.cpp's `llama_model::load_hparams` (src/llama-model.cpp: the keys read
for every architecture, then each family's own; names from src/llama-arch.cpp), read from its
source, not copied.  `tests/test_gguf_keys.py` walks that list per family and fails on any key
missing from `TABLE`.

RoPE scaling as llama.cpp reads it: `rope.scaling.type` (absent: "linear", which with no factor is
no scaling; "none"; "linear"; "yarn"; "longrope" is refused), `rope.scaling.factor` (else the old
`rope.scale_linear`; 0 or absent: 1), `rope.scaling.original_context_length` (absent: the
context length).  YaRN's ramp uses beta_fast 32 / beta_slow 1 and its attention factor
0.1·ln(factor) + 1, as llama.cpp's defaults for these families and transformers' yarn rope do;
the per-file yarn keys that would change those (`yarn_beta_fast` …, `attn_factor`) are refused
unless they hold the default.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

USED = "used"  # read by the engine and applied
REFUSED = "refused"  # a value other than the default is refused at load, naming the key
HARMLESS = "harmless"  # does not change the arithmetic (names, informational flags)

# "{a}." is the architecture's prefix.  A key reads as REFUSED when the engine has no code for
# any value but the default; the default is in `_DEFAULTS`.
TABLE: dict[str, str] = {
    "general.name": HARMLESS,
    "general.architecture": USED,
    "{a}.context_length": USED,
    "{a}.embedding_length": USED,
    "{a}.block_count": USED,
    "{a}.expert_count": USED,  # MoE families and llama (Mixtral); other dense families refuse experts
    "{a}.expert_used_count": USED,
    "{a}.expert_feed_forward_length": USED,
    "{a}.feed_forward_length": USED,  # dense FFN; qwen3moe's experts use expert_feed_forward_length
    "{a}.attention.head_count": USED,
    "{a}.attention.head_count_kv": USED,
    "{a}.attention.key_length": USED,
    "{a}.attention.value_length": REFUSED,  # must equal key_length
    "{a}.attention.layer_norm_rms_epsilon": USED,
    "{a}.rope.freq_base": USED,
    # partial rotary: a family with Family.partial_rotary reads it; the others' graphs in llama.cpp
    # assert it equals key_length, and the engine refuses another value for them
    "{a}.rope.dimension_count": REFUSED,
    "{a}.rope.dimension_sections": REFUSED,  # multi-section (vision) RoPE; qwen3vlmoe checks and uses its own
    "{a}.rope.scaling.type": USED,
    "{a}.rope.scaling.factor": USED,
    "{a}.rope.scale_linear": USED,
    "{a}.rope.scaling.original_context_length": USED,
    "{a}.rope.scaling.finetuned": HARMLESS,  # informational in llama.cpp
    "{a}.rope.scaling.attn_factor": REFUSED,
    "{a}.rope.scaling.alpha": REFUSED,  # NTK-alpha scaling
    "{a}.rope.scaling.yarn_ext_factor": REFUSED,
    "{a}.rope.scaling.yarn_attn_factor": REFUSED,
    "{a}.rope.scaling.yarn_beta_fast": REFUSED,
    "{a}.rope.scaling.yarn_beta_slow": REFUSED,
    "{a}.rope.scaling.yarn_log_multiplier": REFUSED,
    "{a}.attention.sliding_window": USED,  # gpt-oss: its sliding layers' window (the family reads it)
    "{a}.attention.sliding_window_pattern": USED,  # gpt-oss: which layers slide (the family reads it)
    "{a}.rope.freq_base_swa": USED,  # gpt-oss checks it equals rope.freq_base (one RoPE table for all layers)
    # MoE routing variants and layer layouts (engine/models/routing.py): the families that have
    # them read them (Family.own_keys: glm4moe, minimax-m2); any other family refuses a value
    # other than what its own routing and layers are (softmax, renormalised, unscaled, no
    # dense or MTP layers)
    "{a}.expert_gating_func": REFUSED,
    "{a}.expert_weights_norm": REFUSED,
    "{a}.expert_weights_scale": REFUSED,
    "{a}.leading_dense_block_count": REFUSED,
    "{a}.nextn_predict_layers": REFUSED,  # llama.cpp reads it for every family
    "{a}.expert_shared_count": REFUSED,
    "{a}.expert_group_count": REFUSED,  # grouped top-k (DeepSeek-V3); 0 or 1: none
    "{a}.expert_group_used_count": REFUSED,
    # multi-head latent attention (deepseek2 reads and uses them; no other family has them)
    "{a}.attention.q_lora_rank": USED,
    "{a}.attention.kv_lora_rank": USED,
    "{a}.attention.key_length_mla": USED,
    "{a}.attention.value_length_mla": USED,
    "{a}.attention.temperature_scale": REFUSED,  # Mistral-Large-3's attention temperature tuning (deepseek2)
    "{a}.attention.temperature_length": REFUSED,
    "{a}.n_deepstack_layers": HARMLESS,  # qwen3vlmoe: layers that take image features (text runs without)
    # hybrids (qwen3next, qwen35moe): read by their family (its own_keys)
    "{a}.expert_shared_feed_forward_length": USED,
    "{a}.ssm.conv_kernel": USED,
    "{a}.ssm.state_size": USED,
    "{a}.ssm.group_count": USED,
    "{a}.ssm.time_step_rank": USED,
    "{a}.ssm.inner_size": USED,
    "{a}.full_attention_interval": USED,
    "{a}.attention.recurrent_layers": USED,
    "{a}.vocab_size": HARMLESS,  # llama.cpp names the model's size with it; the engine takes token_embd's
    "tokenizer.ggml.tokens": HARMLESS,  # the vocabulary's length, same use
}

# the value each REFUSED key may hold (the one llama.cpp assumes when the key is absent)
_DEFAULTS: dict[str, float | bool] = {
    "{a}.rope.scaling.attn_factor": 1.0,
    "{a}.rope.scaling.alpha": 0.0,
    "{a}.rope.scaling.yarn_attn_factor": 1.0,
    "{a}.rope.scaling.yarn_beta_fast": 32.0,
    "{a}.rope.scaling.yarn_beta_slow": 1.0,
    "{a}.rope.scaling.yarn_log_multiplier": 0.0,
    "{a}.expert_gating_func": 1.0,  # softmax (llama_expert_gating_func_type)
    "{a}.expert_weights_norm": True,
    "{a}.expert_weights_scale": 1.0,
    "{a}.leading_dense_block_count": 0.0,
    "{a}.nextn_predict_layers": 0.0,
    "{a}.expert_shared_count": 0.0,
    "{a}.attention.temperature_scale": 0.0,
    "{a}.attention.temperature_length": 0.0,
    "{a}.expert_group_count": 1.0,  # (0 too: no groups)
    "{a}.expert_group_used_count": 1.0,
}

ROPE_TYPES = ("none", "linear", "yarn")
GATINGS = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func values the engine computes
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0


class KeyProblem(ValueError):
    """A metadata key whose value the engine cannot run; `gguf_model` names the file."""

    def __init__(self, key: str, problem: str) -> None:
        self.key, self.problem = key, problem
        super().__init__(f"metadata key {key} {problem}")


@dataclass(frozen=True)
class RopeScaling:
    """How a file's RoPE frequencies are stretched for a longer context."""

    kind: str  # "linear" | "yarn"
    factor: float
    original_context: int  # yarn: the context the model was trained at
    beta_fast: float = YARN_BETA_FAST
    beta_slow: float = YARN_BETA_SLOW
    # yarn: round the ramp's ends to whole pairs (llama.cpp, transformers' default); gpt-oss's
    # authors' code does not (transformers' `truncate: false`), and its family says so
    truncate: bool = True

    def inv_freq(self, head_dim: int, base: float) -> np.ndarray:
        """The scaled inverse frequencies of pairs 0..head_dim/2-1 (float64)."""
        freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        if self.kind == "linear":
            return freq / self.factor
        # yarn: pairs that turn often over the original context keep their frequency
        # (extrapolate), slow ones are interpolated by `factor`, with a linear ramp between
        def dim_of(rotations: float) -> float:
            return head_dim * math.log(self.original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        span = max(high - low, 0.001)
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / span, 0.0, 1.0)
        keep = 1.0 - ramp
        return freq / self.factor * (1.0 - keep) + freq * keep

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (yarn's attention temperature; 1 for linear)."""
        return 1.0 + 0.1 * math.log(self.factor) if self.kind == "yarn" and self.factor > 1 else 1.0


def _number(meta: Mapping[str, Any], key: str) -> float | None:
    v = meta.get(key)
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise KeyProblem(key, f"is not a number ({type(v).__name__})")
    x = float(v)
    if not math.isfinite(x):
        raise KeyProblem(key, f"is {x!r}, must be a finite number")
    return x


def rope_scaling(meta: Mapping[str, Any], arch: str, context_length: int) -> RopeScaling | None:
    """The file's RoPE scaling as llama.cpp reads it (None: none); KeyProblem names a bad key."""
    tkey = f"{arch}.rope.scaling.type"
    kind = meta.get(tkey)
    if kind is not None and not isinstance(kind, str):
        raise KeyProblem(tkey, f"is not a string ({type(kind).__name__})")
    fkey = f"{arch}.rope.scaling.factor"
    factor = _number(meta, fkey)
    if factor is None:
        fkey = f"{arch}.rope.scale_linear"
        factor = _number(meta, fkey)
    if factor is not None and factor < 0:
        raise KeyProblem(fkey, f"is {factor!r}, must be a finite number above 0")
    if kind is None:
        kind = "linear"  # llama.cpp's default type: a factor alone scales linearly
    if kind not in ROPE_TYPES:
        raise KeyProblem(tkey, f"is {kind!r}: the engine implements {', '.join(ROPE_TYPES)} "
                               f"(longrope and other kinds are not implemented)")
    if kind == "none" or factor in (None, 0.0, 1.0):  # 0 or absent: no scaling, as llama.cpp reads it
        return None
    okey = f"{arch}.rope.scaling.original_context_length"
    original = _number(meta, okey)
    if original is None:
        original = float(context_length)
    if original < 1 or not original.is_integer():
        raise KeyProblem(okey, f"is {original:g}, must be a whole number of tokens >= 1")
    if kind == "yarn" and factor < 1:
        raise KeyProblem(fkey, f"is {factor!r}: a yarn factor stretches the context, so it must be at least 1")
    return RopeScaling(kind, factor, int(original))


def check_refused(meta: Mapping[str, Any], arch: str, head_dim: int, scaling: RopeScaling | None) -> None:
    """Raise KeyProblem for the first REFUSED key whose value the engine cannot honour."""
    for pattern, verdict in TABLE.items():
        if verdict != REFUSED:
            continue
        key = pattern.format(a=arch)
        if key not in meta:
            continue
        if pattern == "{a}.rope.dimension_sections":
            raise KeyProblem(key, "is set: multi-section (vision) RoPE is not implemented")
        if isinstance(_DEFAULTS.get(pattern), bool):  # a flag
            if meta[key] is not _DEFAULTS[pattern] and meta[key] != _DEFAULTS[pattern]:
                raise KeyProblem(key, f"is {meta[key]!r}: only {_DEFAULTS[pattern]} is implemented for this family")
            continue
        value = _number(meta, key)
        if pattern in ("{a}.rope.dimension_count", "{a}.attention.value_length"):
            if value != head_dim:
                what = ("rotary dimensions other than the head's (partial rotary) are not implemented"
                        if "dimension_count" in pattern else "value heads of another size than key heads are not "
                                                             "implemented")
                raise KeyProblem(key, f"is {value:g}, not the key length {head_dim}: {what}")
            continue
        if pattern == "{a}.rope.scaling.yarn_ext_factor":
            auto = 1.0 if scaling is not None and scaling.kind == "yarn" else 0.0
            if value != auto:
                raise KeyProblem(key, f"is {value:g}: only the default ({auto:g} for this scaling) is implemented")
            continue
        default = _DEFAULTS[pattern]
        if pattern in ("{a}.expert_group_count", "{a}.expert_group_used_count") and value in (0.0, 1.0):
            continue  # one group, or none: plain top-k
        if value != default:
            raise KeyProblem(key, f"is {value:g}: only the default {default:g} is implemented")
