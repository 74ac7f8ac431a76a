"""Issue 37: every bad value of every setting makes `strata-bench` exit 2 with one line, before
torch (or the model) is imported; engine.kernels.attention imports no torch._dynamo at start-up."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import ENV_NAMES, SETTING_NAMES
from engine.hw.machine import visible_list_bound

ROOT = Path(__file__).resolve().parent.parent

BAD_VALUES: dict[str, tuple[str, ...]] = {  # at least one per setting (a test checks the table is whole)
    "devices": ("gpu", "cuda:9999", "cpu,,cpu", "cuda:x"),
    "layer_split": ("0,1", "abc", "interleave:0", "12,12"),  # 12,12: two counts for one device
    "chunk_tokens": ("0", "-5", "abc", "2000000", "1.5"),
    "pipeline_depth": ("2", "x", "-1"),
    "prefill_main": ("maybe",),
    "pin_limit_gib": ("-1", "nan", "abc", "1e12"),  # 1e12 GiB: more than this machine's RAM
    "gpu_order": ("random",),
    "expert_cache": ("-1", "lots", "inf"),
    "handoff": ("carrier",),
    "dtype": ("int8",),
    "timing": ("sometimes",),
    "check_nan": ("2",),
    "cuda_graphs": ("maybe",),
    "chunk_schedule": ("random",),
    "executor": ("fibers",),
    "rendezvous": ("host:0", "host:99999", "a b:1"),
}
LOAD_FLAGS = ("devices", "layer_split", "expert_cache", "pin_limit_gib", "dtype")


def cases() -> list[tuple[list[str], dict[str, str], str]]:
    """(argv, environment, text the one line must hold) of every bad value, by flag, by --arm
    and by environment variable."""
    out = []
    for name, values in BAD_VALUES.items():
        flag = "--" + name.replace("_", "-")
        for v in values:
            out.append((["run", flag, v], {}, name if name != "devices" or v != "cuda:9999" else "cuda:"))
            out.append((["run", "--arm", f"{name}={v}"], {}, name))
            if name in LOAD_FLAGS:
                out.append((["load", flag, v], {}, name))
            if name in ENV_NAMES:
                # the variable is named; a machine check (RAM, devices) names the setting
                out.append((["run"], {ENV_NAMES[name]: v}, f"{ENV_NAMES[name]}|{name}"))
    out += [
        (["run", "--arm", "chunk_size=128"], {}, "chunk_tokens"),  # lists the names there are
        (["run", "--repeat", "0"], {}, "repeat"),
        (["run", "--repeat", "x"], {}, "--repeat"),
        (["run", "--warmup", "-1"], {}, "warmup"),
        (["run", "--decode-tokens", "-1"], {}, "decode_tokens"),
        (["run", "--peak-tflops", "-5"], {}, "--peak-tflops"),
        (["run", "--model", "/nonexistent/m.gguf"], {}, "--model"),
        (["run", "--prompt-ids", "/nonexistent/ids.txt"], {}, "--prompt-ids"),
        (["load", "--model", "/nonexistent/m.gguf"], {}, "--model"),
        (["make-model", "/nonexistent-folder/m.gguf"], {}, "No such file or directory"),
    ]
    return out


def test_every_setting_has_bad_values():
    assert set(BAD_VALUES) == set(SETTING_NAMES)


def test_every_bad_value_exits_2_with_one_line_before_torch_is_imported(tmp_path):
    """All cases in one subprocess (a fresh interpreter: nothing imported by pytest), then a look
    at sys.modules: no torch, gguf, numpy-heavy engine module or model was imported."""
    code = """
import contextlib, io, json, os, sys
import engine.cli.bench as b
results = []
for argv, env, _ in json.load(open(sys.argv[1])):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                rc = b.main(argv)
            except SystemExit as e:
                rc = e.code
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    results.append((rc, err.getvalue()))
heavy = sorted(m for m in ("torch", "gguf", "engine.pipeline.session", "engine.io.gguf_model", "engine.io.synth")
               if m in sys.modules)
print(json.dumps({"results": results, "heavy": heavy}))
"""
    all_cases = cases()
    (tmp_path / "cases.json").write_text(json.dumps(all_cases))
    env = {k: v for k, v in __import__("os").environ.items() if k not in ENV_NAMES.values()}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cases.json")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["heavy"] == [], got["heavy"]
    for (argv, env_, words), (rc, err) in zip(all_cases, got["results"]):
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, (argv, env_, rc, err)
        assert "error" in lines[0] and any(w in lines[0] for w in words.split("|")), (argv, env_, lines[0])
    by_argv = {tuple(c[0]): r for c, r in zip(all_cases, got["results"])}
    listed = by_argv[("run", "--arm", "chunk_size=128")][1]
    assert all(name in listed for name in SETTING_NAMES), listed
    assert not (Path("/nonexistent-folder")).exists()


def test_the_engine_imports_no_dynamo_at_start_up():
    """torch.nn.attention.bias pulls torch._dynamo (seconds on a cold start): imported where used."""
    code = ("import sys\nimport engine.pipeline.session, engine.kernels.attention, engine.models.layers, engine.cli.bench\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch.nn.attention.bias') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


@pytest.mark.parametrize("value, bound", [(None, None), ("", 0), ("-1", 0), ("0,1", 2), ("1,-1,2", 1),
                                          ("GPU-8d1c", 1), ("0,,1", 1)])
def test_cuda_visible_devices_bounds_the_count(value, bound):
    assert visible_list_bound(value) == bound
