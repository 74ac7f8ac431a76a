"""What a model family declares: its metadata -> `ModelSpec`, its layers' kinds and parts, the
state each layer carries across chunks.

A family is one `Family` object (or subclass) registered in `engine.models.registry` by its own
module.  The base class reads the keys every llama.cpp transformer family writes
(`{arch}.embedding_length`, `.attention.head_count`, ...); a family that reads other keys, or
whose layers differ from layer to layer (recurrent and attention layers, leading dense layers,
sliding-window layers), overrides `spec_from_metadata`, `layer_kind` or `ffn_is_moe`.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from engine.models.blocks import FULL_ATTENTION, LayerKind, Part
from engine.models.gguf_keys import GATINGS, KeyProblem, check_refused, rope_scaling
from engine.models.spec import ModelSpec

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the registry imports no torch: the CLI lists the families before torch loads
    import torch

    from engine.models.kv import LayerState


class SpecSource(Protocol):
    """A file's metadata and tensor table as a family reads them (`gguf_model` provides it).

    Every reader raises the loader's own error (naming the file); `problem(text)` makes one for
    a family's own check."""

    n_tensors: int

    def read_int(self, key: str, default: int | None = None, minimum: int = 1) -> int: ...

    def read_float(self, key: str, default: float, positive: bool = True) -> float: ...

    def has(self, key: str) -> bool: ...

    def get(self, key: str) -> Any: ...

    def has_tensor(self, name: str) -> bool: ...

    def vocab(self) -> int: ...

    def problem(self, text: str) -> Exception: ...

    @property
    def values(self) -> Any: ...


