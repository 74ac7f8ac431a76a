"""The Run tab's side of the window (GUI thread): Run checks the form and starts the run on the
run controller; the controller's signals are drawn into the RunTab and said in the status line;
a failure opens the error box; each save is said in the History tab.  No widget is built here.

The window it serves needs only `revalidate()`, `current_settings()`, `form`
(run/form_check.py), `store`, `sweeps.is_running`, `set_status()`, `show_error()`,
`history_panel` and `history_changed()`."""
from __future__ import annotations

from PySide6.QtCore import QObject

from .run_controller import RunController
from .run_messages import SaveResult
from .run_state import run_request


class RunPresenter(QObject):
    def __init__(self, window, tab, controller: RunController) -> None:
        super().__init__(window)
        self.win, self.tab, self.controller = window, tab, controller
        c, t, status = controller, tab, window.set_status
        tab.run_button.clicked.connect(self.start)
        tab.stop_button.clicked.connect(self.stop)
        c.run_started.connect(lambda info: (t.on_started(info), status(c.state.started_status(info))))
        c.events.connect(t.on_events)
        c.telemetry.connect(t.telemetry.add_samples)
        c.status.connect(status)
        c.finished.connect(lambda report: status(t.on_finished(report)))
        c.measured.connect(t.on_measured)
        c.warmup.connect(t.on_warmup)
        c.cancelled.connect(lambda msg: (t.on_cancelled(msg), status(f"stopped: {msg}")))
        c.failed.connect(self._on_failed)
        c.saved.connect(self._on_saved)

    def start(self) -> bool:
        w = self.win
        if self.controller.is_running or w.sweeps.is_running:
            return False
        v = w.revalidate()
        if w.form.pending:
            w.set_status("cannot run yet: the model file is still being read")
            return False
        if not v.ok or v.config is None:
            names = ", ".join(k.replace("_", " ") for k in v.errors) or "the model"
            w.set_status(f"cannot run: fix the {len(v.errors) or 1} setting(s) marked in red ({names})")
            return False
        s = w.current_settings()
        w.store.save_run_settings(s)
        self.tab.begin_run()
        return self.controller.start(run_request(s, v.config, w.form.model_path(s), w.form.model_label(s)))

    def stop(self) -> None:
        if self.controller.is_running:
            self.win.set_status("stopping at the next chunk boundary …")
            self.controller.stop()

    def _on_failed(self, title: str, message: str, details: str) -> None:
        self.tab.on_failed(message)
        self.win.set_status(f"{title}: {message}")
        self.win.show_error(title, message, details)

    def _on_saved(self, result: SaveResult) -> None:
        panel = self.win.history_panel
        if result.error:
            self.win.set_status(f"the run was not saved to the history: {result.error}")
            panel.set_message(f"the last run was not saved: {result.error}", error=True)
            return
        panel.set_message(f"run #{result.run} saved ({result.status})")
        self.win.history_changed()
