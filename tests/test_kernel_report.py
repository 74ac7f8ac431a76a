"""Which kernel each part runs, and the warning when a fast one is missing on CUDA — above all in a
frozen build, where engine/ modules are bytecode and Triton's @jit raises ValueError (not
ImportError).  The frozen case runs here on Linux: the engine compiled to .pyc only in a temp dir,
imported beside a `triton` whose `jit` reads a function's source the way Triton does."""
from __future__ import annotations

import compileall
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from engine.pipeline import kernel_report

ROOT = Path(__file__).resolve().parents[1]

# Triton's jit reads the decorated function's source (inspect.getsourcelines) and raises this
# ValueError when there is none: a module loaded from bytecode.  Everything else is permissive.
FAKE_TRITON = '''
import inspect
__version__ = "9.9.9-fake"
def jit(fn=None, **kw):
    def deco(f):
        try:
            inspect.getsourcelines(f)
        except OSError as exc:
            raise ValueError("@jit functions should be defined in a Python file") from exc
        return f
    return deco(fn) if fn is not None else deco
class _Any:
    def __getattr__(self, name): return _Any()
    def __call__(self, *a, **k): return _Any()
    def __getitem__(self, k): return _Any()
def __getattr__(name): return _Any()
'''
FAKE_LANGUAGE = '''
from triton import _Any
constexpr = _Any()
def __getattr__(name): return _Any()
'''

PROBE = textwrap.dedent('''
    import json, logging, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import engine.quant.dequant_triton, engine.kernels.moe_kernels, engine.kernels.qk_rope  # importing must not raise
    from engine.pipeline import kernel_report
    from gguf import GGMLQuantizationType as T
    parts = kernel_report.kernel_parts(["cuda"], is_moe=True, qtypes=[T.Q4_K, T.Q8_0, T.F32])
    print(json.dumps({"file": engine.kernels.moe_kernels.__file__, "describe": kernel_report.describe(parts),
                      "parts": [[p.part, p.kernel, p.detail, p.missing] for p in parts],
                      "warnings": kernel_report.warnings(parts) + kernel_report.warnings(parts)}))
''')


def _fake_triton(folder: Path) -> Path:
    pkg = folder / "triton"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_TRITON)
    (pkg / "language.py").write_text(FAKE_LANGUAGE)
    return folder


def _bytecode_engine(folder: Path) -> Path:
    """engine/ as a frozen build ships it: .pyc files where the modules were, no sources."""
    shutil.copytree(ROOT / "engine", folder / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    assert compileall.compile_dir(folder / "engine", legacy=True, quiet=1)
    for src in (folder / "engine").rglob("*.py"):
        src.unlink()
    return folder


def _probe(*path: Path, env_extra: dict[str, str] | None = None) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "TRITON_"))}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=path[-1], timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_bytecode_only_engine_with_triton_falls_back_and_warns_once(tmp_path):
    fake = _fake_triton(tmp_path / "fake")
    frozen = _bytecode_engine(tmp_path / "frozen")
    got, stderr = _probe(fake, frozen)
    assert got["file"].endswith(".pyc")  # the bytecode was what ran
    for part, kernel, detail, missing in got["parts"]:
        assert kernel == "torch" and missing, part
        assert "@jit functions should be defined in a Python file" in detail and "9.9.9-fake" in detail
    assert len(got["warnings"]) == 2 and got["warnings"][0] == got["warnings"][1]  # one note, same reason
    note = got["warnings"][0]
    assert note.startswith("fast kernel missing: dequant, MoE, q/k-norm+RoPE, decode attention run on torch on CUDA")
    assert "collects engine/ as source" in note
    assert stderr.count("fast kernel missing") == 1  # logged once per process, however often asked


def test_the_same_triton_with_sources_defines_the_kernels(tmp_path):
    """The control: the fake jit refuses only bytecode, so from source every part is Triton."""
    got, stderr = _probe(_fake_triton(tmp_path / "fake"), ROOT)
    assert got["file"].endswith(".py")
    kinds = {part: (kernel, detail) for part, kernel, detail, _ in got["parts"]}
    assert kinds["MoE"] == ("Triton 9.9.9-fake", "") and kinds["q/k-norm+RoPE"] == ("Triton 9.9.9-fake", "")
    assert kinds["decode attention"] == ("Triton 9.9.9-fake", "")
    assert kinds["dequant"][0] == "Triton 9.9.9-fake" and kinds["dequant"][1].startswith("Q4_K")
    assert "torch for Q8_0" in kinds["dequant"][1] or "Q8_0" in kinds["dequant"][1]
    assert got["warnings"] == [] and "fast kernel missing" not in stderr


def test_without_triton_on_cuda_the_parts_say_torch_and_why(tmp_path):
    blocked = tmp_path / "blocked"
    (blocked / "triton").mkdir(parents=True)
    (blocked / "triton" / "__init__.py").write_text("raise ImportError('No module named triton (blocked by the test)')\n")
    got, _ = _probe(blocked, ROOT)
    assert all(k == "torch" and m and "triton is not importable" in d for _, k, d, m in got["parts"])
    assert "install the cuda extra" in got["warnings"][0]


def test_a_part_switched_off_is_named_not_warned_about(tmp_path):
    got, _ = _probe(_fake_triton(tmp_path / "fake"), ROOT, env_extra={"STRATA_MOE_KERNELS": "torch"})
    moe = next(p for p in got["parts"] if p[0] == "MoE")
    assert moe[1:] == ["torch", "STRATA_MOE_KERNELS=torch", False] and got["warnings"] == []


