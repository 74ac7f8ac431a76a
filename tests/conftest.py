"""Shared fixtures: generated GGUF models (real files, random weights) and headless Qt."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if "STRATA_LOG_DIR" not in os.environ:  # internal-error logs of the tests stay out of the user's folder
    import tempfile

    os.environ["STRATA_LOG_DIR"] = tempfile.mkdtemp(prefix="strata-test-logs-")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton's kernels (where triton is installed: the test extra brings it on Linux) run interpreted on a
    # CPU. The mode is fixed when an engine module defines its kernels, so it is set here, before
    # any test module imports one: set later, kernels defined earlier stay compiled-only
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.io import synth  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def demo_path(model_dir: Path) -> Path:
    """The built-in demo model, generated the way the app does on first use."""
    return synth.demo_model_path(model_dir)


@pytest.fixture(scope="session")
def make_arch(model_dir: Path):
    """Write (once) a small model of an architecture: make_arch("qwen3") -> Path."""
    cache: dict[tuple, Path] = {}

    def make(arch: str, **changes) -> Path:
        key = (arch, tuple(sorted(changes.items())))
        if key not in cache:
            recipe = synth.recipe_from_args("demo", arch=arch, **changes)
            name = f"{arch}-" + "-".join(f"{k}{v}" for k, v in sorted(changes.items())) + ".gguf"
            cache[key] = synth.write_model(model_dir / name, recipe)
        return cache[key]

    return make
