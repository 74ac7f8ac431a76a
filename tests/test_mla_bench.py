"""benchmarks/mla_bench.py at tiny shapes on the CPU (the lead runs DeepSeek-V3's on an H200): a
row per attention block, prompt length and chunk size, the form MLA ran in, and KV bytes per token
that are the memory plan's (`plan_memory`'s KV of the same synthetic model) and the layout's
(MLA: latent + RoPE key; standard: keys and values of every KV head)."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.io import synth
from engine.models import mla
from engine.plan.memory_plan import plan_memory

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("strata_mla_bench", ROOT / "benchmarks" / "mla_bench.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)

TINY = ["--device", "cpu", "--tokens", "48,64", "--chunks", "16,64", "--repeat", "1", "--hidden", "64",
        "--heads", "4", "--q-lora", "32", "--kv-lora", "16", "--rope", "8", "--nope", "8", "--v", "8",
        "--std", "4x8,2x8"]


@pytest.fixture(scope="module")
def rows():
    return bench.run(bench.parser().parse_args(TINY))


def test_the_table_has_a_row_per_block_length_and_chunk(capsys):
    assert bench.main(TINY) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| attention")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    got = {(c[0].split()[0], c[2], c[3]) for c in cells}
    want = {(kind, t, c) for kind in ("MLA", "MHA", "GQA") for t, c in (("48", "16"), ("48", "48"), ("64", "16"),
                                                                        ("64", "64"))}
    assert got == want and len(cells) == 12
    for c in cells:
        assert float(c[5]) > 0 and float(c[6]) > 0  # ms per chunk, TFLOP/s
        assert int(c[4]) == -(-int(c[2]) // int(c[3]))  # chunks
    mla_rows = [c for c in cells if c[0].startswith("MLA")]
    assert all(c[1] == "expanded" and c[8] == "1.00" for c in mla_rows)
    assert {c[8] for c in cells if c[0].startswith("MHA")} == {f"{2 * 4 * 8 / (16 + 8):.2f}"}
    assert re.search(r"attention kernel, MLA .*: PyTorch SDPA \(CPU\)", out)


def test_kv_bytes_are_the_memory_plans(rows):
    """The figure each row reports is what plan_memory counts for that model's one layer, and the layout's."""
    for r in rows:
        src = synth.SyntheticSource(r.variant.recipe)
        plan = plan_memory(src, EngineConfig(devices=["cpu"], dtype="float32"), r.tokens)
        assert plan.devices[0].kv == r.kv_bytes_per_token * r.tokens == r.plan_bytes_per_token * r.tokens
        s = r.variant.spec
        layout = (s.kv_lora_rank + s.rope_dim) if r.variant.is_mla else 2 * s.n_kv_heads * s.head_dim
        assert r.kv_bytes_per_token == layout * 4


def test_flops_follow_the_form_mla_runs_in(rows):
    """A first chunk's score FLOPs are causal (n (n + 1) / 2 pairs), and a short chunk runs (and is
    counted as) the absorbed form."""
    s = next(r.variant.spec for r in rows if r.variant.is_mla)
    n = 16
    full, form = bench.chunk_flops(s, True, n, 0)
    assert form == ("absorbed" if mla.absorbed_wanted(s, n) else "expanded")
    _, short = bench.chunk_flops(s, True, 1, 100)
    assert short == "absorbed"
    std = next(r.variant.spec for r in rows if not r.variant.is_mla and r.variant.spec.n_kv_heads == 2)
    f, kind = bench.chunk_flops(std, False, n, 0)
    proj = 2 * n * std.hidden * std.head_dim * (2 * std.n_heads + 2 * std.n_kv_heads)
    assert kind == "GQA" and f == proj + 2 * (n * (n + 1) / 2) * std.n_heads * 2 * std.head_dim
    assert full > 0


def test_the_absorbed_form_is_measured_where_it_runs():
    """Chunks short enough for mla.absorbed_wanted run (and are reported as) the latent-space form."""
    argv = [a for a in TINY]
    argv[argv.index("--tokens") + 1], argv[argv.index("--chunks") + 1] = "8", "1,8"
    got = bench.run(bench.parser().parse_args(argv))
    forms = {(r.chunk, r.form) for r in got if r.variant.is_mla}
    s = got[0].variant.spec
    assert forms == {(c, "absorbed" if mla.absorbed_wanted(s, c) else "expanded") for c in (1, 8)}
    assert (1, "absorbed") in forms
    assert all(torch.isfinite(torch.tensor(r.seconds)) for r in got)
