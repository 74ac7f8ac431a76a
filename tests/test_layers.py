"""The package's layers hold: engine/ never imports the app or Qt; only views/ (and the entry
point, the developer tools) import widgets; `*_model.py` modules import no Qt at all."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "strata_gui"


def imported(path: Path) -> set[str]:
    """Every module a file imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parent = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_engine_imports_neither_the_app_nor_qt():
    for path in (ROOT / "engine").rglob("*.py"):
        bad = {m for m in imported(path) if m.startswith(("strata_gui", "PySide6", "pyqtgraph"))}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_only_views_import_widgets():
    allowed = {APP / "app.py"}
    for path in APP.rglob("*.py"):
        rel = path.relative_to(APP)
        if path in allowed or rel.parts[0] in ("views", "tools"):
            continue
        bad = {m for m in imported(path)
               if m.startswith(("PySide6.QtWidgets", "pyqtgraph", "strata_gui.views", "strata_gui.tools"))}
        assert not bad, f"strata_gui/{rel} imports {sorted(bad)}"


def test_models_import_no_qt():
    models = sorted(APP.rglob("*_model.py"))
    assert len(models) >= 8
    for path in models:
        bad = {m for m in imported(path) if m.startswith(("PySide6", "pyqtgraph"))}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


WIDGET_BASES = ("QWidget", "QGroupBox", "QMainWindow", "QDialog")


def test_subpackages_and_naming():
    """app.py and __main__.py stay at the top; a module defining a widget ends in `_view.py`."""
    assert sorted(p.name for p in APP.glob("*.py")) == ["__init__.py", "__main__.py", "app.py"]
    for path in APP.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bases = {b.id for n in tree.body if isinstance(n, ast.ClassDef) for b in n.bases if isinstance(b, ast.Name)}
        if bases & set(WIDGET_BASES):
            assert path.parent.name == "views" and path.name.endswith("_view.py"), path.relative_to(ROOT)
