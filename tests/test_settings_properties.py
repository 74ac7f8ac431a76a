"""Every setting, from every source, against an independent statement of what it allows.

Sources: the `parse_setting` API (strings and typed values, as the GUI passes them), the
environment (`ENV_NAMES`, through `EngineConfig.from_sources`) and the CLI (`strata-bench run`
flags and `--arm` texts, through `bench.build_parser` and `bench.main`).  Properties:
- a valid value round-trips: parse(format(v)) == v, and env/CLI give back the same v;
- any other input is refused with ConfigError whose message names the setting (or the
  environment variable), quotes the value and says what is allowed -- never another exception;
- a value is never silently changed (2.5 layers is refused, not truncated to 2).
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import re
import shlex
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.cli import bench
from engine.config import (
    BOOL_SETTINGS,
    CHOICES,
    ENV_NAMES,
    MAX_PREFILL,
    MAX_SHOWN_VALUE,
    SETTING_NAMES,
    ConfigError,
    EngineConfig,
    format_setting,
    parse_setting,
)

PROPS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])
CLI_PROPS = settings(PROPS, max_examples=60)

FLAGS = {name: "--" + name.replace("_", "-") for name in bench.SETTING_FLAGS}
VALUE_FLAGS = [n for n in bench.SETTING_FLAGS if n not in BOOL_SETTINGS]
NUMBER_SETTINGS = ("pin_limit_gib", "expert_cache")


# ------------------------------------------------------------------ the specification (oracle)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_ASCII_INT = re.compile(r"[+-]?[0-9]+")


def _int_or_none(s: str) -> int | None:
    """An integer written in ASCII digits with an optional sign, below 10**19 in magnitude."""
    s = s.strip()
    if not _ASCII_INT.fullmatch(s):
        return None
    v = int(s)
    return v if abs(v) < 10**19 else None


def _real_or_none(s: str) -> float | None:
    s = s.strip()
    if not s.isascii():
        return None
    try:
        v = float(s)
    except ValueError:
        return None
    return v if math.isfinite(v) and v >= 0 else None


def _device_ok(d: str) -> bool:
    return d == "cpu" or d == "cuda" or (d.startswith("cuda:") and d[5:].isascii() and d[5:].isdigit()
                                         and len(d[5:]) <= 4)


def expected(name: str, s: str) -> Any:
    """What a string must parse to, or None where it must be refused (the README's settings table)."""
    low = s.strip().lower()
    if name == "pipeline_depth":
        v = _int_or_none(s)
        return v if v in (0, 1) else None
    if name == "chunk_tokens":
        if low == "auto":
            return "auto"
        v = _int_or_none(s)
        return v if v is not None and 1 <= v <= MAX_PREFILL else None
    if name in BOOL_SETTINGS:
        return True if low in _TRUE else False if low in _FALSE else None
    if name == "pin_limit_gib":
        return "auto" if low == "auto" else _real_or_none(s)
    if name == "expert_cache":
        return low if low in ("auto", "all") else _real_or_none(s)
    if name in CHOICES:
        return low if low in CHOICES[name] else None
    if name == "layer_split":
        if low == "auto":
            return "auto"
        counts = [_int_or_none(p) for p in low.split(",")]
        return counts if all(c is not None and c > 0 for c in counts) else None
    if name == "devices":
        items = [x.strip() for x in s.split(",")]
        return items if all(_device_ok(x) for x in items) else None
    if name == "rendezvous":
        return s.strip() if s.strip() == "" or _rendezvous_ok(s.strip()) else None
    raise AssertionError(name)


def _rendezvous_ok(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return (bool(sep) and port.isascii() and port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65534
            and (host == "" or (host.isascii() and host[0].isalnum() and len(host) <= 253
                                and all(c.isalnum() or c in ".-" for c in host))))


def in_domain(name: str, v: Any) -> bool:
    """A parsed value has the setting's type and range."""
    is_int = isinstance(v, int) and not isinstance(v, bool)
    if name == "pipeline_depth":
        return is_int and v in (0, 1)
    if name == "chunk_tokens":
        return v == "auto" or (is_int and 1 <= v <= MAX_PREFILL)
    if name in BOOL_SETTINGS:
        return isinstance(v, bool)
    if name in NUMBER_SETTINGS:
        extra = ("auto", "all") if name == "expert_cache" else ("auto",)
        return v in extra or (type(v) is float and math.isfinite(v) and v >= 0)
    if name in CHOICES:
        return v in CHOICES[name]
    if name == "layer_split":
        return v == "auto" or (isinstance(v, list) and v and all(type(c) is int and c > 0 for c in v))
    if name == "devices":
        return isinstance(v, list) and v and all(isinstance(d, str) and _device_ok(d) for d in v)
    if name == "rendezvous":
        return isinstance(v, str) and (v == "" or _rendezvous_ok(v))
    raise AssertionError(name)


# ------------------------------------------------------------------------------ strategies
_float = st.floats(min_value=0, allow_nan=False, allow_infinity=False)
VALID: dict[str, st.SearchStrategy[Any]] = {
    "pipeline_depth": st.sampled_from([0, 1]),
    "chunk_tokens": st.one_of(st.just("auto"), st.integers(1, MAX_PREFILL)),
    "pin_limit_gib": st.one_of(st.just("auto"), _float),
    "expert_cache": st.one_of(st.sampled_from(["auto", "all"]), _float),
    "layer_split": st.one_of(st.just("auto"), st.lists(st.integers(1, 10**6), min_size=1, max_size=12)),
    "devices": st.lists(st.one_of(st.sampled_from(["cpu", "cuda"]), st.integers(0, 9999).map("cuda:{}".format)),
                        min_size=1, max_size=8),
    **{n: st.booleans() for n in BOOL_SETTINGS},
    **{n: st.sampled_from(c) for n, c in CHOICES.items()},
    "rendezvous": st.one_of(st.just(""), st.builds("{}:{}".format, st.sampled_from(["", "127.0.0.1", "ws-a", "h.lan"]),
                                                   st.integers(1, 65534))),
}
# near misses of valid spellings: what a user mistypes, what a parser gets wrong
NEAR = ["auto", "AUTO", " auto ", "all", "0", "1", "2", "-1", "+1", "01", "1.0", "1.5", "1e3", "-0", "1_0", "١",
        "٣", "1 0", "nan", "inf", "-inf", "infinity", "1e309", "0x10", "true", "yes", "on", "off", "maybe", "",
        " ", "pcie", "PCIE", "configured", "peer", "host", "float32", "bfloat16", "int8", "cpu", "cuda", "cuda:0",
        "cuda:", "cuda:x", "cuda:٣", "cuda:12345", "gpu", "cpu,cpu", "cpu,,cpu", "cpu,", "8,8", "8,0", "8,-8",
        "8,8.5", "a,b", "1048576", "1048577", "0", "99999999999999999999", "0" * 30 + "1", "\t1\n", "１"]
_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=24)
ANY_TEXT = st.one_of(
    _text, st.sampled_from(NEAR),
    st.builds(lambda a, b: a + b, st.sampled_from(NEAR), st.sampled_from(NEAR + [",", ":", "."])),
    st.builds(lambda a, b: a + "," + b, st.sampled_from(NEAR), st.sampled_from(NEAR)),
    st.integers(-10**22, 10**22).map(str), st.floats().map(repr),
)
ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(10**400), 10**400), st.floats(), st.binary(max_size=8),
    _text, st.lists(st.one_of(st.integers(-5, 10**20), st.floats(), st.booleans(), st.sampled_from(NEAR)),
                    max_size=4),
    st.tuples(st.integers(-3, 9), st.integers(-3, 9)), st.dictionaries(_text, st.integers(), max_size=2),
)


