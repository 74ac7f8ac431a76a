"""What the Run tab's form needs to know of its settings (no Qt, no widgets): the model file
they name and its facts (parsed once, in a background job: the GUI thread never parses), the
engine's verdict on them, and the texts the form shows beside them (memory plan, the attach
command, the Sweep tab's base)."""
from __future__ import annotations

import html
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from engine.config import ConfigError, rendezvous_address
from engine.pipeline.rendezvous_key import attach_commands, controller_key, exposure_warning

from .model_cache import ModelCache, file_key
from .settings_model import RunSettings, Validation, validate

log = logging.getLogger(__name__)


class FormCheck:
    def __init__(self, models: ModelCache, jobs, env: Mapping[str, str], cuda_count: int, demo_model: Path,
                 on_read: Callable[[], None]) -> None:
        """`jobs`: a background_jobs.BackgroundJobs (files are parsed there); `on_read()`: a file's
        facts arrived, the form should be checked again."""
        self.models = models
        self.jobs = jobs
        self.env = env
        self.cuda_count = cuda_count
        self.demo_model = demo_model
        self.on_read = on_read
        self.reading: set[str] = set()  # file keys a background job is parsing now

    def model_path(self, s: RunSettings) -> Path:
        return Path(s.model_path) if s.model_path else self.demo_model

    def model_label(self, s: RunSettings) -> str:
        return s.model_path if s.model_path else f"built-in demo ({self.demo_model.name})"

    @property
    def pending(self) -> bool:
        """A model file is being parsed: Run waits for its facts."""
        return bool(self.reading)

    def facts(self, path: Path) -> tuple[int | None, str, str]:
        """(n_layers, description, error) of a model file as parsed; a file not parsed yet is
        handed to a background job and reads (None, "", "") until its answer calls `on_read`."""
        facts = self.models.facts(path)
        if facts is not None:
            return facts.n_layers, facts.info, facts.error
        key = file_key(path)
        if key not in self.reading:
            self.reading.add(key)
            self.jobs.submit("model", lambda: self.models.read(path), lambda _f, _e: self._read(key))
        return None, "", ""

    def _read(self, key: str) -> None:
        self.reading.discard(key)
        self.on_read()

    def validate(self, s: RunSettings) -> tuple[Validation, str]:
        """The engine's verdict on the settings, and the model line the form shows."""
        n_layers, info, error = self.facts(self.model_path(s))
        label = "built-in demo model: " if not s.model_path else ""
        line = f"{label}{info}" if info else "reading the model file …" if self.pending else ""
        return validate(s, n_layers, error, self.env, self.cuda_count), line

    def memory_plan_text(self, s: RunSettings, v: Validation) -> str:
        """The next run's memory plan ("" while the settings or the model are not valid)."""
        if not v.ok:
            return ""
        path = self.model_path(s)
        facts = self.models.facts(path)
        model = facts.model if facts is not None else None
        if model is None:
            return ""
        tokens = (s.prompt_tokens if s.prompt_mode == "tokens" else len(s.prompt_text.encode())) + s.decode_tokens
        from engine.plan.memory_plan import plan_memory  # torch: only once a model's facts are in

        try:
            return "Memory plan\n" + plan_memory(model, v.config, tokens).render()
        except Exception:  # the plan is advice: a failure must not block Run
            log.exception("memory plan of %s failed", path)
            return ""

    def attach_text(self, v: Validation) -> tuple[str, str | None]:
        """The command that attaches a stage to this app (rank 0 of N), and the warning for a
        rendezvous beyond loopback; ("", None) without a valid rendezvous."""
        cfg = v.config if v.ok else None
        if cfg is None or cfg.executor != "processes" or not cfg.rendezvous:
            return "", None
        host, _port = rendezvous_address(cfg.rendezvous)
        try:
            key = controller_key(self.env).decode()
        except ConfigError as exc:
            return str(exc), None
        world = len(cfg.devices) * max(cfg.interleave, 1)
        return attach_commands(cfg.rendezvous, world, key)[0], exposure_warning(host)

    def model_spec(self, s: RunSettings):
        """The parsed model's spec (None until parsed)."""
        facts = self.models.facts(self.model_path(s))
        return facts.model.spec if facts is not None and facts.model is not None else None

    @staticmethod
    def sweep_base_text(s: RunSettings) -> str:
        o = s.overrides()
        model = Path(s.model_path).name if s.model_path else "built-in demo model"
        parts = [f"model {model}", f"devices {o['devices']}", f"chunk_tokens {o['chunk_tokens']}",
                 f"pipeline_depth {o['pipeline_depth']}", f"layer_split {o['layer_split']}"]
        if s.prefill_main:
            parts.append("prefill_main on")
        return ("<b>Base settings</b> (the Run tab's; each arm's settings override them): "
                + html.escape(" · ".join(parts)))
