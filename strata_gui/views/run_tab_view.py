"""The Run tab: settings and devices on the left; Run/Stop, the progress bar, the live Gantt,
telemetry and the run summary on the right.  It draws what the run controller's signals say,
reading the press of Run's figures and texts from its RunState; it starts nothing itself."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from engine.events import RunReport
from engine.hw.topology import TelemetrySample

from ..run.record_model import RunRecord
from ..run.run_messages import RunStarted
from ..run.run_state import RunState, measure_text
from .devices_view import DevicesPanel
from .gantt_view import GanttView
from .settings_view import SettingsPanel
from .summary_view import SummaryView
from .telemetry_view import TelemetryView

RUN_TIP = "Prefill the prompt through the split (and decode), with these settings."


def _scroll(widget: QWidget, min_width: int = 0) -> QScrollArea:
    area = QScrollArea()
    area.setWidget(widget)
    area.setWidgetResizable(True)
    area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    if min_width:
        area.setMinimumWidth(min_width)
    return area


class RunTab(QSplitter):
    def __init__(self, state: RunState, parent: QWidget | None = None) -> None:
        super().__init__(Qt.Orientation.Horizontal, parent)
        self.state = state
        self.devices_panel = DevicesPanel()
        self.settings_panel = SettingsPanel()
        left = QWidget()
        left_lay = QVBoxLayout(left)
        left_lay.addWidget(self.devices_panel)
        left_lay.addWidget(self.settings_panel)
        left_lay.addStretch(1)
        right = QWidget()
        right_lay = QVBoxLayout(right)
        right_lay.addLayout(self._build_bar())
        right_lay.addWidget(self._build_plots(), 1)
        self.addWidget(_scroll(left, 470))
        self.addWidget(right)
        self.setStretchFactor(1, 1)
        self.setSizes([480, 1120])

    def _build_bar(self) -> QHBoxLayout:
        self.run_button = QPushButton("Run")
        self.run_button.setObjectName("runButton")
        self.run_button.setToolTip(RUN_TIP)
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
        return bar

    def _build_plots(self) -> QSplitter:
        self.gantt = GanttView()
        self.telemetry = TelemetryView()
        self.telemetry.link_x(self.gantt.plot.getPlotItem())
        self.summary = SummaryView()
        self.splitter = QSplitter(Qt.Orientation.Vertical)
        # the summary scrolls when the window is short (1280x720, 150% scale) instead of clipping
        summary_scroll = _scroll(self.summary)
        summary_scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        self.summary.setMinimumHeight(160)
        for w in (self.gantt, self.telemetry, self.summary):
            w.setContentsMargins(4, 4, 4, 4)
        for w in (self.gantt, self.telemetry, summary_scroll):
            self.splitter.addWidget(w)
        self.splitter.setStretchFactor(0, 5)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setStretchFactor(2, 4)
        self.splitter.setSizes([400, 80, 420])  # proportions: Qt scales them to the window
        return self.splitter

    # ---------------------------------------------------------------- a run, drawn
    def begin_run(self) -> None:
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.progress_label.setText("starting …")
        self.summary.show_message("Run in progress …")
        # the previous run's timeline goes now, not when this run's measured pass starts
        self.gantt.reset("", 0, [])
        self.gantt.set_empty_text("This run's timeline appears when its measured pass starts "
                                  "(loading and the warm-up pass come first).")

    def on_warmup(self, done: int, total: int) -> None:
        """The warm-up pass: unmeasured and undrawn, yet tens of seconds on a long prompt."""
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(min(done, max(total, 1)))
        self.progress_label.setText(f"warm-up pass (not measured): chunk {done}/{total}")

    def on_started(self, info: RunStarted) -> None:
        plan = info.plan
        stages = [(s.stage, s.device, s.first_layer, s.end_layer) for s in plan.stages]
        self.gantt.reset(plan.run_id, info.origin_ns, stages, plan.interleave)
        self.telemetry.start(info.origin_ns, info.telemetry_available, info.telemetry_reason)
        self.progress.setRange(0, max(plan.n_chunks + max(plan.decode_tokens - 1, 0), 1))
        self.progress.setValue(0)
        self.show_progress()

    def on_events(self, batch: list) -> None:
        self.gantt.add_events(batch)
        if self.state.progress_model is not None:
            self.show_progress()

    def show_progress(self) -> None:
        model = self.state.progress_model
        snap = model.snapshot() if model else None
        if snap is None:
            return
        self.progress.setValue(min(snap.done, self.progress.maximum()))
        self.progress_label.setText(snap.text())

    def on_measured(self, done) -> None:
        if done.index + 1 < done.total:
            self.progress_label.setText(f"repeat {done.index + 1} of {done.total} done · "
                                        f"{done.report.prefill_tok_s:,.0f} tok/s")

    def on_finished(self, report: RunReport) -> str:
        """Draws the finished run; returns the status line."""
        st = self.state
        self.gantt.finish()
        self.summary.show_report(report, [d.report for d in st.repeats], measure_text(st.repeats))
        self.show_progress()
        self.progress.setValue(self.progress.maximum())
        label, status = st.finished_texts(report)
        self.progress_label.setText(label)
        return status

    def on_cancelled(self, message: str) -> None:
        self.gantt.finish()
        label, text = self.state.cancelled_texts(message)
        self.progress_label.setText(label)
        self.summary.show_message(text)

    def on_failed(self, message: str) -> None:
        self.gantt.finish()
        self.progress_label.setText("failed")
        self.summary.show_message(f"The run failed: {message}")

    def show_record(self, run: int, record: RunRecord) -> None:
        """A saved run's timeline, telemetry and summary."""
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
        self.state.progress_model = None
        self.progress_label.setText(f"showing run #{run} from the history ({record.status})")

    def set_buttons(self, can_run: bool, running: bool, run_tip: str) -> None:
        self.run_button.setEnabled(can_run)
        self.run_button.setToolTip(run_tip)
        self.stop_button.setEnabled(running)
