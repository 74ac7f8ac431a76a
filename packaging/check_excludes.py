"""Run the self-test, and text prompts of every supported architecture, in this interpreter with
every module the frozen build leaves out (bundle.module_excludes) made unimportable — the same
ImportError the frozen app would meet.  Seconds instead of a build of minutes:

    QT_QPA_PLATFORM=offscreen .venv/bin/python packaging/check_excludes.py

Exit 0 when everything passed; prints which excluded modules something tried to import (a
dependency's optional import that falls back is fine; a failure names what to keep).
"""
from __future__ import annotations

import importlib.abc
import os
import runpy
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import bundle  # noqa: E402


class Blocker:
    """Hides `names` and everything below them from every finder, as PyInstaller's `excludes` do:
    `import` raises ModuleNotFoundError and importlib.util.find_spec returns None."""

    def __init__(self, names: list[str], dists: set[str] | None = None) -> None:
        self.names = set(names)
        self.dists = dists  # normalized names of the distributions whose metadata is bundled
        self.tried: dict[str, int] = {}

    def blocked(self, fullname: str) -> str | None:
        parts = fullname.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in self.names:
                return prefix
        return None

    def install(self) -> None:
        sys.meta_path[:] = [_Hidden(f, self) for f in sys.meta_path]


class _Hidden(importlib.abc.MetaPathFinder):
    def __init__(self, finder, blocker: Blocker) -> None:
        self.finder, self.blocker = finder, blocker

    def find_spec(self, fullname, path=None, target=None):
        hit = self.blocker.blocked(fullname)
        if hit is not None:
            self.blocker.tried[hit] = self.blocker.tried.get(hit, 0) + 1
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(fullname, path, target) if find else None

    def invalidate_caches(self) -> None:
        if hasattr(self.finder, "invalidate_caches"):
            self.finder.invalidate_caches()

    def find_distributions(self, *args, **kwargs):  # importlib.metadata: only what the bundle carries
        find = getattr(self.finder, "find_distributions", None)
        if find is None:
            return iter(())
        dists = self.blocker.dists
        return (d for d in find(*args, **kwargs)
                if dists is None or bundle.normalize_dist(d.metadata["Name"] or "") in dists)

    def __getattr__(self, name):
        return getattr(self.finder, name)


def main() -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    excludes = bundle.module_excludes()
    already = sorted(m for m in sys.modules if Blocker(excludes).blocked(m))
    if already:
        print(f"check_excludes: already imported before the check: {already}", file=sys.stderr)
        return 2
    # what transformers' hook copies; read from the file, since importing transformers before the
    # blocker is in place would cache its availability checks
    table = bundle._package_dir("transformers") / "dependency_versions_table.py"
    deps = runpy.run_path(str(table))["deps"]
    dists = {bundle.normalize_dist(n) for n in [*bundle.METADATA, *deps]}
    blocker = Blocker(excludes, dists)
    blocker.install()
    print(f"check_excludes: {len(excludes)} modules blocked")

    t0 = time.perf_counter()
    from engine.io import prompt
    from engine.io.gguf_model import load
    from engine.io.synth import ModelRecipe, demo_model_path, write_model
    from strata_gui.app import make_app
    from strata_gui.tools.selftest import run_selftest

    failures = []
    app = make_app()
    # ignore_cleanup_errors: on Windows the GGUF files are still memory-mapped when the block ends
    with tempfile.TemporaryDirectory(prefix="strata-check-", ignore_cleanup_errors=True) as tmp:
        demo = demo_model_path(Path(tmp))
        result = run_selftest(app, demo, Path(tmp) / "selftest.png")
        print(f"  selftest: {'ok' if result.ok else 'FAILED'}: {result.message}")
        if not result.ok:
            failures.append("selftest")
        for arch in ("qwen3moe", "qwen3", "qwen2", "llama"):
            path = write_model(Path(tmp) / f"{arch}.gguf", ModelRecipe(arch=arch, n_layers=1))
            try:
                ids = prompt.tokenize(load(path), "hello world, the pipeline split")
                print(f"  text prompt, {arch}: ok ({len(ids)} tokens)")
            except Exception as exc:
                print(f"  text prompt, {arch}: FAILED: {type(exc).__name__}: {exc}")
                failures.append(arch)
    print(f"check_excludes: {time.perf_counter() - t0:.1f} s; excluded modules something tried to import: "
          f"{dict(sorted(blocker.tried.items())) or 'none'}")
    if failures:
        print(f"check_excludes: FAILED: {', '.join(failures)}", file=sys.stderr)
        return 1
    print("check_excludes: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
