"""The main window: five tabs.  Run (run_tab_view.RunTab): settings and devices, Run/Stop, the
live Gantt, telemetry and the run summary.  History: every saved run.  Compare: a before and an
after run.  Sweep: prompt sizes x arms x repeats.  Plan: the what-if planner.  It builds the
views and wires them to the run and sweep controllers (run/run_controller.py,
sweep/sweep_controller.py), the form's checks (run/form_check.py) and the history; it draws,
it never runs engine work in the GUI thread."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from PySide6.QtCore import QSettings, Qt
from PySide6.QtGui import QCloseEvent, QGuiApplication
from PySide6.QtWidgets import QLabel, QMainWindow, QMessageBox, QTabWidget, QWidget

from engine.hw import machine, topology
from engine.hw.topology import Topology

from ..history.history_model import RunHistory, UnsavedRuns, open_history
from ..run.background import BackgroundJobs
from ..run.form_check import FormCheck
from ..run.model_cache import ModelCache
from ..run.monitor_controller import MonitorController
from ..run.record_model import RunRecord
from ..run.run_controller import RunController
from ..run.run_presenter import RunPresenter
from ..run.settings_model import RunSettings, Validation, settings_from_config
from ..run.settings_store import SettingsStore
from ..sweep.sweep_book import SweepBook
from ..sweep.sweep_controller import SweepController
from ..sweep.sweep_presenter import SweepPresenter
from . import wheel_guard, window_fit
from .compare_tab_view import CompareTab
from .compare_view import CompareView
from .history_view import HistoryPanel
from .menu_view import build_menus
from .plan_view import PlanTab
from .run_tab_view import RUN_TIP, RunTab
from .sweep_view import SweepView

log = logging.getLogger(__name__)

APP_TITLE = "Strata GUI: layer-split prefill pipeline"
TAB_TIPS = {
    1: "Every run saved with its settings, report, events and telemetry.",
    2: "Two runs' timelines on one time axis, their figures as ratios, what changed.",
    3: "Prefill tok/s against prompt size for several arms, with repeats.",
    4: "Predict a run on other GPUs or settings from a saved run's measured costs.",
}


def cuda_count_early() -> int:
    """The CUDA devices torch will see, told without importing torch where NVML can tell it
    (engine/hw/machine.py: at most NVML's count, within CUDA_VISIBLE_DEVICES); else torch's count."""
    bound = machine.cuda_count_bound()
    if bound is not None:
        return bound
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_devices(cuda_count: int) -> str:
    """All GPUs when there are any, else a 2-stage CPU split (the pipeline is the point)."""
    return ",".join(f"cuda:{i}" for i in range(cuda_count)) if cuda_count else "cpu,cpu"


def _state_field(name: str) -> property:
    """The window's attribute `name`, read and written on the run controller's RunState."""
    return property(lambda self: getattr(self.controller.state, name),
                    lambda self, value: setattr(self.controller.state, name, value))


class MainWindow(QMainWindow):
    def __init__(self, settings: QSettings, demo_model: Path, controller: RunController | None = None,
                 discover: Callable[[bool], Topology] = topology.discover,
                 env: Mapping[str, str] | None = None, parent: QWidget | None = None,
                 history: RunHistory | None = None, history_path: Path | None = None,
                 sweeps: SweepController | None = None, hold_jobs: bool = False) -> None:
        """`history`: the run history to use; else the one at `history_path` (default: the user's
        data directory), opened here.  A history that cannot be opened (a newer version's, a
        corrupt file) is left untouched; the app then runs without one and says why."""
        super().__init__(parent)
        wheel_guard.install()  # an unfocused combo or spin box never takes the page's scroll wheel
        self.setWindowTitle(APP_TITLE)
        self.store = SettingsStore(settings)
        self.demo_model = Path(demo_model)
        self._owns_history = history is None
        self.history_error = ""
        if history is None:
            history, self.history_error = open_history(history_path)
        self.history = history
        self.jobs = BackgroundJobs(self)
        if hold_jobs:  # the app: discovery and the model's parse (torch) start once the window is drawn
            self.jobs.hold()
        self._discover = discover
        self._env = os.environ if env is None else env
        # before torch (issue 37: the window shows without it): NVML's count within CUDA_VISIBLE_DEVICES,
        # made exact by device discovery (torch's own count) in the background (_on_topology)
        self.cuda_count = cuda_count_early()
        # model files parsed off the GUI thread, once: the form's facts, the run's Session and a sweep share them
        self.models = ModelCache()
        self.form = FormCheck(self.models, self.jobs, self._env, self.cuda_count, self.demo_model,
                              lambda: None if self._closing else self.revalidate())
        setup_controllers(self, controller, sweeps, history_path)
        self.validation = Validation()
        self.error_box: QMessageBox | None = None
        self._closing = False
        self._build()
        self._connect()
        defaults = RunSettings.from_env(self._env, default_devices(self.cuda_count), demo=True)
        saved, replaced = self.store.load_run_settings(defaults) if self.store.has_run_settings else (defaults, [])
        self.apply_settings(saved)
        self.settings_notes = replaced  # saved values that could not be used, each named in the status bar
        geometry = self.store.load_bytes("geometry")
        self.fit_to_screen(geometry is not None and self.restoreGeometry(geometry))
        # shown until device discovery is done too (its "ready" would hide it)
        self._startup_status = ("saved settings not usable, defaults used: " + "; ".join(replaced)
                                if replaced else "")
        self.refresh_topology(probe=False)
        self._startup_notes()

    def _startup_notes(self) -> None:
        if self.history is not None and getattr(self.history, "notice", ""):
            self.set_status(self.history.notice)
        if self._startup_status:
            self.set_status(self._startup_status)
        if self.history_error:
            self.set_status(f"run history unavailable: {self.history_error}")
            self.show_error("Run history unavailable", self.history_error,
                            informative="Runs work as before; they are not saved until this is resolved.")

    # ------------------------------------------------------------------ layout
    def fit_to_screen(self, remembered: bool = True) -> None:
        """The remembered size and place (or a first-start default), clamped to the screen's
        available area: the window never opens larger than the screen (150% scale included)."""
        if self.isMaximized() or self.isFullScreen():
            return
        screen = self.screen() or QGuiApplication.primaryScreen()
        if screen is None:
            return
        a, g, m = screen.availableGeometry(), self.geometry(), self.minimumSizeHint()
        r = window_fit.fit(window_fit.Rect(g.x(), g.y(), g.width(), g.height()) if remembered else None,
                           window_fit.Rect(a.x(), a.y(), a.width(), a.height()), (m.width(), m.height()))
        self.setGeometry(r.x, r.y, r.w, r.h)

    def _build(self) -> None:
        self.run_tab = RunTab(self.controller.state)
        t = self.run_tab  # its parts, by the names the tests and tools use
        self.devices_panel, self.settings_panel, self.summary = t.devices_panel, t.settings_panel, t.summary
        self.run_button, self.stop_button, self.splitter = t.run_button, t.stop_button, t.splitter
        self.progress, self.progress_label = t.progress, t.progress_label
        self.gantt, self.telemetry = t.gantt, t.telemetry
        self.gpu_monitor = MonitorController(self.telemetry, self._busy, lambda: self.controller.topology, self)
        self.monitor = self.gpu_monitor.monitor
        self.history_panel = HistoryPanel(self.history, self.jobs, self.history_error)
        self.compare_tab = CompareTab(self.history)
        self.sweep_view = SweepView()
        self.sweep_presenter = SweepPresenter(self, self.sweep_view, self.sweeps)
        self.run_presenter = RunPresenter(self, self.run_tab, self.controller)
        self.tabs = QTabWidget()
        self.tabs.setDocumentMode(True)
        self.plan_tab = PlanTab(self)  # issue 22: the what-if planner (strata_gui/views/plan_view.py)
        for w, name in ((self.run_tab, "Run"), (self.history_panel, "History"), (self.compare_tab, "Compare"),
                        (self.sweep_view, "Sweep"), (self.plan_tab, "Plan")):
            self.tabs.addTab(w, name)
        for i, tip in TAB_TIPS.items():
            self.tabs.setTabToolTip(i, tip)
        self.setCentralWidget(self.tabs)
        self.sweep_presenter.refresh_past()
        self.status_label = QLabel("ready")
        self.statusBar().addWidget(self.status_label, 1)
        self.quit_action, self.run_action, self.stop_action = build_menus(self, self.tabs, self._run_from_menu,
                                                                          self.stop_run)
        self.run_button.setToolTip(self.run_button.toolTip() + " (Ctrl+R)")

    def _run_from_menu(self) -> None:
        self.tabs.setCurrentWidget(self.run_tab)
        self.start_run()

    def _connect(self) -> None:
        self.settings_panel.changed.connect(self.revalidate)
        self.devices_panel.changed.connect(self.revalidate)
        self.devices_panel.probe_requested.connect(lambda: self.refresh_topology(probe=True))
        self.controller.busy_changed.connect(self._on_busy)
        h = self.history_panel
        h.compare_requested.connect(self.compare_runs)
        h.show_requested.connect(self.show_history_run)
        h.changed.connect(self.history_changed)
        h.error.connect(lambda title, msg: self.show_error(title, msg))
        self.sweeps.busy_changed.connect(self._on_busy)

    # ------------------------------------- a press of Run (the run controller's state), by its old names
    last_report = _state_field("last_report")
    last_outcome = _state_field("last_outcome")
    last_saved = _state_field("last_saved")
    saved_this_run = _state_field("saved_this_run")
    in_warmup = _state_field("in_warmup")
    progress_model = _state_field("progress_model")
    repeats = _state_field("repeats")

    # ---------------------------------------------------------------- devices
    def refresh_topology(self, probe: bool) -> None:
        self.set_status("measuring host-to-device bandwidth …" if probe else "discovering devices …")
        self.devices_panel.probe.setEnabled(False)
        self.jobs.submit("discover", lambda: self._discover(probe), self._on_topology)

    def _on_topology(self, topo: Topology | None, error: str | None) -> None:
        if self._closing:
            return
        if topo is None:
            topo = Topology(reason=f"device discovery failed: {error}")
        elif self._discover is topology.discover:
            exact_cuda_count(self, len(topo.devices))
        self.controller.topology = topo
        self.devices_panel.set_topology(topo)
        if not self.controller.is_running:
            self.telemetry.set_unavailable("GPU telemetry is sampled during a run." if topo.devices else
                                           "telemetry unavailable: no GPU to sample (the Devices panel says why)")
        idle = self._startup_status or "ready"
        self._startup_status = ""
        self.set_status(idle if not self.controller.is_running else self.status_label.text())
        self.revalidate()

    # --------------------------------------------------------------- settings
    def apply_settings(self, s: RunSettings) -> None:
        self.settings_panel.load(s)
        self.devices_panel.load(s.devices, s.gpu_order)
        self.revalidate()

    def current_settings(self) -> RunSettings:
        return RunSettings.from_dict({**self.settings_panel.values(), **self.devices_panel.values()})

    @property
    def model_pending(self) -> bool:
        """A model file is being parsed: Run waits for its facts."""
        return self.form.pending

    def revalidate(self) -> Validation:
        s, f, p = self.current_settings(), self.form, self.settings_panel
        self.validation, model_line = f.validate(s)
        p.set_model_info(model_line)
        p.set_memory_plan(f.memory_plan_text(s, self.validation))
        p.set_errors(self.validation.errors)
        cuda = any(d.strip().startswith("cuda") for d in s.devices.split(","))
        p.set_cuda_graphs_applicable(
            cuda, "" if cuda else "no CUDA device in the list" if self.cuda_count else "no CUDA device")
        self.devices_panel.set_errors(self.validation.errors)
        p.set_attach(*f.attach_text(self.validation))
        self.sweep_view.set_base(f.sweep_base_text(s))
        self.sweep_presenter.update_estimate()
        self._update_buttons()
        return self.validation

    def _busy(self) -> bool:
        return self.controller.is_running or self.sweeps.is_running

    def _update_buttons(self) -> None:
        running, sweeping = self.controller.is_running, self.sweeps.is_running
        ok = self.validation.ok and not self.model_pending
        can_run = ok and not running and not sweeping
        if hasattr(self, "run_action"):
            self.run_action.setEnabled(can_run)
            self.stop_action.setEnabled(running)
        self.run_tab.set_buttons(can_run, running, "A sweep is running; stop it or wait." if sweeping else RUN_TIP
                                 if ok else "Reading the model file …" if self.model_pending
                                 else "Fix the settings marked in red first.")
        self.sweep_view.set_running(sweeping)
        self.sweep_view.set_start_enabled(not running and not sweeping,
                                          "A run is in flight in the Run tab; wait for it." if running else "")

    def _on_busy(self, _running: bool) -> None:
        """A run or a sweep started or ended: settings are fixed while either is in flight."""
        self.gpu_monitor.busy_changed()
        self.settings_panel.set_editable(not self._busy())
        self.devices_panel.set_editable(not self._busy())
        self._update_buttons()

    # -------------------------------------------------------------------- runs (run/run_presenter.py)
    def start_run(self) -> bool:
        return self.run_presenter.start()

    def stop_run(self) -> None:
        self.run_presenter.stop()

    def show_error(self, title: str, message: str, details: str = "",
                   informative: str = "The app stays usable: fix the cause and try again.") -> None:
        """A window-modal message box that does not block the event loop (runs keep their signals)."""
        if self._closing:
            return
        box = QMessageBox(QMessageBox.Icon.Critical, title, message, QMessageBox.StandardButton.Ok, self)
        box.setInformativeText(informative)
        if details:
            box.setDetailedText(details)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.error_box = box
        box.finished.connect(lambda *_: setattr(self, "error_box", None))
        box.open()

    def set_status(self, text: str) -> None:
        self.status_label.setText(text)

    # ----------------------------------------------------------------- history
    def history_changed(self) -> None:
        self.history_panel.refresh()
        self.sweep_presenter.update_estimate()  # a new measured run may be the estimate's reference
        self.compare_tab.refresh()
        self.sweep_presenter.refresh_past()

    @property
    def compare_view(self) -> CompareView:
        """The Compare tab's view, built on first use."""
        return self.compare_tab.view

    def compare_runs(self, before: int, after: int) -> bool:
        ok = self.compare_view.set_pair(before, after)
        self.tabs.setCurrentWidget(self.compare_tab)
        return ok

    def show_history_run(self, run: int) -> bool:
        """A saved run's timeline, telemetry and summary in the Run tab."""
        if self.history is None or self.controller.is_running:
            return False
        try:
            record: RunRecord = self.history.get(run)
        except Exception as exc:
            self.show_error("Cannot show the run", f"Run #{run} cannot be read from the history: {exc}")
            return False
        self.run_tab.show_record(run, record)
        self.tabs.setCurrentWidget(self.run_tab)
        # the form shows the run's settings, so Run repeats it (rather than other values beside its timeline)
        restored, kept = settings_from_config(record.config, self.current_settings())
        self.apply_settings(restored)
        note = f"; kept the form's {', '.join(kept)}" if kept else ""
        self.set_status(f"showing run #{run} from the history; the settings are that run's{note}")
        return True

    # ------------------------------------------------------------------- sweeps (sweep/sweep_presenter.py)
    def start_sweep(self) -> bool:
        return self.sweep_presenter.start()

    def open_sweep(self, sweep: int) -> bool:
        return self.sweep_presenter.open(sweep)

    # ------------------------------------------------------------------- close
    def closeEvent(self, event: QCloseEvent) -> None:
        self._closing = True
        try:
            self.store.save_run_settings(self.current_settings())
            self.store.save_bytes("geometry", self.saveGeometry())
        except Exception:
            log.exception("saving the settings failed")
        if self.controller.is_running:
            self.set_status("stopping the run before closing …")
        self.gpu_monitor.shutdown()
        self.controller.shutdown()
        self.sweeps.shutdown()
        self.jobs.wait_all()
        if self.history is not None and self._owns_history:
            self.history.close()
        super().closeEvent(event)


def exact_cuda_count(win: MainWindow, n: int) -> None:
    """torch's device count, from discovery: the form checks against it from now on, and devices
    still at the early count's default get the default of this one."""
    if n == win.cuda_count:
        return
    old, win.cuda_count = win.cuda_count, n
    win.form.cuda_count = n
    if win.devices_panel.values().get("devices") == default_devices(old):
        win.devices_panel.load(default_devices(n), win.current_settings().gpu_order)


def setup_controllers(win: MainWindow, controller: RunController | None, sweeps: SweepController | None,
                      history_path: Path | None) -> None:
    """The run and sweep controllers, wired to the history and the shared model cache."""
    win.controller = controller or RunController()
    win.controller.setParent(win)
    win.sweeps = sweeps or SweepController()
    win.sweeps.setParent(win)
    if win.history is not None:
        win.controller.recorder = win.history.add
        win.sweeps.recorder = win.history.add
    elif win.history_error:  # runs go to trace files beside the unusable history
        win.controller.recorder = UnsavedRuns(history_path, win.history_error).add
    win.sweeps.book = SweepBook(win.history)
    win.sweeps.free_memory = win.controller.sessions.close  # a sweep's sessions need the memory
    win.controller.sessions.models = win.models
    win.sweeps.models = win.models
