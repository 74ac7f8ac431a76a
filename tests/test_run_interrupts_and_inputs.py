"""Ctrl-C during a multi-repeat `strata-bench run` keeps and prints the repeats that finished
(issue 39: they were thrown away with "interrupted"); `--peak-tflops nan` is refused up front;
a huge text prompt is refused with its size before the tokenizer runs out of memory."""
from __future__ import annotations

import pytest

from engine.cli import bench
from engine.pipeline.session import Session


def test_ctrl_c_keeps_and_prints_the_finished_repeats(monkeypatch, capsys, demo_path):
    real = Session.run
    calls = {"n": 0}

    def run(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # Ctrl-C during the third measured repeat
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Session, "run", run)
    rc = bench.main(["run", "--model", str(demo_path), "--prompt-tokens", "32", "--repeat", "5", "--warmup", "0"])
    out, err = capsys.readouterr()
    assert rc == 130
    assert "interrupted; 2 measured runs finished and are shown below" in err, err
    assert "tok/s" in out and "digest:" in out  # the table of the two finished repeats
    lines = out.splitlines()
    head = [c.strip() for c in lines[0].split("|")]
    cells = [c.strip() for c in lines[2].split("|")]
    spread = next(i for i, h in enumerate(head) if h.startswith("±"))
    assert "base" in cells and cells[spread] not in ("", "—"), out  # a spread: more than one repeat


def test_ctrl_c_before_any_repeat_says_nothing_finished(monkeypatch, capsys, demo_path):
    def run(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Session, "run", run)
    assert bench.main(["run", "--model", str(demo_path), "--prompt-tokens", "32", "--warmup", "0"]) == 130
    assert "0 measured runs finished, nothing to show" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_peak_tflops_must_be_a_finite_number(capsys, value):
    assert bench.main(["run", "--model", "demo", "--prompt-tokens", "8", "--peak-tflops", value]) == 2
    assert "invalid --peak-tflops" in capsys.readouterr().err


def test_a_huge_text_prompt_is_refused_with_its_size_before_tokenising(tmp_path, capsys, demo_path):
    from engine.io.prompt import MAX_TEXT_CHARS

    text = "pipeline " * (MAX_TEXT_CHARS // 9 + 1)
    assert bench.main(["run", "--model", str(demo_path), "--prompt", text, "--warmup", "0"]) == 2
    err = capsys.readouterr().err
    assert f"a text of {len(text):,} characters" in err and f"at most {MAX_TEXT_CHARS:,}" in err, err[:300]


def test_rendezvous_port_65535_is_refused_up_front_naming_port_plus_one(capsys):
    """The controller's store listens on PORT+1: 65535 used to be accepted and then fail to bind
    port 65536 with a message about a port in use."""
    from engine.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match=r"port 1\.\.65534 \(the controller's store listens on PORT\+1\)"):
        EngineConfig.from_sources({"rendezvous": "127.0.0.1:65535", "executor": "processes"}, env={})
    assert EngineConfig.from_sources({"rendezvous": "127.0.0.1:65534", "executor": "processes"},
                                     env={}).rendezvous == "127.0.0.1:65534"
