"""Prefill-main's hand-over of KV and recurrent state, shown where users look (issue 34 item 2):
the app's run summary and strata-bench's hand-off column name the bytes the run moved."""
from __future__ import annotations

from engine.cli import bench
from engine.config import EngineConfig
from engine.io import gguf_model
from engine.io.prompt import synthetic
from engine.pipeline.session import Session

SHAPE = ["--arch", "qwen3next", "--quant", "q8_0", "--layers", "4", "--hidden", "256", "--heads", "4",
         "--kv-heads", "2", "--head-dim", "64", "--experts", "8", "--experts-used", "2", "--expert-ffn", "256"]


def test_the_summary_and_the_table_show_the_state_handed_over(tmp_path, qtbot, capsys):
    from strata_gui.views.summary_view import SummaryView

    path = tmp_path / "qn.gguf"
    assert bench.main(["make-model", str(path), *SHAPE]) == 0
    model = gguf_model.load(path)
    sess = Session(model, EngineConfig(chunk_tokens=32, devices=["cpu", "cpu"], prefill_main=True))
    try:
        report = sess.run(synthetic(80, model.spec.vocab, nonce=2), decode_tokens=1).report
    finally:
        sess.close()
    assert report.state_handoff_bytes > 0
    view = SummaryView()
    qtbot.addWidget(view)
    view.show_report(report)
    mib = f"{report.state_handoff_bytes / 2**20:,.1f} MiB of KV and recurrent state handed to the stages"
    assert mib in view.figures.text()
    capsys.readouterr()
    assert bench.main(["run", "-m", str(path), "--devices", "cpu,cpu", "--prefill-main", "1", "-p", "80", "-n", "0",
                       "-r", "1", "--chunk-tokens", "32", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"{report.state_handoff_bytes / 2**20:,.1f} MiB KV+state to the stages" in out
