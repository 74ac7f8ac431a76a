"""The main window: settings and devices on the left; Run/Stop, the live Gantt, telemetry and
the run summary on the right.  It wires the panels to the run controller and validates every
edit with the engine's rules; it draws, it never runs engine work in the GUI thread."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Mapping

import torch
from PySide6.QtCore import QSettings, Qt
from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import (QHBoxLayout, QLabel, QMainWindow, QMessageBox, QProgressBar, QPushButton,
                               QScrollArea, QSplitter, QVBoxLayout, QWidget)

from engine import topology
from engine.events import RunReport
from engine.gguf_model import GGUFError, load
from engine.topology import Topology

from .background import BackgroundJobs
from .devices_panel import DevicesPanel
from .gantt import GanttView
from .run_controller import RunController
from .run_progress import RunProgress
from .run_settings import RunSettings, Validation, validate
from .run_worker import RunRequest, RunStarted
from .settings_panel import SettingsPanel
from .settings_store import SettingsStore
from .summary_view import SummaryView
from .telemetry_view import TelemetryView

log = logging.getLogger(__name__)

APP_TITLE = "Strata GUI: layer-split prefill pipeline"


def default_devices(cuda_count: int) -> str:
    """All GPUs when there are any, else a 2-stage CPU split (the pipeline is the point)."""
    return ",".join(f"cuda:{i}" for i in range(cuda_count)) if cuda_count else "cpu,cpu"


class MainWindow(QMainWindow):
    def __init__(self, settings: QSettings, demo_model: Path, controller: RunController | None = None,
                 discover: Callable[[bool], Topology] = topology.discover,
                 env: Mapping[str, str] | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(APP_TITLE)
        self.store = SettingsStore(settings)
        self.demo_model = Path(demo_model)
        self.controller = controller or RunController()
        self.controller.setParent(self)
        self.jobs = BackgroundJobs(self)
        self._discover = discover
        self._env = os.environ if env is None else env
        self.cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self._models: dict[str, tuple[int | None, str, str]] = {}  # path -> (n_layers, info, error)
        self.validation = Validation()
        self.progress_model: RunProgress | None = None
        self.last_report: RunReport | None = None
        self.last_outcome = ""  # "finished" | "cancelled" | "failed"
        self.error_box: QMessageBox | None = None
        self._closing = False
        self._build()
        self._connect()
        defaults = RunSettings.from_env(self._env, default_devices(self.cuda_count))
        self.apply_settings(self.store.load_run_settings(defaults) if self.store.has_run_settings else defaults)
        geometry = self.store.load_bytes("geometry")
        if geometry is not None:
            self.restoreGeometry(geometry)
        self.refresh_topology(probe=False)

    # ------------------------------------------------------------------ layout
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
        self.progress_label.setMinimumWidth(330)
        bar = QHBoxLayout()
        bar.addWidget(self.run_button)
        bar.addWidget(self.stop_button)
        bar.addSpacing(12)
        bar.addWidget(self.progress, 2)
        bar.addWidget(self.progress_label, 3)

        self.gantt = GanttView()
        self.telemetry = TelemetryView()
        self.telemetry.link_x(self.gantt.plot.getPlotItem())
        self.summary = SummaryView()
        self.splitter = QSplitter(Qt.Orientation.Vertical)
        for w in (self.gantt, self.telemetry, self.summary):
            w.setContentsMargins(4, 4, 4, 4)
            self.splitter.addWidget(w)
        self.splitter.setStretchFactor(0, 5)
        self.splitter.setStretchFactor(1, 2)
        self.splitter.setStretchFactor(2, 3)
        self.splitter.setSizes([470, 120, 310])
        right = QWidget()
        right_lay = QVBoxLayout(right)
        right_lay.addLayout(bar)
        right_lay.addWidget(self.splitter, 1)

        main = QSplitter(Qt.Orientation.Horizontal)
        main.addWidget(scroll)
        main.addWidget(right)
        main.setStretchFactor(1, 1)
        main.setSizes([480, 1120])
        self.setCentralWidget(main)
        self.status_label = QLabel("ready")
        self.statusBar().addWidget(self.status_label, 1)

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
        c.cancelled.connect(self._on_cancelled)
        c.failed.connect(self._on_failed)
        c.busy_changed.connect(self._on_busy)

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
        self.set_status("ready" if not self.controller.is_running else self.status_label.text())
        self.revalidate()

    @staticmethod
    def _idle_telemetry_text(topo: Topology) -> str:
        if not topo.devices:
            return f"telemetry unavailable: no GPU to sample ({topo.reason or 'no CUDA devices'})"
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
        """(n_layers, description, error) of a model file; cached by path, size and mtime."""
        try:
            st = path.stat()
            key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
        except OSError:
            key = str(path)
        facts = self._models.get(key)
        if facts is None:
            try:
                model = load(path)
                facts = (model.spec.n_layers, model.describe(), "")
            except GGUFError as exc:
                facts = (None, "", str(exc))
            except Exception as exc:  # a reader bug on a strange file must not take the app down
                log.exception("reading %s failed", path)
                facts = (None, "", f"{path}: cannot read the model ({type(exc).__name__}: {exc})")
            self._models[key] = facts
        return facts

    def revalidate(self) -> Validation:
        s = self.current_settings()
        path = self.model_path(s)
        n_layers, info, error = self._model_facts(path)
        label = "built-in demo model: " if not s.model_path else ""
        self.settings_panel.set_model_info(f"{label}{info}" if info else "")
        self.validation = validate(s, n_layers, error, self._env, self.cuda_count)
        self.settings_panel.set_errors(self.validation.errors)
        self.devices_panel.set_errors(self.validation.errors)
        self._update_buttons()
        return self.validation

    def _update_buttons(self) -> None:
        running = self.controller.is_running
        ok = self.validation.ok
        self.run_button.setEnabled(ok and not running)
        self.run_button.setToolTip("Prefill the prompt through the split (and decode), with these settings."
                                   if ok else "Fix the settings marked in red first.")
        self.stop_button.setEnabled(running)

    # -------------------------------------------------------------------- runs
    def start_run(self) -> bool:
        if self.controller.is_running:
            return False
        v = self.revalidate()
        if not v.ok or v.config is None:
            self.set_status("cannot run: fix the settings marked in red")
            return False
        s = self.current_settings()
        self.store.save_run_settings(s)
        request = RunRequest(
            model_path=self.model_path(s), config=v.config,
            prompt_tokens=s.prompt_tokens, prompt_text=s.prompt_text if s.prompt_mode == "text" else None,
            decode_tokens=s.decode_tokens)
        self.last_report = None
        self.last_outcome = ""
        self.progress_model = None
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.progress_label.setText("starting …")
        self.summary.show_message("Run in progress …")
        return self.controller.start(request)

    def stop_run(self) -> None:
        if self.controller.is_running:
            self.set_status("stopping at the next chunk boundary …")
            self.controller.stop()

    def _on_busy(self, running: bool) -> None:
        self.settings_panel.set_editable(not running)
        self.devices_panel.set_editable(not running)
        self._update_buttons()

    def _on_run_started(self, info: RunStarted) -> None:
        plan = info.plan
        stages = [(s.stage, s.device, s.first_layer, s.end_layer) for s in plan.stages]
        self.gantt.reset(plan.run_id, info.origin_ns, stages)
        self.telemetry.start(info.origin_ns, info.telemetry_available, info.telemetry_reason)
        self.progress_model = RunProgress(plan)
        self.progress.setRange(0, max(plan.n_chunks + max(plan.decode_tokens - 1, 0), 1))
        self.progress.setValue(0)
        self._show_progress()
        reused = " (model already loaded)" if info.session_reused else ""
        self.set_status(f"running{reused}: {plan.prompt_tokens:,} tokens as {plan.n_chunks} × {plan.chunk} on "
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

    def _on_finished(self, report: RunReport) -> None:
        self.last_report = report
        self.last_outcome = "finished"
        self.gantt.finish()
        self.summary.show_report(report)
        self._show_progress()
        self.progress.setValue(self.progress.maximum())
        total_s = report.prefill_s + report.decode_s
        self.progress_label.setText(f"done · prefill {report.prefill_tok_s:,.0f} tok/s"
                                    + (f" · decode {report.decode_tok_s:,.1f} tok/s" if report.decode_tok_s else ""))
        self.set_status(f"finished run {report.run_id} in {total_s:.2f} s · digest {report.digest[:12]}")

    def _on_cancelled(self, message: str) -> None:
        self.last_outcome = "cancelled"
        self.gantt.finish()
        snap = self.progress_model.snapshot() if self.progress_model else None
        done = f" after {snap.chunks_done} of {snap.n_chunks} chunks" if snap else ""
        self.progress_label.setText(f"stopped{done}")
        self.summary.show_message(f"Stopped{done}: {message}. The engine reports figures for finished runs only; "
                                  "the timeline keeps what ran.")
        self.set_status(f"stopped: {message}")

    def _on_failed(self, title: str, message: str, details: str) -> None:
        self.last_outcome = "failed"
        self.gantt.finish()
        self.progress_label.setText("failed")
        self.summary.show_message(f"The run failed: {message}")
        self.set_status(f"{title}: {message}")
        self.show_error(title, message, details)

    def show_error(self, title: str, message: str, details: str = "") -> None:
        """A window-modal message box that does not block the event loop (runs keep their signals)."""
        if self._closing:
            return
        box = QMessageBox(QMessageBox.Icon.Critical, title, message, QMessageBox.StandardButton.Ok, self)
        box.setInformativeText("The app stays usable: fix the cause and press Run again.")
        if details:
            box.setDetailedText(details)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.error_box = box
        box.finished.connect(lambda *_: setattr(self, "error_box", None))
        box.open()

    def set_status(self, text: str) -> None:
        self.status_label.setText(text)

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
        self.controller.shutdown()
        self.jobs.wait_all()
        super().closeEvent(event)
