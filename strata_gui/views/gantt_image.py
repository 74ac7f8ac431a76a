"""A stored run's Gantt as a PNG image: a GanttView drawn off screen (GUI thread only)."""
from __future__ import annotations

import logging

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, Qt
from PySide6.QtWidgets import QApplication

from ..run.record_model import RunRecord, describe
from .gantt_view import GanttView

log = logging.getLogger(__name__)

ROW_PX = 64


def gantt_png(record: RunRecord, title: str = "", width: int = 1600) -> bytes:
    """PNG bytes of the run's timeline, every stage a row, the whole run in view."""
    view = GanttView(title=title or f"Pipeline timeline · {describe(record)}", live=False)
    try:
        view.setAttribute(Qt.WidgetAttribute.WA_DontShowOnScreen, True)
        view.fit_button.hide()  # an image has no buttons to press
        view.hint.hide()
        view.layout().setContentsMargins(10, 8, 10, 4)
        n_rows = max(len(record.report.plan.stages), 1)
        view.resize(width, 150 + ROW_PX * n_rows)
        view.show()
        QApplication.processEvents()
        view.show_run(record.report.run_id, record.origin_ns, record.stages, record.events,
                      record.report.plan.interleave)
        QApplication.processEvents()
        image = view.grab().toImage()
    finally:
        view.close()
        view.deleteLater()
    data = QByteArray()
    buf = QBuffer(data)
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    if not image.save(buf, "PNG"):
        raise OSError("the Gantt image could not be encoded as PNG")
    buf.close()
    return bytes(data.data())
