"""What goes into the frozen app and what stays out: the one place `strata_gui.spec` and
`check_excludes.py` read it from.  Plain Python, no PyInstaller import, so the policy can be
checked in a normal interpreter in seconds (check_excludes.py) before a build that takes minutes.

Three kinds of trimming, each kept only where a run showed the app does not need it:
- module excludes (`module_excludes`): packages the app never imports, although a hook or an
  optional import of a dependency would pull them in;
- transformers trimmed to what text prompts use (GGUF vocabulary -> tokenizer): configurations,
  tokenizers and the GGUF integration; every model's modeling/processing code stays out;
- file filters (`drop_file`): torch's C++ test programs, protoc and test libraries that the torch
  hook collects as data or binaries.

`STRATA_BUNDLE_TRIM=0` turns all of it off (the baseline the README's size table compares with).
"""
from __future__ import annotations

import fnmatch
import os
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP_NAME = "strata-gui"  # the windowed app
BENCH_NAME = "strata-bench"  # the console CLI beside it (--help, `stage` for attached stages, benchmarks)

# Modules shipped as .py source files instead of bytecode in the executable's archive:
# Triton's @jit reads a kernel's source (inspect), and raises "ValueError: @jit functions should be
# defined in a Python file" for a module loaded from bytecode.  engine/ holds our kernels;
# triton (also the module name of triton-windows) holds @jit functions of its own
# (triton.language.standard).  "py": loaded from the .py files in _internal/, as from a venv.
COLLECTION_MODE = {"engine": "py", "triton": "py"}


def trim_enabled() -> bool:
    return os.environ.get("STRATA_BUNDLE_TRIM", "1") != "0"


# ---------------------------------------------------------------------------------------------
# Modules.  NOT excluded although the issue suggested it, because a run imports them:
#   unittest (import torch imports it), sympy + mpmath (torch.nn.attention.bias -> torch._dynamo
#   -> symbolic shapes), torch._dynamo / _inductor / onnx / distributed (same chain), jinja2 and
#   huggingface_hub (transformers' tokenizer path), pydoc, sqlite3 (the GUI's run history).
STDLIB_EXCLUDES = [
    "tkinter", "_tkinter", "turtle", "turtledemo", "idlelib", "lib2to3", "ensurepip", "venv",
    "test",  # CPython's own test suite
]

THIRD_PARTY_EXCLUDES = [
    # notebooks, plotting and data stacks a dependency may import optionally
    "matplotlib", "IPython", "ipykernel", "ipywidgets", "jupyter_client", "notebook", "scipy", "pandas",
    "PIL", "cv2", "h5py", "numba", "cupy",
    # other ML backends transformers (and torch) probe for: TF/Flax/JAX, vision/audio add-ons
    "tensorflow", "tensorboard", "keras", "tf_keras", "flax", "jax", "jaxlib", "optax",
    "torchvision", "torchaudio", "onnxruntime", "accelerate", "peft", "bitsandbytes", "deepspeed",
    "sentencepiece", "timm", "datasets", "evaluate",
    # build and test tooling of the venv
    "setuptools", "pkg_resources", "pip", "wheel", "pytest", "_pytest", "pytestqt", "pluggy", "hypothesis",
    # torch._inductor's graph tooling; never imported by a run
    "networkx",
    # the Hugging Face Hub's download accelerator (11 MB) and its command line (typer, rich,
    # pygments, pydantic); text prompts read a local file
    "hf_xet", "typer", "click", "shellingham", "rich", "pygments", "markdown_it", "mdurl", "pydantic",
    "pydantic_core", "fsspec",
    # pyqtgraph's parts that need PyOpenGL / Jupyter, and its examples
    "OpenGL", "pyqtgraph.opengl", "pyqtgraph.jupyter", "pyqtgraph.examples",
]

