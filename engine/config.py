"""Engine settings: one dataclass, parsed from environment and CLI with one set of rules.

Precedence: explicit (GUI/CLI) > environment > default.  Every invalid value raises
`ConfigError` naming the setting, the value and what is allowed.  The settings themselves (names,
environment variables, aliases, choices, allowed texts, defaults) are the rows of
engine/settings_table.py; this module parses and checks a value by its row's kind.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.settings_table import BOOL_ALLOWED, ENGINE_ROWS, MAX_PREFILL, SETTINGS, Setting, rows_of_kind

MAX_SHOWN_VALUE = 80  # characters of a value's repr quoted in a message


def _show(value: Any) -> str:
    """repr() of a value for a message, cut so that a pasted megabyte stays a one-line error."""
    r = repr(value)
    return r if len(r) <= MAX_SHOWN_VALUE else r[: MAX_SHOWN_VALUE - 1] + "…"


class ConfigError(ValueError):
    """An invalid setting: names the setting, the offending value and what is allowed."""

    def __init__(self, setting: str, value: Any, allowed: str, why: str = "") -> None:
        self.setting = setting
        self.value = value
        self.allowed = allowed
        msg = f"invalid {setting}={_show(value)}: allowed {allowed}"
        if why:
            msg += f" ({why})"
        super().__init__(msg)


# the tables below are views of engine/settings_table.py (one row per setting): every name here
# stays importable for the code and tests written against them
ENV_NAMES: dict[str, str] = {s.name: s.env for s in SETTINGS if s.env}  # setting -> environment variable
# the seeds' names, still accepted: environment variables (read when the new one is unset), and
# setting names (CLI/arm/record keys; `canonical` maps them) written before issue 16
ENV_ALIASES: dict[str, tuple[str, ...]] = {s.name: s.env_aliases for s in SETTINGS if s.env_aliases}
NAME_ALIASES: dict[str, str] = {a: s.name for s in SETTINGS for a in s.name_aliases}


def canonical(name: str) -> str:
    """A setting's name now (`pf_depth` -> `pipeline_depth`, `prefill` -> `chunk_tokens`)."""
    return NAME_ALIASES.get(name, name)


def env_var(name: str, env: Mapping[str, str]) -> str:
    """The environment variable that sets `name` in `env`: the new one unless only a seed's alias is set."""
    var = ENV_NAMES[name]
    return next((v for v in (var, *ENV_ALIASES.get(name, ())) if env.get(v, "") != ""), var)


def migrate_keys(values: Mapping[str, Any]) -> dict[str, Any]:
    """A settings dict written with the old names (a record, a trace, a saved arm), renamed.  Of
    an old and a new name given together the later wins, as in `{**base, **arm}`."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        out.pop(canonical(k), None)
        out[canonical(k)] = v
    return out


def old_names_accepted(cls: type) -> type:
    """Let a dataclass's constructor take the seeds' names too (`EngineConfig(pf_depth=0)`), so
    code written before issue 16 keeps working; the fields carry the new names only.  An old name
    wins over its new one (`dataclasses.replace(cfg, pf_depth=0)` passes both)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        merged = {k: v for k, v in kwargs.items() if k not in NAME_ALIASES}
        merged.update({canonical(k): v for k, v in kwargs.items() if k in NAME_ALIASES})
        init(self, *args, **merged)

    cls.__init__ = __init__
    return cls


# every setting `parse_setting` knows, in the order of the README's settings table
SETTING_NAMES: tuple[str, ...] = tuple(s.name for s in SETTINGS)
BOOL_SETTINGS: tuple[str, ...] = tuple(s.name for s in rows_of_kind("bool"))
CHOICES: dict[str, tuple[str, ...]] = {s.name: s.choices for s in rows_of_kind("choice")}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_INT_RE = re.compile(r"[+-]?0*[0-9]{1,19}")  # ASCII digits only (int() also takes "١٦", "1_6")
_DEVICE_RE = re.compile(r"cpu|cuda(:[0-9]{1,4})?")
_RENDEZVOUS_RE = re.compile(r"([A-Za-z0-9]([A-Za-z0-9.-]{0,252}))?:([0-9]{1,5})")

