"""The Sweep tab's side of the window (GUI thread): Start checks the Run tab's settings (the
sweep's base) and every arm, records the sweep and starts it on the sweep controller; the
controller's signals are drawn into the SweepView; past sweeps are listed and reopened from the
history; the plan's time estimate is kept current.  No widget is built here.

The window it serves needs only `current_settings()`, `revalidate()`, `set_status()`,
`show_error()`, `history_changed()`, `controller.is_running`, `form` (run/form_check.py),
`_env` and `cuda_count`."""
from __future__ import annotations

import logging

from PySide6.QtCore import QObject

from engine.config import ConfigError

from .sweep_book import arm_configs
from .sweep_controller import SweepController
from .sweep_messages import SweepRequest
from .sweep_model import estimate_text

log = logging.getLogger(__name__)


class SweepPresenter(QObject):
    def __init__(self, window, view, controller: SweepController) -> None:
        super().__init__(window)
        self.win, self.view, self.sweeps = window, view, controller
        view.start_requested.connect(self.start)
        view.stop_requested.connect(self.stop)
        view.open_requested.connect(self.open)
        view.plan_changed.connect(self.update_estimate)
        controller.progress.connect(view.on_progress)
        controller.point_done.connect(view.add_sample)
        controller.status.connect(window.set_status)
        controller.finished.connect(self._on_finished)
        controller.failed.connect(self._on_failed)

    def start(self) -> bool:
        """Start the Sweep tab's plan over the Run tab's settings (each arm's settings on top)."""
        w, view = self.win, self.view
        if w.controller.is_running or self.sweeps.is_running:
            return False
        s, v = w.current_settings(), w.revalidate()
        errors = [msg for field, msg in v.errors.items() if field not in ("prompt", "decode_tokens")]
        if errors:
            view.set_errors(["The Run tab's settings are the sweep's base; fix them first:", *errors])
            return False
        base, label, path = s.overrides(), w.form.model_label(s), w.form.model_path(s)
        try:
            plan = view.plan(label, base)
        except ConfigError as exc:
            view.set_errors([str(exc)])
            return False
        configs, errors = arm_configs(plan, base, w._env, w.cuda_count, w.form.facts(path)[0])
        if errors:
            view.set_errors(errors)
            return False
        view.set_errors([])
        sweep_id, note = self.sweeps.prepare(plan)
        if note:
            w.set_status(note)
        view.begin(plan, sweep_id)
        w.set_status(f"sweep: {plan.total} runs ({len(plan.arms)} arms × {len(plan.sizes)} sizes × "
                     f"{plan.repeats} repeats)")
        return self.sweeps.start(SweepRequest(path, label, plan, tuple(configs), sweep_id))

    def stop(self) -> None:
        if self.sweeps.is_running:
            self.win.set_status("stopping the sweep at the next chunk boundary; finished points are kept …")
            self.sweeps.stop()

    def _on_finished(self, stopped: bool, message: str) -> None:
        self.view.on_finished(stopped, message)
        self.win.history_changed()
        self.win.set_status(f"sweep {message}")

    def _on_failed(self, title: str, message: str, details: str) -> None:
        self.view.on_finished(True, f"failed: {message}; the finished points are kept")
        self.win.history_changed()
        self.win.set_status(f"{title}: {message}")
        self.win.show_error(title, message, details)

    def refresh_past(self) -> None:
        past = self.sweeps.book.past()
        if past is not None:
            self.view.set_past(past)

    def open(self, sweep: int) -> bool:
        """A past sweep's chart and table, from the runs the history kept."""
        if self.sweeps.book.history is None or self.sweeps.is_running:
            return False
        try:
            results = self.sweeps.book.results(sweep)
        except Exception as exc:
            log.exception("opening sweep %s failed", sweep)
            self.view.set_message(f"cannot open sweep #{sweep}: {exc}", error=True)
            return False
        self.view.show_results(results, sweep)
        self.view.progress_label.setText(f"sweep #{sweep} from the history: {len(results.samples)} of "
                                         f"{results.plan.total} runs")
        return True

    def update_estimate(self) -> None:
        """The plan's time estimate, scaled from the latest finished run of this model on these
        devices in the history (none there: it says how to get one)."""
        s, form = self.win.current_settings(), self.win.form
        try:
            plan = self.view.plan(form.model_label(s), s.overrides())
        except ConfigError:
            self.view.set_estimate("")
            return
        spec = form.model_spec(s)
        devices = ",".join(d.strip() for d in s.devices.split(","))
        reference = self.sweeps.book.reference(form.model_label(s), devices) if spec is not None else None
        self.view.set_estimate(estimate_text(plan, spec.prefill_flops if spec else None, reference))
