"""A sweep's side of the history, and the checks before one starts (no Qt).

`arm_configs` checks every arm's settings on top of the Run tab's (the engine's rules, the
machine, the model's layers) and names each arm that is wrong.  `SweepBook` records a sweep and
its end in the run history, lists the past ones, reads one back as results, and finds the
measured run a plan's time estimate is scaled from.  Without a history every call is a no-op
(or None).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

from engine.config import ConfigError, EngineConfig

from ..run.settings_model import check_machine
from .sweep_model import SweepPlan, SweepResults, SweepSample, SweepStep, arm_config, format_tokens

log = logging.getLogger(__name__)


def arm_configs(plan: SweepPlan, base: dict, env: Mapping[str, str], cuda_count: int,
                n_layers: int | None) -> tuple[list[EngineConfig], list[str]]:
    """Each arm's EngineConfig, in the plan's order, and one line per arm that is wrong."""
    configs, errors = [], []
    for arm in plan.arms:
        try:
            cfg = arm_config(base, arm, env)
            check_machine(cfg, cuda_count)
            if n_layers is not None:
                cfg.check_layers(n_layers)
        except ConfigError as exc:
            errors.append(f"arm {arm.name}: {exc}")
            continue
        configs.append(cfg)
    return configs, errors


def sweep_label(plan: SweepPlan) -> str:
    """How the history lists a sweep: its arms and sizes."""
    return f"{' vs '.join(a.name for a in plan.arms)} · {', '.join(format_tokens(n) for n in plan.sizes)}"


class SweepBook:
    def __init__(self, history=None) -> None:
        self.history = history  # history_model.RunHistory, or None

    def add(self, plan: SweepPlan) -> tuple[int | None, str]:
        """(the new sweep's id, "") or (None, why it is not saved)."""
        if self.history is None:
            return None, ""
        try:
            return self.history.add_sweep(sweep_label(plan), plan.to_dict()), ""
        except Exception as exc:
            log.exception("recording the sweep failed")
            return None, f"the sweep is not saved to the history: {exc}"

    def end(self, sweep_id: int | None, status: str) -> None:
        if self.history is None or sweep_id is None:
            return
        try:
            self.history.set_sweep_status(sweep_id, status)
        except Exception:
            log.exception("recording the sweep's end failed")

    def past(self) -> list | None:
        """The history's sweeps, newest first; None when they cannot be listed."""
        if self.history is None:
            return []
        try:
            return self.history.list_sweeps()
        except Exception:
            log.exception("listing sweeps failed")
            return None

    def results(self, sweep: int) -> SweepResults:
        """A past sweep's plan and the samples of the runs the history kept (raises on a read error)."""
        plan_d, members = self.history.sweep(sweep)
        plan = SweepPlan.from_dict(plan_d)
        samples = [SweepSample.from_report(SweepStep(i, m.prompt_tokens, m.repeat, m.arm),
                                           self.history.report(m.run), m.run) for i, m in enumerate(members)]
        return SweepResults(plan, samples)

    def reference(self, model_label: str, devices: str) -> tuple[int, float, int] | None:
        """(prompt tokens, prefill tok/s, run id) of the latest finished run of this model on these
        devices, the estimate's reference; None without one (an unreadable history included)."""
        if self.history is None:
            return None
        try:
            rows = self.history.list_runs(limit=500)
        except Exception as exc:  # an unreadable history: no estimate, never an error here
            log.info("no sweep estimate: %s", exc)
            return None
        row = next((r for r in rows if r.status == "finished" and r.model == model_label
                    and r.devices == devices and r.prefill_tok_s > 0 and r.prompt_tokens > 0), None)
        return None if row is None else (row.prompt_tokens, row.prefill_tok_s, row.id)
