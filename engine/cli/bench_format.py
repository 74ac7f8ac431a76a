"""`strata-bench run`'s outputs in llama-bench's conventions: the test label (`pp512`, `tg128`),
the model, build and hardware fields every row carries, and the writers of `-o csv|json|jsonl|sql`.

llama-bench (llama.cpp's tools/llama-bench) names a prompt test `pp<N>` and a generation test
`tg<N>` (`pp<N>+tg<M>` for both in one test), reports mean ± standard deviation over the
repetitions, and writes `-o json` as one JSON array, `-o jsonl` as one object a line and `-o sql`
as a CREATE TABLE plus INSERTs that sqlite3 loads.  Our rows keep their own fields (median tok/s,
busy histogram, digest, ...) and add llama-bench's where they mean the same thing.
"""
from __future__ import annotations

import csv
import functools
import io
import json
import math
import platform
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SQL_TABLE = "strata_bench"
ROOT = Path(__file__).resolve().parents[1]


def label(prompt_tokens: int, decode_tokens: int = 0) -> str:
    """llama-bench's test name: pp512, tg128, or pp512+tg128 for a prompt then a generation."""
    if prompt_tokens and decode_tokens:
        return f"pp{prompt_tokens}+tg{decode_tokens}"
    return f"tg{decode_tokens}" if decode_tokens else f"pp{prompt_tokens}"


def stddev(values: Sequence[float]) -> float:
    """The sample standard deviation (n - 1), as llama-bench's stddev_ts; 0 for fewer than two values."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def human_size(nbytes: int) -> str:
    """A size as llama-bench's table shows it: 15.23 GiB, 420.50 MiB."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.2f} MiB"


def human_params(n: int) -> str:
    """A parameter count as llama-bench's table shows it: 30.53 B, 96.00 M."""
    if n >= 10**9:
        return f"{n / 1e9:.2f} B"
    if n >= 10**6:
        return f"{n / 1e6:.2f} M"
    return f"{n / 1e3:.2f} K"


def model_fields(model: Any) -> dict[str, Any]:
    """model_filename, model_type, model_size (bytes of its tensors), model_n_params (elements of
    its tensors, as llama-bench counts them) of a LoadedModel or a SyntheticSource."""
    names = list(model.tensor_names())
    n_params = sum(math.prod(model.shape(n)) for n in names)
    size = sum(model.nbytes(n) for n in names)
    mix = model.quant_mix()
    spec = model.spec
    return {"model_filename": str(model.path), "model_type": f"{spec.arch} {spec.n_layers}L {mix[0][0] if mix else ''}"
            .strip(), "model_size": size, "model_n_params": n_params}


@functools.lru_cache(maxsize=1)
def build_fields() -> dict[str, str]:
    """build_commit (the checkout's short commit, "unknown" outside one) and build_version."""
    from importlib import metadata

    try:
        version = metadata.version("strata-gui")
    except metadata.PackageNotFoundError:
        version = "source"
    commit = "unknown"
    if (ROOT / ".git").exists():
        try:
            out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, timeout=5)
            if out.returncode == 0 and out.stdout.strip():
                commit = out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return {"build_commit": commit, "build_version": version}


def version_text() -> str:
    """`strata-bench --version`: ours, the checkout's commit, and torch's (without importing it)."""
    from importlib import metadata

    b = build_fields()
    try:
        torch_v = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_v = "not installed"
    return f"strata-bench {b['build_version']} (build {b['build_commit']}), torch {torch_v}, Python {platform.python_version()}"


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else what platform says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_fields(devices: Sequence[str]) -> dict[str, str]:
    """backend (CUDA or CPU), gpu_info (the names of the GPUs the stages use, "3x NVIDIA H200"),
    cpu_info.  Called after the run: torch is imported by then."""
    import torch

    cuda = sorted({torch.device(d).index or 0 for d in devices if d.startswith("cuda")})
    names: dict[str, int] = {}
    for i in cuda:
        name = torch.cuda.get_device_name(i)
        names[name] = names.get(name, 0) + 1
    gpu = ", ".join(f"{n}x {name}" if n > 1 else name for name, n in names.items())
    return {"backend": "CUDA" if cuda else "CPU", "gpu_info": gpu, "cpu_info": cpu_name()}


def to_json(rows: list[dict[str, Any]]) -> str:
    """One JSON document: an array of every row (llama-bench's -o json)."""
    return json.dumps(rows, indent=2)


def to_jsonl(rows: list[dict[str, Any]]) -> str:
    """One JSON object a line (llama-bench's -o jsonl)."""
    return "\n".join(json.dumps(r) for r in rows)


def to_csv(cols: list[str], table: list[list[Any]]) -> str:
    """A header and the rows; a cell with no value (None) is empty."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([c.strip() for c in cols])
    w.writerows([["" if c is None else c for c in row] for row in table])
    return buf.getvalue().rstrip("\n")


def _sql_type(values: list[Any]) -> str:
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, (bool, int)) for v in present):
        return "INTEGER"
    if present and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return "REAL"
    return "TEXT"


def _sql_value(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else "NULL"
    text = v if isinstance(v, str) else json.dumps(v)
    return "'" + text.replace("'", "''") + "'"


def to_sql(rows: list[dict[str, Any]], table: str = SQL_TABLE) -> str:
    """CREATE TABLE IF NOT EXISTS and one INSERT per row (llama-bench's -o sql): `sqlite3 db < out`.
    Lists and objects (busy histogram, per-stage times) are stored as JSON text."""
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    types = {c: _sql_type([r.get(c) for r in rows]) for c in cols}
    quoted = ", ".join(f'"{c}"' for c in cols)
    lines = [f"CREATE TABLE IF NOT EXISTS {table} (" + ", ".join(f'"{c}" {types[c]}' for c in cols) + ");"]
    for r in rows:
        lines.append(f"INSERT INTO {table} ({quoted}) VALUES ("
                     + ", ".join(_sql_value(r.get(c)) for c in cols) + ");")
    return "\n".join(lines)
