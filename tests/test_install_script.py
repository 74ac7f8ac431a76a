"""scripts/install.py keeps a torch the venv already has (a CUDA build above all) instead of
replacing it with the CPU wheel, checked against a fake "installed torch" on this Linux machine —
with pip's own resolver, offline: a throw-away venv holds a fake CUDA torch, and a local wheel
folder holds a stand-in wheel for each of the project's dependencies (and the CPU torch 2.14.1
that PyPI would hand a Windows user)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import json
import os
import subprocess
import sys
import tomllib
import venv
import zipfile
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("strata_install", ROOT / "scripts" / "install.py")
install = importlib.util.module_from_spec(spec)
sys.modules["strata_install"] = install  # dataclasses look their module up
spec.loader.exec_module(install)


def _fake_torch(folder: Path, version: str, cuda: str | None) -> dict[str, str]:
    """A 'torch' package that reports a version and a CUDA build, on PYTHONPATH."""
    pkg = folder / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\nclass version:\n    cuda = {cuda!r}\n")
    return {**os.environ, "PYTHONPATH": str(folder)}


def test_probe_reads_the_installed_torch(tmp_path):
    env = _fake_torch(tmp_path, "2.11.0+cu130", "13.0")
    got = install.probe_torch(sys.executable, env)
    assert got == install.TorchInfo("2.11.0+cu130", "13.0") and got.kind == "CUDA 13.0"


def test_an_installed_cuda_torch_is_kept_and_pinned(tmp_path):
    installed = install.probe_torch(sys.executable, _fake_torch(tmp_path, "2.11.0+cu130", "13.0"))
    steps, constraints, what = install.plan(installed, ["test"])
    flat = [a for step in steps for a in step]
    assert not any(a.startswith("torch") for a in flat)  # no torch requirement of ours at all
    assert constraints == "torch==2.11.0+cu130\n" and "--constraint" in flat
    assert "keeping the installed torch 2.11.0+cu130 (CUDA 13.0)" in what
    assert steps[0][:3] == ["install", "-e", ".[test]"]


def test_without_torch_the_cpu_wheel_or_the_chosen_cuda_index_then_pinned():
    steps, constraints, _ = install.plan(None)
    assert steps == [["install", install.CPU_TORCH, "-e", "."]] and constraints == ""
    steps, _, what = install.plan(None, ["test", "cuda"], torch_index="https://download.pytorch.org/whl/cu128")
    # the index gives a torch in the project's own range, and the -e step runs under a pin of it
    assert steps[0] == ["install", install.torch_requirement(), "--index-url", "https://download.pytorch.org/whl/cu128"]
    assert steps[1] == ["install", "-e", ".[test,cuda]", "--constraint", "{constraints}"]
    assert install.CPU_TORCH not in [a for s in steps for a in s]


def test_the_torch_range_is_the_pyprojects_and_admits_current_releases():
    req = Requirement(install.torch_requirement())
    assert req.name == "torch"
    for v in ("2.11.0+cu130", "2.13.0", "2.14.1", "2.15.0+cu128"):  # device, CI, PyPI's current two
        assert req.specifier.contains(v), v


def test_refusal_names_both_torches():
    cuda = install.TorchInfo("2.15.0+cu128", "12.8")
    assert install.refusal(cuda, install.DryRun(True, None, 12, "")) == ""
    line = install.refusal(cuda, install.DryRun(True, "2.14.1", 12, ""))
    assert "2.15.0+cu128 (CUDA 12.8)" in line and "2.14.1 (a CPU build)" in line
    line = install.refusal(cuda, install.DryRun(False, None, 0, "ERROR: ResolutionImpossible"))
    assert line.startswith("refusing: pip cannot install") and "ResolutionImpossible" in line


def test_entry_points_are_named_by_path_for_both_platforms():
    v = Path(".venv")
    assert install.venv_command(v, "strata-gui", windows=True) == v / "Scripts/strata-gui.exe"
    assert install.venv_command(v, "strata-gui", windows=False) == v / "bin/strata-gui"
    assert install.venv_python(v, windows=True) == v / "Scripts/python.exe"


# --- pip's resolver, offline ---------------------------------------------------------------------

def _wheel(folder: Path, name: str, version: str, files: dict[str, bytes] | None = None,
           dist_info: dict[str, bytes] | None = None) -> Path:
    """A wheel (a zip with a .dist-info) that installs `files`; no dependencies."""
    stem = f"{name.replace('-', '_')}-{version}"
    info = f"{stem}.dist-info"
    meta = {"METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
            "WHEEL": b"Wheel-Version: 1.0\nGenerator: strata-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
            **(dist_info or {})}
    path = folder / f"{stem}-py3-none-any.whl"
    entries = {**(files or {}), **{f"{info}/{k}": v for k, v in meta.items() if k != "RECORD"}}
    with zipfile.ZipFile(path, "w") as z:
        for n, data in entries.items():
            z.writestr(n, data)
        z.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in [*entries, f"{info}/RECORD"]))
    return path


def _setuptools_wheel(folder: Path) -> None:
    """The build backend pip's isolated build needs, zipped from this interpreter's own setuptools."""
    dist = importlib.metadata.distribution("setuptools")
    base = Path(dist.locate_file(""))
    files = {}
    for f in dist.files or []:
        p = str(f)
        if "__pycache__" in p or p.endswith(".pyc") or ".dist-info/" in p or p.startswith(".."):
            continue
        files[p] = (base / f).read_bytes()
    dist_info = {"METADATA": dist.read_text("METADATA").encode(),
                 "entry_points.txt": (dist.read_text("entry_points.txt") or "").encode()}
    _wheel(folder, "setuptools", dist.version, files, dist_info)


def _lowest(req: Requirement) -> str:
    """The lowest version a requirement names that it admits (every dependency here has a lower bound)."""
    for s in req.specifier:
        if req.specifier.contains(s.version, prereleases=True):
            return s.version
    return "1.0"


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wheels")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for d in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        r = Requirement(d)
        if r.name != "torch" and not (folder / f"{r.name.replace('-', '_')}-{_lowest(r)}-py3-none-any.whl").exists():
            _wheel(folder, r.name, _lowest(r), {f"{r.name.replace('-', '_')}_fake.py": b""})
    # what PyPI hands a Windows user: the CPU build of the newest torch the old pin allowed
    _wheel(folder, "torch", "2.14.1", {"torch/__init__.py": b"__version__ = '2.14.1'\nclass version:\n    cuda = None\n"})
    _wheel(folder, "wheel", "0.45.1", {"wheel_fake.py": b""})
    _setuptools_wheel(folder)
    return folder


@pytest.fixture(scope="module")
def test_venv(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("venv") / "v"
    venv.create(folder, with_pip=True)
    return folder


def _pip_env(wheelhouse: Path) -> dict[str, str]:
    """pip on this machine, told to use only the wheel folder and no config (its global constraints included)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheelhouse),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONPATH": ""}