ALLOWED: dict[str, str] = {s.name: s.allowed for s in SETTINGS if s.kind not in ("bool", "choice")} | {
    "device_list": "a comma-separated device list such as cpu,cpu or cuda:0,cuda:1",
    "bool": BOOL_ALLOWED,
}
_DEPTH_WHY = "a stage owns ONE set of chunk buffers, so two of its chunks may never be in flight"


@old_names_accepted
@dataclass
class EngineConfig:
    """Everything that shapes one run. Strings like "auto" are kept as given; see `validate`."""

    devices: list[str] = field(default_factory=lambda: ["cpu"])
    layer_split: str | list[int] = "auto"
    chunk_tokens: str | int = "auto"  # chunk size in tokens (the seeds' "prefill")
    pipeline_depth: int = 1  # 1 overlap, 0 join (the seeds' "pf_depth")
    prefill_main: bool = False
    pin_limit_gib: str | float = "auto"
    gpu_order: str = "pcie"
    expert_cache: str | float = "auto"
    handoff: str = "auto"
    dtype: str = "auto"
    timing: bool = False
    check_nan: bool = False
    cuda_graphs: bool = True  # replay each layer's position-independent kernels as CUDA graphs
    # fixed: every chunk `chunk_tokens` tokens; balanced: as many chunks, each of equal modelled cost
    # (bigger early, smaller late).  Balanced was slower on H200 (docs/benchmarks.md): opt-in.
    chunk_schedule: str = "fixed"
    # threads: every stage a thread of this process; processes: every stage a process of its
    # own on torch.distributed (engine/pipeline/executor.py), past the GIL and across hosts
    executor: str = "threads"
    # processes only: "" spawns the stage processes here; HOST:PORT waits for stages started
    # elsewhere (torchrun ... strata-bench stage --rendezvous HOST:PORT) to attach
    rendezvous: str = ""

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_sources(
        cls, overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> EngineConfig:
        """Default, then environment, then explicit overrides (None values are ignored)."""
        env = os.environ if env is None else env
        overrides = migrate_keys(overrides or {})
        given = {k for k, v in overrides.items() if v is not None}
        values: dict[str, Any] = {}
        for name, var in ENV_NAMES.items():
            if name in given:  # an explicit value wins; a bad env value it replaces is moot
                continue
            var = env_var(name, env)
            if var in env and env[var] != "":
                values[name] = parse_setting(name, env[var], source=var)
        for name, raw in overrides.items():
            if raw is None:
                continue
            values[name] = parse_setting(name, raw)
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def replace(self, **changes: Any) -> EngineConfig:
        parsed = {k: parse_setting(k, v) for k, v in migrate_keys(changes).items()}
        cfg = dataclasses.replace(self, **parsed)
        cfg.validate()
        return cfg

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Every field checked by its row's kind, then the split's counts against the devices."""
        for kind in _CHECK_ORDER:
            for s in rows_of_kind(kind):
                _CHECKS[kind](s, getattr(self, s.name))
        if isinstance(self.layer_split, list):
            if len(self.layer_split) != len(self.devices):
                raise ConfigError(
                    "layer_split", _fmt_split(self.layer_split),
                    f"auto or {len(self.devices)} counts, one per device",
                )
            if any(n <= 0 for n in self.layer_split):
                raise ConfigError("layer_split", _fmt_split(self.layer_split),
                                  "positive counts (an empty stage has nothing to run)")

    def check_layers(self, n_layers: int) -> None:
        """Checks that depend on the model."""
        if isinstance(self.layer_split, list) and sum(self.layer_split) != n_layers:
            raise ConfigError(
                "layer_split", _fmt_split(self.layer_split),
                f"counts summing to the model's {n_layers} layers",
                f"they sum to {sum(self.layer_split)}",
            )
        if self.layer_split == "auto" and len(self.devices) > n_layers:
            raise ConfigError("devices", ",".join(self.devices),
                              f"at most {n_layers} devices (one layer per stage at least)")
        if self.interleave > 1 and len(self.devices) * self.interleave > n_layers:
            raise ConfigError("layer_split", self.layer_split,
                              f"interleave:V with {len(self.devices)} device(s) x V <= the model's {n_layers} layers",
                              "every group needs a layer at least")

    def check_machine(self, cuda_count: int, ram_bytes: int) -> None:
        """Checks that depend on the machine: each cuda:N exists, and a pin limit fits in RAM.
        The one rule both the engine (at Session start) and the app's form (before Run) apply."""
        for d in self.devices:
            if not d.startswith("cuda"):
                continue
            if cuda_count == 0:
                raise ConfigError("devices", d, "cpu (this torch build or machine has no CUDA)")
            index = int(d[5:]) if d[5:].isdigit() else 0
            if index >= cuda_count:
                raise ConfigError("devices", d, f"cuda:0..cuda:{cuda_count - 1}")
        pin = self.pin_limit_gib
        if isinstance(pin, (int, float)) and not isinstance(pin, bool) and pin * 2**30 > ram_bytes:
            raise ConfigError("pin_limit_gib", pin, f"0 to {ram_bytes / 2**30:.1f} GiB (this machine's RAM)",
                              "more than the machine has cannot be page-locked")

    @property
    def prefill(self) -> str | int:
        """The seeds' name of `chunk_tokens` (read-only; for code written before issue 16)."""
        return self.chunk_tokens

    @property
    def pf_depth(self) -> int:
        """The seeds' name of `pipeline_depth` (read-only; for code written before issue 16)."""
        return self.pipeline_depth

    @property
    def interleave(self) -> int:
        """Layer groups per device: V of `interleave:V`, 1 for a contiguous split."""
        return interleave_groups(self.layer_split) or 1


def _check_devices(s: Setting, value: Any) -> None:
    if not value:
        raise ConfigError(s.name, value, "a non-empty list such as cpu or cuda:0,cuda:1")
    for d in value:
        if not (isinstance(d, str) and _DEVICE_RE.fullmatch(d)):
            raise ConfigError(s.name, d, s.allowed)


def _check_depth(s: Setting, value: Any) -> None:
    if not _is_int(value) or value not in (0, 1):
        raise ConfigError(s.name, value, s.allowed, _DEPTH_WHY)


def _check_bool(s: Setting, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(s.name, value, "True or False")


def _check_layer_split(s: Setting, value: Any) -> None:
    if not (value == "auto" or interleave_groups(value) is not None
            or (isinstance(value, list) and all(_is_int(n) for n in value))):
        raise ConfigError(s.name, value, s.allowed)


def _check_chunk(s: Setting, value: Any) -> None:
    if not (value == "auto" or _is_int(value)):
        raise ConfigError(s.name, value, s.allowed)
    if _is_int(value) and not 1 <= value <= MAX_PREFILL:
        raise ConfigError(s.name, value, f"auto or a chunk size from 1 to {MAX_PREFILL} tokens")


def _check_gib(s: Setting, value: Any) -> None:
    if not (value in s.choices or (_is_real(value) and math.isfinite(value) and value >= 0)):
        raise ConfigError(s.name, value, s.allowed)


def _check_choice(s: Setting, value: Any) -> None:
    if value not in s.choices:
        raise ConfigError(s.name, value, _or(s.choices))


def _check_address(s: Setting, value: Any) -> None:
    if not (isinstance(value, str) and (value == "" or rendezvous_address(value))):
        raise ConfigError(s.name, value, s.allowed)


# a typed value's check, by its row's kind, in the order `validate` runs them
_CHECKS: dict[str, Callable[[Setting, Any], None]] = {
    "devices": _check_devices, "depth": _check_depth, "bool": _check_bool, "layer_split": _check_layer_split,
    "chunk": _check_chunk, "gib": _check_gib, "choice": _check_choice, "address": _check_address,
}
_CHECK_ORDER = tuple(_CHECKS)


def _fmt_split(split: list[int]) -> str:
    return ",".join(str(n) for n in split)


def _or(choices: tuple[str, ...]) -> str:
    return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _parse_int(label: str, raw: Any, allowed: str) -> int:
    """An integer from an int or a string of ASCII digits (no bools, floats, '1_0' or '١')."""
    if _is_int(raw):
        return raw
    if isinstance(raw, str):
        s = raw.strip()
        if _INT_RE.fullmatch(s):
            return int(s)
    raise ConfigError(label, raw, allowed)


def _parse_bool(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if _is_int(raw) and raw in (0, 1):
        return bool(raw)
    if isinstance(raw, str):
        s = raw.strip().lower()
        if s in _TRUE:
            return True
        if s in _FALSE:
            return False
    raise ConfigError(name, raw, ALLOWED["bool"])


def _parse_auto_number(name: str, raw: Any, allowed: str, extra: tuple[str, ...] = ()) -> str | float:
    if _is_real(raw):
        try:
            v = float(raw)
        except OverflowError:  # an int beyond float range
            raise ConfigError(name, raw, allowed, "too large") from None
    elif isinstance(raw, str):
        s = raw.strip().lower()
        if s == "auto" or s in extra:
            return s
        if not s.isascii():
            raise ConfigError(name, raw, allowed)
        try:
            v = float(s)
        except ValueError:
            raise ConfigError(name, raw, allowed) from None
    else:
        raise ConfigError(name, raw, allowed)
    if not math.isfinite(v):
        raise ConfigError(name, raw, allowed, "must be finite")
    if v < 0:
        raise ConfigError(name, raw, allowed, "must not be negative")
    return v + 0.0  # -0.0 -> 0.0


def parse_setting(name: str, raw: Any, source: str | None = None) -> Any:
    """Turns a raw value (string from env/CLI/GUI, or a typed value) into the typed setting."""
    name = canonical(name)
    label = source or name
    try:
        return _parse(name, raw, label)
    except ConfigError:
        raise
    except (TypeError, ValueError, ArithmeticError) as exc:  # defensive: never leak a bare parse error
        raise ConfigError(label, raw, "see the README's settings table", str(exc)) from None


def format_setting(name: str, value: Any) -> str:
    """The string form of a parsed setting, as environment and CLI take it:
    `parse_setting(name, format_setting(name, v)) == v` for every valid v."""
    s = ENGINE_ROWS.get(canonical(name))
    if s is None:
        raise unknown_setting(name)
    if s.kind == "devices":
        return ",".join(value)
    if s.kind == "layer_split":
        return value if value == "auto" else _fmt_split(value)
    if s.kind == "bool":
        return "1" if value else "0"
    if s.kind == "gib":
        return value if isinstance(value, str) else repr(float(value))
    return str(value)  # chunk, depth, choice, address


def _parse(name: str, raw: Any, label: str) -> Any:
    s = ENGINE_ROWS.get(name)
    if s is None:
        raise unknown_setting(name)
    return _PARSERS[s.kind](s, raw, label)


def _parse_devices(s: Setting, raw: Any, label: str) -> list[str]:
    if isinstance(raw, (list, tuple)):
        items = [x.strip() if isinstance(x, str) else x for x in raw]
    elif isinstance(raw, str):
        items = [x.strip() for x in raw.split(",")]
    else:
        raise ConfigError(label, raw, ALLOWED["device_list"])
    if not items or any(not x for x in items):
        raise ConfigError(label, raw, ALLOWED["device_list"])
    for d in items:
        if not (isinstance(d, str) and _DEVICE_RE.fullmatch(d)):
            raise ConfigError(label, raw, ALLOWED["device_list"], f"{_show(d)} is not cpu, cuda or cuda:N")
    return items


def _parse_layer_split(s: Setting, raw: Any, label: str) -> str | list[int]:
    if isinstance(raw, (list, tuple)):
        parts = list(raw)
    elif isinstance(raw, str):
        text = raw.strip().lower()
        if text == "auto":
            return "auto"
        if text.startswith("interleave"):
            v = interleave_groups(text)
            if v is None:
                raise ConfigError(label, raw, "interleave:V with V a whole number from 1 to 64")
            return f"interleave:{v}"
        parts = [p.strip() for p in text.split(",")]
    else:
        raise ConfigError(label, raw, s.allowed)
    counts: list[int] = []
    for p in parts:
        if not (_is_int(p) or isinstance(p, str)):  # 2.5 or True would be silently truncated
            raise ConfigError(label, raw, s.allowed)
        try:
            counts.append(_parse_int(label, p, s.allowed))
        except ConfigError:  # quote the value as given, not the lower-cased piece
            raise ConfigError(label, raw, s.allowed) from None
    if not counts or any(c <= 0 for c in counts):
        raise ConfigError(label, raw, "positive layer counts (an empty stage has nothing to run)")
    return counts


def _parse_chunk(s: Setting, raw: Any, label: str) -> str | int:
    if isinstance(raw, str) and raw.strip().lower() == "auto":
        return "auto"
    v = _parse_int(label, raw, s.allowed)
    if not 1 <= v <= MAX_PREFILL:
        raise ConfigError(label, raw, s.allowed)
    return v


def _parse_depth(s: Setting, raw: Any, label: str) -> int:
    v = _parse_int(label, raw, s.allowed)
    if v not in (0, 1):
        raise ConfigError(label, raw, s.allowed, _DEPTH_WHY)
    return v


def _parse_gib(s: Setting, raw: Any, label: str) -> str | float:
    return _parse_auto_number(label, raw, s.allowed, extra=tuple(c for c in s.choices if c != "auto"))


def _parse_address(s: Setting, raw: Any, label: str) -> str:
    if not isinstance(raw, str):
        raise ConfigError(label, raw, s.allowed)
    text = raw.strip()
    if text and rendezvous_address(text) is None:
        raise ConfigError(label, raw, s.allowed)
    return text


def _parse_choice(s: Setting, raw: Any, label: str) -> str:
    word = raw.strip().lower() if isinstance(raw, str) else None
    if word not in s.choices:
        raise ConfigError(label, raw, " or ".join(s.choices))
    return word


# a raw value's parser, by its row's kind
_PARSERS: dict[str, Callable[[Setting, Any, str], Any]] = {
    "devices": _parse_devices, "layer_split": _parse_layer_split, "chunk": _parse_chunk, "depth": _parse_depth,
    "bool": lambda s, raw, label: _parse_bool(label, raw), "gib": _parse_gib, "address": _parse_address,
    "choice": _parse_choice,
}


def unknown_setting(name: str) -> ConfigError:
    """The error for a name that is no setting: it lists the names there are, and the closest."""
    import difflib

    close = difflib.get_close_matches(name, SETTING_NAMES, n=2, cutoff=0.5)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return ConfigError("setting name", name, "one of " + ", ".join(sorted(SETTING_NAMES)),
                       f"unknown setting {name!r}{hint}")


def interleave_groups(split: object) -> int | None:
    """V of a layer split written `interleave:V` (1 <= V <= 64), else None."""
    if not isinstance(split, str):
        return None
    head, sep, tail = split.strip().lower().partition(":")
    if head != "interleave" or not sep or not tail.strip().isdigit():
        return None
    v = int(tail)
    return v if 1 <= v <= 64 else None


def rendezvous_address(text: str) -> tuple[str, int] | None:
    """(host, port) of HOST:PORT (host "" means every interface), else None.  PORT stops at 65534:
    the controller's store listens on PORT+1 (65535 used to pass here and then fail to bind
    port 65536 with a message about a port in use)."""
    m = _RENDEZVOUS_RE.fullmatch(text)
    if m is None:
        return None
    port = int(m.group(3))
    return (m.group(1) or "", port) if 1 <= port <= 65534 else None