def test_cpu_splits_and_dense_or_unquantised_models_need_no_warning(caplog):
    with caplog.at_level(logging.WARNING):
        parts = kernel_report.kernel_parts(["cpu"], is_moe=False, qtypes=[T.F32, T.BF16])
        assert kernel_report.describe(parts) == ("dequant: none (no quantised weights); MoE: none (a dense model); "
                                                 "q/k-norm+RoPE: torch (CPU); decode attention: torch (CPU)")
        assert kernel_report.warnings(parts) == []
    assert not caplog.records


@pytest.fixture
def cpu_session(demo_path):
    from engine.config import EngineConfig
    from engine.io import gguf_model
    from engine.pipeline.session import Session

    sess = Session(gguf_model.load(demo_path), EngineConfig(devices=["cpu"], chunk_tokens=16))
    yield sess
    sess.close()


def test_the_run_report_names_the_kernels(cpu_session):
    run = cpu_session.run(list(range(40)))
    assert run.report.kernels == cpu_session.kernels()
    assert run.report.kernels == ("dequant: torch (CPU); MoE: torch (CPU); q/k-norm+RoPE: torch (CPU); "
                                  "decode attention: torch (CPU)")  # Q8_0 experts
    assert not any(n.startswith("fast kernel missing") for n in run.report.notes)


def test_the_app_summary_shows_the_kernels_and_the_warning_in_colour(cpu_session, qtbot):
    import dataclasses

    from strata_gui.views.summary_view import SummaryView
    from strata_gui.views.theme import WARNING_COLOR

    report = cpu_session.run(list(range(40))).report
    note = ("fast kernel missing: MoE runs on torch on CUDA (slower): triton is not importable: No module named "
            "'triton'; install the cuda extra")
    view = SummaryView()
    qtbot.addWidget(view)
    view.show_report(dataclasses.replace(report, notes=[*report.notes, note]))
    text = view.figures.text()
    assert ">Kernels<" in text and "q/k-norm+RoPE: torch (CPU)" in text
    assert ">Warning<" in text and WARNING_COLOR in text and "fast kernel missing: MoE" in text


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU case (tests/test_cuda.py has the CUDA one)")
def test_the_selftest_exercise_without_cuda_runs_nothing_and_passes():
    assert kernel_report.exercise() == (True, "no CUDA device: Triton kernels not exercised")


def test_low_bit_mixes_expand_every_quantised_type_on_triton(monkeypatch):
    """llama.cpp's IQ3_XXS mix (IQ3_XXS experts, IQ3_S/IQ2_S attention, Q5_K output) and gpt-oss'
    MXFP4 experts: with triton every quantised type of theirs has a kernel, so the report names
    them all and says torch for none (the lattice / fp4 types took the torch path before)."""
    pytest.importorskip("triton")
    from engine.quant import dequant_triton

    monkeypatch.delenv(dequant_triton.ENV, raising=False)
    dequant_triton._kernels.cache_clear()
    try:
        parts = kernel_report.kernel_parts(["cuda"], is_moe=True,
                                           qtypes=[T.IQ3_XXS, T.IQ3_S, T.IQ2_S, T.Q5_K, T.MXFP4, T.Q8_0, T.F32])
    finally:
        dequant_triton._kernels.cache_clear()
    dq = next(p for p in parts if p.part == "dequant")
    assert dq.kernel.startswith("Triton") and not dq.missing, dq
    assert dq.detail == "IQ2_S, IQ3_S, IQ3_XXS, MXFP4, Q5_K, Q8_0", dq.detail


def test_a_gdn_model_names_its_delta_rule(monkeypatch):
    """The GDN layers' rule is a part of its own (only for a model that has them): torch on CPU and
    in fp32, fla on CUDA where it imports; without fla a CUDA bf16 split says torch with the gdn
    extra's fix, and STRATA_GDN_KERNEL=torch is named, not warned about."""
    import sys

    from engine.kernels import gated_delta_fla

    cpu = kernel_report.kernel_parts(["cpu"], is_moe=True, gdn=True)
    assert cpu[-1] == kernel_report.PartKernel("GDN rule", "torch", "CPU")
    assert "GDN rule" not in kernel_report.describe(kernel_report.kernel_parts(["cpu"], is_moe=True))
    fp32 = kernel_report.kernel_parts(["cuda"], is_moe=True, gdn=True, half=False)[-1]
    assert (fp32.kernel, fp32.missing) == ("torch", False) and "fp32" in fp32.detail
    monkeypatch.delenv(gated_delta_fla.ENV, raising=False)
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla` raises ImportError
    gated_delta_fla._load.cache_clear()
    try:
        part = kernel_report.kernel_parts(["cuda"], is_moe=True, gdn=True)[-1]
        assert part.part == "GDN rule" and part.kernel == "torch" and part.missing
        assert part.detail.startswith("fla is not importable")
        note = kernel_report.warnings([part])[0]
        assert note.startswith("fast kernel missing: GDN rule runs on torch on CUDA") and "gdn extra" in note
        monkeypatch.setenv(gated_delta_fla.ENV, "torch")
        off = kernel_report.kernel_parts(["cuda"], is_moe=True, gdn=True)[-1]
        assert (off.kernel, off.detail, off.missing) == ("torch", "STRATA_GDN_KERNEL=torch", False)
        assert kernel_report.warnings([off]) == []
    finally:
        gated_delta_fla._load.cache_clear()


def test_a_qwen3next_session_reports_the_gdn_rule():
    from engine.config import EngineConfig
    from engine.io import gguf_model
    from engine.pipeline.session import Session

    sess = Session(gguf_model.load(ROOT / "tests" / "data" / "families" / "qwen3next.gguf"),
                   EngineConfig(devices=["cpu"], chunk_tokens=16))
    try:
        assert sess.kernels().endswith("; GDN rule: torch (CPU)")
    finally:
        sess.close()
