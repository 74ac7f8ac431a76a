"""Issue 37: the form's validation reports every problem at once, each under its own field —
parse errors, the checks across settings, the machine's and the model's — not the first alone."""
from __future__ import annotations

from strata_gui.run.settings_model import RunSettings, validate


def test_every_error_shows_at_once():
    s = RunSettings(devices="cuda:7,cpu", chunk_mode="fixed", chunk_tokens="0", pin_limit_gib="1e9",
                    split_mode="manual", split_counts="3,3", repeats=0)
    v = validate(s, n_layers=4, env={}, cuda_count=0)
    assert not v.ok and v.config is None
    assert {"chunk_tokens", "devices", "pin_limit_gib", "layer_split", "repeats"} <= set(v.errors), v.errors
    assert "cuda:7" in v.errors["devices"] and "RAM" in v.errors["pin_limit_gib"]
    assert "4 layers" in v.errors["layer_split"]


def test_a_bad_environment_value_does_not_hide_the_forms_errors():
    s = RunSettings(devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="0")
    v = validate(s, n_layers=4, env={"STRATA_CHECK_NAN": "x", "STRATA_DBG_NAN": "maybe"}, cuda_count=0)
    assert "chunk_tokens" in v.errors and "general" in v.errors and "STRATA_DBG_NAN" in v.errors["general"]


def test_a_valid_form_still_gives_a_config():
    v = validate(RunSettings(devices="cpu,cpu"), n_layers=4, env={}, cuda_count=0)
    assert v.ok and v.config.devices == ["cpu", "cpu"]
