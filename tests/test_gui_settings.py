"""The settings form and the devices panel: in-place validation with the engine's messages, a broken
GGUF in the picker, persistence across restarts, GPU ordering preview and drag reordering."""
from __future__ import annotations

import pytest
from gui_support import qsettings, qt_settings_sandbox, set_form, themed_app, wait_model, window  # noqa: F401
from PySide6.QtCore import QModelIndex, Qt
from PySide6.QtWidgets import QAbstractItemView

from engine.hw.topology import GpuInfo, Topology
from strata_gui.views.devices_view import DevicesPanel
from strata_gui.views.settings_view import TIPS


def _flagged(win, field: str) -> str:
    panel = win.devices_panel if field in ("devices", "gpu_order") else win.settings_panel
    box = panel.devices_box if field == "devices" else panel.order_box if field == "gpu_order" else panel.boxes[field]
    if not box.invalid:
        return ""
    assert box.error.isVisible()
    assert any(w.property("invalid") for w in box.flag_targets)  # the red border
    return box.message


def _run_is_blocked(win, qtbot) -> None:
    started = win.controller.runs_started
    assert not win.run_button.isEnabled()
    qtbot.mouseClick(win.run_button, Qt.MouseButton.LeftButton)
    assert win.start_run() is False
    assert win.controller.runs_started == started and not win.controller.is_running


def test_invalid_values_are_flagged_in_place_and_block_run(window, qtbot):
    win = window
    set_form(win, devices="cpu,cpu")
    assert win.run_button.isEnabled(), win.validation.errors

    win.settings_panel.split_mode.setCurrentText("manual")
    win.settings_panel.split_counts.setText("3,3")
    msg = _flagged(win, "layer_split")
    assert "layer_split='3,3'" in msg and "summing to the model's 4 layers" in msg
    _run_is_blocked(win, qtbot)
    win.settings_panel.split_counts.setText("1,3")
    assert _flagged(win, "layer_split") == "" and win.run_button.isEnabled()
    win.settings_panel.split_mode.setCurrentText("auto")

    win.settings_panel.chunk_mode.setCurrentText("fixed")
    win.settings_panel.chunk_tokens.setText("abc")
    msg = _flagged(win, "chunk_tokens")
    assert "chunk_tokens='abc'" in msg and "auto or a chunk size in tokens" in msg
    _run_is_blocked(win, qtbot)
    win.settings_panel.chunk_tokens.setText("128")

    win.settings_panel.pin_limit.setText("-2")
    msg = _flagged(win, "pin_limit_gib")
    assert "pin_limit_gib='-2'" in msg and "must not be negative" in msg
    _run_is_blocked(win, qtbot)
    win.settings_panel.pin_limit.setText("auto")

    win.devices_panel.devices.setCurrentText("cpu,cpu,cpu,cpu,cpu")
    assert "at most 4 devices" in _flagged(win, "devices")
    _run_is_blocked(win, qtbot)
    win.devices_panel.devices.setCurrentText("cpu,cpu")

    assert win.validation.errors == {} and win.run_button.isEnabled()
    # depth is a combo: only the engine's two values can be chosen
    depths = [win.settings_panel.pipeline_depth.itemData(i) for i in range(win.settings_panel.pipeline_depth.count())]
    assert depths == [1, 0]


def test_cuda_devices_without_cuda_are_flagged(window, qtbot):
    if window.cuda_count:
        return  # a machine with GPUs accepts them
    window.devices_panel.devices.setCurrentText("cuda:0,cuda:1")
    assert "no CUDA" in _flagged(window, "devices")
    _run_is_blocked(window, qtbot)