def _install_fake_torch(v: Path, version: str, cuda: str) -> None:
    py = install.venv_python(v)
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for old in site.glob("torch*"):
        subprocess.run(["rm", "-rf", str(old)], check=True)
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\nclass version:\n    cuda = {cuda!r}\n")
    info = site / f"torch-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


def _run_script(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = install.main(args, env)
    return rc, buf.getvalue()


def test_dry_run_keeps_an_installed_cuda_torch(wheelhouse, test_venv):
    """The issue's case: torch 2.15.0+cu128 in the venv; the old pin (<2.15) made pip swap in 2.14.1 (CPU)."""
    _install_fake_torch(test_venv, "2.15.0+cu128", "12.8")
    rc, out = _run_script(["--venv", str(test_venv), "--dry-run", "--test"], _pip_env(wheelhouse))
    assert rc == 0, out
    assert "keeping the installed torch 2.15.0+cu128 (CUDA 12.8)" in out
    assert "torch 2.15.0+cu128 stays" in out and "--constraint" in out


def test_a_cuda_torch_outside_the_range_is_refused_where_plain_pip_would_replace_it(wheelhouse, test_venv, tmp_path):
    _install_fake_torch(test_venv, "2.16.0+cu130", "13.0")
    env = _pip_env(wheelhouse)
    # plain pip (no constraint): would quietly install the CPU torch 2.14.1 over the CUDA build
    report = tmp_path / "r.json"
    subprocess.run([str(install.venv_python(test_venv)), "-m", "pip", "install", "-e", ".", "--dry-run", "--quiet",
                    "--report", str(report)], cwd=ROOT, env=env, check=True, capture_output=True)
    plain = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert plain["torch"] == "2.14.1"
    # the script: refuses in one line, installs nothing
    rc, out = _run_script(["--venv", str(test_venv), "--dry-run"], env)
    assert rc == 1
    assert "refusing: pip cannot install Strata GUI beside the installed torch 2.16.0+cu130 (CUDA 13.0)" in out


def test_torch_index_installs_then_pins_what_it_got_for_the_rest(wheelhouse, tmp_path):
    """The whole --torch-index path, for real and offline: a new venv, torch from the "index" (a
    wheel folder holding a fake CUDA build), then the project under a pin of that torch; the
    script's last check finds the CUDA build still there."""
    index = tmp_path / "cuda-index"
    index.mkdir()
    _wheel(index, "torch", "2.15.0+cu128",
           {"torch/__init__.py": b"__version__ = '2.15.0+cu128'\nclass version:\n    cuda = '12.8'\n"})
    env = {**_pip_env(wheelhouse), "PIP_FIND_LINKS": f"{index} {wheelhouse}"}
    v = tmp_path / "v"
    rc, out = _run_script(["--venv", str(v), "--torch-index", "https://download.pytorch.org/whl/cu128"], env)
    assert rc == 0, out
    assert "installed torch 2.15.0+cu128 (CUDA 12.8); pinning it for the rest" in out
    assert "torch 2.15.0+cu128 stays" in out and out.rstrip().splitlines()[-1].startswith("done:")
    assert install.probe_torch(install.venv_python(v), env) == install.TorchInfo("2.15.0+cu128", "12.8")
