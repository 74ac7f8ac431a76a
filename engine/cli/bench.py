"""`strata-bench`: make models, run prompts through the split (arms x sizes x repeats), list devices."""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from engine import failure, models, settings_table
from engine.cli import bench_format
from engine.cli.load_progress import LoadProgress
from engine.cli.run_progress import RunProgress
from engine.config import ConfigError, EngineConfig, parse_setting
from engine.events import RunReport, format_timing
from engine.io.atomic_file import atomic_open
from engine.sweep import median_spread, parse_arm, steps

if TYPE_CHECKING:
    from engine.plan.roofline import DecodeBytes

log = logging.getLogger("strata.bench")

if TYPE_CHECKING:
    import numpy as np


class _NotImportedYet(Exception):
    """Stands for an engine error class whose module is not imported yet: nothing can raise it."""


# torch, gguf and the pipeline take seconds to import: `_engine()` imports them when a command
# needs them, so --help and argument errors answer at once.  Until then the error names that
# main() catches stand for a class nothing raises; `_engine` binds the real ones before any engine
# code runs.
GGUFError: type[Exception] = _NotImportedYet
StageError: type[Exception] = _NotImportedYet
Cancelled: type[Exception] = _NotImportedYet
# synth.PRESETS without importing torch (a test keeps them equal)
PRESET_NAMES = ("deepseek-v3", "demo", "glm-4.5-air", "gpt-oss-120b", "gpt-oss-20b", "kimi-k2", "minimax-m2-230b-a10b",
                "mixtral-8x7b", "qwen3-30b-a3b", "qwen3-next-80b-a3b", "qwen3.5-35b-a3b")  # sorted
QUANT_NAMES = ("q4_k_m", "q6_k", "q8_0", "iq4_xs", "iq3_xxs", "iq3_s", "iq2_xxs", "iq2_xs", "iq1_s", "iq1_m",
               "mxfp4", "f16", "f32")  # synth.QUANTS, likewise


def _engine() -> None:
    """Import the engine modules the commands use (idempotent; cheap after the first call)."""
    global GGUFError, StageError, Cancelled, load, Session, synth, prompts, roofline
    from engine.io import prompt as prompts
    from engine.io import synth
    from engine.io.gguf_model import GGUFError, load
    from engine.pipeline.session import Cancelled, Session, StageError
    from engine.plan import roofline

# the flag (its argparse dest) of each engine setting: one per row of engine/settings_table.py
SETTING_FLAGS: dict[str, str] = {s.name: s.name for s in settings_table.SETTINGS}


SYNTHETIC_FORM = "synthetic:PRESET[:key=value,...]"
RECIPE_FLAGS = {"n_layers": "layers", "n_heads": "heads", "n_kv_heads": "kv-heads", "head_dim": "head-dim",
                "n_experts": "experts", "n_experts_used": "experts-used", "expert_ffn": "expert-ffn",
                "context_length": "context", "rope_dim": "rope-dim"}  # recipe field -> make-model flag, where they differ


def _recipe_value(typ: type, text: str) -> Any:
    """A recipe field's value from text: int, float, str or a bool (1/0, true/false)."""
    if typ is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(text)
    return typ(text.strip())


def synthetic_recipe(spec: str) -> Any:
    """The recipe of `synthetic:PRESET[:key=value,...]`; ConfigError("model", ...) names what is wrong."""
    _engine()
    parts = spec.split(":", 2)
    preset = parts[1] if len(parts) > 1 else ""
    if preset not in synth.PRESETS:
        raise ConfigError("--model", spec, f"{SYNTHETIC_FORM} with PRESET one of {', '.join(sorted(synth.PRESETS))}")
    base = synth.PRESETS[preset]
    names = [f.name for f in dataclasses.fields(synth.ModelRecipe)]
    changes: dict[str, Any] = {}
    if len(parts) == 3 and parts[2].strip():
        for kv in parts[2].split(","):
            k, eq, v = kv.partition("=")
            k = k.strip()
            if k not in names or not eq:
                raise ConfigError("--model", spec, f"{SYNTHETIC_FORM} with keys {', '.join(names)}",
                                  f"{kv.strip()!r} is not key=value with a known key")
            typ = type(getattr(base, k))
            try:
                changes[k] = _recipe_value(typ, v)
            except ValueError:
                kind = {int: "an integer", float: "a number", bool: "0 or 1"}.get(typ, typ.__name__)
                raise ConfigError("--model", spec, f"{k}=<{typ.__name__}>", f"{v.strip()!r} is not {kind}") from None
    recipe = synth.recipe_from_args(preset, **changes)
    try:
        synth.check_recipe(recipe)
    except synth.RecipeError as exc:
        raise ConfigError("--model", spec, f"{exc.field}: {exc.allowed}", f"{exc.field}={exc.value!r}") from None
    return recipe


def open_model(spec: str, device_hint: str = "cpu"):
    """A GGUF path, `demo` (the built-in demo model) or `synthetic:PRESET[:key=value,...]`."""
    _engine()
    if spec == "demo":
        return load(synth.demo_model_path())
    if spec.startswith("synthetic:"):
        return synth.SyntheticSource(synthetic_recipe(spec), device_hint)
    return load(Path(spec))