def test_broken_gguf_shows_the_engine_error_and_the_app_stays_usable(window, qtbot, tmp_path):
    win = window
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"NOTGGUF" + bytes(100))
    win.settings_panel.set_model_path(str(bad))
    wait_model(qtbot, win)
    msg = _flagged(win, "model")
    assert str(bad) in msg and "not a GGUF file" in msg
    _run_is_blocked(win, qtbot)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(win.demo_model.read_bytes()[:5000])
    win.settings_panel.set_model_path(str(truncated))
    wait_model(qtbot, win)
    assert "truncated" in _flagged(win, "model") or "corrupt" in _flagged(win, "model")
    win.settings_panel.set_model_path("")  # back to the demo model
    wait_model(qtbot, win)
    assert _flagged(win, "model") == "" and win.run_button.isEnabled()
    assert "qwen3moe: 4 layers" in win.settings_panel.model_info.text()
    assert "8 experts" in win.settings_panel.model_info.text()


def test_every_setting_has_a_tooltip(window):
    for name, box in window.settings_panel.boxes.items():
        assert box.inputs[0].toolTip() == TIPS[name]
        assert box.inputs[0].toolTip().count(".") <= 2  # about one sentence
    assert window.devices_panel.devices.toolTip()
    assert window.devices_panel.gpu_order.toolTip()


def test_settings_persist_across_restarts(themed_app, qtbot, qsettings, demo_path):
    from strata_gui.views.main_window_view import MainWindow

    first = MainWindow(qsettings, demo_path)
    qtbot.addWidget(first)
    set_form(first, devices="cpu,cpu,cpu", chunk_mode="fixed", chunk_tokens="96", pipeline_depth=0, prefill_main=True,
             pin_limit_gib="12", expert_cache="all", prompt_mode="text", prompt_text="hello pipeline",
             decode_tokens=7, split_mode="manual", split_counts="1,1,2", gpu_order="configured")
    first.close()
    second = MainWindow(qsettings, demo_path)
    qtbot.addWidget(second)
    s = second.current_settings()
    assert (s.devices, s.chunk_mode, s.chunk_tokens, s.pipeline_depth, s.prefill_main, s.pin_limit_gib, s.expert_cache,
            s.prompt_mode, s.prompt_text, s.decode_tokens, s.split_mode, s.split_counts, s.gpu_order) == \
        ("cpu,cpu,cpu", "fixed", "96", 0, True, "12", "all", "text", "hello pipeline", 7, "manual", "1,1,2",
         "configured")
    assert second.validation.ok, second.validation.errors
    second.close()


def test_devices_panel_shows_the_cpu_and_the_reason_without_gpus(window):
    topo = window.controller.topology
    panel = window.devices_panel
    if topo.devices:
        return
    assert panel.table.rowCount() == 1 and panel.table.item(0, 0).text() == "cpu"
    assert topo.reason in panel.reason.text()
    assert panel.order() == ["cpu", "cpu"]
    assert "fewer than two CUDA devices" in panel.order_reason.text()


def _fake_topology() -> Topology:
    gpus = [GpuInfo(0, "cuda:0", "RTX 5090 Laptop (TB5)", "00000000:07:00.0", 24 << 30, 20 << 30, 4, 4, 4, 4, 4,
                    7.876),
            GpuInfo(1, "cuda:1", "RTX 5090 Laptop", "00000000:01:00.0", 24 << 30, 22 << 30, 1, 8, 5, 8, 5, 31.504)]
    return Topology(gpus, [[True, False], [False, True]], True, "")


def test_pcie_ordering_preview_and_drag_reordering(themed_app, qtbot):
    panel = DevicesPanel()
    qtbot.addWidget(panel)
    panel.set_topology(_fake_topology())
    assert panel.table.rowCount() == 2
    assert panel.table.item(1, 3).text() == "Gen1 x8 / Gen5 x8" and panel.table.item(1, 4).text() == "31.5"
    panel.load("cuda:0,cuda:1", "pcie")
    assert panel.order() == ["cuda:1", "cuda:0"]
    assert "reordered by PCIe link class" in panel.order_reason.text()
    assert panel.order_list.dragDropMode() == QAbstractItemView.DragDropMode.NoDragDrop
    panel.gpu_order.setCurrentText("configured")
    assert panel.order() == ["cuda:0", "cuda:1"]
    assert panel.order_list.dragDropMode() == QAbstractItemView.DragDropMode.InternalMove
    with qtbot.waitSignal(panel.changed, timeout=2_000):
        assert panel.order_list.model().moveRow(QModelIndex(), 1, QModelIndex(), 0)  # what a drag does
    assert panel.values()["devices"] == "cuda:1,cuda:0"
    assert panel.order() == ["cuda:1", "cuda:0"]


