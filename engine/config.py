"""Engine settings: one dataclass, parsed from environment and CLI with one set of rules.

Precedence: explicit (GUI/CLI) > environment > default.  Every invalid value raises
`ConfigError` naming the setting, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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


# setting name -> environment variable (the README's settings table)
ENV_NAMES: dict[str, str] = {
    "pipeline_depth": "STRATA_PIPELINE_DEPTH",
    "prefill_main": "STRATA_PREFILL_MAIN",
    "pin_limit_gib": "STRATA_PIN_LIMIT_GIB",
    "chunk_tokens": "STRATA_CHUNK_TOKENS",
    "gpu_order": "STRATA_GPU_ORDER",
    "timing": "STRATA_PREFILL_TIMING",
    "check_nan": "STRATA_DBG_NAN",
    "cuda_graphs": "STRATA_CUDA_GRAPHS",
    "chunk_schedule": "STRATA_CHUNK_SCHEDULE",
    "executor": "STRATA_EXECUTOR",
    "rendezvous": "STRATA_RENDEZVOUS",
}

# the seeds' names, still accepted: environment variables (read when the new one is unset), and
# setting names (CLI/arm/record keys; `canonical` maps them) written before issue 16
ENV_ALIASES: dict[str, tuple[str, ...]] = {
    "pipeline_depth": ("STRATA_PF_DEPTH",),
    "chunk_tokens": ("STRATA_PREFILL",),
}
NAME_ALIASES: dict[str, str] = {"pf_depth": "pipeline_depth", "prefill": "chunk_tokens"}


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
SETTING_NAMES: tuple[str, ...] = (
    "pipeline_depth", "prefill_main", "pin_limit_gib", "chunk_tokens", "gpu_order", "layer_split", "expert_cache",
    "timing", "check_nan", "devices", "handoff", "dtype", "cuda_graphs", "chunk_schedule",
    "executor", "rendezvous",
)
BOOL_SETTINGS = ("prefill_main", "timing", "check_nan", "cuda_graphs")
CHOICES: dict[str, tuple[str, ...]] = {
    "gpu_order": ("pcie", "configured"),
    "handoff": ("auto", "peer", "host"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "chunk_schedule": ("fixed", "balanced", "auto"),
    "executor": ("threads", "processes"),
}
MAX_PREFILL = 1 << 20

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_INT_RE = re.compile(r"[+-]?0*[0-9]{1,19}")  # ASCII digits only (int() also takes "١٦", "1_6")
_DEVICE_RE = re.compile(r"cpu|cuda(:[0-9]{1,4})?")
_RENDEZVOUS_RE = re.compile(r"([A-Za-z0-9]([A-Za-z0-9.-]{0,252}))?:([0-9]{1,5})")

ALLOWED = {
    "devices": "cpu, cuda or cuda:N",
    "device_list": "a comma-separated device list such as cpu,cpu or cuda:0,cuda:1",
    "layer_split": "auto, comma-separated layer counts such as 12,12,24, or interleave:V (V layer groups per device)",
    "chunk_tokens": f"auto or a chunk size in tokens (1..{MAX_PREFILL})",
    "pipeline_depth": "0 (join) or 1 (overlap)",
    "bool": "1/0, true/false, on/off",
    "pin_limit_gib": "auto or a number of GiB >= 0",
    "expert_cache": "auto, all or a number of GiB >= 0",
    "rendezvous": "empty (stage processes on this machine) or HOST:PORT (stages started with "
                  "`strata-bench stage --rendezvous HOST:PORT` attach to this controller), port 1..65534 "
                  "(the controller's store listens on PORT+1)",
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
    # own on torch.distributed (engine/executor.py), past the GIL and across hosts
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
        if not self.devices:
            raise ConfigError("devices", self.devices, "a non-empty list such as cpu or cuda:0,cuda:1")
        for d in self.devices:
            if not (isinstance(d, str) and _DEVICE_RE.fullmatch(d)):
                raise ConfigError("devices", d, ALLOWED["devices"])
        if not _is_int(self.pipeline_depth) or self.pipeline_depth not in (0, 1):
            raise ConfigError("pipeline_depth", self.pipeline_depth, ALLOWED["pipeline_depth"], _DEPTH_WHY)
        for name in BOOL_SETTINGS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "True or False")
        if not (self.layer_split == "auto" or interleave_groups(self.layer_split) is not None
                or (isinstance(self.layer_split, list) and all(_is_int(n) for n in self.layer_split))):
            raise ConfigError("layer_split", self.layer_split, ALLOWED["layer_split"])
        if not (self.chunk_tokens == "auto" or _is_int(self.chunk_tokens)):
            raise ConfigError("chunk_tokens", self.chunk_tokens, ALLOWED["chunk_tokens"])
        for name, extra in (("pin_limit_gib", ("auto",)), ("expert_cache", ("auto", "all"))):
            v = getattr(self, name)
            if not (v in extra or (_is_real(v) and math.isfinite(v) and v >= 0)):
                raise ConfigError(name, v, ALLOWED[name])
        if isinstance(self.layer_split, list):
            if len(self.layer_split) != len(self.devices):
                raise ConfigError(
                    "layer_split", _fmt_split(self.layer_split),
                    f"auto or {len(self.devices)} counts, one per device",
                )
            if any(n <= 0 for n in self.layer_split):
                raise ConfigError("layer_split", _fmt_split(self.layer_split),
                                  "positive counts (an empty stage has nothing to run)")
        if isinstance(self.chunk_tokens, int) and not (1 <= self.chunk_tokens <= MAX_PREFILL):
            raise ConfigError("chunk_tokens", self.chunk_tokens, f"auto or a chunk size from 1 to {MAX_PREFILL} tokens")
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(name, getattr(self, name), _or(choices))
        if not (isinstance(self.rendezvous, str) and (self.rendezvous == "" or rendezvous_address(self.rendezvous))):
            raise ConfigError("rendezvous", self.rendezvous, ALLOWED["rendezvous"])

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
    name = canonical(name)
    if name == "devices":
        return ",".join(value)
    if name == "layer_split":
        return value if value == "auto" else _fmt_split(value)
    if name in BOOL_SETTINGS:
        return "1" if value else "0"
    if name in ("pin_limit_gib", "expert_cache"):
        return value if isinstance(value, str) else repr(float(value))
    if name in ("chunk_tokens", "pipeline_depth"):
        return str(value)
    if name in CHOICES or name == "rendezvous":
        return str(value)
    raise unknown_setting(name)


def _parse(name: str, raw: Any, label: str) -> Any:
    if name == "devices":
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
    if name == "layer_split":
        if isinstance(raw, (list, tuple)):
            parts = list(raw)
        elif isinstance(raw, str):
            s = raw.strip().lower()
            if s == "auto":
                return "auto"
            if s.startswith("interleave"):
                v = interleave_groups(s)
                if v is None:
                    raise ConfigError(label, raw, "interleave:V with V a whole number from 1 to 64")
                return f"interleave:{v}"
            parts = [p.strip() for p in s.split(",")]
        else:
            raise ConfigError(label, raw, ALLOWED["layer_split"])
        counts: list[int] = []
        for p in parts:
            if not (_is_int(p) or isinstance(p, str)):  # 2.5 or True would be silently truncated
                raise ConfigError(label, raw, ALLOWED["layer_split"])
            try:
                counts.append(_parse_int(label, p, ALLOWED["layer_split"]))
            except ConfigError:  # quote the value as given, not the lower-cased piece
                raise ConfigError(label, raw, ALLOWED["layer_split"]) from None
        if not counts or any(c <= 0 for c in counts):
            raise ConfigError(label, raw, "positive layer counts (an empty stage has nothing to run)")
        return counts
    if name == "chunk_tokens":
        if isinstance(raw, str) and raw.strip().lower() == "auto":
            return "auto"
        v = _parse_int(label, raw, ALLOWED["chunk_tokens"])
        if not 1 <= v <= MAX_PREFILL:
            raise ConfigError(label, raw, ALLOWED["chunk_tokens"])
        return v
    if name == "pipeline_depth":
        v = _parse_int(label, raw, ALLOWED["pipeline_depth"])
        if v not in (0, 1):
            raise ConfigError(label, raw, ALLOWED["pipeline_depth"], _DEPTH_WHY)
        return v
    if name in BOOL_SETTINGS:
        return _parse_bool(label, raw)
    if name == "pin_limit_gib":
        return _parse_auto_number(label, raw, ALLOWED["pin_limit_gib"])
    if name == "expert_cache":
        return _parse_auto_number(label, raw, ALLOWED["expert_cache"], extra=("all",))
    if name == "rendezvous":
        if not isinstance(raw, str):
            raise ConfigError(label, raw, ALLOWED["rendezvous"])
        text = raw.strip()
        if text and rendezvous_address(text) is None:
            raise ConfigError(label, raw, ALLOWED["rendezvous"])
        return text
    if name in CHOICES:
        allowed = CHOICES[name]
        s = raw.strip().lower() if isinstance(raw, str) else None
        if s not in allowed:
            raise ConfigError(label, raw, " or ".join(allowed))
        return s
    raise unknown_setting(name)


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
