"""Import Triton for one engine module, or say in words why its torch fallback must serve.

Two things stop an engine module's Triton kernels: triton is not importable (no `cuda` extra; no
wheel for the platform), or `@triton.jit` refuses the module's functions because their source
cannot be read — `ValueError: @jit functions should be defined in a Python file` — which is what
a frozen build that ships engine/ as bytecode does (packaging/strata_gui.spec collects engine/ as
source for that reason).  `load` asks both, with a probe function of the calling module, so a
module defines its kernels only where that works and falls back instead of crashing on import.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)


def load(probe: Callable[..., Any]) -> tuple[ModuleType | None, ModuleType | None, str]:
    """(triton, triton.language, "") where `probe` (a function of the caller's module) can be
    jitted; else (None, None, why)."""
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        return None, None, f"triton is not importable: {exc}"
    try:
        triton.jit(probe)
    except (ValueError, OSError) as exc:  # the module is bytecode only: a frozen build
        return None, None, (f"Triton {getattr(triton, '__version__', '?')} cannot read the source of the engine's "
                            f"kernels (a frozen build holding bytecode only?): {exc}")
    return triton, tl, ""
