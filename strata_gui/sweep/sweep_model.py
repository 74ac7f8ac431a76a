"""A prompt-size sweep (no Qt): the plan, its results, and its table as CSV and markdown.

A sweep runs every prompt size for every arm (a name and settings over the Run tab's, written
as for `strata-bench run --arm`, e.g. ``pipeline_depth=0 chunk_tokens=2048``), `repeats` times.  It runs
in the order of `strata-bench`: for each size, for each repeat, every arm in turn on the SAME
prompt (`engine.io.prompt.synthetic` with `engine.io.prompt.sweep_nonce(size, repeat)`), so arms see
identical prompts, repeats see different ones, and slow drift of the machine is shared by all
arms.  The table per (arm, size) is the bench's: the median prefill tok/s, ± sd (the sample
standard deviation of the repeats' tok/s: strata-bench's `± sd` and `stddev_ts`), and the ratio to
the first arm at that size.
"""
from __future__ import annotations

import csv
import io
import logging
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.cli.bench_format import stddev
from engine.config import ConfigError, EngineConfig
from engine.events import RunReport
from engine.sweep import SweepStep, median_spread, parse_arm, steps

log = logging.getLogger(__name__)

MAX_SIZES = 32
MAX_REPEATS = 100
MAX_PROMPT_TOKENS = 1 << 20

# RunSettings.overrides() key -> strata-bench flag (for the command that reproduces a sweep)
BENCH_FLAGS = {"devices": "--devices", "gpu_order": "--gpu-order", "layer_split": "--layer-split",
               "chunk_tokens": "--chunk-tokens", "pipeline_depth": "--pipeline-depth",
               "pin_limit_gib": "--pin-limit-gib", "expert_cache": "--expert-cache"}

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kKmM]?)$")


def parse_sizes(text: str) -> list[int]:
    """'8K, 16K, 32768' -> [8192, 16384, 32768]; K = 1024, M = 1024 K.  Sorted, no duplicates."""
    parts = [p.strip() for p in re.split(r"[,\s;]+", text.strip()) if p.strip()]
    allowed = f"prompt sizes such as 8K,16K,32K,64K or 512,1024 (1 to {MAX_PROMPT_TOKENS} tokens, at most {MAX_SIZES})"
    if not parts:
        raise ConfigError("prompt sizes", text, allowed)
    sizes = set()
    for p in parts:
        m = _SIZE.match(p)
        if not m:
            raise ConfigError("prompt sizes", p, allowed)
        n = float(m.group(1)) * {"": 1, "k": 1024, "m": 1 << 20}[m.group(2).lower()]
        if not n.is_integer() or not 1 <= n <= MAX_PROMPT_TOKENS:
            raise ConfigError("prompt sizes", p, allowed)
        sizes.add(int(n))
    if len(sizes) > MAX_SIZES:
        raise ConfigError("prompt sizes", text, allowed)
    return sorted(sizes)


def format_tokens(n: int) -> str:
    """8192 -> '8K', 1536 -> '1.5K', 300 -> '300'."""
    if n >= 1024 and n % 512 == 0:
        k = n / 1024
        return f"{k:g}K"
    return str(n)


@dataclass(frozen=True)
class SweepArm:
    name: str
    settings: str = ""  # "pipeline_depth=0 chunk_tokens=2048": setting=value pairs over the base settings

    def overrides(self) -> dict[str, Any]:
        """The arm's settings, parsed and checked with the engine's rules (raises ConfigError)."""
        return parse_arm(self.settings) if self.settings.strip() else {}


