"""The app's run path without Qt, on real devices: what a click on Run does, checked.

Drives `strata_gui.run.run_job.RunJob` (the body of the app's run worker thread) with the app's
own SessionCache and RunHistory, the built-in demo model and a recording outlet in place of
the Qt signals.  Checks, per device list:

  1. a run finishes with one compute block per (stage, chunk), is saved to the history, and
     the outlet saw started -> events -> saved -> measured -> finished -> done in that order;
  2. a second run with nothing changed reuses the session and gives the same digest;
  3. an internal error injected into a layer fails the run with one line naming the log file
     (traceback only in the details), and the next run succeeds on a fresh session.

Prints one line per check and `APP RUN CHECK PASSED` or `APP RUN CHECK FAILED: ...`; exit 0/1.
    python3 benchmarks/app_run_check.py --devices cuda:0 [--devices cuda:0,cuda:1]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from engine.io import synth  # noqa: E402
from engine.pipeline.session import PipelineHooks  # noqa: E402
from strata_gui.history.history_model import RunHistory  # noqa: E402
from strata_gui.run.run_job import RunJob, RunRequest  # noqa: E402
from strata_gui.run.session_cache import SessionCache  # noqa: E402


class Recorder:
    """A RunOutlet that keeps every call, as the Qt worker would emit it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.got: list = []

    def __getattr__(self, name: str):
        def record(*args) -> None:
            self.calls.append((name, args))
            if name == "events":
                self.got.extend(args[0])
        return record

    def kinds(self) -> list[str]:
        out: list[str] = []
        for name, _ in self.calls:
            if name in ("events", "telemetry", "status", "warmup"):
                continue
            out.append(name)
        return out

    def arg(self, name: str):
        return next(args for n, args in self.calls if n == name)


def one_run(req: RunRequest, sessions: SessionCache, history: RunHistory,
            hooks: PipelineHooks | None = None) -> Recorder:
    out = Recorder()
    RunJob(req, sessions, threading.Event(), out, hooks=hooks, recorder=history.add).execute()
    return out


def check(devices: str, tmp: Path) -> list[str]:
    """Failures (empty: all good) for one device list; prints a line per check."""
    fails: list[str] = []
    model = synth.demo_model_path(tmp / "models")
    history = RunHistory(tmp / f"history-{devices.replace(':', '').replace(',', '-')}.sqlite")
    sessions = SessionCache()
    config = EngineConfig.from_sources({"devices": devices, "prefill": "128"})
    req = RunRequest(model, config, prompt_tokens=1024, decode_tokens=4)
    n_stages = len(config.devices)

    def expect(ok: bool, what: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} [{devices}] {what}")
        if not ok:
            fails.append(f"[{devices}] {what}")

    try:
        first = one_run(req, sessions, history)
        expect(first.kinds() == ["run_started", "saved", "measured", "finished", "done"],
               f"outcome order {first.kinds()}")
        if "finished" in first.kinds():
            report = first.arg("finished")[0]
            computes = sorted((e.stage, e.chunk) for e in first.got if e.kind == "compute")
            want = sorted((s, c) for s in range(n_stages) for c in range(report.plan.n_chunks))
            expect(computes == want, f"{len(computes)} compute blocks for {n_stages} stage(s) x "
                                     f"{report.plan.n_chunks} chunks, one each")
            expect(report.prefill_tok_s > 0 and len(report.generated) == 4,
                   f"prefill {report.prefill_tok_s:,.0f} tok/s, decode {report.decode_tok_s:,.1f} tok/s, "
                   f"generated {report.generated}")
            saved = first.arg("saved")[0]
            expect(saved.run is not None and not saved.error, f"saved to the history as run {saved.run}")
            second = one_run(replace(req), sessions, history)
            rep2 = second.arg("finished")[0] if "finished" in second.kinds() else None
            expect(rep2 is not None and sessions.builds == 1 and rep2.digest == report.digest,
                   f"second run reused the session, digest {rep2.digest if rep2 else '-'} == {report.digest}")

        def fault(stage: int, layer: int, chunk: int) -> None:
            if stage == n_stages - 1 and chunk == 2:
                raise RuntimeError("injected fault")

        broken = one_run(req, sessions, history, hooks=PipelineHooks(after_layer=fault))
        failed = [args for name, args in broken.calls if name == "failed"]
        ok = bool(failed) and broken.kinds()[-2:] == ["failed", "done"]
        line = failed[0][1] if failed else ""
        expect(ok and "internal error" in line and "full traceback in" in line and "\n" not in line
               and "Traceback" in failed[0][2], f"injected fault -> one line: {line[:160]}")
        after = one_run(req, sessions, history)
        expect("finished" in after.kinds() and sessions.builds >= 2, "the next run succeeds on a fresh session")
        expect(history.count() == 3, f"the history holds the 3 finished runs ({history.count()})")
    finally:
        sessions.close()
        history.close()
    return fails


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", action="append", required=True, help="a device list, e.g. cuda:0,cuda:1")
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="strata-app-check-") as tmp:
        os.environ.setdefault("STRATA_LOG_DIR", str(Path(tmp) / "logs"))
        fails: list[str] = []
        for devices in ns.devices:
            fails += check(devices, Path(tmp))
    if fails:
        print(f"APP RUN CHECK FAILED: {'; '.join(fails)}")
        return 1
    print("APP RUN CHECK PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