def assert_clear(exc: ConfigError, label: str, value: Any) -> None:
    """The message names the setting, quotes the value (cut if long) and says what is allowed."""
    msg = str(exc)
    assert exc.setting == label, msg
    assert f"invalid {label}=" in msg, msg
    shown = repr(value)
    assert (shown if len(shown) <= MAX_SHOWN_VALUE else shown[: MAX_SHOWN_VALUE - 1]) in msg, msg
    assert exc.allowed and f"allowed {exc.allowed}" in msg, msg
    assert len(msg) < 600, msg


@contextlib.contextmanager
def clean_environ():
    keep = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    with mock.patch.dict(os.environ, keep, clear=True):
        yield


# ------------------------------------------------------------------------- API: parse_setting
def test_every_setting_has_a_strategy_env_and_cli_names():
    assert set(VALID) == set(SETTING_NAMES)
    assert set(ENV_NAMES) <= set(SETTING_NAMES) and set(bench.SETTING_FLAGS) <= set(SETTING_NAMES)


@pytest.mark.parametrize("name", SETTING_NAMES)
@PROPS
@given(data=st.data())
def test_valid_values_round_trip(name, data):
    v = data.draw(VALID[name])
    text = format_setting(name, v)
    back = parse_setting(name, text)
    assert back == v and type(back) is type(v), (text, back)
    assert parse_setting(name, v) == v  # a typed value (what the GUI passes) is taken as it is
    assert expected(name, text) == v  # and the specification agrees


