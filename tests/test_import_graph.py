"""The engine's import graph: no cycle among its modules (imports inside functions count too; only
`if TYPE_CHECKING:` blocks are left out) and no engine module imports Qt or the app.  The map,
docs/architecture.md, names the packages and which may import which."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"
FORBIDDEN = ("PySide6", "PyQt5", "PyQt6", "pyqtgraph", "shiboken6", "strata_gui")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imported(path: Path, modules: set[str]) -> tuple[set[str], set[str]]:
    """(engine modules `path` imports, top-level packages it imports) — TYPE_CHECKING left out."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tops: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for n in child.orelse:
                    visit(n)
                continue
            if isinstance(child, ast.Import):
                for a in child.names:
                    tops.add(a.name.split(".")[0])
                    if a.name in modules:
                        found.add(a.name)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                tops.add(target.split(".")[0])
                for a in child.names:
                    sub = f"{target}.{a.name}"
                    if sub in modules:
                        found.add(sub)
                    elif target in modules:
                        found.add(target)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    found.discard(name)
    return found, tops


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    files = sorted(ENGINE.rglob("*.py"))
    modules = {module_name(p) for p in files}
    edges, tops = {}, {}
    for p in files:
        edges[module_name(p)], tops[module_name(p)] = imported(p, modules)
    return edges, tops


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycle_inside_the_engine():
    edges, _ = graph()
    assert cycles(edges) == []


def test_the_engine_never_imports_qt_or_the_app():
    _, tops = graph()
    bad = {m: sorted(t & set(FORBIDDEN)) for m, t in tops.items() if t & set(FORBIDDEN)}
    assert bad == {}


def test_the_checker_sees_a_cycle_and_a_function_level_import(tmp_path):
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    pkg = tmp_path / "engine"
    pkg.mkdir()
    (pkg / "x.py").write_text("def f():\n    from . import y\n", encoding="utf-8")
    (pkg / "y.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import x\n",
                              encoding="utf-8")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        mods = {"engine.x", "engine.y"}
        assert imported(pkg / "x.py", mods)[0] == {"engine.y"}
        assert imported(pkg / "y.py", mods)[0] == set()
    finally:
        ROOT = saved


# engine's packages, lowest first: each may import the core and the packages before it, never
# one after it (docs/architecture.md, "Packages").  "core" is engine's own modules (config,
# settings_table, errors, events, failure, sizes, sweep).
LAYERS = ("core", "hw", "kernels", "quant", "models", "io", "plan", "pipeline", "cli")


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else "core"


def test_each_package_imports_only_the_ones_below_it():
    edges, _ = graph()
    upward = sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                    if LAYERS.index(package_of(b)) > LAYERS.index(package_of(a)))
    assert upward == []
    assert {package_of(m) for m in edges} == set(LAYERS)  # every package of the map exists, no other
