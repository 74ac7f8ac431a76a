"""A layer's weights from a file, part by part as its family names them, and the layer built
from them by the class its kind names: the runtime's two calls to make a layer.

Apart from `layers` so that the layer classes import no registry (the registry's layer kinds
name those classes)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine import models
from engine.models.layers import _float_stored, dense_weight
from engine.models.spec import ModelSpec
from engine.quant.qtensor import QTensor, stored

if TYPE_CHECKING:
    from engine.models.experts import ExpertCache
    from engine.models.layers import Rope, WeightSource


def load_layer_weights(src: WeightSource, i: int, device: torch.device, dtype: torch.dtype,
                       experts: bool = True) -> Any:
    """One block's weights on a device, part by part as its family names them (engine/models/);
    experts=False leaves the MoE experts to an ExpertCache."""
    s = src.spec
    b = f"blk.{i}."
    values: dict[str, torch.Tensor | QTensor] = {}
    expert_parts = []
    for part in models.family_of(s).layer_parts(s, i):
        if part.expert:
            expert_parts.append(part)
        else:
            values[part.field] = dense_weight(src, b + part.name, device, torch.float32 if part.fp32 else dtype)
    if experts and expert_parts:  # quantized: kept as stored and expanded right before their GEMMs
        if all(_float_stored(src, b + p.name) for p in expert_parts):  # floats: expanded once, as dense
            values.update((p.field, dense_weight(src, b + p.name, device, dtype)) for p in expert_parts)
        else:
            values.update((p.field, stored(src, b + p.name, device)) for p in expert_parts)
    return models.family_of(s).layer_kind(s, i).layer().weights_type(**values)


def new_layer(spec: ModelSpec, i: int, weights: Any, rope: Rope, cache: ExpertCache | None = None) -> Any:
    """Layer i of `spec`'s model, computed by the class its family's layer kind names."""
    return models.family_of(spec).layer_kind(spec, i).layer()(spec, i, weights, rope, cache=cache)
