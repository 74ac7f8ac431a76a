"""What the settings form holds, and its validation with the engine's own rules (no Qt).

`RunSettings` keeps each field as the user typed it.  `validate` runs every value through
`engine.config.parse_setting`, then `EngineConfig.from_sources` (cross-field rules, environment)
and `check_layers` (rules that need the model), so every message is the engine's: it names the
setting, the value and what is allowed.  The GUI only decides which field shows it.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from engine.config import ConfigError, EngineConfig, env_var, migrate_keys, parse_setting
from engine.settings_table import Setting, form_rows

from .messages import config_error_text

log = logging.getLogger(__name__)

# the engine settings the form shows (engine/settings_table.py rows with a form label)
SETTING_FIELDS: tuple[Setting, ...] = form_rows()
# field names of the form (one error slot each); "general" takes what no field owns
FIELDS = ("model", *(s.name for s in SETTING_FIELDS), "prompt", "decode_tokens", "repeats", "general")
_ROW = {s.name: s for s in SETTING_FIELDS}

MAX_PROMPT_TOKENS = 1 << 20
MAX_DECODE_TOKENS = 4096
MAX_REPEATS = 20
# The demo's first-start chunk: auto (the engine's default, right for real models) picks ONE
# 2048-token chunk for the demo on a CPU, which shows no pipeline; 256 makes C0..C7 on two stages
# with the overlap visible (73% of the prefill with both stages computing, 2 CPU cores).
DEMO_CHUNK = 256
# the form's field names before issue 16 (saved settings) -> now
FORM_ALIASES = {"chunk_size": "chunk_tokens", "pf_depth": "pipeline_depth"}
# a text prompt is refused above this many characters: engine/io/prompt.py MAX_TEXT_CHARS, the
# engine's bound (not imported: that module imports torch, the form must not)
MAX_PROMPT_TEXT_CHARS = 4 << 20
MAX_FIELD_CHARS = 4096  # any other text field (paths, device lists, numbers as typed)
# what each field's widget can show: a value outside would raise in the widget or be lost there
INT_RANGES = {"prompt_tokens": (1, MAX_PROMPT_TOKENS), "decode_tokens": (0, MAX_DECODE_TOKENS),
              "repeats": (1, MAX_REPEATS), "pipeline_depth": (0, 1)}
CHOICES = {"split_mode": ("auto", "manual", "interleave"), "chunk_mode": ("auto", "fixed"),
           "prompt_mode": ("tokens", "text")} | {s.name: s.choices for s in SETTING_FIELDS if s.kind == "choice"}
# a record's settings the form does not take back (it never did): where a past run's stages ran
NOT_RESTORED = ("executor", "rendezvous")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Accepted:
    value: Any


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


def field_problem(name: str, value: Any, default: Any, max_text: int | None = None) -> Accepted | str:
    """The field's value in its type and range (`Accepted`), or why it cannot be used."""
    if isinstance(default, bool):
        if isinstance(value, bool):
            return Accepted(value)
        word = str(value).strip().lower() if isinstance(value, (str, int)) else None
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return Accepted(word in TRUE_WORDS)
        return "not true or false"
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            return "not an integer"
        try:
            number = int(str(value).strip()) if isinstance(value, str) else value
        except ValueError:
            return "not an integer"
        lo, hi = INT_RANGES.get(name, (0, 1 << 31))
        if not lo <= number <= hi:
            return f"outside {lo}..{hi}"
        return Accepted(number)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return f"not text but {type(value).__name__}"
    text = str(value)
    if name in CHOICES and text not in CHOICES[name]:
        return "not one of " + ", ".join(CHOICES[name])
    limit = (max_text if max_text is not None else None) if name == "prompt_text" else MAX_FIELD_CHARS
    if limit is not None and len(text) > limit:
        return f"{len(text):,} characters, more than {limit:,}"
    return Accepted(text)



