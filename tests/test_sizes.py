"""Byte counts in the memory plan and the executor's notes: each in a unit a person reads."""
from __future__ import annotations

import pytest

from engine.sizes import GiB, KiB, MiB, size_text


@pytest.mark.parametrize("nbytes,text", [
    (0, "0 B"), (1, "0.1 KiB"), (512, "0.5 KiB"), (99 * KiB, "99.0 KiB"), (512 * KiB, "512 KiB"),
    (1000 * KiB, "1.0 MiB"), (3 * MiB, "3.0 MiB"), (516 * MiB, "516 MiB"), (GiB - 1, "1.00 GiB"),
    (int(18.6 * GiB), "18.60 GiB"), (int(99.97 * KiB), "100 KiB"), (int(999.7 * KiB), "1.0 MiB"),
    (int(999.7 * MiB), "0.98 GiB"),
])
def test_each_size_in_its_own_unit(nbytes, text):
    assert size_text(nbytes) == text


def test_a_tiny_model_plan_shows_its_sizes_not_zeros(demo_path):
    """The demo model's plan used to read 'dense 0.00 GiB, experts 0.00': every figure is now
    nonzero text for nonzero bytes."""
    from engine.config import EngineConfig
    from engine.io import gguf_model
    from engine.plan.memory_plan import plan_memory
    text = plan_memory(gguf_model.load(demo_path), EngineConfig(devices=["cpu", "cpu"]), tokens=512).render()
    assert "0.00 GiB" not in text and "0.00" not in text
    assert "KiB" in text or "MiB" in text
