"""Colours, the light palette and the style sheet shared by every view.

Kind colours are from the Okabe-Ito set (distinguishable with the common colour-vision
deficiencies): compute blue, wait grey (idle), copy green, stream purple, decode vermillion.
"""
from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QApplication


@dataclass(frozen=True)
class KindStyle:
    color: str
    label: str
    meaning: str


KIND_STYLES: dict[str, KindStyle] = {
    "compute": KindStyle("#0072B2", "compute", "a stage computing its layers for chunk Cn"),
    "wait": KindStyle("#A8A8A8", "wait", "a stage waiting: a GPU idle between its chunks, or a CPU stage's "
                                         "thread waiting on its successor (reap / join / finish guard)"),
    "copy": KindStyle("#009E73", "copy", "activations handed to the next stage (or KV after prefill-main)"),
    "stream": KindStyle("#CC79A7", "stream", "expert weights streamed from host RAM"),
    "decode": KindStyle("#D55E00", "decode", "one decode step Tn through the split"),
}

GPU_COLORS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442")

ERROR_COLOR = "#C62828"
WARNING_COLOR = "#B26A00"  # something the user can fix, e.g. a missing fast kernel
MUTED_COLOR = "#5F6368"
PLOT_BG = "#FFFFFF"
PLOT_FG = "#202124"

STYLE_SHEET = f"""
QGroupBox {{
    font-weight: 600;
    border: 1px solid #D0D4DA;
    border-radius: 6px;
    margin-top: 12px;
    padding: 8px 6px 6px 6px;
    background: #FFFFFF;
}}
QGroupBox::title {{
    subcontrol-origin: margin;
    left: 10px;
    padding: 0 4px;
    color: #1A1A1A;
}}
QLineEdit[invalid="true"], QComboBox[invalid="true"], QPlainTextEdit[invalid="true"],
QSpinBox[invalid="true"] {{
    border: 2px solid {ERROR_COLOR};
    border-radius: 3px;
}}
QLabel[role="error"] {{
    color: {ERROR_COLOR};
    font-weight: normal;
}}
QLabel[role="hint"] {{
    color: {MUTED_COLOR};
    font-weight: normal;
}}
QLabel[role="panel-title"] {{
    font-weight: 600;
    font-size: 11pt;
}}
QPushButton#runButton {{
    background: #1B7F3B;
    color: white;
    font-weight: 600;
    padding: 6px 22px;
    border-radius: 4px;
}}
QPushButton#runButton:disabled {{
    background: #B7C7BC;
    color: #F4F4F4;
}}
QPushButton#stopButton {{
    background: #B3261E;
    color: white;
    font-weight: 600;
    padding: 6px 22px;
    border-radius: 4px;
}}
QPushButton#stopButton:disabled {{
    background: #D9B8B6;
    color: #F4F4F4;
}}
"""


def configure_pyqtgraph() -> None:
    import pyqtgraph as pg  # here, not at the top: the splash screen shows before pyqtgraph loads (0.5 s)

    pg.setConfigOptions(antialias=False, background=PLOT_BG, foreground=PLOT_FG, useOpenGL=False)


def apply(app: QApplication, plots: bool = True) -> None:
    """Fusion style, a light palette and the style sheet; `plots`: pyqtgraph's options too (the
    app's start-up sets those after its splash screen shows)."""
    app.setStyle("Fusion")
    pal = QPalette()
    pal.setColor(QPalette.ColorRole.Window, QColor("#F3F4F6"))
    pal.setColor(QPalette.ColorRole.WindowText, QColor("#1A1A1A"))
    pal.setColor(QPalette.ColorRole.Base, QColor("#FFFFFF"))
    pal.setColor(QPalette.ColorRole.AlternateBase, QColor("#F6F8FA"))
    pal.setColor(QPalette.ColorRole.Text, QColor("#1A1A1A"))
    pal.setColor(QPalette.ColorRole.Button, QColor("#E8EAED"))
    pal.setColor(QPalette.ColorRole.ButtonText, QColor("#1A1A1A"))
    pal.setColor(QPalette.ColorRole.Highlight, QColor("#0072B2"))
    pal.setColor(QPalette.ColorRole.HighlightedText, QColor("#FFFFFF"))
    pal.setColor(QPalette.ColorRole.ToolTipBase, QColor("#FFFFE8"))
    pal.setColor(QPalette.ColorRole.ToolTipText, QColor("#1A1A1A"))
    app.setPalette(pal)
    app.setStyleSheet(STYLE_SHEET)
    if plots:
        configure_pyqtgraph()
