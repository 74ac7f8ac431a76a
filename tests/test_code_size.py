"""The house rule of issue 31: no class over 300 lines and no function over 80 in engine/ and
strata_gui/ (nested classes and functions are held to it too)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLASS_LINES, FUNCTION_LINES = 300, 80


def too_long(source: str, where: str) -> dict[str, int]:
    """`where::qualified name` -> lines, for each class or function of `source` over its limit."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                lines = child.end_lineno - child.lineno + 1
                if lines > (CLASS_LINES if isinstance(child, ast.ClassDef) else FUNCTION_LINES):
                    found[f"{where}::{name}"] = lines
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_no_class_or_function_over_the_limit():
    found: dict[str, int] = {}
    for root in ("engine", "strata_gui"):
        for path in sorted((ROOT / root).rglob("*.py")):
            found |= too_long(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())
    assert found == {}


def test_the_rule_sees_long_methods_inside_classes():
    body = "\n".join(f"        x{i} = {i}" for i in range(80))
    source = f"class A:\n    def short(self):\n        pass\n\n    def long(self):\n{body}\n"
    assert too_long(source, "m.py") == {"m.py::A.long": 81}
