"""The main window: four tabs.  Run: settings and devices on the left; Run/Stop, the live Gantt,
telemetry and the run summary on the right.  History: every saved run.  Compare: a before and an
after run.  Sweep: prompt sizes x arms x repeats.  It wires the panels to the run and sweep
controllers and to the history, and validates every edit with the engine's rules; it draws, it
never runs engine work in the GUI thread."""
from __future__ import annotations

import html
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from PySide6.QtCore import QSettings, Qt, QTimer
from PySide6.QtGui import QAction, QCloseEvent, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from engine import topology
from engine.config import ConfigError, rendezvous_address
from engine.events import RunReport
from engine.memory_plan import plan_memory
from engine.rendezvous_key import attach_commands, controller_key, exposure_warning
from engine.topology import TelemetrySample, Topology

from ..history.history_model import RunHistory, UnsavedRuns, open_history
from ..run.background import BackgroundJobs
from ..run.model_cache import ModelCache, file_key
from ..run.progress_model import RunProgress
from ..run.record_model import RunRecord
from ..run.run_controller import RunController
from ..run.run_job import RepeatDone, RunRequest, RunStarted, SaveResult
from ..run.settings_model import RunSettings, Validation, check_machine, settings_from_config, validate
from ..run.settings_store import SettingsStore
from ..run.spread_model import Spread
from ..run.telemetry_model import TelemetryMonitor, processes_text
from ..sweep.sweep_controller import SweepController
from ..sweep.sweep_model import SweepPlan, SweepResults, SweepSample, SweepStep, arm_config, estimate_text, format_tokens
from ..sweep.sweep_worker import SweepRequest
from . import wheel_guard, window_fit
from .compare_view import CompareView
from .devices_view import DevicesPanel
from .gantt_view import GanttView
from .history_view import HistoryPanel
from .plan_view import PlanTab
from .settings_view import SettingsPanel
from .summary_view import SummaryView
from .sweep_view import SweepView
from .telemetry_view import TelemetryView

log = logging.getLogger(__name__)

APP_TITLE = "Strata GUI: layer-split prefill pipeline"


def default_devices(cuda_count: int) -> str:
    """All GPUs when there are any, else a 2-stage CPU split (the pipeline is the point)."""
    return ",".join(f"cuda:{i}" for i in range(cuda_count)) if cuda_count else "cpu,cpu"


