"""Engine settings: one dataclass, parsed from environment and CLI with one set of rules.

Precedence: explicit (GUI/CLI) > environment > default.  Every invalid value raises
`ConfigError` naming the setting, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping


class ConfigError(ValueError):
    """An invalid setting: names the setting, the offending value and what is allowed."""

    def __init__(self, setting: str, value: Any, allowed: str, why: str = "") -> None:
        self.setting = setting
        self.value = value
        self.allowed = allowed
        msg = f"invalid {setting}={value!r}: allowed {allowed}"
        if why:
            msg += f" ({why})"
        super().__init__(msg)


# setting name -> environment variable (DESIGN.md "Settings")
ENV_NAMES: dict[str, str] = {
    "pf_depth": "STRATA_PF_DEPTH",
    "prefill_main": "STRATA_PREFILL_MAIN",
    "pin_limit_gib": "STRATA_PIN_LIMIT_GIB",
    "prefill": "STRATA_PREFILL",
    "gpu_order": "STRATA_GPU_ORDER",
    "timing": "STRATA_PREFILL_TIMING",
    "check_nan": "STRATA_DBG_NAN",
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass
class EngineConfig:
    """Everything that shapes one run. Strings like "auto" are kept as given; see `validate`."""

    devices: list[str] = field(default_factory=lambda: ["cpu"])
    layer_split: str | list[int] = "auto"
    prefill: str | int = "auto"  # chunk size
    pf_depth: int = 1
    prefill_main: bool = False
    pin_limit_gib: str | float = "auto"
    gpu_order: str = "pcie"
    expert_cache: str | float = "auto"
    handoff: str = "auto"
    dtype: str = "auto"
    timing: bool = False
    check_nan: bool = False

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_sources(
        cls, overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> "EngineConfig":
        """Default, then environment, then explicit overrides (None values are ignored)."""
        env = os.environ if env is None else env
        given = {k for k, v in (overrides or {}).items() if v is not None}
        values: dict[str, Any] = {}
        for name, var in ENV_NAMES.items():
            if name in given:  # an explicit value wins; a bad env value it replaces is moot
                continue
            if var in env and env[var] != "":
                values[name] = parse_setting(name, env[var], source=var)
        for name, raw in (overrides or {}).items():
            if raw is None:
                continue
            values[name] = parse_setting(name, raw)
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def replace(self, **changes: Any) -> "EngineConfig":
        parsed = {k: parse_setting(k, v) for k, v in changes.items()}
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
            if not (d == "cpu" or (d.startswith("cuda") and (d == "cuda" or d[5:].isdigit()))):
                raise ConfigError("devices", d, "cpu, cuda or cuda:N")
        if self.pf_depth not in (0, 1):
            raise ConfigError(
                "pf_depth", self.pf_depth, "0 (join) or 1 (overlap)",
                "a stage owns ONE set of chunk buffers, so two of its chunks may never be in flight",
            )
        if isinstance(self.layer_split, list):
            if len(self.layer_split) != len(self.devices):
                raise ConfigError(
                    "layer_split", _fmt_split(self.layer_split),
                    f"auto or {len(self.devices)} counts, one per device",
                )
            if any(n <= 0 for n in self.layer_split):
                raise ConfigError("layer_split", _fmt_split(self.layer_split),
                                  "positive counts (an empty stage has nothing to run)")
        if isinstance(self.prefill, int) and not (1 <= self.prefill <= 1 << 20):
            raise ConfigError("prefill", self.prefill, "auto or a chunk size from 1 to 1048576 tokens")
        if isinstance(self.pin_limit_gib, float) and self.pin_limit_gib < 0:
            raise ConfigError("pin_limit_gib", self.pin_limit_gib, "auto or a number of GiB >= 0")
        if isinstance(self.expert_cache, float) and self.expert_cache < 0:
            raise ConfigError("expert_cache", self.expert_cache, "auto, all or a number of GiB >= 0")
        if self.gpu_order not in ("pcie", "configured"):
            raise ConfigError("gpu_order", self.gpu_order, "pcie or configured")
        if self.handoff not in ("auto", "peer", "host"):
            raise ConfigError("handoff", self.handoff, "auto, peer or host")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError("dtype", self.dtype, "auto, float32, bfloat16 or float16")

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


def _fmt_split(split: list[int]) -> str:
    return ",".join(str(n) for n in split)


def _parse_bool(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    s = str(raw).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ConfigError(name, raw, "1/0, true/false, on/off")


def _parse_auto_number(name: str, raw: Any, allowed: str, extra: tuple[str, ...] = ()) -> str | float:
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        v = float(raw)
    else:
        s = str(raw).strip().lower()
        if s == "auto" or s in extra:
            return s
        try:
            v = float(s)
        except ValueError:
            raise ConfigError(name, raw, allowed) from None
    if v != v or v in (float("inf"), float("-inf")):
        raise ConfigError(name, raw, allowed)
    if v < 0:
        raise ConfigError(name, raw, allowed, "must not be negative")
    return v


def parse_setting(name: str, raw: Any, source: str | None = None) -> Any:
    """Turns a raw value (string from env/CLI/GUI, or a typed value) into the typed setting."""
    label = source or name
    try:
        return _parse(name, raw, label)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:  # defensive: never leak a bare parse error
        raise ConfigError(label, raw, "see DESIGN.md settings", str(exc)) from None


def _parse(name: str, raw: Any, label: str) -> Any:
    if name == "devices":
        if isinstance(raw, (list, tuple)):
            items = [str(x).strip() for x in raw]
        else:
            items = [x.strip() for x in str(raw).split(",")]
        if not items or any(not x for x in items):
            raise ConfigError(label, raw, "a comma-separated device list such as cpu,cpu or cuda:0,cuda:1")
        return items
    if name == "layer_split":
        if isinstance(raw, (list, tuple)):
            parts = list(raw)
        else:
            s = str(raw).strip().lower()
            if s == "auto":
                return "auto"
            parts = [p.strip() for p in s.split(",")]
        try:
            counts = [int(p) for p in parts]
        except (TypeError, ValueError):
            raise ConfigError(label, raw, "auto or comma-separated layer counts such as 12,12,24") from None
        if any(c <= 0 for c in counts):
            raise ConfigError(label, raw, "positive layer counts (an empty stage has nothing to run)")
        return counts
    if name == "prefill":
        if isinstance(raw, int) and not isinstance(raw, bool):
            v = raw
        else:
            s = str(raw).strip().lower()
            if s == "auto":
                return "auto"
            try:
                v = int(s)
            except ValueError:
                raise ConfigError(label, raw, "auto or a chunk size in tokens (1..1048576)") from None
        if not 1 <= v <= 1 << 20:
            raise ConfigError(label, raw, "auto or a chunk size in tokens (1..1048576)")
        return v
    if name == "pf_depth":
        try:
            v = int(str(raw).strip())
        except ValueError:
            raise ConfigError(label, raw, "0 (join) or 1 (overlap)") from None
        if v not in (0, 1):
            raise ConfigError(
                label, raw, "0 (join) or 1 (overlap)",
                "a stage owns ONE set of chunk buffers, so two of its chunks may never be in flight",
            )
        return v
    if name in ("prefill_main", "timing", "check_nan"):
        return _parse_bool(label, raw)
    if name == "pin_limit_gib":
        return _parse_auto_number(label, raw, "auto or a number of GiB >= 0")
    if name == "expert_cache":
        return _parse_auto_number(label, raw, "auto, all or a number of GiB >= 0", extra=("all",))
    if name in ("gpu_order", "handoff", "dtype"):
        s = str(raw).strip().lower()
        allowed = {
            "gpu_order": ("pcie", "configured"),
            "handoff": ("auto", "peer", "host"),
            "dtype": ("auto", "float32", "bfloat16", "float16"),
        }[name]
        if s not in allowed:
            raise ConfigError(label, raw, " or ".join(allowed))
        return s
    raise ConfigError(label, raw, "a known setting name", f"unknown setting {name!r}")
