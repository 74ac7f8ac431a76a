"""Engine errors in the words of the form (no Qt).

The engine's messages name its settings ("invalid prefill='abc': allowed …"), which is right for
the CLI and the environment; in the app the user typed into a field called "Chunk size".  These
helpers put the field's name first, keep the engine's setting name at the end (what the CLI, the
environment and the history call it), and say what a GGUF file problem means for the user.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import ConfigError, _show

if TYPE_CHECKING:
    from engine.io.gguf_model import GGUFError

# engine setting -> the form's label
LABELS = {
    "model": "Model", "devices": "Device list", "gpu_order": "GPU ordering", "layer_split": "Layer split",
    "chunk_tokens": "Chunk size", "chunk_schedule": "Chunk schedule", "pipeline_depth": "Pipeline depth",
    "prefill_main": "Prefill-main", "cuda_graphs": "CUDA graphs", "pin_limit_gib": "Pin limit (GiB)",
    "expert_cache": "Expert cache (GiB)", "prompt": "Prompt", "prompt_tokens": "Prompt tokens",
    "decode_tokens": "Decode tokens", "repeats": "Repeats", "handoff": "Hand-off",
}


def config_error_text(exc: ConfigError) -> str:
    """'Chunk size: 'abc' is invalid; allowed: auto or a chunk size in tokens … (setting prefill='abc')'."""
    label = LABELS.get(exc.setting)
    if label is None:  # an environment variable or a setting the form does not show: the engine's words
        return str(exc)
    sep = f": allowed {exc.allowed}"
    why = str(exc).split(sep, 1)[1].strip() if sep in str(exc) else ""
    text = f"{label}: {_show(exc.value)} is invalid; allowed: {exc.allowed}"
    if why:
        text += f" {why}"
    return f"{text} (setting {exc.setting}={_show(exc.value)})"


def model_error_text(exc: GGUFError) -> str:
    """A GGUF problem as the user should read it: the file, then what is wrong with it."""
    from engine.io.gguf_model import KIND_MAGIC
    if exc.kind == KIND_MAGIC:
        return (f"{exc.path}: not a GGUF file — it does not start with the bytes 'GGUF' (pick a .gguf model, "
                "or press Demo)")
    return str(exc)