@pytest.mark.parametrize("name", SETTING_NAMES)
@PROPS
@given(s=ANY_TEXT)
def test_any_text_is_parsed_as_specified_or_refused_clearly(name, s):
    want = expected(name, s)
    if want is None:
        with pytest.raises(ConfigError) as ei:
            parse_setting(name, s)
        assert_clear(ei.value, name, s)
    else:
        got = parse_setting(name, s)
        assert got == want and in_domain(name, got), (s, got, want)
        assert parse_setting(name, format_setting(name, got)) == got


@pytest.mark.parametrize("name", SETTING_NAMES)
@PROPS
@given(raw=ANY_VALUE)
@example(raw=10**400)
@example(raw=[2.5, 2])
@example(raw=[True, 3])
@example(raw=float("nan"))
@example(raw=-0.0)
def test_any_python_value_is_taken_unchanged_or_refused_clearly(name, raw):
    try:
        got = parse_setting(name, raw)
    except ConfigError as exc:
        assert_clear(exc, name, raw)
        return
    assert in_domain(name, got), (raw, got)
    assert parse_setting(name, format_setting(name, got)) == got
    if isinstance(raw, str):
        assert got == expected(name, raw)
    elif isinstance(raw, (list, tuple)) and name in ("layer_split", "devices"):
        assert list(raw) == got and all(type(a) is type(b) for a, b in zip(raw, got)), (raw, got)
    elif isinstance(raw, (int, float)) and not isinstance(raw, bool) and name not in BOOL_SETTINGS:
        assert float(got) == float(raw), (raw, got)  # never rounded, truncated or clamped


def test_unknown_names_and_formats_are_refused():
    with pytest.raises(ConfigError, match="unknown setting 'depth'"):
        parse_setting("depth", "1")
    with pytest.raises(ConfigError, match="unknown setting 'depth'"):
        format_setting("depth", 1)


@pytest.mark.parametrize("raw, words", [
    (10**400, ["pin_limit_gib", "too large"]),  # was OverflowError out of float()
    ("x" * 10_000, ["pin_limit_gib='xxxx", "…", "allowed auto or a number of GiB >= 0"]),  # message stays short
])
def test_defects_found_by_the_properties_stay_fixed(raw, words):
    with pytest.raises(ConfigError) as ei:
        parse_setting("pin_limit_gib", raw)
    for w in words:
        assert w in str(ei.value)
    assert len(str(ei.value)) < 200


@pytest.mark.parametrize("name, raw", [
    ("layer_split", [2.5, 2]), ("layer_split", [True, 3]), ("layer_split", "8,٨"), ("devices", "cuda:٣"),
    ("devices", "gpu"), ("chunk_tokens", "1_024"), ("pipeline_depth", "١"), ("pin_limit_gib", "١"),
])
def test_values_once_accepted_by_mistake_are_refused(name, raw):
    with pytest.raises(ConfigError) as ei:
        parse_setting(name, raw)
    assert_clear(ei.value, name, raw)