@dataclass
class RunSettings:
    """The form's fields as typed; an engine setting's field is named as its row and starts at the
    row's default (the devices at two CPU stages, so the first Run shows a pipeline)."""

    model_path: str = ""  # "" : the built-in demo model
    devices: str = "cpu,cpu"
    gpu_order: str = _ROW["gpu_order"].default
    split_mode: str = "auto"  # auto | manual | interleave (split_counts then holds V)
    split_counts: str = ""
    chunk_mode: str = "auto"  # auto | fixed
    chunk_tokens: str = "256"
    chunk_schedule: str = _ROW["chunk_schedule"].default
    pipeline_depth: int = _ROW["pipeline_depth"].default
    prefill_main: bool = _ROW["prefill_main"].default
    pin_limit_gib: str = _ROW["pin_limit_gib"].default
    expert_cache: str = _ROW["expert_cache"].default
    prompt_mode: str = "tokens"  # tokens | text
    prompt_tokens: int = 2048
    prompt_text: str = ""
    decode_tokens: int = 16
    cuda_graphs: bool = _ROW["cuda_graphs"].default
    warmup: bool = True  # an unmeasured pass before the first measured run of each new shape
    repeats: int = 1  # measured runs per press of Run; the summary shows their median and spread
    executor: str = _ROW["executor"].default  # threads | processes
    rendezvous: str = _ROW["rendezvous"].default  # processes: "" spawns here; HOST:PORT waits for stages

    def overrides(self) -> dict[str, Any]:
        """The engine settings as raw values for `EngineConfig.from_sources` (GUI > env > default):
        each form field as typed, the split and chunk from their mode, an empty rendezvous left out
        (STRATA_RENDEZVOUS then stands)."""
        out = {s.name: getattr(self, s.name, None) for s in SETTING_FIELDS}  # layer_split: below
        out["layer_split"] = (self.split_counts if self.split_mode == "manual"
                              else f"interleave:{self.split_counts.strip()}" if self.split_mode == "interleave"
                              else "auto")
        out["chunk_tokens"] = self.chunk_tokens if self.chunk_mode == "fixed" else "auto"
        if self.rendezvous.strip():
            out["rendezvous"] = self.rendezvous.strip()
        else:
            del out["rendezvous"]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSettings:
        """Known keys with a value of the right type and inside the form's range; anything else
        keeps its default (logged).  Settings saved before issue 16 name two fields `chunk_size`
        and `pf_depth`: read as the new names."""
        settings, rejected = cls.from_dict_checked(data)
        for note in rejected:
            log.warning("stored setting ignored: %s", note)
        return settings

    @classmethod
    def from_dict_checked(cls, data: Mapping[str, Any], max_text: int | None = None,
                          base: RunSettings | None = None) -> tuple[RunSettings, list[str]]:
        """`from_dict` that also says which values it replaced by their default: one note per
        field, naming it, the value (shortened) and what the form allows.

        max_text: a longer prompt text is replaced too (saved settings: a 50 MB text would make
        every start slow; what a user types is refused by `validate` instead, with its size).
        base: the defaults a missing or rejected value takes (the class's own when None)."""
        data = {FORM_ALIASES.get(k, k): v for k, v in data.items() if k in FORM_ALIASES} | \
            {k: v for k, v in data.items() if k not in FORM_ALIASES}
        base = base if base is not None else cls()
        kw: dict[str, Any] = base.to_dict()
        rejected: list[str] = []
        for f in fields(cls):
            if f.name not in data:
                continue
            default = getattr(base, f.name)
            why = field_problem(f.name, data[f.name], default, max_text)
            if isinstance(why, str):
                rejected.append(f"{f.name}={_short(data[f.name])} ({why}; using {_short(default)})")
                continue
            kw[f.name] = why.value
        return cls(**kw), rejected

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, devices: str = "cpu,cpu",
                 demo: bool = False) -> RunSettings:
        """Defaults for a first start: the environment's valid values (the README's settings table).

        demo: the first start opens the built-in demo model; its chunk is fixed at DEMO_CHUNK
        (unless STRATA_CHUNK_TOKENS or STRATA_PREFILL says otherwise) so the first Run shows the pipeline."""
        env = os.environ if env is None else env
        s = cls(devices=devices)
        if demo:
            s.chunk_mode, s.chunk_tokens = "fixed", str(DEMO_CHUNK)
        for row in SETTING_FIELDS:
            if not row.env:
                continue
            var = env_var(row.name, env)
            raw = env.get(var, "")
            if raw == "":
                continue
            try:
                value = parse_setting(row.name, raw, source=var)
            except ConfigError as exc:
                log.warning("ignoring %s for the form's defaults: %s", var, exc)
                continue
            if row.kind == "chunk":
                s.chunk_mode = "auto" if value == "auto" else "fixed"
                s.chunk_tokens = s.chunk_tokens if value == "auto" else str(value)
            else:  # a text field keeps the text as set (20, not 20.0), other fields the typed value
                text_field = isinstance(getattr(s, row.name), str) and not isinstance(value, str)
                setattr(s, row.name, raw.strip() if text_field else value)
        return s


