"""Run settings: model file, layer split, chunk size, depth, prefill-main, pin limit, expert cache,
prompt and decode tokens.  Each field says in its tooltip what it does and when it helps (the
seeds' figures), and shows the engine's message under itself when its value is refused.  An
engine setting's field, label and tooltip come from its row of engine/settings_table.py."""
from __future__ import annotations

import logging
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.settings_table import Setting

from ..run.settings_model import (
    DEMO_CHUNK,
    MAX_DECODE_TOKENS,
    MAX_PROMPT_TOKENS,
    MAX_REPEATS,
    SETTING_FIELDS,
    RunSettings,
)
from .field_box_view import FieldBox

log = logging.getLogger(__name__)

# the form's own fields (not engine settings: those take their tooltip from engine/settings_table.py)
FORM_TIPS = {
    "model": "The GGUF model to run; the built-in demo is a 4-layer Qwen3-MoE with random weights that "
             "prefills in well under a second on a CPU, so you can watch the pipeline without a GPU.",
    "attach": "Run this on each host, once per rank 0…N-1: the key is this app's own, made at start "
              "(STRATA_RENDEZVOUS_KEY sets your own, 20+ characters); a stage without it is refused.",
    "prompt": "A synthetic prompt of N tokens (deterministic, with a nonce first so no prefix cache helps) or "
              "your text, tokenised with the model's own vocabulary; the overlap pays off once the prompt "
              "spans several chunks (+10% at 16K, +28% at 64K tokens on 4 GPUs).",
    "decode_tokens": "Tokens to generate greedily after the prompt, one step at a time through the split; "
                     "decode speed is not expected to change with the prefill settings.",
    "warmup": "Before the first measured run of a new prompt shape, run its chunk shapes once unmeasured (not "
              "drawn, not saved): the first pass pays one-off set-up such as kernels, memory and CUDA graph capture "
              "(a demo C0 took ~250 ms cold, ~55 ms warm); off, that run is labelled cold.",
    "repeats": "Measured runs of the same prompt per press of Run: the summary shows their median and spread, "
               "every repeat is saved, and Compare uses the spread to tell a change from noise.",
}
# the demo's first chunk is the app's idea, said after the engine's text
_DEMO_NOTE = (f" The demo starts at a fixed {DEMO_CHUNK}: auto makes its 2048-token prompt one chunk on a CPU, "
              "which shows no pipeline.")
TIPS = {s.name: s.tooltip + (_DEMO_NOTE if s.name == "chunk_tokens" else "") for s in SETTING_FIELDS} | FORM_TIPS
DEVICE_PANEL = ("devices", "gpu_order")  # the form's settings the devices panel shows (devices_view.py)
PANEL_ROWS = tuple(s for s in SETTING_FIELDS if s.name not in DEVICE_PANEL)
WIDGET_NAMES = {"pin_limit_gib": "pin_limit"}  # a setting's input attribute, where it is not its name
MODES = {"layer_split": ("split_mode", ("auto", "manual", "interleave"), "split_counts"),
         "chunk_tokens": ("chunk_mode", ("auto", "fixed"), "chunk_tokens")}  # mode combo, its items, the text


