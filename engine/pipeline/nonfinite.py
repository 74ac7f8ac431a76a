"""Non-finite outputs: one check per run, and where they first appear when it fails.

A file whose weights hold NaN or inf (all-0xFF blocks, an F32 tensor relabelled as a quantized
type) used to run to a normal table, digest and tokens.  `check_prefill` reduces the run's
output logits once (`torch.isfinite(...).all()`, a few vocabulary-sized rows: nothing per layer).
Only when that fails is the prefill run again with the per-layer check on (`check_nan`), so the
error names the first stage, chunk and layer whose output is not finite; when every layer is
finite the error blames the output head (final norm or logits).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # no import cycle at run time: run imports this module
    from engine.pipeline.run import Run

log = logging.getLogger(__name__)


def all_finite(*tensors: torch.Tensor | None) -> bool:
    """True when every value of every given tensor is finite (None is skipped).

    Host tensors are checked with numpy: torch's CPU `isfinite` is five parallel ops, and with
    the run's other threads (stages, timing, digest) alive they took ~8 ms each on the device
    machine — a fixed ~40 ms in every prefill's wall (profiled on H200, 8K to 64K)."""
    return all(_finite(t) for t in tensors if t is not None)


def _finite(t: torch.Tensor) -> bool:
    if t.device.type != "cpu":
        return bool(torch.isfinite(t).all())
    if t.dtype not in (torch.float16, torch.float32, torch.float64):
        t = t.to(torch.float32)  # bf16 has no numpy type
    return bool(np.isfinite(t.detach().numpy()).all())


def check_prefill(run: Run) -> None:
    """Raise StageError naming where non-finite values first appear, if the run's logits hold any."""
    from engine.errors import NonFiniteError, StageError

    if all_finite(run.last_logits, run.logits):
        return
    log.info("run %s: non-finite logits; running the prefill again with the per-layer check to find "
                "where they start", run.run_id)
    session = run.session
    last = session.stages[-1]
    bounds = run.plan.chunk_bounds()
    if not session.config.check_nan:  # with the check on, the first pass would have raised already
        for st in session.stages:  # the same prompt again, from position 0
            for kv in st.kvs:
                kv.reset()
        logits_all, run.logits_all = run.logits_all, False
        try:
            run.prefill(check_nan=True)
        except StageError as exc:
            if isinstance(exc.__cause__, NonFiniteError):
                located = StageError(exc.stage, exc.device, exc.chunk, exc.layer, NonFiniteError(
                    f"the logits are not finite; the first non-finite value is in the output of layer "
                    f"{exc.layer} (the model's weights there hold NaN or inf?)"))
                located.__suppress_context__ = True  # the cause is the NonFiniteError, not the re-run's error
                raise located  # noqa: B904  (its __cause__ is the located NonFiniteError)
            raise
        finally:
            run.logits_all = logits_all
            if run.hasher is not None:
                run.hasher.close()
    raise StageError(last.index, last.name, len(bounds) - 1, None, NonFiniteError(
        "the logits are not finite but every layer's output is: the final norm or output head "
        "(output.weight / token_embd.weight) holds NaN or inf?"))