def test_a_pin_limit_above_ram_is_flagged_under_its_field_before_run(window, qtbot):
    """The form applies the engine's own machine check (EngineConfig.check_machine)."""
    from gui_support import set_form

    from engine.models.experts import physical_ram

    win = window
    too_much = f"{physical_ram() / 2**30 * 2:.0f}"
    set_form(win, devices="cpu,cpu", pin_limit_gib=too_much)
    assert "pin_limit_gib" in win.validation.errors and "this machine's RAM" in win.validation.errors["pin_limit_gib"]
    assert not win.run_button.isEnabled()
    set_form(win, pin_limit_gib="1")
    assert win.validation.ok and win.run_button.isEnabled()


def test_model_quant_mix_and_memory_plan_are_shown_before_run(window, qtbot, tmp_path):
    """The model line names its quant mix; the memory plan follows the settings (per device,
    and the host arena once experts are streamed)."""
    from engine.config import EngineConfig
    from engine.io import synth
    from engine.io.gguf_model import load
    from engine.plan.memory_plan import plan_memory

    win = window
    p = synth.write_model(tmp_path / "q4km.gguf", synth.recipe_from_args(
        "demo", quant="q4_k_m", hidden=256, head_dim=64, n_experts=16, expert_ffn=256))
    win.settings_panel.set_model_path(str(p))
    wait_model(qtbot, win)
    info = win.settings_panel.model_info.text()
    assert "Q4_K 7" in info and "Q6_K" in info and "F32" in info
    plan = win.settings_panel.memory_plan.text()
    assert win.settings_panel.memory_plan.isVisible()
    s = win.current_settings()
    want = plan_memory(load(p), EngineConfig.from_sources(s.overrides(), {}), s.prompt_tokens + s.decode_tokens)
    assert plan == "Memory plan\n" + want.render()
    assert "stage 0 cpu (layers 0-1)" in plan and "stage 1 cpu (layers 2-3)" in plan and "every expert resident" in plan
    win.settings_panel.expert_cache.setText("0.001")
    plan = win.settings_panel.memory_plan.text()
    assert "expert cache" in plan and "slots" in plan and "host arena" in plan and "page-locked 0 B" in plan
    win.devices_panel.devices.setCurrentText("cpu,cpu,cpu,cpu,cpu")  # invalid: no plan
    assert not win.settings_panel.memory_plan.isVisible()


@pytest.mark.parametrize("quant,types", [("iq3_xxs", ("IQ3_XXS", "IQ3_S", "IQ2_S", "Q5_K")),
                                         ("mxfp4", ("MXFP4", "Q8_0"))])
def test_low_bit_quant_mix_and_memory_plan_are_shown(window, qtbot, tmp_path, quant, types):
    """An IQ3_XXS-mix or MXFP4 file: the model line names its types, and the memory plan sizes
    its experts by their own blocks (resident: the file's expert bytes; streamed: the arena)."""
    from engine.io import synth
    from engine.io.gguf_model import load
    from engine.sizes import size_text

    win = window
    p = synth.write_model(tmp_path / f"{quant}.gguf", synth.recipe_from_args(
        "demo", quant=quant, hidden=256, head_dim=64, n_experts=16, expert_ffn=256))
    win.settings_panel.set_model_path(str(p))
    wait_model(qtbot, win)
    info = win.settings_panel.model_info.text()
    assert all(t in info for t in types), info
    assert "unsupported" not in info and "cannot" not in info, info
    model = load(p)
    exps = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    stored = [sum(model.nbytes(f"blk.{i}.{t}.weight") for t in exps) for i in range(model.spec.n_layers)]
    plan = win.settings_panel.memory_plan.text()
    assert "stage 0 cpu (layers 0-1)" in plan and "every expert resident" in plan
    assert f"experts {size_text(stored[0] + stored[1])}" in plan, plan
    win.settings_panel.expert_cache.setText("0.001")
    plan = win.settings_panel.memory_plan.text()
    assert f"host arena {size_text(sum(stored))}" in plan, plan