class MainWindow(QMainWindow):
    def __init__(self, settings: QSettings, demo_model: Path, controller: RunController | None = None,
                 discover: Callable[[bool], Topology] = topology.discover,
                 env: Mapping[str, str] | None = None, parent: QWidget | None = None,
                 history: RunHistory | None = None, history_path: Path | None = None,
                 sweeps: SweepController | None = None) -> None:
        """`history`: the run history to use; else the one at `history_path` (default: the user's
        data directory), opened here.  A history that cannot be opened (a newer version's, a
        corrupt file) is left untouched; the app then runs without one and says why."""
        super().__init__(parent)
        wheel_guard.install()  # an unfocused combo or spin box never takes the page's scroll wheel
        self.setWindowTitle(APP_TITLE)
        self.store = SettingsStore(settings)
        self.demo_model = Path(demo_model)
        self.controller = controller or RunController()
        self.controller.setParent(self)
        self.sweeps = sweeps or SweepController()
        self.sweeps.setParent(self)
        self._owns_history = history is None
        self.history_error = ""
        if history is None:
            history, self.history_error = open_history(history_path)
        self.history = history
        if history is not None:
            self.controller.recorder = history.add
            self.sweeps.recorder = history.add
        elif self.history_error:  # runs go to trace files beside the unusable history
            self.controller.recorder = UnsavedRuns(history_path, self.history_error).add
        self.jobs = BackgroundJobs(self)
        self._discover = discover
        self._env = os.environ if env is None else env
        self.cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        # model files parsed off the GUI thread, once: the form's facts, the run's Session and a sweep share them
        self.models = ModelCache()
        self.controller.sessions.models = self.models
        self.sweeps.models = self.models
        self._reading: set[str] = set()  # file keys a background job is parsing now
        self.validation = Validation()
        self.progress_model: RunProgress | None = None
        self.last_report: RunReport | None = None
        self.last_outcome = ""  # "finished" | "cancelled" | "failed"
        self.last_saved: SaveResult | None = None  # how the last run went into the history
        self.saved_this_run: list[SaveResult] = []  # every save of this press of Run (repeats, a stopped run)
        self.in_warmup = False  # the warm-up pass is running (nothing measured yet)
        self.repeats: list[RepeatDone] = []  # the measured repeats of the run in flight (or the last one)
        self.error_box: QMessageBox | None = None
        self._closing = False
        self._build()
        self._connect()
        defaults = RunSettings.from_env(self._env, default_devices(self.cuda_count), demo=True)
        saved, replaced = self.store.load_run_settings(defaults) if self.store.has_run_settings else (defaults, [])
        self.apply_settings(saved)
        self.settings_notes = replaced  # saved values that could not be used, each named in the status bar
        geometry = self.store.load_bytes("geometry")
        restored = geometry is not None and self.restoreGeometry(geometry)
        self.fit_to_screen(restored)
        # shown until device discovery is done too (its "ready" would hide it)
        self._startup_status = ("saved settings not usable, defaults used: " + "; ".join(replaced)
                                if replaced else "")
        self.refresh_topology(probe=False)
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
        a = screen.availableGeometry()
        g = self.geometry()
        m = self.minimumSizeHint()
        r = window_fit.fit(window_fit.Rect(g.x(), g.y(), g.width(), g.height()) if remembered else None,
                           window_fit.Rect(a.x(), a.y(), a.width(), a.height()), (m.width(), m.height()))
        self.setGeometry(r.x, r.y, r.w, r.h)

    def _build(self) -> None:
        self.devices_panel = DevicesPanel()
        self.settings_panel = SettingsPanel()
        left = QWidget()
        left_lay = QVBoxLayout(left)
        left_lay.addWidget(self.devices_panel)
        left_lay.addWidget(self.settings_panel)
        left_lay.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidget(left)
        scroll.setWidgetResizable(True)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setMinimumWidth(470)

        self.run_button = QPushButton("Run")
        self.run_button.setObjectName("runButton")
        self.run_button.setToolTip("Prefill the prompt through the split (and decode), with these settings.")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setObjectName("stopButton")
        self.stop_button.setToolTip("Stop at the next chunk boundary; the engine drains the split first.")
        self.stop_button.setEnabled(False)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.progress.setFormat("%v / %m")
        self.progress.setMinimumWidth(220)
        self.progress.setToolTip("Prefill chunks finished by the last stage, then decode steps.")
        self.progress_label = QLabel("idle")
        self.progress_label.setMinimumWidth(160)
        self.progress_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        bar = QHBoxLayout()
        bar.addWidget(self.run_button)
        bar.addWidget(self.stop_button)
        bar.addSpacing(12)
        bar.addWidget(self.progress, 2)
        bar.addWidget(self.progress_label, 3)

        self.gantt = GanttView()
        self.telemetry = TelemetryView()
        self.telemetry.link_x(self.gantt.plot.getPlotItem())
        self.monitor = TelemetryMonitor(None)
        self._monitor_timer = QTimer(self)
        self._monitor_timer.setInterval(500)
        self._monitor_timer.timeout.connect(self._poll_monitor)
        self.telemetry.monitor_toggled.connect(self.set_monitor)
        self.summary = SummaryView()
        self.splitter = QSplitter(Qt.Orientation.Vertical)
        # the summary scrolls when the window is short (1280x720, 150% scale) instead of clipping
        summary_scroll = QScrollArea()
        summary_scroll.setWidget(self.summary)
        summary_scroll.setWidgetResizable(True)
        summary_scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        summary_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.summary.setMinimumHeight(160)
        for w in (self.gantt, self.telemetry, self.summary):
            w.setContentsMargins(4, 4, 4, 4)
        for w in (self.gantt, self.telemetry, summary_scroll):
            self.splitter.addWidget(w)
        self.splitter.setStretchFactor(0, 5)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setStretchFactor(2, 4)
        self.splitter.setSizes([400, 80, 420])  # proportions: Qt scales them to the window
        right = QWidget()
        right_lay = QVBoxLayout(right)
        right_lay.addLayout(bar)
        right_lay.addWidget(self.splitter, 1)

        main = QSplitter(Qt.Orientation.Horizontal)
        main.addWidget(scroll)
        main.addWidget(right)
        main.setStretchFactor(1, 1)
        main.setSizes([480, 1120])

        self.history_panel = HistoryPanel(self.history, self.jobs, self.history_error)
        self._compare_view: CompareView | None = None  # built when first shown (three plots: not free)
        self.compare_tab = QWidget()
        QVBoxLayout(self.compare_tab).setContentsMargins(0, 0, 0, 0)
        self.sweep_view = SweepView()
        self.tabs = QTabWidget()
        self.tabs.setDocumentMode(True)
        self.run_tab = main
        self.tabs.addTab(main, "Run")
        self.tabs.addTab(self.history_panel, "History")
        self.tabs.addTab(self.compare_tab, "Compare")
        self.tabs.addTab(self.sweep_view, "Sweep")
        self.plan_tab = PlanTab(self)  # issue 22: the what-if planner (strata_gui/views/plan_view.py)
        self.tabs.addTab(self.plan_tab, "Plan")
        self.tabs.setTabToolTip(4, "Predict a run on other GPUs or settings from a saved run's measured costs.")
        self.tabs.setTabToolTip(1, "Every run saved with its settings, report, events and telemetry.")
        self.tabs.setTabToolTip(2, "Two runs' timelines on one time axis, their figures as ratios, what changed.")
        self.tabs.setTabToolTip(3, "Prefill tok/s against prompt size for several arms, with repeats.")
        self.tabs.currentChanged.connect(self._on_tab_changed)
        self.setCentralWidget(self.tabs)
        self._refresh_past_sweeps()
        self.status_label = QLabel("ready")
        self.statusBar().addWidget(self.status_label, 1)
        self._build_menu()

    def _build_menu(self) -> None:
        """File and Run menus with the shortcuts a desktop app has (Ctrl+R run, Ctrl+Q quit)."""
        bar = self.menuBar()
        file_menu = bar.addMenu("&File")
        self.quit_action = QAction("&Quit", self)
        self.quit_action.setShortcut(QKeySequence("Ctrl+Q"))  # StandardKey.Quit is empty on Windows
        self.quit_action.triggered.connect(self.close)
        file_menu.addAction(self.quit_action)
        run_menu = bar.addMenu("&Run")
        self.run_action = QAction("&Run", self)
        self.run_action.setShortcut(QKeySequence("Ctrl+R"))
        self.run_action.setToolTip("Prefill the prompt through the split with the Run tab's settings.")
        self.run_action.triggered.connect(self._run_from_menu)
        self.stop_action = QAction("&Stop", self)
        self.stop_action.setShortcut(QKeySequence("Ctrl+."))
        self.stop_action.triggered.connect(self.stop_run)
        run_menu.addAction(self.run_action)
        run_menu.addAction(self.stop_action)
        view_menu = bar.addMenu("&View")
        for i, key in ((0, "Ctrl+1"), (1, "Ctrl+2"), (2, "Ctrl+3"), (3, "Ctrl+4")):
            act = QAction(f"{self.tabs.tabText(i)} tab", self)
            act.setShortcut(QKeySequence(key))
            act.triggered.connect(lambda _=False, i=i: self.tabs.setCurrentIndex(i))
            view_menu.addAction(act)
        self.run_button.setToolTip(self.run_button.toolTip() + " (Ctrl+R)")

    def _run_from_menu(self) -> None:
        self.tabs.setCurrentWidget(self.run_tab)
        self.start_run()

    def _connect(self) -> None:
        self.settings_panel.changed.connect(self.revalidate)
        self.devices_panel.changed.connect(self.revalidate)
        self.devices_panel.probe_requested.connect(lambda: self.refresh_topology(probe=True))
        self.run_button.clicked.connect(self.start_run)
        self.stop_button.clicked.connect(self.stop_run)
        c = self.controller
        c.run_started.connect(self._on_run_started)
        c.events.connect(self._on_events)
        c.telemetry.connect(self._on_telemetry)
        c.status.connect(self.set_status)
        c.finished.connect(self._on_finished)
        c.measured.connect(self._on_measured)
        c.warmup.connect(self._on_warmup)
        c.cancelled.connect(self._on_cancelled)
        c.failed.connect(self._on_failed)
        c.busy_changed.connect(self._on_busy)
        c.saved.connect(self._on_saved)
        h = self.history_panel
        h.compare_requested.connect(self.compare_runs)
        h.show_requested.connect(self.show_history_run)
        h.changed.connect(self._on_history_changed)
        h.error.connect(lambda title, msg: self.show_error(title, msg))
        v = self.sweep_view
        v.start_requested.connect(self.start_sweep)
        v.stop_requested.connect(self.stop_sweep)
        v.open_requested.connect(self.open_sweep)
        v.plan_changed.connect(self.update_sweep_estimate)
        w = self.sweeps
        w.progress.connect(v.on_progress)
        w.point_done.connect(self._on_sweep_point)
        w.status.connect(self.set_status)
        w.finished.connect(self._on_sweep_finished)
        w.failed.connect(self._on_sweep_failed)
        w.busy_changed.connect(self._on_busy)

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
        self.controller.topology = topo
        self.devices_panel.set_topology(topo)
        if not self.controller.is_running:
            self.telemetry.set_unavailable(self._idle_telemetry_text(topo))
        idle = self._startup_status or "ready"
        self._startup_status = ""
        self.set_status(idle if not self.controller.is_running else self.status_label.text())
        self.revalidate()

    @staticmethod
    def _idle_telemetry_text(topo: Topology) -> str:
        if not topo.devices:
            return "telemetry unavailable: no GPU to sample (the Devices panel says why)"
        return "GPU telemetry is sampled during a run."

    # --------------------------------------------------------------- settings
    def apply_settings(self, s: RunSettings) -> None:
        self.settings_panel.load(s)
        self.devices_panel.load(s.devices, s.gpu_order)
        self.revalidate()

    def current_settings(self) -> RunSettings:
        return RunSettings.from_dict({**self.settings_panel.values(), **self.devices_panel.values()})

    def model_path(self, s: RunSettings | None = None) -> Path:
        s = s or self.current_settings()
        return Path(s.model_path) if s.model_path else self.demo_model

    def _model_facts(self, path: Path) -> tuple[int | None, str, str]:
        """(n_layers, description, error) of a model file as parsed; a file not parsed yet is
        handed to a background job (the GUI thread never parses) and reads (None, "", "") until
        the job's answer revalidates the form."""
        facts = self.models.facts(path)
        if facts is not None:
            return facts.n_layers, facts.info, facts.error
        key = file_key(path)
        if key not in self._reading:
            self._reading.add(key)
            self.jobs.submit("model", lambda: self.models.read(path), lambda _f, _e: self._on_model_read(key))
        return None, "", ""

    def _on_model_read(self, key: str) -> None:
        self._reading.discard(key)
        if not self._closing:
            self.revalidate()

    @property
    def model_pending(self) -> bool:
        """A model file is being parsed: Run waits for its facts."""
        return bool(self._reading)

    def revalidate(self) -> Validation:
        s = self.current_settings()
        path = self.model_path(s)
        n_layers, info, error = self._model_facts(path)
        label = "built-in demo model: " if not s.model_path else ""
        self.settings_panel.set_model_info(f"{label}{info}" if info else
                                           "reading the model file …" if self.model_pending else "")
        self.validation = validate(s, n_layers, error, self._env, self.cuda_count)
        self.settings_panel.set_memory_plan(self._memory_plan_text(path, s))
        self.settings_panel.set_errors(self.validation.errors)
        cuda = any(d.strip().startswith("cuda") for d in s.devices.split(","))
        self.settings_panel.set_cuda_graphs_applicable(
            cuda, "" if cuda else "no CUDA device in the list" if self.cuda_count else "no CUDA device")
        self.devices_panel.set_errors(self.validation.errors)
        self.settings_panel.set_attach(*self._attach_text())
        self.sweep_view.set_base(self._sweep_base_text(s))
        self.update_sweep_estimate()
        self._update_buttons()
        return self.validation

    def _attach_text(self) -> tuple[str, str | None]:
        """The command that attaches a stage to this app (rank 0 of N), and the warning for a
        rendezvous beyond loopback; ("", None) without a valid rendezvous."""
        cfg = self.validation.config if self.validation.ok else None
        if cfg is None or cfg.executor != "processes" or not cfg.rendezvous:
            return "", None
        host, _port = rendezvous_address(cfg.rendezvous)
        try:
            key = controller_key(self._env).decode()
        except ConfigError as exc:
            return str(exc), None
        world = len(cfg.devices) * max(cfg.interleave, 1)
        return attach_commands(cfg.rendezvous, world, key)[0], exposure_warning(host)

    def update_sweep_estimate(self) -> None:
        """The Sweep tab's time estimate: its plan scaled from the latest finished run of this model
        on these devices in the history (none there: it says how to get one)."""
        s = self.current_settings()
        try:
            plan = self.sweep_view.plan(self.model_label(s), s.overrides())
        except ConfigError:
            self.sweep_view.set_estimate("")
            return
        facts = self.models.facts(self.model_path(s))
        spec = facts.model.spec if facts is not None and facts.model is not None else None
        reference = None
        if self.history is not None and spec is not None:
            try:
                rows = self.history.list_runs(limit=500)
            except Exception as exc:  # an unreadable history: no estimate, never an error here
                log.info("no sweep estimate: %s", exc)
                rows = []
            devices = ",".join(d.strip() for d in s.devices.split(","))
            row = next((r for r in rows if r.status == "finished" and r.model == self.model_label(s)
                        and r.devices == devices and r.prefill_tok_s > 0 and r.prompt_tokens > 0), None)
            if row is not None:
                reference = (row.prompt_tokens, row.prefill_tok_s, row.id)
        self.sweep_view.set_estimate(estimate_text(plan, spec.prefill_flops if spec else None, reference))

    def _memory_plan_text(self, path: Path, s: RunSettings) -> str:
        """The next run's memory plan ("" while the settings or the model are not valid)."""
        if not self.validation.ok:
            return ""
        facts = self.models.facts(path)
        model = facts.model if facts is not None else None
        if model is None:
            return ""
        tokens = (s.prompt_tokens if s.prompt_mode == "tokens" else len(s.prompt_text.encode())) + s.decode_tokens
        try:
            return "Memory plan\n" + plan_memory(model, self.validation.config, tokens).render()
        except Exception:  # the plan is advice: a failure must not block Run
            log.exception("memory plan of %s failed", path)
            return ""

    def model_label(self, s: RunSettings | None = None) -> str:
        s = s or self.current_settings()
        return s.model_path if s.model_path else f"built-in demo ({self.demo_model.name})"

    def _sweep_base_text(self, s: RunSettings) -> str:
        o = s.overrides()
        model = Path(s.model_path).name if s.model_path else "built-in demo model"
        parts = [f"model {model}", f"devices {o['devices']}", f"chunk_tokens {o['chunk_tokens']}",
                 f"pipeline_depth {o['pipeline_depth']}", f"layer_split {o['layer_split']}"]
        if s.prefill_main:
            parts.append("prefill_main on")
        return ("<b>Base settings</b> (the Run tab's; each arm's settings override them): "
                + html.escape(" · ".join(parts)))

    def _update_buttons(self) -> None:
        running = self.controller.is_running
        sweeping = self.sweeps.is_running
        ok = self.validation.ok and not self.model_pending
        self.run_button.setEnabled(ok and not running and not sweeping)
        if hasattr(self, "run_action"):
            self.run_action.setEnabled(ok and not running and not sweeping)
            self.stop_action.setEnabled(running)
        self.run_button.setToolTip("A sweep is running; stop it or wait." if sweeping else
                                   "Prefill the prompt through the split (and decode), with these settings."
                                   if ok else "Reading the model file …" if self.model_pending
                                   else "Fix the settings marked in red first.")
        self.stop_button.setEnabled(running)
        self.sweep_view.set_running(sweeping)
        self.sweep_view.set_start_enabled(not running and not sweeping,
                                          "A run is in flight in the Run tab; wait for it." if running else "")

    # -------------------------------------------------------------------- runs
    def start_run(self) -> bool:
        if self.controller.is_running or self.sweeps.is_running:
            return False
        v = self.revalidate()
        if self.model_pending:
            self.set_status("cannot run yet: the model file is still being read")
            return False
        if not v.ok or v.config is None:
            names = ", ".join(k.replace("_", " ") for k in v.errors) or "the model"
            self.set_status(f"cannot run: fix the {len(v.errors) or 1} setting(s) marked in red ({names})")
            return False
        s = self.current_settings()
        self.store.save_run_settings(s)
        request = RunRequest(
            model_path=self.model_path(s), config=v.config,
            prompt_tokens=s.prompt_tokens, prompt_text=s.prompt_text if s.prompt_mode == "text" else None,
            decode_tokens=s.decode_tokens, model_label=self.model_label(s), warmup=s.warmup, repeats=s.repeats)
        self.repeats = []
        self.last_report = None
        self.last_outcome = ""
        self.last_saved = None
        self.progress_model = None
        self.saved_this_run = []
        self.in_warmup = False
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.progress_label.setText("starting …")
        self.summary.show_message("Run in progress …")
        # the previous run's timeline goes now, not when this run's measured pass starts
        self.gantt.reset("", 0, [])
        self.gantt.set_empty_text("This run's timeline appears when its measured pass starts "
                                  "(loading and the warm-up pass come first).")
        return self.controller.start(request)

    def _on_warmup(self, done: int, total: int) -> None:
        """The warm-up pass: unmeasured and undrawn, yet tens of seconds on a long prompt."""
        self.in_warmup = done < total
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(min(done, max(total, 1)))
        self.progress_label.setText(f"warm-up pass (not measured): chunk {done}/{total}")

    def stop_run(self) -> None:
        if self.controller.is_running:
            self.set_status("stopping at the next chunk boundary …")
            self.controller.stop()

    # ------------------------------------------------------- GPU monitor between runs
    def set_monitor(self, on: bool) -> None:
        """The GPU panel's between-runs monitor (its checkbox): on while no run or sweep is in flight."""
        if self.telemetry.monitor_box.isChecked() != on:
            self.telemetry.monitor_box.setChecked(on)  # emits monitor_toggled: comes back here
            return
        busy = self.controller.is_running or self.sweeps.is_running
        if on and not busy:
            self.monitor.topology = self.controller.topology
            if self.monitor.start():
                self.telemetry.start_monitor(self.monitor.origin_ns, self.monitor.reason)
                self._monitor_timer.start()
                self._poll_monitor()
            else:
                self.telemetry.set_unavailable(f"monitor unavailable: {self.monitor.reason}")
        else:
            self._monitor_timer.stop()
            was = self.monitor.running
            self.monitor.stop()
            if was and not busy:
                self.telemetry.stop_monitor("GPU telemetry is sampled during a run.")

    def _poll_monitor(self) -> None:
        samples, procs = self.monitor.poll()
        if samples:
            self.telemetry.add_samples(samples)
        if procs is not None:
            self.telemetry.set_processes(processes_text(procs))

    def _on_busy(self, _running: bool) -> None:
        """A run or a sweep started or ended: settings are fixed while either is in flight."""
        busy = self.controller.is_running or self.sweeps.is_running
        if self.telemetry.monitor_box.isChecked():  # a run takes the panel over; the monitor resumes after it
            if busy and self.monitor.running:
                self._monitor_timer.stop()
                self.monitor.stop()
                self.telemetry.stop_monitor()
            elif not busy and not self.monitor.running:
                self.set_monitor(True)
        self.settings_panel.set_editable(not busy)
        self.devices_panel.set_editable(not busy)
        self._update_buttons()

    def _on_run_started(self, info: RunStarted) -> None:
        self.in_warmup = False
        plan = info.plan
        stages = [(s.stage, s.device, s.first_layer, s.end_layer) for s in plan.stages]
        self.gantt.reset(plan.run_id, info.origin_ns, stages, plan.interleave)
        self.telemetry.start(info.origin_ns, info.telemetry_available, info.telemetry_reason)
        self.progress_model = RunProgress(plan)
        self.progress.setRange(0, max(plan.n_chunks + max(plan.decode_tokens - 1, 0), 1))
        self.progress.setValue(0)
        self._show_progress()
        reused = " (model already loaded)" if info.session_reused else ""
        total = self.current_settings().repeats
        if total > 1:
            reused += f" · repeat {len(self.repeats) + 1} of {total}"
        self.set_status(f"running{reused}: {plan.prompt_tokens:,} tokens as {plan.n_chunks} "
                        f"{'balanced chunks of up to' if plan.schedule == 'balanced' else '×'} {plan.chunk} on "
                        f"{len(plan.stages)} stage(s) · {plan.chunk_reason}")

    def _on_events(self, batch: list) -> None:
        self.gantt.add_events(batch)
        if self.progress_model is not None:
            self.progress_model.add(batch)
            self._show_progress()

    def _show_progress(self) -> None:
        snap = self.progress_model.snapshot() if self.progress_model else None
        if snap is None:
            return
        self.progress.setValue(min(snap.done, self.progress.maximum()))
        self.progress_label.setText(snap.text())

    def _on_telemetry(self, samples: list) -> None:
        self.telemetry.add_samples(samples)

    def _on_measured(self, done: RepeatDone) -> None:
        self.repeats.append(done)
        if done.index + 1 < done.total:
            self.progress_label.setText(f"repeat {done.index + 1} of {done.total} done · "
                                        f"{done.report.prefill_tok_s:,.0f} tok/s")

    @staticmethod
    def measure_text(repeats: list[RepeatDone]) -> str:
        """How the shown figures were measured, in words (the summary's 'Measured' row)."""
        if not repeats:
            return ""
        n = len(repeats)
        what = f"{n} repeats of the same prompt; the Gantt shows the last" if n > 1 else "one run"
        if repeats[0].warmed_up:
            how = "after a warm-up pass of the same shapes (not measured, not drawn)"
        elif repeats[0].cold:
            how = ("COLD: no warm-up and the first run of this shape, so it includes one-off set-up "
                   "(turn on the warm-up, or run again)")
        else:
            how = "warm (this shape ran before in this session)"
        return f"{what}, {how}"

    def _on_finished(self, report: RunReport) -> None:
        self.last_report = report
        self.last_outcome = "finished"
        self.gantt.finish()
        self.summary.show_report(report, [d.report for d in self.repeats], self.measure_text(self.repeats))
        self._show_progress()
        self.progress.setValue(self.progress.maximum())
        total_s = report.prefill_s + report.decode_s
        if len(self.repeats) > 1:
            pre = Spread.of(d.report.prefill_tok_s for d in self.repeats)
            self.progress_label.setText(f"done · prefill median {pre.median:,.0f} tok/s ±{pre.rel * 100:.1f}% "
                                        f"over {pre.n} repeats")
        else:
            decode = f" · decode {report.decode_tok_s:,.1f} tok/s" if report.decode_tok_s else ""
            self.progress_label.setText(f"done · prefill {report.prefill_tok_s:,.0f} tok/s{decode}")
        saved = self.last_saved
        where = f" · saved to the history as #{saved.run}" if saved is not None and saved.run is not None else ""
        self.set_status(f"finished run {report.run_id} in {total_s:.2f} s · digest {report.digest[:12]}{where}")

    def _on_cancelled(self, message: str) -> None:
        self.last_outcome = "cancelled"
        self.gantt.finish()
        snap = self.progress_model.snapshot() if self.progress_model else None
        if snap is None:  # before any measured pass: loading or the warm-up
            where = " during the warm-up pass" if self.in_warmup else " before the run started"
            self.progress_label.setText(f"stopped{where}")
            self.summary.show_message(f"Stopped{where}: {message}. {self.kept_text()}")
        else:
            done = f" after {snap.chunks_done} of {snap.n_chunks} chunks"
            self.progress_label.setText(f"stopped{done}")
            self.summary.show_message(f"Stopped{done}: {message}. The timeline keeps what ran. {self.kept_text()}")
        self.in_warmup = False
        self.set_status(f"stopped: {message}")

    def kept_text(self) -> str:
        """What this press of Run left in the history, said as it is (the saves came before the stop)."""
        saved = [r for r in self.saved_this_run if r.run is not None]
        errors = [r for r in self.saved_this_run if r.error]
        parts = []
        done = [r for r in saved if r.status == "finished"]
        partial = [r for r in saved if r.status == "cancelled"]
        if done:
            parts.append(f"{len(done)} finished repeat(s) saved to the History tab "
                         f"(#{', #'.join(str(r.run) for r in done)})")
        if partial:
            parts.append(f"the stopped run's partial report saved as #{partial[0].run}")
        if errors:
            parts.append(f"not saved: {errors[-1].error}")
        if not parts:
            return "Nothing was measured, so nothing was saved to the History tab."
        text = "; ".join(parts)
        return text[0].upper() + text[1:] + "."

    def _on_failed(self, title: str, message: str, details: str) -> None:
        self.last_outcome = "failed"
        self.gantt.finish()
        self.progress_label.setText("failed")
        self.summary.show_message(f"The run failed: {message}")
        self.set_status(f"{title}: {message}")
        self.show_error(title, message, details)

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
    def _on_saved(self, result: SaveResult) -> None:
        self.last_saved = result
        self.saved_this_run.append(result)
        if result.error:
            self.set_status(f"the run was not saved to the history: {result.error}")
            self.history_panel.set_message(f"the last run was not saved: {result.error}", error=True)
            return
        self.history_panel.set_message(f"run #{result.run} saved ({result.status})")
        self._on_history_changed()

    def _on_history_changed(self) -> None:
        self.history_panel.refresh()
        self.update_sweep_estimate()  # a new measured run may be the estimate's reference
        if self._compare_view is not None:
            self._compare_view.refresh_choices()
        self._refresh_past_sweeps()

    @property
    def compare_view(self) -> CompareView:
        """The Compare tab's view, built on first use."""
        if self._compare_view is None:
            self._compare_view = CompareView(self.history)
            self.compare_tab.layout().addWidget(self._compare_view)
        return self._compare_view

    def _on_tab_changed(self, index: int) -> None:
        if self.tabs.widget(index) is self.compare_tab:
            self.compare_view  # noqa: B018 - builds it

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
        origin = record.origin_ns
        self.gantt.reset(record.report.run_id, origin, record.stages, record.report.plan.interleave)
        self.gantt.add_events(record.events)
        self.gantt.finish()
        if record.telemetry:
            self.telemetry.start(origin, True, "")
            self.telemetry.add_samples([TelemetrySample(**d) for d in record.telemetry])
        else:
            why = record.report.telemetry_status or "none recorded"
            self.telemetry.set_unavailable(f"no telemetry in run #{run} ({why})")
        self.summary.show_report(record.report)
        self.progress_model = None
        self.progress_label.setText(f"showing run #{run} from the history ({record.status})")
        self.tabs.setCurrentWidget(self.run_tab)
        # the form shows the run's settings, so Run repeats it (rather than other values beside its timeline)
        restored, kept = settings_from_config(record.config, self.current_settings())
        self.apply_settings(restored)
        note = f"; kept the form's {', '.join(kept)}" if kept else ""
        self.set_status(f"showing run #{run} from the history; the settings are that run's{note}")
        return True

    # ------------------------------------------------------------------- sweeps
    def start_sweep(self) -> bool:
        """Start the Sweep tab's plan over the Run tab's settings (each arm's settings on top)."""
        if self.controller.is_running or self.sweeps.is_running:
            return False
        s = self.current_settings()
        v = self.revalidate()
        errors = [msg for field, msg in v.errors.items() if field not in ("prompt", "decode_tokens")]
        if errors:
            self.sweep_view.set_errors(["The Run tab's settings are the sweep's base; fix them first:", *errors])
            return False
        base = s.overrides()
        label = self.model_label(s)
        try:
            plan = self.sweep_view.plan(label, base)
        except ConfigError as exc:
            self.sweep_view.set_errors([str(exc)])
            return False
        n_layers = self._model_facts(self.model_path(s))[0]
        configs = []
        for arm in plan.arms:
            try:
                cfg = arm_config(base, arm, self._env)
                check_machine(cfg, self.cuda_count)
                if n_layers is not None:
                    cfg.check_layers(n_layers)
            except ConfigError as exc:
                errors.append(f"arm {arm.name}: {exc}")
                continue
            configs.append(cfg)
        if errors:
            self.sweep_view.set_errors(errors)
            return False
        self.sweep_view.set_errors([])
        self.controller.sessions.close()  # the Run tab's loaded model: free its memory for the sweep's sessions
        sweep_id = None
        if self.history is not None:
            try:
                sweep_id = self.history.add_sweep(
                    f"{' vs '.join(a.name for a in plan.arms)} · {', '.join(format_tokens(n) for n in plan.sizes)}",
                    plan.to_dict())
            except Exception as exc:
                log.exception("recording the sweep failed")
                self.set_status(f"the sweep is not saved to the history: {exc}")
        self.sweep_view.begin(plan, sweep_id)
        request = SweepRequest(self.model_path(s), label, plan, tuple(configs), sweep_id)
        self.set_status(f"sweep: {plan.total} runs ({len(plan.arms)} arms × {len(plan.sizes)} sizes × "
                        f"{plan.repeats} repeats)")
        return self.sweeps.start(request)

    def stop_sweep(self) -> None:
        if self.sweeps.is_running:
            self.set_status("stopping the sweep at the next chunk boundary; finished points are kept …")
            self.sweeps.stop()

    def _on_sweep_point(self, sample: SweepSample) -> None:
        self.sweep_view.add_sample(sample)

    def _end_sweep(self, status: str) -> None:
        sid = self.sweep_view.sweep_id
        if self.history is not None and sid is not None:
            try:
                self.history.set_sweep_status(sid, status)
            except Exception:
                log.exception("recording the sweep's end failed")
        self._on_history_changed()

    def _on_sweep_finished(self, stopped: bool, message: str) -> None:
        self.sweep_view.on_finished(stopped, message)
        self._end_sweep("stopped" if stopped else "finished")
        self.set_status(f"sweep {message}")

    def _on_sweep_failed(self, title: str, message: str, details: str) -> None:
        self.sweep_view.on_finished(True, f"failed: {message}; the finished points are kept")
        self._end_sweep("stopped")
        self.set_status(f"{title}: {message}")
        self.show_error(title, message, details)

    def _refresh_past_sweeps(self) -> None:
        if self.history is None:
            self.sweep_view.set_past([])
            return
        try:
            self.sweep_view.set_past(self.history.list_sweeps())
        except Exception:
            log.exception("listing sweeps failed")

    def open_sweep(self, sweep: int) -> bool:
        """A past sweep's chart and table, from the runs the history kept."""
        if self.history is None or self.sweeps.is_running:
            return False
        try:
            plan_d, members = self.history.sweep(sweep)
            plan = SweepPlan.from_dict(plan_d)
            samples = [SweepSample.from_report(SweepStep(i, m.prompt_tokens, m.repeat, m.arm),
                                               self.history.report(m.run), m.run) for i, m in enumerate(members)]
        except Exception as exc:
            log.exception("opening sweep %s failed", sweep)
            self.sweep_view.set_message(f"cannot open sweep #{sweep}: {exc}", error=True)
            return False
        self.sweep_view.show_results(SweepResults(plan, samples), sweep)
        self.sweep_view.progress_label.setText(f"sweep #{sweep} from the history: {len(samples)} of {plan.total} runs")
        return True

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
        self._monitor_timer.stop()
        self.monitor.stop()  # its sampler thread
        self.controller.shutdown()
        self.sweeps.shutdown()
        self.jobs.wait_all()
        if self.history is not None and self._owns_history:
            self.history.close()
        super().closeEvent(event)
