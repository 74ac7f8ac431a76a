"""Prompts as token ids: synthetic (deterministic, nonce first), from a file, or from text."""
from __future__ import annotations

import logging
import re
import zlib
from pathlib import Path

import numpy as np

from engine.config import ConfigError
from engine.io.gguf_model import GGUFError, LoadedModel
from engine.sweep import sweep_nonce  # noqa: F401  (the sweep's nonce; prompts are made here)

log = logging.getLogger(__name__)

NONCE_TOKENS = 8


def synthetic(n_tokens: int, vocab: int, nonce: int = 0) -> list[int]:
    """Deterministic ids; the first NONCE_TOKENS come from `nonce`, so prompts that share a
    nonce are identical (arms of a sweep) and prompts with different nonces differ from the
    start (repeats), defeating any prefix cache."""
    if n_tokens <= 0:
        raise ConfigError("prompt_tokens", n_tokens, "a positive token count")
    body = (np.arange(n_tokens, dtype=np.int64) * 7919 + 13) % max(vocab - 1, 1)
    k = min(NONCE_TOKENS, n_tokens)
    rng = np.random.default_rng(zlib.crc32(f"nonce:{nonce}".encode()))
    body[:k] = rng.integers(0, vocab, size=k)
    return body.tolist()


WARMUP_NONCE = -1  # the warm-up prompt of a sweep (never one of the measured prompts)


def warmup_ids(prompt_tokens: int, vocab: int) -> list[int]:
    """A sweep's unmeasured warm-up prompt for one size (strata-bench and the app's Sweep)."""
    return synthetic(prompt_tokens, vocab, nonce=WARMUP_NONCE)


def count_ids(path: Path | str, block: int = 1 << 20) -> int:
    """How many whitespace/comma separated items the file holds, read a block at a time (memory
    stays one block, whatever the file's size); `read_ids` checks them."""
    p = Path(path)
    n = 0
    tail = b""
    try:
        with p.open("rb") as fh:
            while chunk := fh.read(block):
                chunk = tail + chunk
                items = re.split(rb"[\s,]+", chunk)
                tail = items.pop()  # may continue in the next block
                n += sum(1 for t in items if t)
    except OSError as exc:
        raise ConfigError("prompt_ids", str(p), "a readable file of token ids", str(exc)) from None
    return n + (1 if tail else 0)


def bos_ids(model) -> list[int]:
    """The one-token prompt of a decode-only run (llama-bench's `-p 0`): the file's BOS token
    (`tokenizer.ggml.bos_token_id`), else token 0 (a source without a vocabulary)."""
    meta = getattr(model, "metadata", None) or {}
    bos = meta.get("tokenizer.ggml.bos_token_id")
    try:
        bos = int(bos)
    except (TypeError, ValueError):
        return [0]
    return [bos] if 0 <= bos < model.spec.vocab else [0]


def read_ids(path: Path | str) -> list[int]:
    """Integers separated by whitespace and/or commas."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError("prompt_ids", str(p), "a readable file of token ids", str(exc)) from None
    parts = [t for t in re.split(r"[\s,]+", text.strip()) if t]
    try:
        ids = [int(t) for t in parts]
    except ValueError as exc:
        raise ConfigError("prompt_ids", str(p), "integers separated by whitespace or commas", str(exc)) from None
    if not ids:
        raise ConfigError("prompt_ids", str(p), "at least one token id")
    return ids


MAX_TEXT_CHARS = 4 << 20  # a text prompt above this is refused: 1M tokens are about 4M characters of prose


def tokenize(model: LoadedModel, text: str) -> list[int]:
    """Tokenise with the file's own vocabulary through transformers' GGUF tokenizer support.

    A text longer than MAX_TEXT_CHARS is refused with its size before the tokenizer sees it
    (a 50 MB text made the tokenizer take 7.5 GiB and abort without a word)."""
    if len(text) > MAX_TEXT_CHARS:
        raise ConfigError("prompt", f"a text of {len(text):,} characters",
                          f"a text of at most {MAX_TEXT_CHARS:,} characters (tokenising takes about 150 bytes of "
                          f"memory a character)")
    if not model.has_vocab():
        raise GGUFError(model.path, "the file has no vocabulary (tokenizer.ggml.tokens): pass token ids instead")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is a dependency
        raise GGUFError(model.path, f"text prompts need transformers ({exc})") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(model.path.parent), gguf_file=model.path.name)
    except Exception as exc:
        raise GGUFError(model.path, f"cannot build a tokenizer from the file's vocabulary: {exc}") from None
    ids = tok.encode(text, add_special_tokens=False)
    if not ids:
        raise ConfigError("prompt", text, "text that yields at least one token")
    return ids