# Qt modules the app does not use (it uses QtCore, QtGui, QtWidgets, QtSvg, QtOpenGL,
# QtOpenGLWidgets and QtTest, the last four through pyqtgraph).
QT_EXCLUDES = [f"PySide6.{m}" for m in (
    "QtNetwork", "QtNetworkAuth", "QtQml", "QtQuick", "QtQuickWidgets", "QtQuickControls2", "QtQuickTest",
    "QtQuick3D", "QtDBus", "QtDesigner", "QtUiTools", "QtHelp", "QtSql", "QtXml", "QtPrintSupport",
    "QtConcurrent", "QtStateMachine", "QtSvgWidgets", "QtCharts", "QtDataVisualization", "QtGraphs",
    "QtMultimedia", "QtMultimediaWidgets", "QtPdf", "QtPdfWidgets", "QtWebEngineCore", "QtWebEngineWidgets",
    "QtWebEngineQuick", "QtWebChannel", "QtWebSockets", "QtWebView", "QtBluetooth", "QtNfc", "QtPositioning",
    "QtLocation", "QtSensors", "QtSerialPort", "QtSerialBus", "QtTextToSpeech", "QtRemoteObjects",
    "QtScxml", "QtSpatialAudio", "QtHttpServer", "QtAxContainer", "Qt3DCore", "Qt3DRender", "Qt3DInput",
    "Qt3DLogic", "Qt3DAnimation", "Qt3DExtras")]

TORCH_EXCLUDES = ["torch.utils.tensorboard", "torch.utils.benchmark", "torch.utils.bottleneck"]

# torch.testing._internal is test code, but `import torch` and torch._dynamo import these few.
TORCH_TESTING_KEEP = {
    "torch.testing._internal", "torch.testing._internal.common_dtype", "torch.testing._internal.logging_tensor",
    "torch.testing._internal.distributed", "torch.testing._internal.distributed.fake_pg",
}

# transformers: the parts of each model package that text prompts never import.
_TRANSFORMERS_MODEL_DROP = re.compile(
    r"^(modeling|modular|image_processing|video_processing|feature_extraction|processing|convert)_")
# whole subpackages of transformers outside the tokenizer path.  Kept although unused by text
# prompts: modeling_utils, distributed, quantizers & co. (a llama configuration reaches them
# through integrations.hub_kernels -> core_model_loading); chasing that graph per release is not
# worth a few MB.
TRANSFORMERS_DROP = [f"transformers.{m}" for m in (
    "pipelines", "trainer", "trainer_callback", "trainer_pt_utils", "trainer_seq2seq", "trainer_utils",
    "training_args", "training_args_seq2seq", "data", "commands", "cli", "exporters", "onnx", "benchmark",
    "sagemaker", "hyperparameter_search")]


def _package_dir(name: str) -> Path | None:
    """Directory of a (sub)package, found without importing it (torch takes seconds)."""
    import importlib.util

    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*rest)
    return path if (path / "__init__.py").is_file() else None


def _modules_under(package: str, base: Path) -> list[str]:
    """Dotted names of every module and package below `base` (the directory of `package`)."""
    out = []
    for path in base.rglob("*.py"):
        rel = path.relative_to(base).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p == "__pycache__" for p in parts):
            continue
        out.append(".".join([package, *parts]))
    return out


def torch_testing_excludes() -> list[str]:
    base = _package_dir("torch.testing._internal")
    if base is None:
        return []
    names = _modules_under("torch.testing._internal", base)
    # exclude the top-most names outside the keep set (their children go with them)
    drop = sorted(n for n in names if n not in TORCH_TESTING_KEEP
                  and not any(k.startswith(n + ".") for k in TORCH_TESTING_KEEP))
    top = [n for n in drop if not any(n.startswith(d + ".") for d in drop if d != n)]
    return top


