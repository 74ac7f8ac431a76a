"""One engine Session kept between runs while nothing that shaped it changed (no Qt).

Loading a real model onto its devices takes long; a second run with the same file (path, size,
modification time) and the same EngineConfig reuses the Session.  Anything else closes the old
one (freeing its device memory) before the new one is built.  Used from one run worker at a
time; `close()` from the GUI thread once no run is in flight.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.plan import split_choice

from .model_cache import ModelCache

if TYPE_CHECKING:
    from engine.io.gguf_model import LoadedModel
    from engine.pipeline.session import Session

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionKey:
    path: str
    size: int
    mtime_ns: int
    config: tuple

    @classmethod
    def of(cls, path: Path, config: EngineConfig) -> SessionKey:
        st = path.stat()
        items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.as_dict().items()))
        return cls(str(path.resolve()), st.st_size, st.st_mtime_ns, items)


class SessionCache:
    def __init__(self, models: ModelCache | None = None) -> None:
        # where parsed files come from: the window shares its own, so the form's parse is the run's
        self.models = models or ModelCache()
        self._key: SessionKey | None = None
        self._session: Session | None = None
        self.builds = 0  # how many Sessions were built (tests, status)
        # shapes (prompt tokens, decode or not) the cached Session has run: warm, no warm-up needed
        self.warm_shapes: set[tuple[int, bool]] = set()
        # layer_split auto over several devices: the split the last run of these settings ran with
        self._splits: dict[SessionKey, EngineConfig] = {}

    @property
    def session(self) -> Session | None:
        return self._session

    def acquire(self, path: Path, config: EngineConfig,
                progress: Callable[[str, float], None] | None = None) -> tuple[Session, bool]:
        """The Session for (file, config), and whether it was reused.  Raises GGUFError for a
        bad file and ConfigError/StageError-free engine errors as the engine raises them."""
        path = Path(path)
        key = SessionKey.of(path, config)
        if self._session is not None and key == self._key:
            return self._session, True
        self.close()
        from engine.pipeline.session import Session  # torch: with the first run, not the window

        model: LoadedModel = self.models.get(path)
        session = Session(model, config, progress=progress)
        self._session, self._key = session, key
        self.warm_shapes = set()
        self.builds += 1
        log.info("built a session: %s on %s", model.describe(), ", ".join(session.device_order))
        return session, False

    def acquire_for_run(self, path: Path, config: EngineConfig,
                        progress: Callable[[str, float], None] | None = None) -> tuple[Session, bool]:
        """`acquire` for the user's settings: with layer_split auto, the split the last run of the
        same settings ran with (so a repeat Run reuses its Session instead of rebuilding)."""
        path = Path(path)
        return self.acquire(path, self._splits.get(SessionKey.of(path, config), config), progress)

    def fit_split(self, path: Path, config: EngineConfig, n_tokens: int,
                  progress: Callable[[str, float], None] | None = None) -> tuple[Session, bool]:
        """The Session for a prompt of n_tokens under the user's settings: with layer_split auto
        over several devices, rebuilt with the split (contiguous or interleave:V) the model rates
        fastest for it (engine/plan/split_choice.py), which every report's notes then say."""
        path = Path(path)
        session = self._session
        if session is None or not split_choice.applies(config):
            return self.acquire(path, config, progress)
        builds = self.builds
        session = split_choice.fit(session, config, n_tokens, lambda split: self.acquire(path, split, progress)[0])
        self._splits[SessionKey.of(path, config)] = session.config  # the split these settings ran with
        return session, self.builds == builds

    def discard(self) -> None:
        """Drop the Session after an error: the next run starts from a fresh one."""
        self.close()

    def close(self) -> None:
        session, self._session, self._key = self._session, None, None
        self.warm_shapes = set()
        if session is not None:
            try:
                session.close()
            except Exception:
                log.exception("closing the session failed")