@dataclass(frozen=True)
class Family:
    """A transformer family of llama.cpp's GGUF files.  The flags are what these families differ
    in today: routed experts, per-head q/k RMSNorm, q/k/v biases and the RoPE pairing."""

    arch: str  # general.architecture, as llama.cpp writes it
    moe: bool = False  # routed experts in every layer (else a dense SwiGLU FFN)
    qk_norm: bool = False
    qkv_bias: bool = False
    rope_style: str = "neox"  # "neox" (rotate halves) or "norm" (adjacent pairs: llama's permuted q/k)
    # metadata keys (after "{arch}.") this family reads and checks itself, so the shared table of
    # refused keys (gguf_keys) leaves them to it; e.g. qwen3vlmoe's rope.dimension_sections
    own_keys: tuple[str, ...] = ()
    # RoPE over the first `rope.dimension_count` dimensions of each head (the rest pass through),
    # as llama.cpp runs this family; the others refuse a count below the head size, as its graphs
    # of them assert
    partial_rotary: bool = False

    # --------------------------------------------------------------- the spec
    def spec_from_metadata(self, m: SpecSource) -> ModelSpec:
        """The model's spec from a file (every check of `gguf_model.load` on the metadata)."""
        a = self.arch
        hidden = m.read_int(f"{a}.embedding_length")
        n_heads = m.read_int(f"{a}.attention.head_count", minimum=0)
        n_kv = m.read_int(f"{a}.attention.head_count_kv", n_heads, minimum=0)
        if n_heads <= 0 or n_kv <= 0 or n_heads % n_kv:
            raise m.problem(f"head counts {n_heads}/{n_kv}: query heads must be a positive multiple of KV heads")
        key = f"{a}.attention.key_length"
        head_dim = m.read_int(key, hidden // n_heads)
        if head_dim % 2:
            source = "" if m.has(key) else f" (embedding_length {hidden} / head_count {n_heads})"
            raise m.problem(f"metadata key {key} is {head_dim}{source}: RoPE rotates pairs of "
                            f"dimensions, so the head dimension must be even")
        n_layers = m.read_int(f"{a}.block_count", minimum=0)
        if n_layers <= 0:
            raise m.problem(f"{a}.block_count is {n_layers}")
        if n_layers > m.n_tensors:  # checked before anything loops over the layers
            raise m.problem(f"{a}.block_count {n_layers} is more layers than the file's {m.n_tensors} tensors "
                            f"can hold")
        vocab = m.vocab()
        n_exp, n_used = self._experts(m)
        context_length = m.read_int(f"{a}.context_length", 4096)
        try:
            scaling = rope_scaling(m.values, a, context_length)
            own = {f"{a}.{k}" for k in self.own_keys + (("rope.dimension_count",) if self.partial_rotary else ())}
            check_refused({k: v for k, v in m.values.items() if k not in own}, a, head_dim, scaling)
        except KeyProblem as exc:
            raise m.problem(str(exc)) from None
        expert_ffn = m.read_int(f"{a}.expert_feed_forward_length", 0) if self.moe else 0
        ffn = 0 if self.moe else m.read_int(f"{a}.feed_forward_length")
        return ModelSpec(
            arch=a, n_layers=n_layers, hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            n_experts=n_exp, n_experts_used=n_used, expert_ffn=expert_ffn, ffn=ffn,
            rope_base=m.read_float(f"{a}.rope.freq_base", 10000.0),
            rms_eps=m.read_float(f"{a}.attention.layer_norm_rms_epsilon", 1e-6, positive=False),
            vocab=vocab, context_length=context_length, qk_norm=self.qk_norm, qkv_bias=self.qkv_bias,
            rope_style=self.rope_style, tied_embeddings=not m.has_tensor("output.weight"), rope_scaling=scaling,
            rope_dim=self._rope_dim(m, head_dim),
        )

    def _rope_dim(self, m: SpecSource, head_dim: int) -> int:
        """The rotated part of each head (`ModelSpec.rope_dim`: 0 for all of it)."""
        key = f"{self.arch}.rope.dimension_count"
        if not self.partial_rotary or not m.has(key):
            return 0  # (a family without partial rotary has refused any other count above)
        rot = m.read_int(key)
        if rot % 2 or rot > head_dim:
            raise m.problem(f"metadata key {key} is {rot}: RoPE turns pairs of a head's first dimensions, so it must "
                            f"be even and at most the key length {head_dim}")
        return 0 if rot == head_dim else rot

    def routing_from_metadata(self, m: SpecSource, gating: str = "softmax", norm: bool = True) -> dict[str, Any]:
        """The routing variant's `ModelSpec` fields from the keys this family names in `own_keys`
        (`expert_gating_func`, `expert_weights_norm`, `expert_weights_scale`; engine/models/
        routing.py), an absent key at `gating` / `norm` / unscaled as llama.cpp reads it for the family."""
        a, out = self.arch, {}
        if "expert_gating_func" in self.own_keys and m.has(f"{a}.expert_gating_func"):
            key = f"{a}.expert_gating_func"
            value = m.read_int(key, minimum=0)
            if value and value not in GATINGS:
                raise m.problem(f"metadata key {key} is {value}: the engine computes "
                                f"{', '.join(f'{k} ({v})' for k, v in GATINGS.items())}")
            gating = GATINGS.get(value, gating)  # 0 (none): the family's own
        out["expert_gating"], out["expert_weights_norm"] = gating, norm
        if "expert_weights_norm" in self.own_keys and m.has(f"{a}.expert_weights_norm"):
            norm = m.get(f"{a}.expert_weights_norm")
            if not isinstance(norm, (bool, int)):
                raise m.problem(f"metadata key {a}.expert_weights_norm is not a flag ({type(norm).__name__})")
            out["expert_weights_norm"] = bool(norm)
        if "expert_weights_scale" in self.own_keys:
            scale = m.read_float(f"{a}.expert_weights_scale", 1.0, positive=False)
            out["expert_weights_scale"] = scale if scale > 0 else 1.0  # 0: none, as llama.cpp reads it
        return out

    def _experts(self, m: SpecSource) -> tuple[int, int]:
        """(experts, experts used) as the file says them; a dense family refuses experts."""
        a = self.arch
        if not self.moe:
            for key in (f"{a}.expert_count", f"{a}.expert_used_count"):
                if m.read_int(key, 0, minimum=0):
                    raise m.problem(f"metadata key {key} is {m.get(key)}: {a} files with experts are not "
                                    f"supported; the engine runs {a} as a dense model")
            return 0, 0
        n_exp = m.read_int(f"{a}.expert_count", 0, minimum=0)
        n_used = m.read_int(f"{a}.expert_used_count", 0, minimum=0)
        if not 0 < n_used <= n_exp:
            raise m.problem(f"expert_used_count {n_used} must be between 1 and expert_count {n_exp}")
        return n_exp, n_used

    def with_experts(self, r: Any) -> Any | None:
        """A generated model's recipe (`synth.ModelRecipe`) once the user asked for routed experts
        (make-model's expert flags): unchanged where the family has them, None where it cannot
        (a dense family; llama overrides it: Mixtral's layout)."""
        return r if self.moe else None

    def has_experts(self, r: Any) -> bool:
        """Whether a generated model of recipe `r` routes experts (what its expert fields must suit)."""
        return self.moe

    def spec_from_recipe(self, r: Any) -> ModelSpec:
        """The spec of a generated model (`synth.ModelRecipe`: its shape fields, vocab resolved)."""
        moe = self.moe
        return ModelSpec(
            arch=self.arch, n_layers=r.n_layers, hidden=r.hidden, n_heads=r.n_heads,
            n_kv_heads=r.n_kv_heads, head_dim=r.head_dim,
            n_experts=r.n_experts if moe else 0, n_experts_used=r.n_experts_used if moe else 0,
            expert_ffn=r.expert_ffn if moe else 0, ffn=0 if moe else r.ffn,
            rope_base=r.rope_base, rms_eps=r.rms_eps, vocab=r.vocab, context_length=r.context_length,
            qk_norm=self.qk_norm, qkv_bias=self.qkv_bias, rope_style=self.rope_style, tied_embeddings=r.tied,
            rope_dim=r.rope_dim if self.partial_rotary and r.rope_dim != r.head_dim else 0,
        )

    def file_metadata(self, s: ModelSpec) -> list[tuple[str, int | float | bool]]:
        """The `{arch}.*` keys a file of this spec carries, in the order make-model writes them
        (an int is written as uint32, a float as float32): what `spec_from_metadata` reads back."""
        a = self.arch
        keys: list[tuple[str, int | float | bool]] = [
            (f"{a}.block_count", s.n_layers), (f"{a}.context_length", s.context_length),
            (f"{a}.embedding_length", s.hidden), (f"{a}.attention.head_count", s.n_heads),
            (f"{a}.attention.head_count_kv", s.n_kv_heads), (f"{a}.attention.key_length", s.head_dim),
            (f"{a}.attention.value_length", s.head_dim), (f"{a}.rope.freq_base", float(s.rope_base)),
            (f"{a}.attention.layer_norm_rms_epsilon", float(s.rms_eps)),
        ]
        if s.rope_dim:
            keys.append((f"{a}.rope.dimension_count", s.rope_dim))
        if s.is_moe:
            return keys + [(f"{a}.feed_forward_length", s.expert_ffn), (f"{a}.expert_count", s.n_experts),
                           (f"{a}.expert_used_count", s.n_experts_used),
                           (f"{a}.expert_feed_forward_length", s.expert_ffn)]
        return keys + [(f"{a}.feed_forward_length", s.ffn)]

    def attention_kernel(self, spec: ModelSpec, device: Any, dtype: torch.dtype) -> str:
        """What computes this family's attention on `device` (the run report's line)."""
        from engine.kernels.attention import kernel_for

        return kernel_for(device, spec.n_heads, spec.n_kv_heads, spec.head_dim, dtype).describe()

    # ------------------------------------------------------------- the layers
    def layer_kind(self, spec: ModelSpec, i: int) -> LayerKind:
        """What layer i is: its tensors and the state it carries (every layer alike here)."""
        return FULL_ATTENTION

    def layer_params(self, spec: ModelSpec, i: int) -> int:
        """Parameters of layer i (what loading it asks of its device; every layer alike here)."""
        return spec.layer_params()

    def layer_parts(self, spec: ModelSpec, i: int) -> tuple[Part, ...]:
        """Layer i's tensors (names after `blk.{i}.`), in the order files store them."""
        return self.layer_kind(spec, i).parts(spec)

    def new_state(self, spec: ModelSpec, i: int, capacity: int, device: torch.device,
                  dtype: torch.dtype) -> LayerState:
        """Layer i's state for one sequence of up to `capacity` tokens, on `device`."""
        return self.layer_kind(spec, i).state.new(spec, capacity, device, dtype)

    def state_bytes(self, spec: ModelSpec, layers: Iterable[int], tokens: int, dtype: torch.dtype) -> int:
        """Bytes the states of `layers` take for `tokens` tokens (the memory plan's figure, the
        allocator's request, and what prefill-main hands over at most)."""
        return sum(self.layer_kind(spec, i).state.nbytes(spec, tokens, dtype) for i in layers)


# ----------------------------------------------------------- keys several families read
def layers_without_mtp(m: SpecSource, arch: str, n_layers: int) -> int:
    """The layers to run of a file whose block_count counts its MTP (nextn) draft blocks, as
    llama.cpp runs them: block_count less `nextn_predict_layers` (the skip is logged)."""
    nextn = m.read_int(f"{arch}.nextn_predict_layers", 0, minimum=0)
    if nextn >= n_layers:
        raise m.problem(f"metadata key {arch}.nextn_predict_layers is {nextn}: block_count {n_layers} counts "
                        f"them, so it leaves no layer to run")
    if nextn:
        log.info("%s: the last %d of block_count %d blocks are the MTP (nextn) draft block: skipped",
                 arch, nextn, n_layers)
    return n_layers - nextn


def whole_numbers(m: SpecSource, key: str) -> list[int] | None:
    """An array key's values as ints (None where the file lacks the key)."""
    raw = m.get(key)
    if raw is None:
        return None
    try:  # an array is left undecoded in the mapped file until asked
        return [int(x) for x in (raw.decode() if hasattr(raw, "decode") else raw)]
    except (TypeError, ValueError, OverflowError):
        raise m.problem(f"metadata key {key} is not a list of whole numbers") from None
