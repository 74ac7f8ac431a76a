"""What one press of Run has done so far, and how the window says it (no Qt).

The run controller feeds it the run's signals in order (begin, warm-up, started, events,
measured, saved, and one of finished / cancelled / failed); the window reads its figures and
texts to draw the progress bar, the summary and the status line.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.config import EngineConfig
from engine.events import RunReport

from .progress_model import RunProgress
from .run_messages import RepeatDone, RunRequest, RunStarted, SaveResult
from .settings_model import RunSettings
from .spread_model import Spread


def run_request(s: RunSettings, config: EngineConfig, model_path: Path, model_label: str) -> RunRequest:
    """The Run tab's form as the request its run is made of."""
    return RunRequest(
        model_path=model_path, config=config,
        prompt_tokens=s.prompt_tokens, prompt_text=s.prompt_text if s.prompt_mode == "text" else None,
        decode_tokens=s.decode_tokens, model_label=model_label, warmup=s.warmup, repeats=s.repeats)


def measure_text(repeats: list[RepeatDone]) -> str:
    """How the shown figures were measured, in words (the summary's 'Measured' row)."""
    if not repeats:
        return ""
    n = len(repeats)
    what = f"{n} repeats of the same prompt; the Gantt shows the last" if n > 1 else "one run"
    if repeats[0].warmed_up:
        how = "after a warm-up pass of the same shapes (not measured, not drawn)"
    elif repeats[0].cold:
        how = ("COLD: no warm-up and the first run of this shape, so it includes one-off set-up "
               "(turn on the warm-up, or run again)")
    else:
        how = "warm (this shape ran before in this session)"
    return f"{what}, {how}"


@dataclass
class RunState:
    total_repeats: int = 1  # asked for by this press of Run
    progress_model: RunProgress | None = None
    last_report: RunReport | None = None
    last_outcome: str = ""  # "finished" | "cancelled" | "failed"
    last_saved: SaveResult | None = None  # how the last run went into the history
    saved_this_run: list[SaveResult] = field(default_factory=list)  # every save of this press of Run
    in_warmup: bool = False  # the warm-up pass is running (nothing measured yet)
    repeats: list[RepeatDone] = field(default_factory=list)  # the measured repeats of this press of Run

    # ------------------------------------------------------------- the run's signals
    def begin(self, total_repeats: int) -> None:
        self.total_repeats = max(int(total_repeats), 1)
        self.repeats, self.saved_this_run = [], []
        self.last_report, self.last_outcome, self.last_saved = None, "", None
        self.progress_model, self.in_warmup = None, False

    def warmup(self, done: int, total: int) -> None:
        self.in_warmup = done < total

    def started(self, info: RunStarted) -> None:
        self.in_warmup = False
        self.progress_model = RunProgress(info.plan)

    def events(self, batch: list) -> None:
        if self.progress_model is not None:
            self.progress_model.add(batch)

    def measured(self, done: RepeatDone) -> None:
        self.repeats.append(done)

    def saved(self, result: SaveResult) -> None:
        self.last_saved = result
        self.saved_this_run.append(result)

    def finished(self, report: RunReport) -> None:
        self.last_report = report
        self.last_outcome = "finished"

    def ended(self, outcome: str) -> None:
        """cancelled | failed"""
        self.last_outcome = outcome

    # ------------------------------------------------------------------- its texts
    def started_status(self, info: RunStarted) -> str:
        plan = info.plan
        reused = " (model already loaded)" if info.session_reused else ""
        if self.total_repeats > 1:
            reused += f" · repeat {len(self.repeats) + 1} of {self.total_repeats}"
        return (f"running{reused}: {plan.prompt_tokens:,} tokens as {plan.n_chunks} "
                f"{'balanced chunks of up to' if plan.schedule == 'balanced' else '×'} {plan.chunk} on "
                f"{len(plan.stages)} stage(s) · {plan.chunk_reason}")

    def finished_texts(self, report: RunReport) -> tuple[str, str]:
        """(the progress label, the status line) of a finished run."""
        if len(self.repeats) > 1:
            pre = Spread.of(d.report.prefill_tok_s for d in self.repeats)
            label = f"done · prefill median {pre.median:,.0f} tok/s ± sd {pre.sd:,.0f} over {pre.n} repeats"
        else:
            decode = f" · decode {report.decode_tok_s:,.1f} tok/s" if report.decode_tok_s else ""
            label = f"done · prefill {report.prefill_tok_s:,.0f} tok/s{decode}"
        saved = self.last_saved
        where = f" · saved to the history as #{saved.run}" if saved is not None and saved.run is not None else ""
        total_s = report.prefill_s + report.decode_s
        return label, f"finished run {report.run_id} in {total_s:.2f} s · digest {report.digest[:12]}{where}"

    def cancelled_texts(self, message: str) -> tuple[str, str]:
        """(the progress label, the summary's message) of a stopped run; leaves the warm-up."""
        snap = self.progress_model.snapshot() if self.progress_model else None
        if snap is None:  # before any measured pass: loading or the warm-up
            where = " during the warm-up pass" if self.in_warmup else " before the run started"
            label, text = f"stopped{where}", f"Stopped{where}: {message}. {self.kept_text()}"
        else:
            done = f" after {snap.chunks_done} of {snap.n_chunks} chunks"
            label = f"stopped{done}"
            text = f"Stopped{done}: {message}. The timeline keeps what ran. {self.kept_text()}"
        self.in_warmup = False
        return label, text

    def kept_text(self) -> str:
        """What this press of Run left in the history, said as it is (the saves came before the stop)."""
        saved = [r for r in self.saved_this_run if r.run is not None]
        errors = [r for r in self.saved_this_run if r.error]
        parts = []
        done = [r for r in saved if r.status == "finished"]
        partial = [r for r in saved if r.status == "cancelled"]
        if done:
            parts.append(f"{len(done)} finished repeat(s) saved to the History tab "
                         f"(#{', #'.join(str(r.run) for r in done)})")
        if partial:
            parts.append(f"the stopped run's partial report saved as #{partial[0].run}")
        if errors:
            parts.append(f"not saved: {errors[-1].error}")
        if not parts:
            return "Nothing was measured, so nothing was saved to the History tab."
        text = "; ".join(parts)
        return text[0].upper() + text[1:] + "."