@pytest.mark.parametrize("changes", [
    dict(chunk_tokens="big"), dict(chunk_tokens=True), dict(pin_limit_gib="lots"),
    dict(pin_limit_gib=float("nan")), dict(expert_cache="x"), dict(layer_split="8,8"), dict(pipeline_depth="1"),
    dict(timing="yes"), dict(devices=["gpu"]),
])
def test_a_config_built_directly_is_validated_too(changes):
    name = next(iter(changes))
    with pytest.raises(ConfigError) as ei:
        EngineConfig(**changes).validate()
    assert ei.value.setting == name and "allowed" in str(ei.value)


# -------------------------------------------------------------------------------- environment
@pytest.mark.parametrize("name", list(ENV_NAMES))
@PROPS
@given(data=st.data())
def test_environment_values_round_trip(name, data):
    v = data.draw(VALID[name])
    cfg = EngineConfig.from_sources({}, env={ENV_NAMES[name]: format_setting(name, v)})
    assert getattr(cfg, name) == v


@pytest.mark.parametrize("name", list(ENV_NAMES))
@PROPS
@given(s=ANY_TEXT.filter(lambda s: s != ""))
def test_environment_text_is_parsed_as_specified_or_refused_naming_the_variable(name, s):
    var = ENV_NAMES[name]
    want = expected(name, s)
    if want is None:
        with pytest.raises(ConfigError) as ei:
            EngineConfig.from_sources({}, env={var: s})
        assert_clear(ei.value, var, s)
    else:
        assert getattr(EngineConfig.from_sources({}, env={var: s}), name) == want
    # an explicit value wins over the environment, whatever the environment holds
    explicit = format_setting(name, EngineConfig().as_dict()[name])
    assert getattr(EngineConfig.from_sources({name: explicit}, env={var: s}), name) == EngineConfig().as_dict()[name]


# ------------------------------------------------------------------------------------- CLI
def _cli_config(argv: list[str]) -> EngineConfig:
    ns = bench.build_parser().parse_args(["run", *argv])
    raw = {k: getattr(ns, k) for k in bench.SETTING_FLAGS if getattr(ns, k, None) is not None}
    return EngineConfig.from_sources(raw, env={})


@pytest.mark.parametrize("name", list(bench.SETTING_FLAGS))
@PROPS
@given(data=st.data())
def test_cli_values_round_trip(name, data):
    v = data.draw(VALID[name])
    if name in BOOL_SETTINGS:  # a bare flag means on; --flag=0 off
        argv = [FLAGS[name]] if v else [FLAGS[name] + "=0"]
    else:
        argv = [f"{FLAGS[name]}={format_setting(name, v)}"]
    if name == "layer_split" and v != "auto":
        argv.append("--devices=" + ",".join(["cpu"] * len(v)))
    assert getattr(_cli_config(argv), name) == v


def _main(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with clean_environ(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = bench.main(["run", "--warmup", "0", "--prompt-tokens", "8", *argv])
    return rc, err.getvalue()


_cli_text = ANY_TEXT.filter(lambda s: "\x00" not in s)


@pytest.mark.parametrize("name", VALUE_FLAGS)
@CLI_PROPS
@given(s=_cli_text)
def test_invalid_cli_values_are_one_clear_line(name, s):
    """Only invalid values run main (a valid one would run the model): exit 2, one line naming it."""
    want = expected(name, s)
    if want is not None and not (name == "layer_split" and want != "auto" and len(want) != 1):
        return
    rc, err = _main([f"{FLAGS[name]}={s}"])
    assert rc == 2, err
    assert err.startswith("strata-bench: error: invalid ") and err.count("\n") == 1, err
    assert f"invalid {name}=" in err and "allowed" in err, err


@pytest.mark.parametrize("name", SETTING_NAMES)
@CLI_PROPS
@given(s=_cli_text)
def test_invalid_arm_values_are_one_clear_line(name, s):
    if expected(name, s) is not None:
        return
    rc, err = _main(["--arm", f"{name}={shlex.quote(s)}"])
    assert rc == 2, err
    assert f"invalid {name}=" in err and "allowed" in err and err.count("\n") == 1, err


def test_an_arm_with_an_unclosed_quote_is_one_clear_line():
    rc, err = _main(["--arm", 'pipeline_depth="1'])
    assert rc == 2 and "arm" in err
