"""The app's settings form, property-based: whatever a user types into a field, Run is either
allowed with exactly that value reaching the engine, or blocked with a message in that field
naming the setting, the value and what is allowed."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import ConfigError, parse_setting
from strata_gui.run.settings_model import RunSettings, validate

N_LAYERS = 4  # the demo model
TEXT = st.one_of(st.text(max_size=12),
                 st.from_regex(r"-?[0-9]{0,6}(\.[0-9]{0,3})?", fullmatch=True),
                 st.sampled_from(["auto", "all", "AUTO", " 2 ", "1e3", "nan", "inf", "-1", "0"]))

FIELD_TO_SETTING = {"chunk_tokens": "chunk_tokens", "pin_limit_gib": "pin_limit_gib", "expert_cache": "expert_cache"}


def _check(field: str, text: str, **extra) -> None:
    form = RunSettings(devices="cpu,cpu", **extra, **{field: text})
    v = validate(form, N_LAYERS, env={})
    setting = FIELD_TO_SETTING.get(field, field)
    try:
        expected = parse_setting(setting, text)
    except ConfigError:
        expected = None
    if v.ok:
        got = getattr(v.config, setting)
        assert expected is not None and got == expected, (field, text, got)
    else:
        msg = " ".join(v.errors.values())
        assert "invalid" in msg and "allowed" in msg, msg


@settings(max_examples=150, deadline=None)
@given(TEXT)
def test_chunk_size_field(text):
    _check("chunk_tokens", text, chunk_mode="fixed")


@settings(max_examples=150, deadline=None)
@given(TEXT)
def test_pin_limit_field(text):
    _check("pin_limit_gib", text)


@settings(max_examples=150, deadline=None)
@given(TEXT)
def test_expert_cache_field(text):
    _check("expert_cache", text)


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=10), st.lists(st.integers(-2, 5), min_size=1, max_size=3).map(
    lambda xs: ",".join(map(str, xs)))))
def test_layer_split_field(text):
    form = RunSettings(devices="cpu,cpu", split_mode="manual", split_counts=text)
    v = validate(form, N_LAYERS, env={})
    if v.ok:
        counts = v.config.layer_split
        assert isinstance(counts, list) and len(counts) == 2 and sum(counts) == N_LAYERS and min(counts) > 0
    else:
        msg = " ".join(v.errors.values())
        assert "layer_split" in msg and "allowed" in msg, msg


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=24))
def test_device_list_field(text):
    v = validate(RunSettings(devices=text), N_LAYERS, env={}, cuda_count=0)
    if v.ok:
        assert all(d == "cpu" for d in v.config.devices) and 1 <= len(v.config.devices) <= N_LAYERS
    else:
        msg = " ".join(v.errors.values())
        assert "devices" in msg and "allowed" in msg, msg
