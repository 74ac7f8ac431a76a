"""GGUF file -> `ModelSpec` + memory-mapped tensors, checked before any device memory is taken.

Parsing and dequantisation come from the `gguf` package.  Everything that can be wrong with a
file is reported as `GGUFError` naming the file and the problem.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType, GGUFReader
from gguf import quants as gguf_quants

log = logging.getLogger(__name__)

ARCHITECTURES = ("qwen3moe", "qwen3", "qwen2", "llama")


class GGUFError(Exception):
    """A model file that cannot be used; the message names the file and the problem."""

    def __init__(self, path: Path | str, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int  # 0 for a dense model
    n_experts_used: int
    expert_ffn: int
    ffn: int  # dense FFN size (0 for a pure MoE model)
    rope_base: float
    rms_eps: float
    vocab: int
    context_length: int
    qk_norm: bool
    qkv_bias: bool
    rope_style: str  # "neox" (rotate halves) or "norm" (rotate adjacent pairs, llama GGUF)
    tied_embeddings: bool = False

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def layer_params(self) -> int:
        """Parameters of one layer (all experts counted)."""
        attn = self.hidden * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.is_moe:
            ffn = self.n_experts * 3 * self.hidden * self.expert_ffn + self.n_experts * self.hidden
        else:
            ffn = 3 * self.hidden * self.ffn
        return attn + ffn + 2 * self.hidden

    def active_flops_per_token(self, context: int) -> float:
        """Forward FLOPs of one token per layer at a given attention context (2 per MAC)."""
        proj = self.hidden * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.is_moe:
            ffn = self.n_experts_used * 3 * self.hidden * self.expert_ffn + self.n_experts * self.hidden
        else:
            ffn = 3 * self.hidden * self.ffn
        attn = 2 * self.n_heads * self.head_dim * context  # QK^T and PV
        return 2.0 * (proj + ffn + attn)

    def prefill_flops(self, n_tokens: int) -> float:
        """FLOPs of a causal prefill of n tokens through every layer (attention at its causal
        cost: token i attends to i keys), LM head excluded."""
        per_token = self.active_flops_per_token(0)
        attn = 2.0 * self.n_heads * self.head_dim * n_tokens * (n_tokens + 1)
        return self.n_layers * (n_tokens * per_token + attn)


def supported_types() -> set[GGMLQuantizationType]:
    traits = getattr(gguf_quants, "_type_traits", {})
    return {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *traits.keys()}


@dataclass
class LoadedModel:
    """A parsed, validated GGUF file.  Tensors stay memory-mapped until asked for."""

    path: Path
    spec: ModelSpec
    metadata: dict[str, Any]
    _reader: GGUFReader = field(repr=False)
    _tensors: dict[str, Any] = field(repr=False)

    @property
    def file_bytes(self) -> int:
        return self.path.stat().st_size

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def tensor(self, name: str) -> torch.Tensor:
        """Dequantised float32 tensor in torch order (a copy; the file stays mapped)."""
        t = self._tensors.get(name)
        if t is None:
            raise GGUFError(self.path, f"missing tensor {name}")
        try:
            arr = gguf_quants.dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise GGUFError(self.path, f"cannot dequantise {name} ({t.tensor_type.name}): {exc}") from None
        return torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))

    def has_vocab(self) -> bool:
        return "tokenizer.ggml.tokens" in self.metadata

    def describe(self) -> str:
        s = self.spec
        kind = f"{s.n_experts} experts, top-{s.n_experts_used}" if s.is_moe else f"dense FFN {s.ffn}"
        return (f"{s.arch}: {s.n_layers} layers, hidden {s.hidden}, {s.n_heads}/{s.n_kv_heads} heads, "
                f"{kind}, vocab {s.vocab}, {self.file_bytes / 2**20:.1f} MiB")


def _field_value(f: Any) -> Any:
    """Decode a ReaderField into a Python value (scalars, strings and arrays)."""
    types = f.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        sub = types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
    return f.parts[f.data[0]].tolist()[0]


def read_metadata(reader: GGUFReader, path: Path, with_arrays: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if not with_arrays and f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
            meta[key] = f  # kept raw; decoded on demand (vocabularies are large)
            continue
        try:
            meta[key] = _field_value(f)
        except Exception as exc:  # a corrupt value is a file defect
            raise GGUFError(path, f"cannot decode metadata key {key}: {exc}") from None
    return meta


def open_reader(path: Path | str) -> GGUFReader:
    p = Path(path)
    if not p.exists():
        raise GGUFError(p, "file not found")
    if not p.is_file():
        raise GGUFError(p, "not a regular file")
    size = p.stat().st_size
    if size < 24:
        raise GGUFError(p, f"truncated file: {size} bytes is shorter than a GGUF header (24 bytes)")
    with p.open("rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise GGUFError(p, f"bad magic {magic!r}: not a GGUF file (expected b'GGUF')")
    try:
        return GGUFReader(p, "r")
    except Exception as exc:  # gguf raises ValueError/IndexError/... on corrupt files
        raise GGUFError(p, f"corrupt or truncated GGUF header, metadata or tensor table ({type(exc).__name__}: {exc})") from None


def _meta_int(meta: dict[str, Any], path: Path, key: str, default: int | None = None) -> int:
    v = meta.get(key)
    if v is None:
        if default is None:
            raise GGUFError(path, f"missing metadata key {key}")
        return default
    if isinstance(v, (list, tuple)) or not isinstance(v, (int, float, np.integer)):
        raise GGUFError(path, f"metadata key {key} is not a number: {v!r}")
    return int(v)


def _meta_float(meta: dict[str, Any], path: Path, key: str, default: float) -> float:
    v = meta.get(key)
    if v is None:
        log.info("%s: %s missing, using %s", path.name, key, default)
        return default
    if not isinstance(v, (int, float, np.floating, np.integer)):
        raise GGUFError(path, f"metadata key {key} is not a number: {v!r}")
    return float(v)


def spec_from_metadata(meta: dict[str, Any], tensors: dict[str, Any], path: Path) -> ModelSpec:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(path, "missing metadata key general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(path, f"unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
    a = arch
    hidden = _meta_int(meta, path, f"{a}.embedding_length")
    n_heads = _meta_int(meta, path, f"{a}.attention.head_count")
    n_kv = _meta_int(meta, path, f"{a}.attention.head_count_kv", n_heads)
    if n_heads <= 0 or n_kv <= 0 or n_heads % n_kv:
        raise GGUFError(path, f"head counts {n_heads}/{n_kv}: query heads must be a positive multiple of KV heads")
    head_dim = _meta_int(meta, path, f"{a}.attention.key_length", hidden // n_heads)
    n_layers = _meta_int(meta, path, f"{a}.block_count")
    if n_layers <= 0:
        raise GGUFError(path, f"{a}.block_count is {n_layers}")
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise GGUFError(path, "missing tensor token_embd.weight")
    vocab = int(emb.shape[1]) if len(emb.shape) == 2 else 0
    moe = a == "qwen3moe"
    n_exp = _meta_int(meta, path, f"{a}.expert_count", 0) if moe else 0
    n_used = _meta_int(meta, path, f"{a}.expert_used_count", 0) if moe else 0
    if moe and not (0 < n_used <= n_exp):
        raise GGUFError(path, f"expert_used_count {n_used} must be between 1 and expert_count {n_exp}")
    return ModelSpec(
        arch=a,
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        n_experts=n_exp,
        n_experts_used=n_used,
        expert_ffn=_meta_int(meta, path, f"{a}.expert_feed_forward_length", 0) if moe else 0,
        ffn=0 if moe else _meta_int(meta, path, f"{a}.feed_forward_length"),
        rope_base=_meta_float(meta, path, f"{a}.rope.freq_base", 10000.0),
        rms_eps=_meta_float(meta, path, f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        vocab=vocab,
        context_length=_meta_int(meta, path, f"{a}.context_length", 4096),
        qk_norm=a in ("qwen3", "qwen3moe"),
        qkv_bias=a == "qwen2",
        rope_style="norm" if a == "llama" else "neox",
        tied_embeddings="output.weight" not in tensors,
    )


def expected_shapes(s: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the engine needs, in torch order."""
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    out: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (s.vocab, s.hidden),
        "output_norm.weight": (s.hidden,),
    }
    if not s.tied_embeddings:
        out["output.weight"] = (s.vocab, s.hidden)
    for i in range(s.n_layers):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = (s.hidden,)
        out[b + "attn_q.weight"] = (q, s.hidden)
        out[b + "attn_k.weight"] = (kv, s.hidden)
        out[b + "attn_v.weight"] = (kv, s.hidden)
        out[b + "attn_output.weight"] = (s.hidden, q)
        out[b + "ffn_norm.weight"] = (s.hidden,)
        if s.qk_norm:
            out[b + "attn_q_norm.weight"] = (s.head_dim,)
            out[b + "attn_k_norm.weight"] = (s.head_dim,)
        if s.qkv_bias:
            out[b + "attn_q.bias"] = (q,)
            out[b + "attn_k.bias"] = (kv,)
            out[b + "attn_v.bias"] = (kv,)
        if s.is_moe:
            out[b + "ffn_gate_inp.weight"] = (s.n_experts, s.hidden)
            out[b + "ffn_gate_exps.weight"] = (s.n_experts, s.expert_ffn, s.hidden)
            out[b + "ffn_up_exps.weight"] = (s.n_experts, s.expert_ffn, s.hidden)
            out[b + "ffn_down_exps.weight"] = (s.n_experts, s.hidden, s.expert_ffn)
        else:
            out[b + "ffn_gate.weight"] = (s.ffn, s.hidden)
            out[b + "ffn_up.weight"] = (s.ffn, s.hidden)
            out[b + "ffn_down.weight"] = (s.hidden, s.ffn)
    return out


