"""Devices: the topology table, the device list of the split, and the order that will be used.

Without a GPU the table shows the CPU and the reason `topology.discover()` gives (e.g. "NVML not
found").  The order list previews `topology.order_devices`: with ordering "configured" it can be
reordered by drag, which rewrites the device list.
"""
from __future__ import annotations

import html
import logging
import os

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine import settings_table
from engine.hw.topology import GpuInfo, Topology, driver_facts, order_devices

from .field_box_view import FieldBox
from .table_height import fit_height

log = logging.getLogger(__name__)

COLUMNS = ("device", "name", "VRAM GiB\ntotal / free", "PCIe\ncur / max", "link class\nGB/s", "measured\nH2D GB/s",
           "driver\nmodel")

TIP_DEVICES = settings_table.row("devices").tooltip  # engine/settings_table.py: the setting's one row
TIP_ORDER = settings_table.row("gpu_order").tooltip
_GIB = float(1 << 30)


def _num(v: float | None, scale: float = 1.0) -> str:
    return "—" if v is None else f"{v / scale:.1f}"


def _link(gen: int | None, width: int | None) -> str:
    return "—" if gen is None or width is None else f"Gen{gen} x{width}"


class DevicesPanel(QGroupBox):
    changed = Signal()
    probe_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Devices", parent)
        self.topology: Topology | None = None
        self.reason = QLabel("Discovering devices…")
        self.reason.setProperty("role", "hint")
        self.reason.setWordWrap(True)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        hdr = self.table.horizontalHeader()
        hdr.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        hdr.setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        self.table.setToolTip("Link class: GB/s per direction at the link's max generation x width (idle links "
                              "downshift, so the current figures say little); measured: pinned host->device.")
        self.facts = QLabel()
        self.facts.setProperty("role", "hint")
        self.facts.setWordWrap(True)
        self.facts.setVisible(False)
        self.facts.setToolTip("What the GPUs' Windows driver models (NVML: WDDM, TCC or MCDM; n/a off Windows) and "
                              "their peer access mean for a run.")
        self.probe = QPushButton("Measure bandwidth")
        self.probe.setToolTip("Measure pinned host->device GB/s per GPU (used by ordering pcie when present).")
        self.probe.clicked.connect(self.probe_requested)
        self.probe.setEnabled(False)

        self.devices = QComboBox()
        self.devices.setEditable(True)
        self.devices.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)
        self.devices.lineEdit().setPlaceholderText("e.g. cpu,cpu or cuda:0,cuda:1")
        self.devices_box = FieldBox(self.devices, tooltip=TIP_DEVICES)
        self.gpu_order = QComboBox()
        self.gpu_order.addItems(["pcie", "configured"])
        self.order_box = FieldBox(self.gpu_order, tooltip=TIP_ORDER)
        self.order_list = QListWidget()
        self.order_list.setFixedHeight(34)
        self.order_list.setFlow(QListWidget.Flow.LeftToRight)
        self.order_list.setSpacing(2)
        self.order_list.model().rowsMoved.connect(self._on_dragged)
        self.order_reason = QLabel()
        self.order_reason.setProperty("role", "hint")
        self.order_reason.setWordWrap(True)

        form = QFormLayout()
        form.addRow(self._label("Device list", TIP_DEVICES), self.devices_box)
        form.addRow(self._label("GPU ordering", TIP_ORDER), self.order_box)
        order_col = QVBoxLayout()
        order_col.setSpacing(2)
        order_col.addWidget(self.order_list)
        order_col.addWidget(self.order_reason)
        form.addRow(self._label("Order used", "The stages in the order the run will use; stage 0 is the main "
                                              "device."), order_col)
        top = QHBoxLayout()
        top.addWidget(self.reason, 1)
        top.addWidget(self.probe, 0, Qt.AlignmentFlag.AlignTop)
        lay = QVBoxLayout(self)
        lay.addLayout(top)
        lay.addWidget(self.table)
        lay.addWidget(self.facts)
        lay.addLayout(form)

        self.devices.currentTextChanged.connect(self._on_edited)
        self.gpu_order.currentIndexChanged.connect(self._on_edited)
        self._fill_presets(Topology())

    @staticmethod
    def _label(text: str, tip: str) -> QLabel:
        lab = QLabel(text)
        lab.setToolTip(tip)
        lab.setStyleSheet("font-weight: normal")
        return lab

    # --------------------------------------------------------------- topology
    def set_topology(self, topo: Topology) -> None:
        self.topology = topo
        self.table.setRowCount(0)
        if topo.devices:
            self.reason.setText(f"{len(topo.devices)} CUDA GPU(s)." + (
                f" Note: {html.escape(topo.reason)}" if topo.reason else ""))
            for g in topo.devices:
                self._add_gpu_row(g)
        else:
            self.reason.setText(f"No CUDA GPU: stages run on the CPU. Reason: {topo.reason or 'unknown'}")
            cores = os.cpu_count() or 0
            self._add_row(("cpu", f"host CPU, {cores} logical cores", "—", "—", "—", "—", "n/a"))
        # the driver model is a GPU's fact: no column for the CPU row
        self.table.setColumnHidden(COLUMNS.index("driver\nmodel"), not topo.devices)
        facts = driver_facts(topo)
        self.facts.setText("\n".join(facts))
        self.facts.setVisible(bool(facts))
        fit_height(self.table)
        self.probe.setEnabled(bool(topo.devices))
        self.probe.setVisible(bool(topo.devices))
        self.probe.setText("Measure bandwidth" if not topo.probed else "Measure again")
        self._fill_presets(topo)
        self.refresh_order()

    def _add_gpu_row(self, g: GpuInfo) -> None:
        self._add_row((g.torch_name, g.name, f"{_num(g.vram_total, _GIB)} / {_num(g.vram_free, _GIB)}",
                       f"{_link(g.pcie_gen_cur, g.pcie_width_cur)} / {_link(g.pcie_gen_max, g.pcie_width_max)}",
                       _num(g.link_class_gbs), _num(g.h2d_gbs), g.driver_model))

    def _add_row(self, cells: tuple[str, ...]) -> None:
        r = self.table.rowCount()
        self.table.insertRow(r)
        for j, text in enumerate(cells):
            item = QTableWidgetItem(text)
            if j >= 2:
                item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
            self.table.setItem(r, j, item)

    def _fill_presets(self, topo: Topology) -> None:
        current = self.devices.currentText()
        presets = ["cpu", "cpu,cpu", "cpu,cpu,cpu", "cpu,cpu,cpu,cpu"]
        names = [g.torch_name for g in topo.devices]
        for k in range(1, len(names) + 1):
            presets.insert(k - 1, ",".join(names[:k]))
        self.devices.blockSignals(True)
        self.devices.clear()
        self.devices.addItems(presets)
        self.devices.setCurrentText(current)
        self.devices.blockSignals(False)

    # ----------------------------------------------------------------- values
    def load(self, devices: str, gpu_order: str) -> None:
        self.devices.blockSignals(True)
        self.gpu_order.blockSignals(True)
        self.devices.setCurrentText(devices)
        self.gpu_order.setCurrentText(gpu_order if gpu_order in ("pcie", "configured") else "pcie")
        self.devices.blockSignals(False)
        self.gpu_order.blockSignals(False)
        self.refresh_order()

    def values(self) -> dict[str, str]:
        return {"devices": self.devices.currentText().strip(), "gpu_order": self.gpu_order.currentText()}

    def set_errors(self, errors: dict[str, str]) -> None:
        self.devices_box.set_error(errors.get("devices"))
        self.order_box.set_error(errors.get("gpu_order"))

    def set_editable(self, on: bool) -> None:
        for w in (self.devices_box, self.order_box, self.order_list, self.probe):
            w.setEnabled(on and (w is not self.probe or bool(self.topology and self.topology.devices)))

    # ------------------------------------------------------------------ order
    def _on_edited(self, *args: object) -> None:
        self.refresh_order()
        self.changed.emit()

    def refresh_order(self) -> None:
        """Preview the order the run will use, and why."""
        devices = [d.strip() for d in self.devices.currentText().split(",") if d.strip()]
        mode = self.gpu_order.currentText()
        configured = mode == "configured"
        try:
            res = order_devices(devices, mode, self.topology or Topology(reason="devices not discovered yet"))
            order, reason = res.devices, res.reason
        except Exception as exc:  # the field's own validation names the problem
            order, reason = devices, f"no preview: {exc}"
        self.order_list.blockSignals(True)
        self.order_list.clear()
        for i, d in enumerate(order):
            item = QListWidgetItem(f"{i}: {d}" + (" (main)" if i == 0 else ""))
            item.setData(Qt.ItemDataRole.UserRole, d)
            self.order_list.addItem(item)
        self.order_list.blockSignals(False)
        drag = configured and len(order) > 1
        self.order_list.setDragDropMode(QAbstractItemView.DragDropMode.InternalMove if drag
                                        else QAbstractItemView.DragDropMode.NoDragDrop)
        self.order_list.setToolTip("Drag to reorder the stages." if drag else
                                   "Switch GPU ordering to 'configured' to reorder the stages by drag.")
        hint = " Drag to reorder." if drag else ""
        self.order_reason.setText(reason + hint)

    def order(self) -> list[str]:
        return [self.order_list.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.order_list.count())]

    def _on_dragged(self, *args: object) -> None:
        # the list's model is still inside its move: rewrite the device list afterwards
        QTimer.singleShot(0, self._apply_drag)

    def _apply_drag(self) -> None:
        new = ",".join(self.order())
        if new != self.devices.currentText():
            self.devices.setCurrentText(new)  # refreshes the list and revalidates