@dataclass(frozen=True)
class SweepPlan:
    sizes: tuple[int, ...]
    arms: tuple[SweepArm, ...]
    repeats: int = 1
    warmup: int = 1  # unmeasured warm-up runs per arm before each prompt size's points (as strata-bench)
    decode_tokens: int = 0
    model: str = ""  # for the table's heading and the history
    base: Mapping[str, Any] = field(default_factory=dict)  # the Run tab's settings (raw values)

    def validate(self) -> None:
        if not self.sizes:
            raise ConfigError("prompt sizes", "", "at least one prompt size")
        if not self.arms:
            raise ConfigError("arms", "", "at least one arm")
        names = [a.name for a in self.arms]
        for a in self.arms:
            if not a.name.strip():
                raise ConfigError("arm name", a.name, "a non-empty name")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError("arm name", dup[0], "a name used by one arm only")
        if not 1 <= self.repeats <= MAX_REPEATS:
            raise ConfigError("repeats", self.repeats, f"an integer from 1 to {MAX_REPEATS}")
        if not 0 <= self.warmup <= 10:
            raise ConfigError("warm-up runs", self.warmup, "an integer from 0 to 10")
        if self.decode_tokens < 0:
            raise ConfigError("decode_tokens", self.decode_tokens, "an integer >= 0")

    def steps(self) -> list[SweepStep]:
        """Size by size, repeat by repeat, every arm on the same prompt (engine.sweep: strata-bench's order)."""
        return steps(self.sizes, self.repeats, len(self.arms))

    @property
    def total(self) -> int:
        return len(self.sizes) * self.repeats * len(self.arms)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["base"] = dict(self.base)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SweepPlan:
        return cls(sizes=tuple(int(x) for x in d["sizes"]),
                   arms=tuple(SweepArm(str(a["name"]), str(a.get("settings", ""))) for a in d["arms"]),
                   repeats=int(d.get("repeats", 1)), warmup=int(d.get("warmup", 1)),
                   decode_tokens=int(d.get("decode_tokens", 0)), model=str(d.get("model", "")),
                   base=dict(d.get("base", {})))

    def bench_command(self, model_arg: str = "MODEL") -> str:
        """The `strata-bench run` command that measures the same sweep."""
        parts = ["strata-bench", "run", "--model", shlex.quote(model_arg),
                 "--prompt-tokens", ",".join(str(n) for n in self.sizes)]
        for key, flag in BENCH_FLAGS.items():
            value = self.base.get(key)
            if value in (None, "", "auto") or (key == "gpu_order" and value == "pcie"):
                continue
            parts += [flag, shlex.quote(str(value))]
        if self.base.get("prefill_main"):
            parts.append("--prefill-main")
        for a in self.arms:
            parts += ["--arm", shlex.quote(a.settings or "")]
        parts += ["--repeat", str(self.repeats), "--warmup", str(self.warmup)]
        if self.decode_tokens:
            parts += ["--decode-tokens", str(self.decode_tokens)]
        return " ".join(parts)


def arm_config(base: Mapping[str, Any], arm: SweepArm, env: Mapping[str, str] | None = None) -> EngineConfig:
    """The engine config of one arm: the base settings, then the arm's (GUI > environment > default)."""
    return EngineConfig.from_sources({**base, **arm.overrides()}, env)


# --------------------------------------------------------------------------- results

@dataclass(frozen=True)
class SweepSample:
    """One measured run of a sweep."""

    arm: int
    prompt_tokens: int
    repeat: int
    prefill_tok_s: float
    decode_tok_s: float
    digest: str
    chunk: int
    n_chunks: int
    n_stages: int
    handoff: str
    busy_histogram: tuple[float, ...]
    run: int | None = None  # its id in the history, when saved

    @classmethod
    def from_report(cls, step: SweepStep, report: RunReport, run: int | None = None) -> SweepSample:
        return cls(step.arm, step.prompt_tokens, step.repeat, report.prefill_tok_s, report.decode_tok_s,
                   report.digest, report.plan.chunk, report.plan.n_chunks, len(report.plan.stages), report.handoff,
                   tuple(report.busy_histogram), run)


@dataclass(frozen=True)
class SweepRow:
    """One (arm, prompt size) of the table."""

    arm: int
    arm_name: str
    settings: str
    prompt_tokens: int
    tok_s: tuple[float, ...]  # every repeat's prefill tok/s, in order
    median: float
    sd: float  # the repeats' sample standard deviation, tok/s (n - 1; 0 for one): strata-bench's ± sd
    ratio: float | None  # median / the first arm's median at this size
    decode_median: float
    chunk: int
    n_chunks: int
    n_stages: int
    handoff: str
    busy_histogram: tuple[float, ...]  # of the last repeat
    digests: tuple[str, ...]
    same_output: bool | None  # every repeat's digest equals the first arm's (None: nothing to compare)

    @property
    def n(self) -> int:
        return len(self.tok_s)

    @property
    def low(self) -> float:
        return min(self.tok_s)

    @property
    def high(self) -> float:
        return max(self.tok_s)