class SettingsPanel(QGroupBox):
    changed = Signal()
    model_chosen = Signal(str)  # a path, or "" for the demo model

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Run settings", parent)
        self.boxes: dict[str, FieldBox] = {}
        self.inputs: dict[str, QWidget] = {}  # each engine setting's input (a mode's text for split, chunk)
        self.form = form = QFormLayout()
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.DontWrapRows)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        self._model_row()
        for row in PANEL_ROWS:  # engine/settings_table.py's order
            self._setting_row(row)
            if row.name == "rendezvous":
                self._attach_row()
        self._prompt_row()
        self.decode_tokens = QSpinBox()
        self.decode_tokens.setRange(0, MAX_DECODE_TOKENS)
        self._add(form, "Decode tokens", "decode_tokens", FieldBox(self.decode_tokens, tooltip=TIPS["decode_tokens"]))
        self.warmup = QCheckBox("warm-up pass first")
        self.repeats = QSpinBox()
        self.repeats.setRange(1, MAX_REPEATS)
        self.repeats.setPrefix("repeats ")
        box = FieldBox(self.repeats, self.warmup, tooltip=TIPS["repeats"])
        self.warmup.setToolTip(TIPS["warmup"])
        box.flag_targets = [self.repeats]
        self._add(form, "Measure", "repeats", box)

        self.general = QLabel()
        self.general.setProperty("role", "error")
        self.general.setWordWrap(True)
        self.general.setVisible(False)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(self.general)
        self._connect()
        self._sync_enabled()

    def _model_row(self) -> None:
        self.model_path = QLineEdit()
        self.model_path.setReadOnly(True)
        self.model_path.setPlaceholderText("built-in demo model")
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        demo = QPushButton("Demo")
        demo.setToolTip("Use the built-in demo model.")
        demo.clicked.connect(lambda: self.set_model_path(""))
        model_box = FieldBox(self.model_path, tooltip=TIPS["model"])
        model_box.row.addWidget(browse)
        model_box.row.addWidget(demo)
        browse.setToolTip(TIPS["model"])
        self.model_info = QLabel("")
        self.model_info.setProperty("role", "hint")
        self.model_info.setWordWrap(True)
        model_box.column.insertWidget(1, self.model_info)
        # where the run's memory goes, per device and on the host (updated with the settings)
        self.memory_plan = QLabel("")
        self.memory_plan.setProperty("role", "hint")
        self.memory_plan.setWordWrap(True)
        self.memory_plan.setToolTip("Memory plan of the next run: per device the dense weights, the experts "
                                    "(or expert cache), the KV cache and the expansion scratch; on the host the "
                                    "expert arena and how much of it the pin limit page-locks.")
        model_box.column.insertWidget(2, self.memory_plan)
        self._add(self.form, "Model", "model", model_box)

    def _setting_row(self, row: Setting) -> None:
        """One engine setting's field, made from its row: a check box, a combo of its items, a text
        field, or (layer split, chunk size) a mode combo with the text it enables."""
        if row.name in MODES:
            mode_name, modes, text_name = MODES[row.name]
            mode = QComboBox()
            mode.addItems(list(modes))
            setattr(self, mode_name, mode)
            widget: QWidget = QLineEdit()
            widget.setPlaceholderText(row.placeholder)
            box = FieldBox(mode, widget, tooltip=TIPS[row.name])
            box.flag_targets = [widget]
        else:
            if row.kind == "bool":
                widget = QCheckBox(row.placeholder)
            elif row.kind in ("choice", "depth"):
                widget = QComboBox()
                for text, value in row.items():
                    widget.addItem(text, value)
            else:
                widget = QLineEdit()
                widget.setPlaceholderText(row.placeholder)
            box = FieldBox(widget, tooltip=TIPS[row.name])
        self.inputs[row.name] = widget
        setattr(self, MODES[row.name][2] if row.name in MODES else WIDGET_NAMES.get(row.name, row.name), widget)
        self._add(self.form, row.label, row.name, box)

    def _attach_row(self) -> None:
        # the command that attaches a stage to this app, with this app's key (there is no default key)
        self.attach_command = QLineEdit()
        self.attach_command.setReadOnly(True)
        self.attach_command.setToolTip(TIPS["attach"])
        self.attach_copy = QPushButton("Copy")
        self.attach_copy.setToolTip("Copy the command (with the key) to the clipboard")
        self.attach_copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.attach_command.text()))
        self.attach_warning = QLabel()
        self.attach_warning.setWordWrap(True)
        self.attach_warning.setProperty("role", "error")
        self.attach_warning.setMinimumHeight(3 * self.attach_warning.fontMetrics().lineSpacing())
        box = FieldBox(self.attach_command, self.attach_copy, tooltip=TIPS["attach"], stretch_last=False)
        box.row.setStretch(0, 1)
        box.column.addWidget(self.attach_warning)
        self._add(self.form, "Attach stages", "attach", box)
        self.set_attach("", None)

    def _prompt_row(self) -> None:
        self.prompt_mode = QComboBox()
        self.prompt_mode.addItem("synthetic, tokens:", "tokens")
        self.prompt_mode.addItem("text", "text")
        self.prompt_tokens = QSpinBox()
        self.prompt_tokens.setRange(1, MAX_PROMPT_TOKENS)
        self.prompt_tokens.setSingleStep(256)
        self.prompt_tokens.setGroupSeparatorShown(True)
        self.prompt_text = QPlainTextEdit()
        self.prompt_text.setPlaceholderText("prompt text, tokenised with the model's vocabulary")
        self.prompt_text.setFixedHeight(60)
        self.prompt_text.setToolTip(TIPS["prompt"])
        box = FieldBox(self.prompt_mode, self.prompt_tokens, tooltip=TIPS["prompt"])
        box.column.insertWidget(1, self.prompt_text)
        box.flag_targets = [self.prompt_tokens, self.prompt_text]
        self._add(self.form, "Prompt", "prompt", box)

    def _connect(self) -> None:
        """Every input's change says `changed`; a combo's also re-enables what depends on it."""
        combos = [self.split_mode, self.chunk_mode, self.prompt_mode]
        for w in self.inputs.values():
            if isinstance(w, QLineEdit):
                w.textChanged.connect(self.changed)
            elif isinstance(w, QCheckBox):
                w.toggled.connect(self.changed)
            else:
                combos.append(w)
        for w in combos:
            w.currentIndexChanged.connect(self._sync_enabled)
            w.currentIndexChanged.connect(self.changed)
        self.warmup.toggled.connect(self.changed)
        self.repeats.valueChanged.connect(self.changed)
        self.prompt_tokens.valueChanged.connect(self.changed)
        self.decode_tokens.valueChanged.connect(self.changed)
        self.prompt_text.textChanged.connect(self.changed)

    def set_attach(self, command: str, warning: str | None) -> None:
        """Show how to start each stage elsewhere (empty: the row is hidden) and what a
        rendezvous beyond loopback exposes."""
        self.attach_command.setText(command)
        self.attach_command.setCursorPosition(0)
        self.attach_warning.setText(warning or "")
        self.attach_warning.setVisible(bool(warning))
        box = self.boxes["attach"]
        box.setVisible(bool(command))
        label = self.form.labelForField(box)
        if label is not None:
            label.setVisible(bool(command))

    def _add(self, form: QFormLayout, label: str, name: str, box: FieldBox) -> None:
        lab = QLabel(label)
        lab.setToolTip(TIPS.get(name, ""))
        lab.setStyleSheet("font-weight: normal")
        form.addRow(lab, box)
        self.boxes[name] = box

    def _sync_enabled(self) -> None:
        mode = self.split_mode.currentText()
        self.split_counts.setEnabled(mode in ("manual", "interleave"))
        self.split_counts.setPlaceholderText("groups per device, e.g. 2" if mode == "interleave" else "e.g. 2,2")
        self.chunk_tokens.setEnabled(self.chunk_mode.currentText() == "fixed")
        self.rendezvous.setEnabled(self.executor.currentData() == "processes")
        tokens = self.prompt_mode.currentData() == "tokens"
        self.prompt_tokens.setVisible(tokens)
        self.prompt_text.setVisible(not tokens)
        box = self.boxes.get("prompt")
        if box is not None:  # only the input in use gets the red border
            error = box.message
            box.set_error(None)
            box.flag_targets = [self.prompt_tokens if tokens else self.prompt_text]
            box.set_error(error)

    # ------------------------------------------------------------------- model
    def _browse(self) -> None:
        start = str(Path(self.model_path.text()).parent) if self.model_path.text() else str(Path.home())
        path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF model", start, "GGUF models (*.gguf);;All files (*)")
        if path:
            self.set_model_path(path)

    def set_model_path(self, path: str) -> None:
        self.model_path.setText(path)
        self.model_chosen.emit(path)
        self.changed.emit()

    def set_model_info(self, text: str) -> None:
        self.model_info.setText(text)
        self.model_info.setVisible(bool(text))

    def set_memory_plan(self, text: str) -> None:
        self.memory_plan.setText(text)
        self.memory_plan.setVisible(bool(text))

    # ------------------------------------------------------------------- values
    def _all_inputs(self) -> list[QWidget]:
        return [self.split_mode, self.chunk_mode, *self.inputs.values(), self.prompt_mode, self.prompt_tokens,
                self.prompt_text, self.decode_tokens, self.warmup, self.repeats]

    def load(self, s: RunSettings) -> None:
        widgets = self._all_inputs()
        for w in widgets:
            w.blockSignals(True)
        try:
            self.model_path.setText(s.model_path)
            self.split_mode.setCurrentText(s.split_mode if s.split_mode in MODES["layer_split"][1] else "auto")
            self.chunk_mode.setCurrentText(s.chunk_mode if s.chunk_mode in MODES["chunk_tokens"][1] else "auto")
            self.split_counts.setText(s.split_counts)
            for row in PANEL_ROWS:
                if row.name == "layer_split":
                    continue
                w, value = self.inputs[row.name], getattr(s, row.name)
                if isinstance(w, QCheckBox):
                    w.setChecked(value)
                elif isinstance(w, QComboBox):
                    w.setCurrentIndex(max(w.findData(value), 0))
                else:
                    w.setText(value)
            self.prompt_mode.setCurrentIndex(max(self.prompt_mode.findData(s.prompt_mode), 0))
            self.prompt_tokens.setValue(s.prompt_tokens)
            self.prompt_text.setPlainText(s.prompt_text)
            self.decode_tokens.setValue(s.decode_tokens)
            self.warmup.setChecked(s.warmup)
            self.repeats.setValue(s.repeats)
        finally:
            for w in widgets:
                w.blockSignals(False)
        self._sync_enabled()

    def values(self) -> dict[str, object]:
        out: dict[str, object] = {"model_path": self.model_path.text(), "split_mode": self.split_mode.currentText(),
                                  "split_counts": self.split_counts.text(), "chunk_mode": self.chunk_mode.currentText()}
        for row in PANEL_ROWS:
            if row.name == "layer_split":
                continue
            w = self.inputs[row.name]
            out[row.name] = (w.isChecked() if isinstance(w, QCheckBox) else w.currentData() if isinstance(w, QComboBox)
                             else w.text())
        return out | {
            "prompt_mode": self.prompt_mode.currentData(),
            "prompt_tokens": self.prompt_tokens.value(),
            "prompt_text": self.prompt_text.toPlainText(),
            "decode_tokens": self.decode_tokens.value(),
            "warmup": self.warmup.isChecked(),
            "repeats": self.repeats.value(),
        }

    def set_errors(self, errors: dict[str, str]) -> None:
        for name, box in self.boxes.items():
            box.set_error(errors.get(name))
        general = errors.get("general", "")
        self.general.setText(general)
        self.general.setVisible(bool(general))

    def set_cuda_graphs_applicable(self, applicable: bool, why: str = "") -> None:
        """CUDA graphs only apply to CUDA stages: the box is greyed out, saying why, for CPU runs."""
        self.cuda_graphs.setEnabled(applicable)
        self.cuda_graphs.setText("replay layers as CUDA graphs" if applicable else
                                 f"not used: {why}")

    def set_editable(self, on: bool) -> None:
        """Settings are fixed while a run is in flight."""
        for box in self.boxes.values():
            box.setEnabled(on)