def load(path: Path | str) -> LoadedModel:
    """Parse and validate a GGUF model.  Takes no device memory; tensors stay mapped."""
    p = Path(path)
    reader = open_reader(p)
    size = p.stat().st_size
    meta = read_metadata(reader, p)
    tensors = {t.name: t for t in reader.tensors}
    spec = spec_from_metadata(meta, tensors, p)
    ok_types = supported_types()
    for name, shape in expected_shapes(spec).items():
        t = tensors.get(name)
        if t is None:
            raise GGUFError(p, f"missing tensor {name} (needed by {spec.arch})")
        got = tuple(int(x) for x in reversed(t.shape.tolist()))
        if got != shape:
            raise GGUFError(p, f"tensor {name} has shape {list(got)}, expected {list(shape)} from the metadata")
        if t.tensor_type not in ok_types:
            raise GGUFError(
                p, f"tensor {name} has unsupported type {t.tensor_type.name} "
                   f"(supported: {', '.join(sorted(q.name for q in ok_types))})")
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(
                p, f"truncated file: tensor {name} needs bytes up to {t.data_offset + t.n_bytes}, "
                   f"file has {size}")
    log.info("loaded %s: %s", p.name, spec)
    return LoadedModel(path=p, spec=spec, metadata=meta, _reader=reader, _tensors=tensors)


def vocabulary(model: LoadedModel) -> list[str]:
    f = model.metadata.get("tokenizer.ggml.tokens")
    if f is None:
        raise GGUFError(model.path, "the file has no vocabulary (tokenizer.ggml.tokens): use token ids")
    return _field_value(f) if not isinstance(f, list) else f
