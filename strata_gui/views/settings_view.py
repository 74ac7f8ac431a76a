"""Run settings: model file, layer split, chunk size, depth, prefill-main, pin limit, expert cache,
prompt and decode tokens.  Each field says in its tooltip what it does and when it helps (the
seeds' figures), and shows the engine's message under itself when its value is refused."""
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

from ..run.settings_model import DEMO_CHUNK, MAX_DECODE_TOKENS, MAX_PROMPT_TOKENS, MAX_REPEATS, RunSettings
from .field_box_view import FieldBox

log = logging.getLogger(__name__)

TIPS = {
    "model": "The GGUF model to run; the built-in demo is a 4-layer Qwen3-MoE with random weights that "
             "prefills in well under a second on a CPU, so you can watch the pipeline without a GPU.",
    "layer_split": "How many layers each stage owns: auto balances them, manual counts such as 12,12,24 "
                   "(one per device, summing to the model's layers) let a faster or emptier card carry more. "
                   "interleave V gives each device V groups of layers (2 GPUs, V=2: layers 0-7 on the first, "
                   "8-15 on the second, 16-23 on the first again…): a chunk visits every device V times, "
                   "so the pipeline's fill and drain shrink about V-fold while chunks stay big.",
    "chunk_tokens": "Tokens per prefill chunk: auto (the engine's default) weighs prompt length and stage count; on "
               "4 GPUs a fixed 3072 or 4096 beat auto by up to 27% at 6-12K-token prompts, while 1024 was too "
               f"small everywhere. The demo starts at a fixed {DEMO_CHUNK}: auto makes its 2048-token prompt one "
               "chunk on a CPU, which shows no pipeline.",
    "chunk_schedule": "fixed: every chunk the chosen size. balanced: as many chunks, sized so each costs the "
                      "same (bigger early, smaller late, since a late chunk attends to the whole prompt before "
                      "it) — the next stage then never waits for a costlier chunk; each new size plans its "
                      "kernels once, so it pays off on repeated prompt lengths; auto: whichever of the two the "
                      "measured costs model faster.",
    "cuda_graphs": "Replay each layer's kernels as CUDA graphs (one launch instead of ~50): decode went from "
                   "12 to 159 tok/s on an H200; costs some VRAM per chunk size. Off runs every op eagerly.",
    "executor": "threads: every stage a thread of this process (the default); processes: every stage a "
                "process of its own on torch.distributed (NCCL between GPUs, gloo on CPU) owning its device, "
                "layers and KV, so stages stop sharing one interpreter (the GIL) — starting them costs "
                "seconds, then they stay up between runs of the same settings.",
    "rendezvous": "With executor processes: empty starts the stage processes on this machine; HOST:PORT makes "
                  "this app the controller that stages started elsewhere with `strata-bench stage --rendezvous "
                  "HOST:PORT` attach to (a taken port or a stage that never attaches fails the Run with a message).",
    "attach": "Run this on each host, once per rank 0…N-1: the key is this app's own, made at start "
              "(STRATA_RENDEZVOUS_KEY sets your own, 20+ characters); a stage without it is refused.",
    "pipeline_depth": "1 (overlap) lets a stage take the next chunk while the stages below still work (2.04x on a "
                "4-GPU split); 0 (join) restores the old wait for the whole chain below, for an A/B one setting apart.",
    "prefill_main": "Prefill the whole prompt on the main (first) device, then copy the later layers' KV to "
                    "their stages; helps when prefill is bound by streaming expert misses over a slow second "
                    "link (+54% in the seed), decode stays split.",
    "pin_limit_gib": "GiB of the host expert arena to page-lock for fast DMA (auto: what the machine allows); "
                     "20 GiB lifted a 2-GPU Windows split whose registration was capped at 8 GiB, and more than "
                     "can be pinned is refused.",
    "expert_cache": "VRAM per stage for cached experts in GiB (auto: from free VRAM, all: every expert); "
                    "misses stream from host RAM, so a larger cache means less streaming during prefill.",
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


class SettingsPanel(QGroupBox):
    changed = Signal()
    model_chosen = Signal(str)  # a path, or "" for the demo model

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Run settings", parent)
        self.boxes: dict[str, FieldBox] = {}
        self.form = form = QFormLayout()
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.DontWrapRows)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)

        # model
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
        self._add(form, "Model", "model", model_box)

        # layer split
        self.split_mode = QComboBox()
        self.split_mode.addItems(["auto", "manual", "interleave"])
        self.split_counts = QLineEdit()
        self.split_counts.setPlaceholderText("e.g. 2,2")
        box = FieldBox(self.split_mode, self.split_counts, tooltip=TIPS["layer_split"])
        box.flag_targets = [self.split_counts]
        self._add(form, "Layer split", "layer_split", box)

        # chunk size
        self.chunk_mode = QComboBox()
        self.chunk_mode.addItems(["auto", "fixed"])
        self.chunk_tokens = QLineEdit()
        self.chunk_tokens.setPlaceholderText("tokens, e.g. 256")
        box = FieldBox(self.chunk_mode, self.chunk_tokens, tooltip=TIPS["chunk_tokens"])
        box.flag_targets = [self.chunk_tokens]
        self._add(form, "Chunk size", "chunk_tokens", box)
        self.chunk_schedule = QComboBox()
        self.chunk_schedule.addItems(["fixed", "balanced", "auto"])
        self._add(form, "Chunk schedule", "chunk_schedule",
                  FieldBox(self.chunk_schedule, tooltip=TIPS["chunk_schedule"]))

        # depth
        self.pipeline_depth = QComboBox()
        self.pipeline_depth.addItem("1 · overlap", 1)
        self.pipeline_depth.addItem("0 · join", 0)
        self._add(form, "Pipeline depth", "pipeline_depth",
                  FieldBox(self.pipeline_depth, tooltip=TIPS["pipeline_depth"]))

        self.prefill_main = QCheckBox("prefill the whole prompt on the main device")
        self._add(form, "Prefill-main", "prefill_main", FieldBox(self.prefill_main, tooltip=TIPS["prefill_main"]))
        self.cuda_graphs = QCheckBox("replay layers as CUDA graphs")
        self._add(form, "CUDA graphs", "cuda_graphs", FieldBox(self.cuda_graphs, tooltip=TIPS["cuda_graphs"]))
        self.executor = QComboBox()
        self.executor.addItem("threads · one process", "threads")
        self.executor.addItem("processes · one per stage", "processes")
        self._add(form, "Executor", "executor", FieldBox(self.executor, tooltip=TIPS["executor"]))
        self.rendezvous = QLineEdit()
        self.rendezvous.setPlaceholderText("empty: stages start here; or HOST:PORT")
        self._add(form, "Rendezvous", "rendezvous", FieldBox(self.rendezvous, tooltip=TIPS["rendezvous"]))
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
        self._add(form, "Attach stages", "attach", box)
        self.set_attach("", None)

        self.pin_limit = QLineEdit()
        self.pin_limit.setPlaceholderText("auto or GiB")
        self._add(form, "Pin limit (GiB)", "pin_limit_gib", FieldBox(self.pin_limit, tooltip=TIPS["pin_limit_gib"]))

        self.expert_cache = QLineEdit()
        self.expert_cache.setPlaceholderText("auto, all or GiB")
        self._add(form, "Expert cache (GiB)", "expert_cache",
                  FieldBox(self.expert_cache, tooltip=TIPS["expert_cache"]))

        # prompt
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
        self._add(form, "Prompt", "prompt", box)

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

        for w in (self.split_counts, self.chunk_tokens, self.pin_limit, self.expert_cache, self.rendezvous):
            w.textChanged.connect(self.changed)
        for w in (self.split_mode, self.chunk_mode, self.chunk_schedule, self.pipeline_depth, self.executor,
                  self.prompt_mode):
            w.currentIndexChanged.connect(self._sync_enabled)
            w.currentIndexChanged.connect(self.changed)
        self.prefill_main.toggled.connect(self.changed)
        self.cuda_graphs.toggled.connect(self.changed)
        self.warmup.toggled.connect(self.changed)
        self.repeats.valueChanged.connect(self.changed)
        self.prompt_tokens.valueChanged.connect(self.changed)
        self.decode_tokens.valueChanged.connect(self.changed)
        self.prompt_text.textChanged.connect(self.changed)
        self._sync_enabled()

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
    def load(self, s: RunSettings) -> None:
        widgets = (self.split_mode, self.split_counts, self.chunk_mode, self.chunk_tokens, self.chunk_schedule,
                   self.pipeline_depth, self.prefill_main, self.cuda_graphs, self.executor, self.rendezvous, self.pin_limit,
                   self.expert_cache, self.prompt_mode, self.prompt_tokens, self.prompt_text, self.decode_tokens,
                   self.warmup, self.repeats)
        for w in widgets:
            w.blockSignals(True)
        try:
            self.model_path.setText(s.model_path)
            self.split_mode.setCurrentText(s.split_mode if s.split_mode in ("auto", "manual", "interleave") else "auto")
            self.split_counts.setText(s.split_counts)
            self.chunk_mode.setCurrentText(s.chunk_mode if s.chunk_mode in ("auto", "fixed") else "auto")
            self.chunk_tokens.setText(s.chunk_tokens)
            self.pipeline_depth.setCurrentIndex(max(self.pipeline_depth.findData(s.pipeline_depth), 0))
            self.prefill_main.setChecked(s.prefill_main)
            schedule = s.chunk_schedule if s.chunk_schedule in ("fixed", "balanced", "auto") else "fixed"
            self.chunk_schedule.setCurrentText(schedule)
            self.cuda_graphs.setChecked(s.cuda_graphs)
            self.executor.setCurrentIndex(max(self.executor.findData(s.executor), 0))
            self.rendezvous.setText(s.rendezvous)
            self.pin_limit.setText(s.pin_limit_gib)
            self.expert_cache.setText(s.expert_cache)
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
        return {
            "model_path": self.model_path.text(),
            "split_mode": self.split_mode.currentText(),
            "split_counts": self.split_counts.text(),
            "chunk_mode": self.chunk_mode.currentText(),
            "chunk_tokens": self.chunk_tokens.text(),
            "pipeline_depth": int(self.pipeline_depth.currentData()),
            "prefill_main": self.prefill_main.isChecked(),
            "chunk_schedule": self.chunk_schedule.currentText(),
            "cuda_graphs": self.cuda_graphs.isChecked(),
            "executor": self.executor.currentData(),
            "rendezvous": self.rendezvous.text(),
            "pin_limit_gib": self.pin_limit.text(),
            "expert_cache": self.expert_cache.text(),
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