def test_devices_panel_shows_driver_models_and_what_follows_from_a_fake_nvml(themed_app, qtbot, monkeypatch):
    """Two WDDM GPUs without peer access (a Windows workstation), seen through a fake NVML."""
    import pynvml
    from test_topology import FakeCuda, FakeNvml, FakeNvmlDevice, cuda_props

    from engine.hw import topology

    FakeNvml([FakeNvmlDevice(0, 6, 0, name="RTX A", driver_model=pynvml.NVML_DRIVER_WDDM),
              FakeNvmlDevice(0, 7, 0, name="RTX B", driver_model=pynvml.NVML_DRIVER_WDDM)]).install(monkeypatch)
    FakeCuda([cuda_props("RTX A", 0, 6, 0), cuda_props("RTX B", 0, 7, 0)], peer=set()).install(monkeypatch)
    panel = DevicesPanel()
    qtbot.addWidget(panel)
    panel.set_topology(topology.discover())
    col = [panel.table.horizontalHeaderItem(j).text() for j in range(panel.table.columnCount())].index("driver\nmodel")
    assert [panel.table.item(r, col).text() for r in range(2)] == ["WDDM", "WDDM"]
    assert not panel.facts.isHidden()
    text = panel.facts.text()
    assert "host-staged" in text and "capped at 22 GiB" in text and "WDDM" in text
    panel.set_topology(_fake_topology())  # driver model unknown (Linux): n/a, nothing to explain but peer access
    assert panel.table.item(0, col).text() == "n/a"
    assert "WDDM" not in panel.facts.text() and "host-staged" in panel.facts.text()
    panel.set_topology(Topology(reason="no CUDA devices"))  # CPU only: no driver-model column
    assert panel.table.isColumnHidden(col) and panel.facts.isHidden()


def test_errors_lead_with_the_fields_name_not_the_engines(window, qtbot, tmp_path):
    win = window
    win.settings_panel.chunk_mode.setCurrentText("fixed")
    win.settings_panel.chunk_tokens.setText("abc")
    msg = _flagged(win, "chunk_tokens")
    assert msg.startswith("Chunk size: 'abc' is invalid; allowed: auto or a chunk size in tokens")
    assert msg.endswith("(setting chunk_tokens='abc')")  # the name the CLI and the environment use, last
    win.settings_panel.chunk_tokens.setText("128")
    bad = tmp_path / "hello.gguf"
    bad.write_bytes(b"hello world" + bytes(64))
    win.settings_panel.set_model_path(str(bad))
    wait_model(qtbot, win)
    msg = _flagged(win, "model")
    assert "not a GGUF file" in msg and "bad magic" not in msg and "b'hell'" not in msg
    win.settings_panel.set_model_path("")
    wait_model(qtbot, win)


def test_menu_shortcuts_and_cuda_graphs_greyed_for_cpu_runs(window, qtbot):
    from PySide6.QtGui import QKeySequence

    win = window
    assert win.run_action.shortcut() == QKeySequence("Ctrl+R") and win.quit_action.shortcut() == QKeySequence("Ctrl+Q")
    assert [a.text() for a in win.menuBar().actions()] == ["&File", "&Run", "&View"]
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="64", prompt_tokens=128, decode_tokens=0)
    assert not win.settings_panel.cuda_graphs.isEnabled()
    assert win.settings_panel.cuda_graphs.text() == "not used: no CUDA device"
    win.tabs.setCurrentIndex(1)
    win.run_action.trigger()  # Ctrl+R from any tab runs, and shows the Run tab
    assert win.tabs.currentWidget() is win.run_tab
    qtbot.waitUntil(lambda: win.last_outcome == "finished" and not win.controller.is_running, timeout=60_000)
    assert win.run_action.isEnabled()
