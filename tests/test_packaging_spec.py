"""The PyInstaller spec builds both programs into one folder — the windowed app and the console
`strata-bench` — and ships engine/ as source (Triton's @jit refuses bytecode).  Read from the spec
itself (its syntax tree), so no PyInstaller is needed; packaging/build.sh builds it for real."""
from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "packaging" / "strata_gui.spec"
_spec = importlib.util.spec_from_file_location("strata_bundle", ROOT / "packaging" / "bundle.py")
bundle = importlib.util.module_from_spec(_spec)
sys.modules["strata_bundle"] = bundle
_spec.loader.exec_module(bundle)


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]


def _kw(call: ast.Call, key: str) -> ast.expr:
    return next(k.value for k in call.keywords if k.arg == key)


def test_the_spec_builds_a_windowed_app_and_a_console_bench_into_one_folder():
    tree = ast.parse(SPEC.read_text())
    execs = {}
    for call in _calls(tree, "_exe"):
        script, name, console = call.args[0], call.args[1], _kw(call, "console")
        execs[ast.unparse(name)] = (ast.literal_eval(script), ast.literal_eval(console))
    assert execs == {"bundle.APP_NAME": ("entry", False), "bundle.BENCH_NAME": ("bench_entry", True)}
    assert (bundle.APP_NAME, bundle.BENCH_NAME) == ("strata-gui", "strata-bench")
    # one EXE( call, made for each program with its console flag; both go into the one COLLECT folder
    (exe_call,) = _calls(tree, "EXE")
    assert ast.unparse(_kw(exe_call, "console")) == "console" and ast.unparse(_kw(exe_call, "name")) == "name"
    (coll,) = _calls(tree, "COLLECT")
    assert [ast.unparse(a) for a in coll.args[:2]] == ["exe", "bench_exe"]
    assert ast.unparse(_kw(coll, "name")) == "bundle.APP_NAME"


def test_both_entry_scripts_are_analysed_and_each_exe_runs_only_its_own():
    tree = ast.parse(SPEC.read_text())
    (analysis,) = _calls(tree, "Analysis")
    scripts = ast.unparse(analysis.args[0])
    assert scripts == "[str(SPEC_DIR / 'entry.py'), str(SPEC_DIR / 'bench_entry.py')]"
    for script, main in (("entry.py", "strata_gui.app import main"), ("bench_entry.py", "engine.cli.bench import main")):
        text = (ROOT / "packaging" / script).read_text()
        assert f"from {main}" in text and "freeze_support()" in text
    # _script drops the other entry script from a.scripts
    ns: dict = {}
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_script")
    exec(compile(ast.Module([fn], []), str(SPEC), "exec"), ns)
    class A:  # noqa: N801 (the spec's `a`, as PyInstaller's Analysis leaves its scripts)
        scripts = [("pyiboot01_bootstrap", "x", "PYSOURCE"), ("entry", "e", "PYSOURCE"), ("bench_entry", "b", "PYSOURCE")]
    ns["a"] = A
    assert [s[0] for s in ns["_script"]("entry")] == ["pyiboot01_bootstrap", "entry"]
    assert [s[0] for s in ns["_script"]("bench_entry")] == ["pyiboot01_bootstrap", "bench_entry"]


def test_engine_and_triton_are_collected_as_source():
    tree = ast.parse(SPEC.read_text())
    (analysis,) = _calls(tree, "Analysis")
    assert ast.unparse(_kw(analysis, "module_collection_mode")) == "bundle.COLLECTION_MODE"
    assert bundle.COLLECTION_MODE["engine"] == "py" and bundle.COLLECTION_MODE["triton"] == "py"
    # nothing the frozen app runs a Triton kernel from may be excluded
    assert not any(m.split(".")[0] in ("engine", "triton") for m in bundle.THIRD_PARTY_EXCLUDES)