def settings_from_config(config: Mapping[str, Any], current: RunSettings) -> tuple[RunSettings, list[str]]:
    """The form's values that reproduce a recorded run (`record_config`'s flat dict), and what
    could not be restored (kept at `current`): a model file that is gone, a text prompt (the
    history keeps only its head)."""
    s = RunSettings.from_dict(current.to_dict())
    config = migrate_keys(config)
    kept: list[str] = []
    model = str(config.get("model", ""))
    if model.startswith("built-in demo"):
        s.model_path = ""
    elif model and os.path.isfile(model):
        s.model_path = model
    elif model:
        kept.append(f"model ({model} is not a file here)")
    for row in SETTING_FIELDS:
        if config.get(row.name) is not None and row.name not in NOT_RESTORED:
            _restore(s, row, config[row.name])
    for key in ("decode_tokens", "repeats"):
        if isinstance(config.get(key), int) and not isinstance(config.get(key), bool):
            setattr(s, key, config[key])
    if isinstance(config.get("warmup"), bool):
        s.warmup = config["warmup"]
    prompt = str(config.get("prompt", ""))
    if prompt.startswith("synthetic") and isinstance(config.get("prompt_tokens"), int):
        s.prompt_mode, s.prompt_tokens = "tokens", config["prompt_tokens"]
    elif prompt:
        kept.append("prompt text (the history keeps only its first characters)")
    return s, kept


def _restore(s: RunSettings, row: Setting, value: Any) -> None:
    """One recorded engine setting into its form field: a split or chunk sets its mode too, a
    check box or combo of numbers takes only its own type, a text field the value as text."""
    current = getattr(s, row.name, None)  # None: layer_split (its form fields are the mode and counts)
    if row.kind in ("layer_split", "chunk"):
        text = str(value)
        mode, counts = ("split_mode", "split_counts") if row.kind == "layer_split" else ("chunk_mode", "chunk_tokens")
        on = "manual" if row.kind == "layer_split" else "fixed"
        setattr(s, mode, "auto" if text == "auto" else on)
        if text != "auto":
            setattr(s, counts, text)
    elif isinstance(current, bool):
        if isinstance(value, bool):
            setattr(s, row.name, value)
    elif isinstance(current, int):
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(s, row.name, value)
    else:
        setattr(s, row.name, f"{value:g}" if isinstance(value, float) else str(value))


@dataclass
class Validation:
    errors: dict[str, str] = field(default_factory=dict)
    config: EngineConfig | None = None

    @property
    def ok(self) -> bool:
        return not self.errors and self.config is not None


