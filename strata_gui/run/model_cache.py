"""GGUF files parsed once (no Qt): the form's facts and the run's Session share one parse.

The settings panel needs a model's layer count, description and quant mix as soon as a file is
picked; a run needs the parsed file to build its Session.  `ModelCache.read` parses a file (the
window calls it from a background job, never on the GUI thread) and keeps the `LoadedModel`
(memory-mapped, read-only: safe to share between threads) under the file's identity (path,
size, modification time).  `facts` answers from the cache without reading the file, and
`SessionCache.acquire` takes the same parse through `get`.  The most recent few files are kept.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .messages import model_error_text

if TYPE_CHECKING:
    from engine.io.gguf_model import LoadedModel

log = logging.getLogger(__name__)

KEEP = 4  # parsed files kept (each is a memory map and its tensor table, not the weights)


def _load(path: Path) -> LoadedModel:
    from engine.io.gguf_model import load  # torch and gguf: off the window's start (a background job)

    return load(path)


def file_key(path: Path | str) -> str:
    """A file's identity: path, size and modification time (the path alone when it cannot be read)."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        return str(path)
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


@dataclass(frozen=True)
class ModelFacts:
    """What the form shows about a model file: its layers and description, or why it cannot be used."""

    n_layers: int | None
    info: str
    error: str
    model: LoadedModel | None = None


class ModelCache:
    def __init__(self, keep: int = KEEP, loader: Callable[[Path], LoadedModel] | None = None) -> None:
        """`loader`: engine.io.gguf_model.load by default (imported with the first parse: torch)."""
        self.keep = keep
        self.loader = loader or _load
        self.parses = 0  # how many times a file was parsed (tests)
        self._facts: OrderedDict[str, ModelFacts] = OrderedDict()
        self._lock = threading.Lock()

    def facts(self, path: Path | str) -> ModelFacts | None:
        """The facts of this file as last read, or None when it has not been read (or changed since)."""
        key = file_key(path)
        with self._lock:
            found = self._facts.get(key)
            if found is not None:
                self._facts.move_to_end(key)
            return found

    def read(self, path: Path | str) -> ModelFacts:
        """Parse the file unless it is cached; a problem becomes the facts' error, never an exception."""
        path = Path(path)
        found = self.facts(path)
        if found is not None:
            return found
        key = file_key(path)
        from engine.io.gguf_model import GGUFError

        try:
            model = self._parse(path)
            facts = ModelFacts(model.spec.n_layers, model.describe(), "", model)
        except GGUFError as exc:
            facts = ModelFacts(None, "", model_error_text(exc))
        except Exception as exc:  # a reader bug on a strange file must not take the app down
            log.exception("reading %s failed", path)
            facts = ModelFacts(None, "", f"{path}: cannot read the model ({type(exc).__name__}: {exc})")
        self._store(key, facts)
        return facts

    def get(self, path: Path | str) -> LoadedModel:
        """The parsed file for a Session: the cached parse, else a fresh one.  Raises GGUFError."""
        path = Path(path)
        found = self.facts(path)
        if found is not None and found.model is not None:
            return found.model
        key = file_key(path)
        model = self._parse(path)
        self._store(key, ModelFacts(model.spec.n_layers, model.describe(), "", model))
        return model

    def _parse(self, path: Path) -> LoadedModel:
        model = self.loader(path)
        with self._lock:
            self.parses += 1
        log.info("parsed %s: %s", path, model.describe())
        return model

    def _store(self, key: str, facts: ModelFacts) -> None:
        with self._lock:
            self._facts[key] = facts
            self._facts.move_to_end(key)
            while len(self._facts) > self.keep:
                self._facts.popitem(last=False)
