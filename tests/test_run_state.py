"""What one press of Run did, said as it is (run/run_state.py, no Qt): a stop before the
measured pass, during the warm-up, or after chunks; what the history kept; how the figures were
measured; the repeats' status line."""
from __future__ import annotations

from engine.events import RunPlan, StageEvent, StagePlan
from strata_gui.run.run_job import RunStarted, SaveResult
from strata_gui.run.run_state import RunState, measure_text

PLAN = RunPlan("r1", (StagePlan(0, "cpu", 0, 2), StagePlan(1, "cpu", 2, 4)), 256, 64, 4, 0, "same-device", False, 1,
               "fixed 64")


def _started(reused: bool = False) -> RunStarted:
    return RunStarted(PLAN, 0, "demo", reused, False, "no GPU")


def test_a_stop_before_the_measured_pass_says_where_and_that_nothing_was_kept():
    st = RunState()
    st.begin(1)
    assert st.cancelled_texts("stopped by the user") == (
        "stopped before the run started",
        "Stopped before the run started: stopped by the user. Nothing was measured, so nothing was saved to "
        "the History tab.")
    st.begin(1)
    st.warmup(1, 4)
    assert st.in_warmup
    label, _ = st.cancelled_texts("x")
    assert label == "stopped during the warm-up pass" and not st.in_warmup


def test_a_stop_after_chunks_counts_them_and_names_every_save():
    st = RunState()
    st.begin(3)
    st.warmup(4, 4)
    st.started(_started())
    assert not st.in_warmup and st.started_status(_started(True)).startswith(
        "running (model already loaded) · repeat 1 of 3: 256 tokens as 4 × 64 on 2 stage(s) · fixed 64")
    st.saved(SaveResult(7, "finished"))
    st.saved(SaveResult(None, "finished", "disk full"))
    st.started(_started())
    st.events([StageEvent("r1", 1, "cpu", k, "compute", k * 10, k * 10 + 5, 64) for k in range(2)])
    st.saved(SaveResult(9, "cancelled"))
    st.ended("cancelled")
    label, text = st.cancelled_texts("stopped")
    assert label == "stopped after 2 of 4 chunks"
    assert text == ("Stopped after 2 of 4 chunks: stopped. The timeline keeps what ran. 1 finished repeat(s) "
                    "saved to the History tab (#7); the stopped run's partial report saved as #9; not saved: "
                    "disk full.")
    assert st.last_outcome == "cancelled" and st.last_saved == SaveResult(9, "cancelled")
    st.begin(1)  # the next press of Run starts clean
    assert (st.saved_this_run, st.repeats, st.last_saved, st.progress_model, st.last_outcome) == ([], [], None, None, "")


def test_how_the_figures_were_measured():
    from types import SimpleNamespace as NS

    assert measure_text([]) == ""
    assert measure_text([NS(warmed_up=True, cold=False)]) == \
        "one run, after a warm-up pass of the same shapes (not measured, not drawn)"
    assert measure_text([NS(warmed_up=False, cold=True)] * 3).startswith(
        "3 repeats of the same prompt; the Gantt shows the last, COLD")
    assert measure_text([NS(warmed_up=False, cold=False)]) == "one run, warm (this shape ran before in this session)"