def _field_for(setting: str) -> str:
    """Which form field shows a ConfigError about `setting` (a name or an env variable)."""
    if setting in FIELDS:
        return setting
    if setting in ("prompt_tokens", "prompt_ids"):
        return "prompt"
    return "general"  # e.g. an invalid STRATA_* variable the form does not show


def check_machine(cfg: EngineConfig, cuda_count: int) -> None:
    """The machine check `Session` makes when it starts (`EngineConfig.check_machine`: devices
    that exist, a pin limit within RAM), made before Run so the form flags it under its field."""
    from engine.hw.machine import physical_ram  # the same figure, without torch

    cfg.check_machine(cuda_count, physical_ram())


def validate(settings: RunSettings, n_layers: int | None, model_error: str = "",
             env: Mapping[str, str] | None = None, cuda_count: int | None = None) -> Validation:
    """Every problem, one message per field; `config` is set only when all is valid.

    n_layers None: the model is unknown (not loaded), model-dependent checks are skipped.
    cuda_count: how many CUDA devices torch sees (None: not checked here)."""
    v = Validation()
    if model_error:
        v.errors["model"] = model_error
    raw = settings.overrides()
    for name, value in raw.items():
        try:
            parse_setting(name, value)
        except ConfigError as exc:
            v.errors.setdefault(_field_for(name), config_error_text(exc))
    if settings.prompt_mode == "text":
        if len(settings.prompt_text) > MAX_PROMPT_TEXT_CHARS:
            v.errors["prompt"] = config_error_text(ConfigError(
                "prompt", f"text of {len(settings.prompt_text):,} characters",
                f"a text of at most {MAX_PROMPT_TEXT_CHARS:,} characters"))
        elif not settings.prompt_text.strip():
            v.errors["prompt"] = config_error_text(ConfigError("prompt", settings.prompt_text,
                                                                "text that yields at least one token"))
    elif not 1 <= settings.prompt_tokens <= MAX_PROMPT_TOKENS:
        v.errors["prompt"] = config_error_text(ConfigError("prompt_tokens", settings.prompt_tokens,
                                             f"a token count from 1 to {MAX_PROMPT_TOKENS}"))
    if not 1 <= settings.repeats <= MAX_REPEATS:
        v.errors["repeats"] = config_error_text(ConfigError("repeats", settings.repeats,
                                                            f"an integer from 1 to {MAX_REPEATS}"))
    if not 0 <= settings.decode_tokens <= MAX_DECODE_TOKENS:
        v.errors["decode_tokens"] = config_error_text(ConfigError("decode_tokens", settings.decode_tokens,
                                                    f"an integer from 0 to {MAX_DECODE_TOKENS}"))
    # the checks across settings, every one of them (issue 37: one error at a time hid the rest):
    # a setting that fails is set aside (its default or environment value stands in) and the
    # config is built again, so each later check still runs and reports under its own field
    pending = {k: val for k, val in raw.items() if _field_for(k) not in v.errors}
    env = dict(os.environ if env is None else env)
    cfg = None
    for _ in range(len(raw) + len(env) + 1):
        try:
            cfg = EngineConfig.from_sources(pending, env)
            break
        except ConfigError as exc:
            v.errors.setdefault(_field_for(exc.setting), config_error_text(exc))
            if exc.setting in pending:
                pending.pop(exc.setting)
            elif exc.setting in env:
                env.pop(exc.setting)
            else:
                return v
    if cfg is None:
        return v
    checks = []
    if cuda_count is not None:
        checks.append(lambda: check_machine(cfg, cuda_count))
        # a bad device stops check_machine before the pin limit: check that on its own too
        checks.append(lambda: check_machine(replace(cfg, devices=["cpu"]), cuda_count))
    if n_layers is not None:
        checks.append(lambda: cfg.check_layers(n_layers))
    for check in checks:
        try:
            check()
        except ConfigError as exc:
            v.errors.setdefault(_field_for(exc.setting), config_error_text(exc))
    if not v.errors:
        v.config = cfg
    return v
