"""One sweep for the CLI and the app: arms x prompt sizes x repeats, in one order, with one
statistic (no Qt, no torch).

Order: for each prompt size, for each repeat, every arm in turn on the SAME prompt
(`engine.io.prompt.synthetic` with `sweep_nonce(size, repeat)`), so arms see identical prompts,
repeats see different ones, and slow drift of the machine is shared by all arms.  Unmeasured
warm-up runs come before each size's first step.  A point (arm, size) is summarised by the
median prefill tok/s and its spread: half the range, as a share of the median.

`strata-bench run` (engine/cli/bench.py) and the app's Sweep tab (strata_gui/sweep.py,
sweep_worker.py) both walk `steps()` and summarise with `median_spread()`; an arm's text is
parsed by `parse_arm` for both.
"""
from __future__ import annotations

import shlex
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.config import ConfigError, canonical, parse_setting


def sweep_nonce(prompt_tokens: int, repeat: int) -> int:
    """The synthetic prompt's nonce of one (size, repeat): the same for every arm."""
    return prompt_tokens * 1000 + repeat


@dataclass(frozen=True)
class SweepStep:
    index: int
    prompt_tokens: int
    repeat: int
    arm: int

    @property
    def nonce(self) -> int:
        return sweep_nonce(self.prompt_tokens, self.repeat)

    @property
    def first_of_size(self) -> bool:
        """The size's first step: warm-up runs go before it."""
        return self.repeat == 0 and self.arm == 0


def steps(sizes: Sequence[int], repeats: int, n_arms: int) -> list[SweepStep]:
    """Size by size, repeat by repeat, every arm on the same prompt."""
    out: list[SweepStep] = []
    for n in sizes:
        for rep in range(repeats):
            for arm in range(n_arms):
                out.append(SweepStep(len(out), n, rep, arm))
    return out


def median_spread(values: Sequence[float]) -> tuple[float, float]:
    """(median, spread): the spread is half the range as a share of the median (0 for one value)."""
    if not values:
        return 0.0, 0.0
    med = statistics.median(values)
    spread = (max(values) - min(values)) / 2 / med if len(values) > 1 and med else 0.0
    return med, spread


def parse_arm(text: str) -> dict[str, Any]:
    """`"pipeline_depth=0 chunk_tokens=2048"` -> {"pipeline_depth": 0, "chunk_tokens": 2048} (validated;
    the seeds' names pf_depth and prefill are read as these)."""
    out: dict[str, Any] = {}
    try:
        items = shlex.split(text.replace(";", " "))
    except ValueError as exc:  # an unclosed quote
        raise ConfigError("arm", text, "space-separated setting=value pairs such as pipeline_depth=0",
                          str(exc)) from None
    for item in items:
        k, sep, v = item.partition("=")
        k = canonical(k.strip().replace("-", "_"))
        if not sep:
            raise ConfigError("arm", text, "space-separated setting=value pairs such as pipeline_depth=0")
        out[k] = parse_setting(k, v)
    return out