def transformers_excludes() -> list[str]:
    base = _package_dir("transformers")
    if base is None:
        return []
    out = list(TRANSFORMERS_DROP)
    models = base / "models"
    for pkg in sorted(p for p in models.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        if pkg.name == "auto":  # modeling_auto & co. are the name tables the Auto classes read
            continue
        for f in sorted(pkg.glob("*.py")):
            if _TRANSFORMERS_MODEL_DROP.match(f.stem):
                out.append(f"transformers.models.{pkg.name}.{f.stem}")
    return out


def module_excludes() -> list[str]:
    if not trim_enabled():
        return list(STDLIB_EXCLUDES)  # tkinter & co. stay out even in the baseline
    return (STDLIB_EXCLUDES + THIRD_PARTY_EXCLUDES + QT_EXCLUDES + TORCH_EXCLUDES
            + torch_testing_excludes() + transformers_excludes())


# ---------------------------------------------------------------------------------------------
# Package metadata (dist-info) the frozen app reads with importlib.metadata.  httpx2 and
# httpcore2 read their own version at import (huggingface_hub -> transformers' tokenizer path)
# and have no PyInstaller hook; the others are what transformers' and huggingface_hub's
# availability checks ask for.  transformers' hook adds the rest of its dependency table.
METADATA = ["httpx2", "httpcore2", "huggingface_hub", "tokenizers", "transformers", "tqdm", "regex",
            "safetensors", "filelock", "numpy", "packaging", "pyyaml", "jinja2", "torch", "gguf"]


def normalize_dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ---------------------------------------------------------------------------------------------
# Files (destination paths inside the bundle, '/' separators): torch's tests and tools.
DROP_FILE_PATTERNS = [
    "torch/test/*",  # C++ unit-test programs (86 MB on Linux)
    "torch/bin/*",  # protoc and C++ test programs (52 MB on Linux); torch_shm_manager stays
    "torch/include/*", "torch/share/*",  # headers, CMake files
    "torch/lib/*jitbackend_test*", "torch/lib/*torchbind_test*", "torch/lib/*aoti_custom_ops*",
    "torch/lib/*backend_with_compiler*",
    # a CUDA toolkit's runtime found on the build machine through a ctypes reference (torch brings
    # its own CUDA libraries; a second cudart beside the executable could shadow them)
    "libcudart.so*", "cudart64_*.dll",
    "torch/*.pyi", "PySide6/*.pyi",  # type stubs (fnmatch: * also crosses /)
]


# ... except what `import torch` checks for on Linux, and (caution, unmeasured on Windows) any DLL
KEEP_FILE_PATTERNS = ["torch/bin/torch_shm_manager*", "torch/bin/*.dll"]


def drop_file(dest: str) -> bool:
    if not trim_enabled():
        return False
    d = dest.replace("\\", "/")
    if any(fnmatch.fnmatch(d, p) for p in KEEP_FILE_PATTERNS):
        return False
    return any(fnmatch.fnmatch(d, p) for p in DROP_FILE_PATTERNS)


# ---------------------------------------------------------------------------------------------
# Version metadata

def project_version() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def version_tuple(version: str) -> tuple[int, int, int, int]:
    """'0.1.0' -> (0, 1, 0, 0); pre/dev/local parts ('1.2.0rc1', '1.2.0.dev3+g12') are dropped."""
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        raise ValueError(f"cannot read a version number from {version!r}")
    nums = [int(x) for x in m.group(1).split(".")][:4]
    return tuple(nums + [0] * (4 - len(nums)))  # type: ignore[return-value]


def version_info_text(version: str) -> str:
    """A PyInstaller version-resource file (the format `pyi-grab_version` writes)."""
    t = version_tuple(version)
    strings = {
        "CompanyName": "Strata",
        "FileDescription": "Strata GUI - layer-split MoE prefill pipeline viewer",
        "FileVersion": version,
        "InternalName": APP_NAME,
        "LegalCopyright": "MIT License",
        "OriginalFilename": f"{APP_NAME}.exe",
        "ProductName": "Strata GUI",
        "ProductVersion": version,
    }
    entries = ",\n".join(f"          StringStruct({k!r}, {v!r})" for k, v in strings.items())
    return f"""# UTF-8
# Generated by packaging/bundle.py from pyproject.toml (version {version}); do not edit.
VSVersionInfo(
  ffi=FixedFileInfo(
    filevers={t},
    prodvers={t},
    mask=0x3f,
    flags=0x0,
    OS=0x40004,
    fileType=0x1,
    subtype=0x0,
    date=(0, 0)
  ),
  kids=[
    StringFileInfo([
      StringTable(
        '040904B0',
        [
{entries}
        ])
    ]),
    VarFileInfo([VarStruct('Translation', [1033, 1200])])
  ]
)
"""


def write_version_info(path: Path) -> Path:
    import ast

    text = version_info_text(project_version())
    ast.parse(text, mode="eval")  # the same expression syntax PyInstaller evaluates on Windows
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
