"""A full-attention layer with a dense SwiGLU FFN in a model whose other layers route experts:
the leading dense layers of GLM-4.5 (`leading_dense_block_count`; DeepSeek-V3 has them too).
The spec says experts (`is_moe`); this layer's kind has the dense parts and no expert ones, and
its FFN is the dense one on every path (CPU, the GPU path, CUDA graphs)."""
from __future__ import annotations

import torch

from engine.models.layers import Layer


class DenseFFNLayer(Layer):
    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        return self.dense(h)

    def graphable(self, x: torch.Tensor) -> bool:
        """No experts, so nothing here synchronises with the host (a streamed model's cache is
        never asked for this layer)."""
        return self.fast_ok(x)
