"""Real runs of the demo model on a 2-stage CPU split, started by clicking Run."""
from __future__ import annotations

import time
from pathlib import Path

from gui_support import qsettings, qt_settings_sandbox, set_form, themed_app, wait_no_engine_threads, window  # noqa: F401
from PySide6.QtCore import Qt

from engine.pipeline.session import PipelineHooks

RUN_TIMEOUT_MS = 60_000


def _click_run(qtbot, win) -> None:
    assert win.run_button.isEnabled(), win.validation.errors
    qtbot.mouseClick(win.run_button, Qt.MouseButton.LeftButton)


def _wait_done(qtbot, win, outcome: str) -> None:
    qtbot.waitUntil(lambda: win.last_outcome != "" and not win.controller.is_running, timeout=RUN_TIMEOUT_MS)
    assert win.last_outcome == outcome, f"{win.last_outcome}: {win.status_label.text()}"


def test_run_demo_on_two_cpu_stages_fills_gantt_summary_and_progress(window, qtbot):
    win = window
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="64", prompt_mode="tokens",
             prompt_tokens=512, decode_tokens=4, pipeline_depth=1)
    _click_run(qtbot, win)
    assert win.stop_button.isEnabled() and not win.run_button.isEnabled()
    _wait_done(qtbot, win, "finished")
    report = win.last_report
    plan = report.plan
    assert (len(plan.stages), plan.n_chunks, plan.chunk) == (2, 8, 64)
    ok, what = win.gantt.store.one_compute_per_stage_chunk(2, 8)
    assert ok, what
    # everything the engine emitted reached the Gantt, in coalesced batches
    session = win.controller.sessions.session
    assert win.gantt.store.count() == len(session.events)
    assert win.gantt.store.count("decode") == 2 * 3  # 4 tokens: 3 steps through 2 stages
    # progress: chunks of the last stage, then decode steps
    assert win.progress.value() == win.progress.maximum() == 8 + 3
    assert "prefill" in win.progress_label.text() and f"{report.prefill_tok_s:,.0f}" in win.progress_label.text()
    # summary shows the engine's report
    text = win.summary.figures.text()
    assert report.digest in text and f"{report.prefill_tok_s:,.0f} tok/s" in text
    assert "order kept" in text or report.order_reason in text
    assert win.summary.table.rowCount() == 2
    assert win.summary.table.item(1, 3).text() == "8"
    assert "no expert streaming in this run" in win.summary.expert.text()
    assert len(win.summary.bar_labels) == 3  # k = 0, 1, 2 stages computing
    # telemetry: no plots on a machine without NVML, the reason instead
    if not win.telemetry.showing_plots:
        assert win.telemetry.message.text().startswith("telemetry unavailable: ")
    assert win.telemetry.util.getViewBox().linkedView(0) is win.gantt.vb
    assert win.run_button.isEnabled() and not win.stop_button.isEnabled()
    assert wait_no_engine_threads() == []
    # a second run with nothing changed reuses the loaded session
    _click_run(qtbot, win)
    _wait_done(qtbot, win, "finished")
    assert win.controller.sessions.builds == 1
    assert win.last_report.digest == report.digest  # same prompt, same split: same bytes


def test_stop_mid_run_leaves_no_thread_and_the_next_run_works(window, qtbot):
    win = window
    win.controller.hooks = PipelineHooks(after_layer=lambda s, layer, c: time.sleep(0.02))
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="32", prompt_tokens=1024, decode_tokens=0)
    _click_run(qtbot, win)
    qtbot.waitUntil(lambda: win.progress_model is not None and win.progress_model.snapshot().chunks_done >= 2,
                    timeout=RUN_TIMEOUT_MS)
    qtbot.mouseClick(win.stop_button, Qt.MouseButton.LeftButton)
    _wait_done(qtbot, win, "cancelled")
    assert not win.controller.is_running
    assert wait_no_engine_threads() == []
    done = win.progress_model.snapshot().chunks_done
    assert 2 <= done < 32 and "stopped after" in win.progress_label.text()
    assert win.gantt.store.count("compute") >= done
    assert win.run_button.isEnabled()
    win.controller.hooks = None
    set_form(win, prompt_tokens=256)
    _click_run(qtbot, win)
    _wait_done(qtbot, win, "finished")
    ok, what = win.gantt.store.one_compute_per_stage_chunk(2, win.last_report.plan.n_chunks)
    assert ok, what


