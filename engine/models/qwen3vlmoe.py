"""Qwen3-VL-MoE, text only (llama.cpp `qwen3vlmoe`): qwen3moe's layers (routed experts, q/k
RMSNorm, neox RoPE) with multi-section RoPE (MRoPE).

MRoPE gives each rotary frequency the position of one section (time, height, width); a text
token has the same position in all three, so every frequency turns by that one position, which
is plain RoPE: the sections are checked, then need no code.  The vision tower is another file
(llama.cpp's converter writes it as an mmproj GGUF) and its deepstack features enter only with
an image; this file's `n_deepstack_layers` is noted and left.
Oracle: tests/test_family_files.py (transformers' Qwen3VLMoeForConditionalGeneration, text path,
on the weights the file was converted from)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.models.family import Family, SpecSource, whole_numbers
from engine.models.spec import ModelSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Qwen3VLMoe(Family):
    def spec_from_metadata(self, m: SpecSource) -> ModelSpec:
        a = self.arch
        skey, dkey = f"{a}.rope.dimension_sections", f"{a}.n_deepstack_layers"
        spec = super().spec_from_metadata(m)
        values = whole_numbers(m, skey)
        if values is not None:
            if any(v < 0 for v in values) or sum(values) * 2 > spec.head_dim:
                raise m.problem(f"metadata key {skey} is {values}: the sections must be >= 0 and cover at most "
                                f"half the head dimension {spec.head_dim} (one entry per rotated pair)")
        if m.get(dkey):
            log.info("%s: text only; the file's %s (%s) takes image features, which come with the vision "
                     "tower's own file: not used", a, dkey, m.get(dkey))
        return spec


FAMILY = Qwen3VLMoe("qwen3vlmoe", moe=True, qk_norm=True, own_keys=("rope.dimension_sections",))
