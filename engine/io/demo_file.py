"""Where the built-in demo model lives (no torch, no gguf): the app finds an existing demo file
before its window shows without importing the writer (engine/io/synth.py writes it)."""
from __future__ import annotations

from pathlib import Path

DEMO_VERSION = 2  # 2: q8_0 is llama.cpp's Q8_0 mix (the embedding quantized too)


def demo_file(cache_dir: Path | None = None) -> Path:
    """The demo model's path in `cache_dir` (default: the user's cache directory), written or not."""
    if cache_dir is None:
        import platformdirs

        cache_dir = Path(platformdirs.user_cache_dir("strata-gui", appauthor=False))
    return Path(cache_dir) / f"demo-qwen3moe-v{DEMO_VERSION}.gguf"