def test_engine_error_shows_a_dialog_and_the_next_run_succeeds(window, qtbot, tmp_path, monkeypatch):
    win = window
    log_dir = tmp_path / "logs"
    monkeypatch.setenv("STRATA_LOG_DIR", str(log_dir))

    def fault(stage: int, layer: int, chunk: int) -> None:
        if stage == 1 and chunk == 2:
            raise RuntimeError("injected fault")

    win.controller.hooks = PipelineHooks(after_layer=fault)
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="64", prompt_tokens=512, decode_tokens=2)
    _click_run(qtbot, win)
    _wait_done(qtbot, win, "failed")
    box = win.error_box
    assert box is not None and box.isVisible()
    # an internal error: one line (what, where, the log file), the traceback behind Details
    line = box.text()
    assert line.startswith("internal error in the run at stage_runtime.py:") and "\n" not in line  # the stage body
    assert "stage 1 (cpu), chunk 2" in line and "injected fault" in line
    log_file = Path(line.rsplit("full traceback in ", 1)[1])
    assert log_file.parent == log_dir and "Traceback (most recent call last)" in log_file.read_text()
    assert "Traceback (most recent call last)" in box.detailedText()
    assert box.windowTitle() == "Run failed: internal error"
    assert wait_no_engine_threads() == []
    box.accept()
    qtbot.waitUntil(lambda: win.error_box is None, timeout=5_000)
    builds = win.controller.sessions.builds
    win.controller.hooks = None
    _click_run(qtbot, win)
    _wait_done(qtbot, win, "finished")
    assert win.controller.sessions.builds == builds + 1  # the failed session was not reused
    ok, what = win.gantt.store.one_compute_per_stage_chunk(2, 8)
    assert ok, what


def test_closing_the_window_during_a_run_stops_it_cleanly(themed_app, qtbot, qsettings, demo_path):
    from strata_gui.views.main_window_view import MainWindow

    win = MainWindow(qsettings, demo_path)
    qtbot.addWidget(win)
    win.show()
    qtbot.waitUntil(lambda: not win.jobs.busy, timeout=20_000)
    win.controller.hooks = PipelineHooks(after_layer=lambda s, layer, c: time.sleep(0.02))
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="32", prompt_tokens=1024, decode_tokens=0)
    _click_run(qtbot, win)
    qtbot.waitUntil(lambda: win.progress_model is not None and win.progress_model.snapshot().chunks_done >= 1,
                    timeout=RUN_TIMEOUT_MS)
    win.close()
    assert not win.controller.is_running
    assert win.controller.sessions.session is None
    assert wait_no_engine_threads() == []


def test_text_prompt_is_tokenised_with_the_models_vocabulary(window, qtbot):
    from engine.io import prompt
    from engine.io.gguf_model import load

    win = window
    text = "hello world, the pipeline split"
    set_form(win, devices="cpu,cpu", prompt_mode="text", prompt_text=text, chunk_mode="fixed", chunk_tokens="4",
             decode_tokens=2)
    _click_run(qtbot, win)
    _wait_done(qtbot, win, "finished")
    n = len(prompt.tokenize(load(win.demo_model), text))
    plan = win.last_report.plan
    assert plan.prompt_tokens == n and plan.n_chunks == -(-n // 4)
    ok, what = win.gantt.store.one_compute_per_stage_chunk(2, plan.n_chunks)
    assert ok, what


def test_telemetry_reason_for_a_gpu_run_without_nvml():
    from engine.config import EngineConfig
    from engine.hw.topology import Topology
    from strata_gui.run.run_job import make_sampler

    sampler, reason = make_sampler(EngineConfig(devices=["cpu", "cpu"]), Topology(reason="no CUDA devices: test"))
    if sampler is None:  # this machine: no NVML
        assert reason and not reason.startswith("unavailable:")
    else:
        sampler.stop()


def test_out_of_memory_shows_what_to_change_and_the_next_run_succeeds(window, qtbot):
    """An OOM (forced through the allocation hook) reaches the user as the engine's message."""
    win = window

    def oom(what: str, device: str, nbytes: int) -> None:
        if what.startswith("KV for layers 2-3"):
            raise MemoryError("simulated")

    win.controller.hooks = PipelineHooks(before_alloc=oom)
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="64", prompt_tokens=256, decode_tokens=2)
    _click_run(qtbot, win)
    _wait_done(qtbot, win, "failed")
    box = win.error_box
    assert box is not None and "out of memory on cpu allocating KV for layers 2-3" in box.text()
    assert "--layer-split" in box.text()
    assert wait_no_engine_threads() == []
    box.accept()
    qtbot.waitUntil(lambda: win.error_box is None, timeout=5_000)
    win.controller.hooks = None
    _click_run(qtbot, win)
    _wait_done(qtbot, win, "finished")