def ratio_noise(row: SweepRow, base: SweepRow | None) -> tuple[bool | None, float | None]:
    """(within noise, ±share) of a row's ratio to its size's first-arm row: within when the ratios
    the repeats allow, [lowest / base's highest, highest / base's lowest], hold 1 (as Compare
    judges); (None, None) with a single repeat on both sides."""
    if base is None or row.ratio is None or (row.n < 2 and base.n < 2) or base.low <= 0:
        return None, None
    lo, hi = row.low / base.high, row.high / base.low
    return lo <= 1.0 <= hi, (hi - lo) / 2 / row.ratio


class SweepResults:
    """The samples of one sweep as they arrive, and the table they make."""

    def __init__(self, plan: SweepPlan, samples: Sequence[SweepSample] = ()) -> None:
        self.plan = plan
        self.samples: list[SweepSample] = list(samples)

    def add(self, sample: SweepSample) -> None:
        self.samples.append(sample)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def complete(self) -> bool:
        return len(self.samples) >= self.plan.total

    def _group(self) -> dict[tuple[int, int], list[SweepSample]]:
        groups: dict[tuple[int, int], list[SweepSample]] = {}
        for s in self.samples:
            groups.setdefault((s.arm, s.prompt_tokens), []).append(s)
        for g in groups.values():
            g.sort(key=lambda s: s.repeat)
        return groups

    def rows(self) -> list[SweepRow]:
        """Size by size, arm by arm; only points with at least one finished repeat."""
        groups = self._group()
        out = []
        for n in self.plan.sizes:
            base = groups.get((0, n))
            base_median = median_spread([s.prefill_tok_s for s in base])[0] if base else None
            base_digest = {s.repeat: s.digest for s in base} if base else {}
            for a, arm in enumerate(self.plan.arms):
                g = groups.get((a, n))
                if not g:
                    continue
                tok = tuple(s.prefill_tok_s for s in g)
                median, sd = median_spread(tok)[0], stddev(tok)
                ratio = median / base_median if base_median else None
                pairs = [(s.digest, base_digest.get(s.repeat)) for s in g if s.digest and base_digest.get(s.repeat)]
                same = all(x == y for x, y in pairs) if pairs and a > 0 else None
                last = g[-1]
                out.append(SweepRow(a, arm.name, arm.settings, n, tok, median, sd, ratio,
                                    median_spread([s.decode_tok_s for s in g])[0], last.chunk, last.n_chunks,
                                    last.n_stages, last.handoff, last.busy_histogram,
                                    tuple(s.digest for s in g), same))
        return out

    def series(self, arm: int) -> tuple[list[int], list[float], list[float], list[float]]:
        """(prompt sizes, medians, lows, highs) of one arm's finished points, by size."""
        rows = [r for r in self.rows() if r.arm == arm]
        return ([r.prompt_tokens for r in rows], [r.median for r in rows], [r.low for r in rows],
                [r.high for r in rows])

    # ---------------------------------------------------------------- rendering
    def _table(self) -> tuple[list[str], list[list[str]]]:
        cols = ["arm", "settings", "prompt", "chunk", "stages", "prefill tok/s", "± sd", "n", "ratio",
                "decode tok/s", "busy 0/1/..%", "handoff", "digest"]
        body = []
        for r in self.rows():
            body.append([r.arm_name, r.settings or "(base)", str(r.prompt_tokens), f"{r.chunk}x{r.n_chunks}",
                         str(r.n_stages), f"{r.median:.1f}", f"{r.sd:.1f}", str(r.n),
                         "—" if r.ratio is None else f"{r.ratio:.3f}", f"{r.decode_median:.1f}",
                         "/".join(f"{x * 100:.0f}" for x in r.busy_histogram), r.handoff, r.digests[-1][:12]])
        return cols, body

    def to_csv(self) -> str:
        """One row per (arm, prompt size), every repeat's tok/s in the last column."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["arm", "settings", "prompt_tokens", "chunk", "n_chunks", "stages", "prefill_tok_s_median",
                    "stddev_ts", "repeats", "ratio_to_first_arm", "decode_tok_s_median", "busy_histogram", "handoff",
                    "digest", "same_output_as_first_arm", "prefill_tok_s_all"])
        for r in self.rows():
            w.writerow([r.arm_name, r.settings, r.prompt_tokens, r.chunk, r.n_chunks, r.n_stages, f"{r.median:.3f}",
                        f"{r.sd:.3f}", r.n, "" if r.ratio is None else f"{r.ratio:.5f}",
                        f"{r.decode_median:.3f}", "/".join(f"{x:.4f}" for x in r.busy_histogram), r.handoff,
                        r.digests[-1], "" if r.same_output is None else str(r.same_output).lower(),
                        ";".join(f"{x:.3f}" for x in r.tok_s)])
        return buf.getvalue()

    def to_markdown(self, model_arg: str | None = None) -> str:
        """The table with a heading that says what was measured and how to measure it again."""
        p = self.plan
        done = f"{len(self.samples)} of {p.total} runs" + ("" if self.complete else " (stopped early)")
        lines = [f"Prefill tok/s by prompt size: {len(p.arms)} arm(s) x {len(p.sizes)} size(s) x {p.repeats} "
                 f"repeat(s), {done}.", ""]
        if p.model:
            lines.append(f"Model: {p.model}")
        base = ", ".join(f"{k}={v}" for k, v in p.base.items() if v not in ("", None))
        if base:
            lines.append(f"Base settings: {base}")
        lines.append("Arms: " + "; ".join(f"{a.name} = {a.settings or '(base)'}" for a in p.arms))
        lines += ["", "```", p.bench_command(model_arg or "MODEL"), "```", ""]
        cols, body = self._table()
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
        return "\n".join(lines) + "\n"



def estimate_seconds(plan: SweepPlan, flops: Callable[[int], float], ref_tokens: int, ref_prefill_s: float) -> float:
    """The sweep's prefill time, every run (warm-ups too) scaled from one measured run: a prompt of
    n tokens takes ref_prefill_s x flops(n) / flops(ref_tokens) (the model's causal prefill FLOPs,
    so attention's quadratic share grows as it does).  Decode, loading and the machine's drift are
    left out: it tells hours from minutes, no more."""
    if ref_tokens < 1 or ref_prefill_s <= 0 or flops(ref_tokens) <= 0:
        raise ValueError("no measured reference run")
    per_flop = ref_prefill_s / flops(ref_tokens)
    runs_per_size = len(plan.arms) * (plan.repeats + plan.warmup)
    return sum(flops(n) * per_flop * runs_per_size for n in plan.sizes)


def format_duration(seconds: float) -> str:
    """About 40 s, about 12 min, about 3.4 h."""
    if seconds < 90:
        return f"about {seconds:.0f} s"
    if seconds < 5400:
        return f"about {seconds / 60:.0f} min"
    return f"about {seconds / 3600:.1f} h"


def estimate_text(plan: SweepPlan, flops: Callable[[int], float] | None,
                  reference: tuple[int, float, int] | None) -> str:
    """The Sweep tab's time estimate in words.  `reference`: (prompt tokens, prefill tok/s, run
    id) of a finished run of this model on these devices; None: no estimate, and how to get one."""
    runs = plan.total + len(plan.arms) * plan.warmup * len(plan.sizes)
    head = f"{runs} runs ({plan.total} measured + {runs - plan.total} warm-up) of up to {format_tokens(max(plan.sizes))} tokens"
    if flops is None or reference is None:
        return (f"{head}. No time estimate yet: it scales a measured run of this model on these devices, "
                "and there is none in the history — run once in the Run tab (a small prompt will do).")
    n, tok_s, run = reference
    est = estimate_seconds(plan, flops, n, n / tok_s)
    return (f"{head}: {format_duration(est)} of prefill, scaled from run #{run} "
            f"({format_tokens(n)} tokens at {tok_s:,.0f} tok/s).")
