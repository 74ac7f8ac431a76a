"""`ModelSpec`: the shape of a model, as its family reads it from a file's metadata (or a recipe).

Plain data, the same for every family: the loader, the memory plan, the planner and the layers
read it.  What a family adds beyond these fields lives in its module (`engine/models/`)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models.gguf_keys import RopeScaling


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
    rope_scaling: RopeScaling | None = None  # linear or YaRN stretching of the RoPE frequencies
    shared_ffn: int = 0  # the shared expert's FFN size, beside the routed ones (0: none)
    shared_gate: bool = False  # the shared expert's output scaled by sigmoid(a per-token gate) (Qwen3-Next)
    rope_dim: int = 0  # partial rotary: RoPE turns each head's first rope_dim dimensions, the rest pass (0: all)
    # routing (engine/models/routing.py): the defaults are softmax top-k renormalised, no bias, no scale
    expert_gating: str = "softmax"  # the router's scores: "softmax" over experts or "sigmoid" per expert
    expert_bias: bool = False  # a per-expert score-correction bias (exp_probs_b) that only selects
    expert_weights_norm: bool = True  # the top k weights renormalised to sum 1
    expert_weights_scale: float = 1.0  # the routed experts' weights multiplied by it
    expert_groups: int = 0  # grouped top-k: experts in this many groups (0 or 1: none) ...
    expert_groups_used: int = 0  # ... of which the best this many (by their top-2 scores) are chosen from

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head RoPE turns (the first ones; `rope.dimension_count`)."""
        return self.rope_dim or self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def has_experts(self, i: int) -> bool:
        """Whether layer i routes experts (a family with leading dense layers says otherwise for them)."""
        return self.is_moe

    def expert_layers(self, first: int, end: int) -> int:
        """How many of layers [first, end) route experts (the expert slots and arena count these)."""
        return sum(self.has_experts(i) for i in range(first, end))

    def layer_params(self) -> int:
        """Parameters of one layer (all experts counted)."""
        attn = self.hidden * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.is_moe:
            ffn = self.n_experts * 3 * self.hidden * self.expert_ffn + self.n_experts * self.hidden
            ffn += self.n_experts if self.expert_bias else 0
        else:
            ffn = 3 * self.hidden * self.ffn
        return attn + ffn + self.shared_params() + 2 * self.hidden

    def shared_params(self) -> int:
        """Parameters of one layer's shared expert and its gate (0 without one)."""
        return 3 * self.hidden * self.shared_ffn + (self.hidden if self.shared_gate else 0) if self.shared_ffn else 0

    def active_flops_per_token(self, context: int) -> float:
        """Forward FLOPs of one token per layer at a given attention context (2 per MAC)."""
        proj = self.hidden * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.is_moe:
            ffn = self.n_experts_used * 3 * self.hidden * self.expert_ffn + self.n_experts * self.hidden
            ffn += self.shared_params()
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