def test_stop_during_decode_keeps_the_prompts_result(window, qtbot):
    win = window
    win.controller.hooks = PipelineHooks(after_layer=lambda s, layer, c: time.sleep(0.01) if c == -1 else None)
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="64", prompt_tokens=256, decode_tokens=400)
    _click_run(qtbot, win)
    qtbot.waitUntil(lambda: win.progress_model is not None and win.progress_model.snapshot().chunks_done >= 4,
                    timeout=RUN_TIMEOUT_MS)
    qtbot.wait(100)  # into the decode steps
    win.stop_button.click()
    _wait_done(qtbot, win, "cancelled")
    assert wait_no_engine_threads() == []
    win.controller.hooks = None
    set_form(win, decode_tokens=2)
    _click_run(qtbot, win)
    _wait_done(qtbot, win, "finished")


def test_balanced_schedule_and_cuda_graphs_settings_reach_the_engine(window, qtbot):
    """The form's chunk schedule and CUDA-graphs switch become the run's settings; the Gantt
    shows the balanced chunks the plan made."""
    win = window
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="64", chunk_schedule="balanced",
             cuda_graphs=False, prompt_mode="tokens", prompt_tokens=512, decode_tokens=2)
    assert win.settings_panel.chunk_schedule.currentText() == "balanced"
    assert not win.settings_panel.cuda_graphs.isChecked()
    _click_run(qtbot, win)
    _wait_done(qtbot, win, "finished")
    plan = win.last_report.plan
    assert plan.schedule == "balanced" and plan.n_chunks == 8 and sum(n for _, n in plan.bounds) == 512
    session = win.controller.sessions.session
    assert session.config.chunk_schedule == "balanced" and session.config.cuda_graphs is False
    ok, what = win.gantt.store.one_compute_per_stage_chunk(2, plan.n_chunks)
    assert ok, what


def test_an_interleaved_run_draws_a_row_per_device_with_groups_labelled(window, qtbot):
    win = window
    set_form(win, devices="cpu,cpu", split_mode="interleave", split_counts="2", chunk_mode="fixed",
             chunk_tokens="64", prompt_mode="tokens", prompt_tokens=256, decode_tokens=0, pipeline_depth=1)
    _click_run(qtbot, win)
    _wait_done(qtbot, win, "finished")
    plan = win.last_report.plan
    assert plan.interleave == 2 and len(plan.stages) == 4
    store = win.gantt.store
    assert store.n_rows == 2 and [store.row_of(s) for s in range(4)] == [0, 1, 0, 1]
    ok, what = store.one_compute_per_stage_chunk(4, 4)
    assert ok, what
    win.gantt.fit()
    win.gantt.redraw()
    texts = win.gantt.labels._texts
    assert "C0·g2" in texts and "C3·g1" in texts, texts
    ticks = win.gantt.plot.getPlotItem().getAxis("left")._tickLevels[0]
    assert [t for _, t in ticks] == ["cpu\ngroups g0, g2", "cpu\ngroups g1, g3"]
    assert "4 layer groups" in win.summary.figures.text() and "3 hop(s) per chunk" in win.summary.figures.text()


def test_first_run_on_the_demo_shows_the_pipeline(themed_app, qtbot, tmp_path, demo_path):
    """A first start (no stored settings) pressing Run: C0…C7 on two stages, with both stages
    computing at once for part of the prefill; auto stays the engine's default elsewhere."""
    from PySide6.QtCore import QSettings

    from strata_gui.run.settings_model import RunSettings
    from strata_gui.views.main_window_view import MainWindow

    assert RunSettings().chunk_mode == "auto" and RunSettings.from_env({}).chunk_mode == "auto"
    assert RunSettings.from_env({"STRATA_CHUNK_TOKENS": "auto"}, demo=True).chunk_mode == "auto"
    fresh = QSettings(str(tmp_path / "first-start.ini"), QSettings.Format.IniFormat)
    win = MainWindow(fresh, demo_path, history_path=tmp_path / "h.sqlite3", env={})
    qtbot.addWidget(win)
    win.show()
    try:
        qtbot.waitUntil(lambda: not win.jobs.busy, timeout=20_000)
        s = win.current_settings()
        assert (s.chunk_mode, s.chunk_tokens, s.prompt_tokens, s.warmup) == ("fixed", "256", 2048, True)
        _click_run(qtbot, win)
        _wait_done(qtbot, win, "finished")
        plan = win.last_report.plan
        assert (len(plan.stages), plan.n_chunks) == (2, 8)
        ok, what = win.gantt.store.one_compute_per_stage_chunk(2, 8)
        assert ok, what
        assert win.last_report.busy_histogram[2] > 0.2  # the overlap is visible: both stages at once
    finally:
        win.close()