def check_writable(flag: str, path: str | Path, *, folder_must_exist: bool = False) -> Path:
    """An output path that can be written, checked before a run: its nearest existing folder
    takes a new file (tried, not guessed from permission bits).  ConfigError names the flag.
    With `folder_must_exist` the file's own folder must be there already, as cp and
    llama-quantize want it: a typo in a folder name is not silently made into a new folder."""
    p = Path(path)
    try:
        is_dir = p.is_dir()
        folder = p.parent
        missing = not folder.exists()
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
    except OSError as exc:  # a name too long, a loop of links...
        raise ConfigError(flag, str(path), "a path that can be written", exc.strerror or str(exc)) from None
    if is_dir:
        raise ConfigError(flag, str(path), "a file path", "it is a folder")
    if folder_must_exist and missing:
        raise ConfigError(flag, str(path), "a path in an existing folder",
                          f"No such file or directory: {p.parent} (create it first, e.g. mkdir -p {p.parent})")
    if not folder.is_dir():
        raise ConfigError(flag, str(path), "a path in a folder", f"{folder} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".strata-bench-probe-", dir=folder)
    except OSError as exc:
        raise ConfigError(flag, str(path), "a path in a folder you can write to",
                          f"cannot create a file in {folder}: {exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(probe)
    try:
        name_max = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # not on every OS
        name_max = 255
    if len(p.name.encode()) > name_max:
        raise ConfigError(flag, str(path), f"a file name of at most {name_max} bytes")
    return p


def write_or_fallback(flag: str, path: Path, write: Callable[[Path], None]) -> bool:
    """Write a run's output; when that fails after the run, write it to the temp folder instead
    and say where (one line on stderr).  True when `path` was written."""
    try:
        write(path)
        return True
    except OSError as exc:
        fallback = Path(tempfile.gettempdir()) / f"strata-bench-{os.getpid()}-{path.name}"
        try:
            write(fallback)
        except OSError as exc2:
            print(f"strata-bench: error: cannot write {flag} {path} ({exc.strerror or exc}), "
                  f"nor {fallback} ({exc2.strerror or exc2}): that output is lost", file=sys.stderr)
            return False
        print(f"strata-bench: error: cannot write {flag} {path} ({exc.strerror or exc}); "
              f"saved it to {fallback} instead", file=sys.stderr)
        return False


def _save_npy(path: Path, array: np.ndarray) -> None:
    """Atomically (a full disk leaves an earlier file at `path` as it was)."""
    import numpy as np

    with atomic_open(path) as fh:  # a file object: np.save would add .npy to a name without it
        np.save(fh, array)


def prompt_sizes(text: str, decode_tokens: int = 0) -> list[int]:
    """The --prompt-tokens sizes; 0 (decode only, llama-bench's `-p 0`) only with --decode-tokens."""
    low = 0 if decode_tokens > 0 else 1
    try:
        sizes = [int(x) for x in str(text).split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(n < low for n in sizes):
        if decode_tokens > 0:
            raise ConfigError("--prompt-tokens", text, "comma-separated integers >= 0, e.g. 0,512 "
                                                       "(0: decode only, from a single BOS token)")
        raise ConfigError("--prompt-tokens", text, "comma-separated integers >= 1, e.g. 512,2048 "
                                                   "(0 needs --decode-tokens N: decode only)")
    return sizes


def prompt_tokens_text(ns: argparse.Namespace) -> str:
    """--prompt-tokens as given; omitted: 512, or 0 (decode only, llama-bench's `-p 0 -n N`) when
    --decode-tokens asks for decode and no prompt is given."""
    if ns.prompt_tokens is not None:
        return ns.prompt_tokens
    return "0" if ns.decode_tokens > 0 and ns.prompt_ids is None and ns.prompt is None else "512"


@dataclass
class Point:
    arm: str
    prompt_tokens: int
    reports: list[RunReport] = field(default_factory=list)

    @property
    def tok_s(self) -> list[float]:
        return [r.prefill_tok_s for r in self.reports]

    @property
    def median(self) -> float:
        return median_spread(self.tok_s)[0]

    @property
    def spread(self) -> float:
        """Half the range, as a share of the median."""
        return median_spread(self.tok_s)[1]


def _hist(h: Sequence[float]) -> str:
    return "/".join(f"{x * 100:.0f}" for x in h)


def _experts(r: RunReport) -> dict[str, float] | None:
    """Streamed experts over all stages: hit rate, bytes moved, achieved GB/s (None if resident)."""
    st = [x for x in r.expert_stats if not x.get("resident")]
    if not st:
        return None
    hits, misses = sum(x["hits"] for x in st), sum(x["misses"] for x in st)
    moved = sum(x["bytes_pinned"] + x["bytes_pageable"] for x in st)
    ns = sum(x["stream_ns"] for x in st)
    return {"hit_rate": hits / (hits + misses) if hits + misses else 0.0, "gib": moved / 2**30,
            "pinned_gib": sum(x["bytes_pinned"] for x in st) / 2**30, "gbs": moved / ns if ns else 0.0}


def _row(p: Point, base: Point | None, flops: float = 0.0, peak_tflops: float = 0.0) -> dict[str, Any]:
    r = p.reports[-1]
    tflops = flops / p.prompt_tokens * p.median / 1e12 if p.prompt_tokens else 0.0
    gpus = len({s.device for s in r.plan.stages})
    return {  # MFU per GPU: against the peak of every device the arm used
        "tflops": tflops, "mfu": tflops / (peak_tflops * gpus) if peak_tflops else None,
        "row": "summary", "arm": p.arm, "prompt_tokens": p.prompt_tokens, "chunk": r.plan.chunk,
        "n_chunks": r.plan.n_chunks, "stages": len(r.plan.stages), "handoff": r.handoff,
        "executor": r.executor, "handoff_s": r.handoff_s, "handoff_gbps": r.handoff_gbps,
        "handoff_share": r.handoff_share, "state_handoff_bytes": r.state_handoff_bytes,
        "schedule": r.plan.schedule, "chunk_sizes": [n for _, n in r.plan.chunk_bounds()],
        "prefill_tok_s": p.median, "prefill_tok_s_all": p.tok_s, "spread": p.spread,
        "decode_tok_s": median_spread([x.decode_tok_s for x in p.reports])[0],
        "decode_spread": median_spread([x.decode_tok_s for x in p.reports])[1],
        "decode_sd": bench_format.stddev([x.decode_tok_s for x in p.reports]),  # the tg column's ±
        "ratio": p.median / base.median if base and base.median else 1.0,
        "busy_histogram": r.busy_histogram, "digest": r.digest, "experts": _experts(r),
        "per_stage": [vars(t) for t in r.per_stage],
    }


def _handoff(r: dict[str, Any]) -> str:
    """gloo · processes · 1.20 GB/s, 3% of wall (the executor named when it is not the default)."""
    text = r["handoff"]
    if r.get("executor", "threads") != "threads":
        text += f" · {r['executor']}"
    if r.get("handoff_s"):
        text += f" · {r['handoff_gbps']:.2f} GB/s, {r['handoff_share'] * 100:.0f}% of wall"
    if r.get("state_handoff_bytes"):  # prefill-main's KV and state rows to the stages
        text += f" · {r['state_handoff_bytes'] / 2**20:,.1f} MiB KV+state to the stages"
    return text


def _chunks(r: dict[str, Any]) -> str:
    """2048x16 for fixed chunks; 16 bal 4224..1344 for a balanced schedule (first..last size)."""
    if r.get("schedule") == "balanced":
        sizes = r["chunk_sizes"]
        return f"{r['n_chunks']} bal {sizes[0]}..{sizes[-1]}"
    return f"{r['chunk']}x{r['n_chunks']}"


def _decode_columns(r: dict[str, Any], p: Point, decode_tokens: int, weights: DecodeBytes | None,
                    bandwidth: Callable | None) -> None:
    """The llama-bench-style tg figure and the roofline of a point, into its row."""
    r["tg"] = f"tg{decode_tokens}" if decode_tokens > 0 else ""
    if weights is None:
        return
    from engine.plan import roofline

    rep = p.reports[-1]
    stages = [(st.device, st.first_layer, st.end_layer) for st in rep.plan.stages]
    roof = roofline.roofline(weights, stages, bandwidth or roofline.bandwidth_of())
    r["decode_weight_bytes"] = roof.weight_bytes
    r["roofline_tok_s"] = roof.limit_tok_s
    r["roofline_share"] = roof.share(r["decode_tok_s"])
    r["roofline_how"] = roof.how


def _run_decode_fields(r: RunReport, ns: argparse.Namespace, weights: DecodeBytes | None) -> dict[str, Any]:
    """A JSON run row's tg label and roofline (decode runs only)."""
    if weights is None:
        return {}
    from engine.plan import roofline

    stages = [(st.device, st.first_layer, st.end_layer) for st in r.plan.stages]
    roof = roofline.roofline(weights, stages, roofline.bandwidth_of(ns.mem_gbs))
    return {"tg": f"tg{ns.decode_tokens}", "decode_weight_bytes": roof.weight_bytes,
            "roofline_tok_s": roof.limit_tok_s, "roofline_share": roof.share(r.decode_tok_s)}


def _roof_cells(r: dict[str, Any]) -> list[str]:
    limit, share = r.get("roofline_tok_s"), r.get("roofline_share")
    return [f"{r['decode_weight_bytes'] / 2**20:.1f}",
            f"{limit:.0f}" if limit else "unknown",
            f"{share * 100:.1f}%" if share is not None else "—"]


def summary_rows(points: list[Point], arms: list[str], spec=None, peak_tflops: float = 0.0,
                 info: dict[str, Any] | None = None, decode_tokens: int = 0, weights: DecodeBytes | None = None,
                 bandwidth: Callable | None = None) -> list[dict[str, Any]]:
    """One row per (arm, prompt size): ours, with llama-bench's fields where they mean the same
    (test, n_prompt, n_gen, avg_ts, stddev_ts, samples_ts over the prefill's tok/s), the model,
    build and hardware fields of `info` (engine/cli/bench_format.py) and, with decode, the tg figure
    and the roofline (engine/plan/roofline.py)."""
    bases = {p.prompt_tokens: p for p in points if p.arm == arms[0]}
    rows = []
    for p in points:
        r = {**(info or {}), **_row(p, bases.get(p.prompt_tokens),
                                    spec.prefill_flops(p.prompt_tokens) if spec and p.prompt_tokens else 0.0,
                                    peak_tflops)}
        r.update(test=bench_format.label(p.prompt_tokens, decode_tokens), n_prompt=p.prompt_tokens,
                 n_gen=decode_tokens, avg_ts=statistics.fmean(p.tok_s) if p.tok_s else 0.0,
                 stddev_ts=bench_format.stddev(p.tok_s), samples_ts=p.tok_s)
        _decode_columns(r, p, decode_tokens, weights, bandwidth)
        rows.append(r)
    return rows


TABLE_NOTE = ("prefill tok/s: the median of the repeats; ± sd: their sample standard deviation (tok/s); "
              "ratio: against the first arm's median")


def render(points: list[Point], arms: list[str], fmt: str, spec=None, peak_tflops: float = 0.0,
           info: dict[str, Any] | None = None, decode_tokens: int = 0, weights: DecodeBytes | None = None,
           bandwidth: Callable | None = None) -> str:
    """The summary as a md or csv table, or its rows as json (one array), jsonl or sql.  With
    decode (`decode_tokens` > 0): a `tg<N>` column (decode tok/s ± its sample sd over the repeats, as
    llama-bench prints tg) and, given `weights` (the bytes a decode token reads), the roofline:
    MiB of weights per token, the tok/s the devices' bandwidth allows (`bandwidth(device)`;
    unknown for a CPU unless measured) and the share of it decode reached.  A prompt of 0 tokens
    (decode only, llama-bench's -p 0) shows no prefill figures."""
    rows = summary_rows(points, arms, spec, peak_tflops, info, decode_tokens, weights, bandwidth)
    if fmt in ("json", "jsonl", "sql"):
        return {"json": bench_format.to_json, "jsonl": bench_format.to_jsonl, "sql": bench_format.to_sql}[fmt](rows)
    csv_out = fmt == "csv"
    none = None if csv_out else "—"  # a cell with no value: empty in CSV
    model_cols = ["model", "size", "params", "backend"] if info else []
    cols = [*model_cols, "test", "arm", "chunk", "stages", "prefill tok/s", "± sd", "decode tok/s", "ratio",
            "busy 0/1/..%", "handoff", "digest"]
    table = [[*([r["model_type"], bench_format.human_size(r["model_size"]), bench_format.human_params(
                r["model_n_params"]), r["backend"]] if info else []),
              r["test"], r["arm"], _chunks(r), r["stages"],
              f"{r['prefill_tok_s']:.1f}" if r["prompt_tokens"] else none,  # decode only (-p 0): no prefill
              f"{r['stddev_ts']:.1f}" if r["prompt_tokens"] else none,
              f"{r['decode_tok_s']:.1f}" if r["decode_tok_s"] else none,  # no decode steps
              f"{r['ratio']:.3f}" if r["prompt_tokens"] else none,
              _hist(r["busy_histogram"]), _handoff(r), r["digest"][:12]] for r in rows]
    if decode_tokens > 0:
        at = cols.index("decode tok/s") + 1
        extra = [f"tg{decode_tokens}"] + (["MiB/token", "roofline tok/s", "of roofline"] if weights else [])
        cols[at:at] = extra
        for row, r in zip(table, rows):
            tg = (f"{r['decode_tok_s']:.1f} ± {r['decode_sd']:.1f}"
                  if r["decode_tok_s"] else none)
            row[at:at] = [tg] + (_roof_cells(r) if weights else [])
    if any(r["experts"] for r in rows):
        cols[-1:-1] = ["expert hits", "streamed GiB (pinned)", "H2D GB/s"]
        for row, r in zip(table, rows):
            x = r["experts"]
            row[-1:-1] = ([f"{x['hit_rate'] * 100:.0f}%", f"{x['gib']:.1f} ({x['pinned_gib']:.1f})",
                           f"{x['gbs']:.1f}"] if x else ["resident", none, none])
    if peak_tflops:
        at = cols.index("decode tok/s")
        cols[at:at] = ["TFLOP/s", "MFU/GPU"]
        for row, r in zip(table, rows):
            row[at:at] = [f"{r['tflops']:.1f}", f"{r['mfu'] * 100:.1f}%"]
    if csv_out:
        return bench_format.to_csv(cols, table)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table]
    return "\n".join(lines)


def _base_settings(ns: argparse.Namespace) -> dict[str, Any]:
    return settings_table.flag_values(ns)


def _split_for(model, config: EngineConfig, sess, name: str, n_tokens: int, ns):
    """(name, session) for a prompt of n_tokens: with layer_split auto over several devices,
    rebuilt with the split the model rates fastest for it (engine/plan/split_choice.py)."""
    from engine.plan import split_choice

    def rebuild(split: EngineConfig):
        sess.close()
        shown = _load_progress(model, name, ns.quiet)
        new = _session(shown, model, split, events=not ns.no_events)
        shown.finish()
        return new

    return name, split_choice.fit(sess, config, n_tokens, rebuild)


def check_model_arg(spec: str) -> None:
    """A --model that names a file: it exists and is a file (a synthetic spec is checked with
    its recipe, which needs the engine)."""
    if spec == "demo" or spec.startswith("synthetic:"):
        return
    p = Path(spec)
    if not p.exists():
        raise ConfigError("--model", spec, "a GGUF file, 'demo' or synthetic:PRESET[:key=val,...]",
                          "no such file")
    if p.is_dir():
        raise ConfigError("--model", spec, "a GGUF file, 'demo' or synthetic:PRESET[:key=val,...]",
                          "it is a folder")


def configs_from_args(ns: argparse.Namespace) -> list[tuple[str, EngineConfig]]:
    """(arm name, config) of every arm, from the flags, the environment and each --arm, checked
    against the machine as far as that is known without torch (engine/hw/machine.py): every bad
    setting is refused here, before anything heavy is imported."""
    from engine.hw.machine import check_machine_early

    base = _base_settings(ns)
    texts = getattr(ns, "arm", None) or [""]
    configs = [(t or "base", EngineConfig.from_sources({**base, **parse_arm(t)})) for t in texts]
    for _, cfg in configs:
        check_machine_early(cfg)
    return configs


@dataclass
class _Measured:
    """What the measured runs of `strata-bench run` left: a point per (arm, size), a JSON row per
    run, the last (session, result), and whether Ctrl-C stopped them."""

    points: list[Point] = field(default_factory=list)
    run_rows: list[dict[str, Any]] = field(default_factory=list)
    last: tuple[Any, Any] | None = None
    interrupted: bool = False


def _output_paths(ns: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """--logits-out (named as np.save names it) and --trace, checked writable before anything runs."""
    logits_out = trace_out = None
    if ns.logits_out:
        name = ns.logits_out if str(ns.logits_out).endswith(".npy") else f"{ns.logits_out}.npy"
        logits_out = check_writable("--logits-out", name)
    if ns.trace:
        trace_out = check_writable("--trace", ns.trace)
    return logits_out, trace_out


def _prompts(ns: argparse.Namespace, model, configs: list[tuple[str, EngineConfig]],
             logits_out: Path | None) -> tuple[list[int], list[int] | None]:
    """(prompt sizes, the fixed prompt's ids or None), each size checked to fit in memory (KV,
    weights, scratch, logits) before a byte of the run is allocated."""
    from engine.plan import memory_check

    def check_fits(tokens: int, flag: str) -> None:
        for _, cfg in configs:
            memory_check.check_run(model, cfg, tokens, ns.decode_tokens, bool(ns.logits_out), flag)
        if logits_out is not None:
            memory_check.check_output("--logits-out", logits_out, tokens * model.spec.vocab * 4 + 128,
                                      f"lower {flag}")

    if ns.prompt_ids:
        check_fits(prompts.count_ids(ns.prompt_ids), "--prompt-ids")  # counted without holding them
        try:
            ids = prompts.read_ids(ns.prompt_ids)
        except UnicodeDecodeError as exc:
            raise ConfigError("--prompt-ids", ns.prompt_ids, "a text file of token ids", f"not text: {exc.reason}") \
                from None
        bad = next((i for i in ids if not 0 <= i < model.spec.vocab), None)
        if bad is not None:
            raise ConfigError("--prompt-ids", ns.prompt_ids, f"token ids 0..{model.spec.vocab - 1} (the model's vocabulary)",
                              f"id {bad}")
        return [len(ids)], ids
    if ns.prompt is not None:
        ids = prompts.tokenize(model, ns.prompt)
        check_fits(len(ids), "--prompt")
        return [len(ids)], ids
    sizes = prompt_sizes(prompt_tokens_text(ns), ns.decode_tokens)
    check_fits(max(max(sizes), 1), "--prompt-tokens")  # 0: decode-only, a one-token prompt
    return sizes, None


def _run_row(r: RunReport, ns: argparse.Namespace, name: str, n: int, rep: int,
             weights: DecodeBytes | None) -> dict[str, Any]:
    """One measured run as a JSON row."""
    return {
        "row": "run", "test": bench_format.label(n, ns.decode_tokens), "arm": name, "prompt_tokens": n,
        "repeat": rep, "chunk": r.plan.chunk,
        "prefill_tok_s": r.prefill_tok_s, "decode_tok_s": r.decode_tok_s,
        "digest": r.digest, "generated": r.generated, "busy_histogram": r.busy_histogram,
        "per_stage": [vars(t) for t in r.per_stage], "handoff": r.handoff, "attention": r.attention,
        "kernels": r.kernels, "executor": r.executor, "handoff_s": r.handoff_s, "handoff_gbps": r.handoff_gbps,
        "handoff_share": r.handoff_share, "state_handoff_bytes": r.state_handoff_bytes,
        "device_order": r.device_order, **_run_decode_fields(r, ns, weights)}


def _measure(ns: argparse.Namespace, model, configs: list[tuple[str, EngineConfig]], sizes: list[int],
             fixed_ids: list[int] | None, weights: DecodeBytes | None) -> _Measured:
    """Every (size, repeat, arm) step (engine/sweep.py: the app's Sweep walks the same), each new
    size after its unmeasured warm-up runs; Ctrl-C keeps the repeats that finished."""
    out = _Measured()
    sessions = []
    for name, cfg in configs:
        shown = _load_progress(model, name, ns.quiet)
        sessions.append((name, _session(shown, model, cfg, events=not ns.no_events)))
        shown.finish()
    pts: dict[str, Point] = {}
    shown_runs = RunProgress.for_stream(sys.stderr, quiet=ns.quiet, force=ns.progress,
                                        measured=len(sizes) * ns.repeat * len(sessions),
                                        warmups=len(sizes) * ns.warmup * len(sessions))
    try:
        ids: list[int] | None = None
        for step in steps(sizes, ns.repeat, len(sessions)):
            n, rep = step.prompt_tokens, step.repeat
            if step.first_of_size:
                out.points.extend(pts.values())
                pts = {a: Point(a, n) for a, _ in sessions}
                sessions = [_split_for(model, configs[i][1], s, a, max(n, 1), ns)
                            for i, (a, s) in enumerate(sessions)]
                _warm_up(ns, model, sessions, n, fixed_ids, shown_runs)
            name, sess = sessions[step.arm]
            if step.arm == 0:  # every arm of this (size, repeat) on the same prompt
                ids = fixed_ids if fixed_ids is not None else (
                    prompts.bos_ids(model) if n == 0 else prompts.synthetic(n, model.spec.vocab, step.nonce))
            shown_runs.start(name, n, repeat=rep)
            res = sess.run(ids, ns.decode_tokens, logits_all=bool(ns.logits_out))
            pts[name].reports.append(res.report)
            out.last = (sess, res)
            if sess.config.timing:
                print(f"# timing: arm {name}, {n} tokens, repeat {rep}\n{format_timing(res.report.per_stage)}",
                      file=sys.stderr)
            out.run_rows.append(_run_row(res.report, ns, name, n, rep, weights))
            if ns.format == "jsonl":  # one line a run as it ends
                print(json.dumps(out.run_rows[-1]), flush=True)
    except KeyboardInterrupt:  # Ctrl-C: the repeats that finished are kept and printed
        out.interrupted = True
    finally:
        out.points.extend(p for p in pts.values() if p.reports)
        shown_runs.close()
        for _, sess in sessions:
            sess.close()
    return out


def _warm_up(ns: argparse.Namespace, model, sessions: list, n: int, fixed_ids: list[int] | None,
             shown_runs: RunProgress) -> None:
    """Unmeasured runs at a new size: the first sight of its chunk shapes plans kernels and
    captures CUDA graphs, which a measured run must not pay for (with decode, one decode step too:
    its size-1 graphs are captured there, not in the first measured decode)."""
    warm = fixed_ids if fixed_ids is not None else (
        prompts.bos_ids(model) if n == 0 else prompts.warmup_ids(n, model.spec.vocab))
    for w in range(ns.warmup):
        for a, s in sessions:
            shown_runs.start(a, n, warmup=w)
            s.run(warm, min(ns.decode_tokens, 2))


def _print_tables(ns: argparse.Namespace, model, configs: list[tuple[str, EngineConfig]], m: _Measured,
                  weights: DecodeBytes | None) -> None:
    """The summary on stdout in --format, with the md table's notes under it."""
    info = {**bench_format.model_fields(model), **bench_format.build_fields(),
            **bench_format.hardware_fields([d for _, c in configs for d in c.devices])}
    arm_names = [a for a, _ in configs]
    bandwidth = roofline.bandwidth_of(ns.mem_gbs)
    if ns.format in ("json", "sql"):  # one document: every run, then every (arm, size)
        rows = m.run_rows + summary_rows(m.points, arm_names, model.spec, ns.peak_tflops, info, ns.decode_tokens,
                                         weights, bandwidth)
        print(bench_format.to_json(rows) if ns.format == "json" else bench_format.to_sql(rows))
    else:
        print(render(m.points, arm_names, ns.format, model.spec, ns.peak_tflops, info, ns.decode_tokens,
                     weights, bandwidth))
    if ns.format == "md":
        _print_md_notes(ns, model, m, weights, info)


def _print_md_notes(ns: argparse.Namespace, model, m: _Measured, weights: DecodeBytes | None,
                    info: dict[str, Any]) -> None:
    print(f"\n{TABLE_NOTE}")
    gpu = f" · GPU: {info['gpu_info']}" if info["gpu_info"] else ""
    print(f"build: {info['build_commit']} ({info['build_version']}){gpu} · CPU: {info['cpu_info']}")
    if weights is not None and m.points and m.points[-1].reports:
        last_plan = m.points[-1].reports[-1].plan
        roof = roofline.roofline(weights, [(st.device, st.first_layer, st.end_layer) for st in last_plan.stages],
                                 roofline.bandwidth_of(ns.mem_gbs))
        print(f"roofline: {weights.total / 2**20:.1f} MiB of weights per decode token as stored "
              f"(dense + top-{model.spec.n_experts_used} experts per layer; KV not counted); bandwidth: {roof.how}")
    report = m.last[1].report if m.last is not None else None
    if report is not None and report.attention:
        print(f"attention: {report.attention}")
    if report is not None and report.kernels:
        print(f"kernels: {report.kernels}")
        for note in report.notes:
            if note.startswith("fast kernel missing"):
                print(f"warning: {note}")
            elif note.startswith("decode"):  # a decode step kept eager, and why (engine/pipeline/stage_decode.py)
                print(note)


def _log_model_error(points: list[Point]) -> None:
    for p in points:
        r = p.reports[-1] if p.reports else None
        if r is not None and r.plan.modelled_s > 0 and not r.cancelled and p.prompt_tokens:
            log.info("chunk-cost model, arm %s, %d tokens: it predicted %.1f ms for this prefill, the run took "
                     "%.1f ms (%+.1f%%); the chunk size was picked with it, so a large error (a busy machine, "
                     "a first run paying set-up) means the pick may not be the fastest", p.arm, p.prompt_tokens,
                     r.plan.modelled_s * 1e3, r.prefill_s * 1e3, (r.prefill_s / r.plan.modelled_s - 1) * 100)


def _write_outputs(m: _Measured, logits_out: Path | None, trace_out: Path | None) -> bool:
    """The last run's logits and trace; False when one went to the fallback folder or was lost."""
    ok = True
    if m.last is None:
        return ok
    sess, res = m.last
    if logits_out is not None:
        logits = res.logits.float().numpy()
        ok &= write_or_fallback("--logits-out", logits_out, lambda p: _save_npy(p, logits))
        log.info("wrote logits %s", tuple(logits.shape))
    if trace_out is not None:
        from engine.io import trace

        ok &= write_or_fallback("--trace", trace_out, lambda p: trace.save(
            p, sess.events, {"report": res.report}, telemetry=res.report.telemetry,
            stage_names=res.report.plan.stage_names()))
        log.info("wrote trace %s", trace_out)
    return ok


def cmd_run(ns: argparse.Namespace) -> int:
    logits_out, trace_out = _output_paths(ns)
    if ns.prompt_ids is None and ns.prompt is None:
        prompt_sizes(prompt_tokens_text(ns), ns.decode_tokens)
    if ns.prompt_ids is not None and not Path(ns.prompt_ids).is_file():
        raise ConfigError("--prompt-ids", ns.prompt_ids, "a text file of token ids", "no such file")
    check_model_arg(ns.model)
    configs = configs_from_args(ns)
    _engine()
    model = open_model(ns.model, configs[0][1].devices[0])
    log.info("model: %s", model.describe())
    sizes, fixed_ids = _prompts(ns, model, configs, logits_out)
    weights = roofline.decode_weight_bytes(model) if ns.decode_tokens > 0 else None
    m = _measure(ns, model, configs, sizes, fixed_ids, weights)
    if m.interrupted:
        done = sum(len(p.reports) for p in m.points)
        print(f"strata-bench: interrupted; {done} measured run{'s' if done != 1 else ''} finished"
              + (" and are shown below" if done else ", nothing to show"), file=sys.stderr)
        if not m.points:
            return 130
    _print_tables(ns, model, configs, m, weights)
    _log_model_error(m.points)
    if ns.format == "md" and m.last is not None and len(m.points) == 1:
        r = m.last[1].report
        print((f"\ngenerated: {r.generated}" if r.generated else "") + f"\ndigest: {r.digest}")
    ok = _write_outputs(m, logits_out, trace_out)
    if m.interrupted:
        return 130
    return 0 if ok else 2


def _session(shown: LoadProgress, model, config: EngineConfig, events: bool):
    """A Session loaded with `shown` as its progress; the progress line is cleared (its heartbeat
    stopped) when the load fails, so the error line stands alone."""
    from engine.pipeline.session import Session  # by name: a caller may come here before _engine() ran

    try:
        return Session(model, config, events=events, progress=shown)
    except BaseException:
        shown.clear()
        raise


def _load_progress(model, arm: str = "", quiet: bool = False) -> LoadProgress:
    size = model.file_bytes if hasattr(model, "file_bytes") else 0
    label = Path(str(model.path)).name + (f" (arm {arm})" if arm and arm != "base" else "")
    return LoadProgress(io.StringIO() if quiet else sys.stderr, size, label, heartbeat_s=1.0)


def cmd_load(ns: argparse.Namespace) -> int:
    """Load a model onto the devices and report how fast (GB/s of file) and where it went."""
    check_model_arg(ns.model)
    [(_, cfg)] = configs_from_args(ns)
    _engine()
    model = open_model(ns.model, cfg.devices[0])
    shown = _load_progress(model, quiet=ns.quiet)
    sess = _session(shown, model, cfg, events=False)
    try:
        took = shown.finish()
        size = getattr(model, "file_bytes", 0)
        print(f"model: {model.describe()}")
        print(f"load: {took:.2f} s" + (f", {size / took / 1e9:.2f} GB/s of file" if size else ""))
        for note in sess.setup_notes:
            print(f"note: {note}")
    finally:
        sess.close()
    return 0


def cmd_make_model(ns: argparse.Namespace) -> int:
    changes = {k: getattr(ns, k) for k in ("arch", "n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim",
                                           "n_experts", "n_experts_used", "expert_ffn", "ffn", "vocab",
                                           "context_length", "seed", "quant", "rope_dim")}
    check_writable("make-model PATH", ns.path, folder_must_exist=True)
    _engine()
    recipe = synth.recipe_from_args(ns.preset, **changes)
    recipe = _experts_asked(ns, recipe)
    try:
        synth.check_recipe(recipe)
    except synth.RecipeError as exc:
        raise ConfigError("--" + RECIPE_FLAGS.get(exc.field, exc.field).replace("_", "-"), exc.value, exc.allowed) \
            from None
    from engine.plan import memory_check

    memory_check.check_make_model(recipe, Path(ns.path))  # before a byte is drawn
    shown = LoadProgress(sys.stderr, 0, Path(ns.path).name, verb="writing")
    path = synth.write_model(ns.path, recipe, progress=shown)
    took = shown.clear()
    size = path.stat().st_size
    print(f"wrote {path} ({size / 2**20:.1f} MiB in {took:.1f} s, {size / max(took, 1e-9) / 1e6:.0f} MB/s): "
          f"{load(path).describe()}")
    if recipe.quant:
        from engine.io.gguf_model import expected_shapes
        from engine.io.quant_recipe import explain_fallbacks

        spec = recipe.spec()
        note = explain_fallbacks(expected_shapes(spec), recipe.quant, spec)
        if note:
            print(f"note: {note}")
    return 0


def _experts_asked(ns: argparse.Namespace, recipe: Any) -> Any:
    """Expert flags given: the recipe as the family takes routed experts (llama: Mixtral's layout),
    or a one-line refusal naming the families that have them, never a dense model written with
    the flags silently dropped."""
    given = [(flag, v) for flag, v in (("--experts", ns.n_experts), ("--experts-used", ns.n_experts_used),
                                       ("--expert-ffn", ns.expert_ffn)) if v is not None]
    if not given:
        return recipe
    got = models.family(recipe.arch).with_experts(recipe)
    if got is not None:
        return got
    flag, value = given[0]
    with_them = [a for a in models.names() if models.family(a).with_experts(recipe) is not None]
    raise ConfigError(flag, value, f"only with a family that has routed experts ({', '.join(with_them)}): "
                                   f"{recipe.arch} is dense")


def cmd_stage(ns: argparse.Namespace) -> int:
    """One stage process for a controller on another host (or this one): see docs/executor.md."""
    from engine.pipeline.stage_process import AttachError, attach

    rank = ns.rank if ns.rank is not None else os.environ.get("RANK")
    world = ns.world if ns.world is not None else os.environ.get("WORLD_SIZE")
    if rank is None or world is None:
        raise ConfigError("--rank/--world", f"{rank}/{world}", "integers, or RANK and WORLD_SIZE from torchrun")
    rank, world = parse_int_arg("--rank", rank, 0), parse_int_arg("--world", world, 1)
    if rank >= world:
        raise ConfigError("--rank", rank, f"0..{world - 1} (--world {world})")
    if not ns.timeout > 0:
        raise ConfigError("--timeout", ns.timeout, "seconds > 0")
    try:
        return attach(ns.rendezvous, rank, world, ns.timeout, key_file=ns.key_file)
    except AttachError as exc:
        print(f"strata-bench stage: error: {exc}", file=sys.stderr)
        return 2


def parse_int_arg(flag: str, raw, low: int) -> int:
    try:
        v = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(flag, raw, f"an integer >= {low}") from None
    if v < low:
        raise ConfigError(flag, raw, f"an integer >= {low}")
    return v


def cmd_devices(ns: argparse.Namespace) -> int:
    from engine.hw import topology

    print(topology.render_devices(topology.discover(probe=ns.probe), ns.format))
    return 0


OUTPUT_FORMATS = ("md", "csv", "json", "jsonl", "sql")  # llama-bench's -o, with jsonl and sql


class VersionAction(argparse.Action):
    """--version: computed when asked (it runs git), printed to stdout, exit 0."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(bench_format.version_text())
        parser.exit(0)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit 2, like every other input error here (its
    subcommands' parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


LOAD_SETTINGS = ("devices", "layer_split", "expert_cache", "pin_limit_gib", "dtype")  # `load` takes these


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="strata-bench", description=__doc__)
    ap.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    ap.add_argument("--version", action=VersionAction, help="print the version, the build's commit and torch's")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_run(sub)
    lo = sub.add_parser("load", help="load a model onto the devices; print the load rate (GB/s of file)")
    lo.add_argument("-m", "--model", default="demo", help="GGUF path, 'demo', or synthetic:PRESET[:key=val,...]")
    lo.add_argument("--quiet", action="store_true", help="no progress on stderr")
    settings_table.add_flags(lo, LOAD_SETTINGS)
    lo.set_defaults(func=cmd_load)
    _add_make_model(sub)
    g = sub.add_parser("stage", help="serve one pipeline stage for a controller elsewhere (run it under "
                       "torchrun on each workstation, or once per rank)")
    g.add_argument("--rendezvous", required=True, help="HOST:PORT of the controller (its --rendezvous)")
    g.add_argument("--rank", type=int, help="this stage's index (default: $RANK, as torchrun sets it)")
    g.add_argument("--world", type=int, help="the number of stages (default: $WORLD_SIZE)")
    g.add_argument("--timeout", type=float, default=60.0, help="seconds to reach the controller")
    g.add_argument("--key-file", help="a file holding the controller's key "
                   f"(default: ${settings_table.row('rendezvous_key').env})")
    g.set_defaults(func=cmd_stage)

    d = sub.add_parser("devices", help="GPU topology: PCIe links, link class, peer access")
    d.add_argument("--probe", action="store_true", help="measure pinned host<->device GB/s")
    d.add_argument("--format", choices=("md", "json"), default="md")
    d.set_defaults(func=cmd_devices)

    from engine.cli import plan_cli  # issue 22: the what-if planner's subcommand lives in its own module

    plan_cli.add_parser(sub)
    return ap


def _add_run(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="prefill (and decode) prompts through the split; print a table",
                       description="Prefill (and decode) prompts through the split and print a table. "
                       "llama-bench's short flags work: -m model, -p prompt sizes, -n tokens to generate, "
                       "-r repetitions, -o md|csv|json|jsonl|sql; tests are named pp<N> / pp<N>+tg<M>.")
    r.add_argument("-m", "--model", default="demo", help="GGUF path, 'demo', or synthetic:PRESET[:key=val,...]")
    g = r.add_mutually_exclusive_group()
    g.add_argument("-p", "--prompt-tokens", default=None,
                   help="synthetic prompt size(s), comma-separated (default 512; 0, or omitted with "
                        "--decode-tokens: decode only from a single BOS token, as llama-bench -p 0 -n N)")
    g.add_argument("--prompt-ids", help="file of token ids (whitespace or commas)")
    g.add_argument("--prompt", help="text, tokenised with the file's own vocabulary")
    r.add_argument("-n", "--decode-tokens", type=int, default=0,
                   help="tokens to generate greedily after the prompt (0: none; the test is then pp<N>+tg<M>)")
    settings_table.add_flags(r)  # every engine setting (engine/settings_table.py)
    r.add_argument("--arm", action="append", help='settings of one arm, e.g. "pipeline_depth=0" (repeatable)')
    r.add_argument("-r", "--repeat", type=int, default=1,
                   help="measured runs per arm and prompt size (median and standard deviation)")
    r.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up runs per arm and prompt size")
    r.add_argument("-o", "--output", "--format", dest="format", choices=OUTPUT_FORMATS, default="md",
                   help="md or csv: a table; json: one JSON array of every run and every (arm, size); "
                   "jsonl: the same, one object a line (runs as they end); sql: CREATE TABLE and INSERTs "
                   f"for sqlite3 (table {bench_format.SQL_TABLE})")
    r.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="log at INFO level (as strata-bench -v run)")
    r.add_argument("--quiet", action="store_true", help="no progress on stderr (load and runs)")
    r.add_argument("--progress", action="store_true",
                   help="progress on stderr even when it is not a terminal (a line per run)")
    r.add_argument("--logits-out", help="save logits of every prompt position (float32 [tokens, vocab])")
    r.add_argument("--trace", help="write the last run's Chrome trace (.json or .json.gz)")
    r.add_argument("--peak-tflops", type=float, default=0.0,
                   help="add TFLOP/s and MFU columns against this peak (H200 bf16: 794)")
    r.add_argument("--mem-gbs", dest="mem_gbs", type=float, default=0.0,
                   help="memory bandwidth in GB/s for the decode roofline (default: derived for CUDA "
                        "from the memory clock and bus width; unknown for a CPU)")
    r.add_argument("--no-events", action="store_true", help="no timing events (measures their overhead)")
    r.set_defaults(func=cmd_run)


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("make-model", help="write a GGUF model with random weights")
    m.add_argument("path")
    m.add_argument("--preset", default="demo", choices=PRESET_NAMES)
    m.add_argument("--arch", choices=models.names())
    m.add_argument("--layers", dest="n_layers", type=int)
    m.add_argument("--hidden", type=int)
    m.add_argument("--heads", dest="n_heads", type=int)
    m.add_argument("--kv-heads", dest="n_kv_heads", type=int)
    m.add_argument("--head-dim", dest="head_dim", type=int)
    m.add_argument("--experts", dest="n_experts", type=int)
    m.add_argument("--experts-used", dest="n_experts_used", type=int)
    m.add_argument("--expert-ffn", dest="expert_ffn", type=int)
    m.add_argument("--ffn", type=int)
    m.add_argument("--vocab", type=int)
    m.add_argument("--context", dest="context_length", type=int)
    m.add_argument("--rope-dim", dest="rope_dim", type=int,
                   help="partial rotary: RoPE over each head's first N dims (families with it: minimax-m2, glm4moe)")
    m.add_argument("--seed", type=int)
    m.add_argument("--quant", choices=QUANT_NAMES,
                   help="llama.cpp's tensor-type mix (q4_k_m, q6_k, q8_0, iq4_xs, iq3_xxs, iq3_s, iq2_xxs, "
                        "iq2_xs, iq1_s, iq1_m; mxfp4: gpt-oss's MXFP4 experts) or plain f16/f32")
    m.set_defaults(func=cmd_make_model)


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    timing = getattr(ns, "timing", None)
    try:
        timing = bool(timing is not None and parse_setting("timing", timing))
    except ConfigError:
        timing = False  # reported with the other settings when the run parses them
    logging.basicConfig(level=logging.INFO if ns.verbose or timing else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if ns.cmd == "run":
            for name, value, low in (("repeat", ns.repeat, 1), ("warmup", ns.warmup, 0),
                                     ("decode_tokens", ns.decode_tokens, 0)):
                if value < low:
                    raise ConfigError(name, value, f"an integer >= {low}")
            if not (math.isfinite(ns.peak_tflops) and ns.peak_tflops >= 0):
                raise ConfigError("--peak-tflops", ns.peak_tflops, "TFLOP/s >= 0 (0: no MFU columns)")
            if ns.mem_gbs < 0:
                raise ConfigError("--mem-gbs", ns.mem_gbs, "a measured bandwidth in GB/s > 0 (0 or omitted: "
                                                           "derived for CUDA, unknown for a CPU)")
        return ns.func(ns)
    except KeyboardInterrupt:
        print("strata-bench: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        oom = failure.host_out_of_memory(exc)
        if oom is not None:
            print(f"strata-bench: error: {oom}", file=sys.stderr)
            return failure.BAD_INPUT
        if failure.is_user_error(exc):
            print(f"strata-bench: error: {exc}", file=sys.stderr)
            return failure.BAD_INPUT
        if ns.verbose:
            log.exception("internal error")
        print(f"strata-bench: {failure.record(exc, f'strata-bench {ns.cmd}').line}", file=sys.stderr)
        return failure.INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