def test_showing_a_saved_run_puts_its_settings_in_the_form(window, qtbot):
    win = window
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="32", prompt_mode="tokens", prompt_tokens=256,
             decode_tokens=2, pipeline_depth=0, repeats=1)
    _click_run(qtbot, win)
    _wait_done(qtbot, win, "finished")
    qtbot.waitUntil(lambda: win.last_saved is not None, timeout=5_000)
    saved = win.last_saved.run
    set_form(win, chunk_mode="auto", prompt_tokens=999, decode_tokens=7, pipeline_depth=1, devices="cpu")
    assert win.show_history_run(saved)
    s = win.current_settings()
    assert (s.devices, s.chunk_mode, s.chunk_tokens, s.prompt_tokens, s.decode_tokens, s.pipeline_depth) == \
        ("cpu,cpu", "fixed", "32", 256, 2, 0)
    assert win.validation.ok and "settings are that run's" in win.status_label.text()
    _click_run(qtbot, win)  # Run now repeats the shown run: same plan, same output
    _wait_done(qtbot, win, "finished")
    assert win.last_report.digest == win.history.report(saved).digest


def test_a_run_without_warm_up_is_labelled_cold(window, qtbot):
    win = window
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="32", prompt_tokens=192, decode_tokens=0,
             warmup=False)
    _click_run(qtbot, win)
    _wait_done(qtbot, win, "finished")
    qtbot.waitUntil(lambda: win.last_saved is not None, timeout=5_000)
    first_id = win.last_saved.run
    first = win.history.get(first_id)
    assert first.config["cold"] is True and first.config["warmup"] is False
    assert "COLD" in win.summary.figures.text()
    _click_run(qtbot, win)  # the same shape again: warm now
    _wait_done(qtbot, win, "finished")
    qtbot.waitUntil(lambda: win.last_saved is not None and win.last_saved.run != first_id, timeout=5_000)
    assert win.history.get(win.last_saved.run).config["cold"] is False


def test_a_stopped_run_shown_from_the_history_has_no_prefill_figure(window, qtbot):
    win = window
    win.controller.hooks = PipelineHooks(after_layer=lambda s, layer, c: time.sleep(0.02))
    set_form(win, devices="cpu,cpu", chunk_mode="fixed", chunk_tokens="32", prompt_tokens=512, decode_tokens=0,
             warmup=False)
    _click_run(qtbot, win)
    qtbot.waitUntil(lambda: win.progress_model is not None and win.progress_model.snapshot().chunks_done >= 2,
                    timeout=RUN_TIMEOUT_MS)
    win.stop_button.click()
    _wait_done(qtbot, win, "cancelled")
    win.controller.hooks = None
    qtbot.waitUntil(lambda: win.last_saved is not None, timeout=5_000)
    assert win.show_history_run(win.last_saved.run)
    text = win.summary.figures.text()
    assert "<b>—</b> (stopped: no prefill rate)" in text and "0 tok/s" not in text


def test_layer_split_auto_runs_the_split_the_model_picks_and_keeps_it_for_the_next_run(window, qtbot, monkeypatch):
    """Over two devices with split auto, the app models contiguous vs interleave:V for the
    prompt, rebuilds its session for the faster one (here: 3 chunks on 2 devices, interleave:2),
    says so in the report, and the next Run of the same settings reuses that session."""
    from engine.plan import split_choice

    monkeypatch.setattr(split_choice, "distinct_devices", lambda config: len(config.devices))  # cpu,cpu as 2 GPUs
    win = window
    set_form(win, devices="cpu,cpu", split_mode="auto", chunk_mode="fixed", chunk_tokens="16", prompt_mode="tokens",
             prompt_tokens=48, decode_tokens=0, pipeline_depth=1)
    _click_run(qtbot, win)
    _wait_done(qtbot, win, "finished")
    report = win.last_report
    assert report.plan.interleave == 2 and len(report.plan.stages) == 4
    assert any(n.startswith("layer split auto: interleave:2") for n in report.notes)
    ok, what = win.gantt.store.one_compute_per_stage_chunk(4, 3)
    assert ok, what
    builds = win.controller.sessions.builds
    _click_run(qtbot, win)
    _wait_done(qtbot, win, "finished")
    assert win.controller.sessions.builds == builds and win.last_report.plan.interleave == 2
