"""What a run raises: a cancel (with the report of what ran), a stage's error, a non-finite
value, an out-of-memory that names its device.  Re-exported by engine.pipeline.session."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.events import RunReport, StageEvent


class Cancelled(Exception):
    """The run was stopped at a chunk boundary; the split was drained.

    What ran before the stop, for a GUI to show and a history to keep: `report` and `events`
    (a run cancelled in prefill or decode carries them; a cancelled load, or a cancel inside a
    stage, carries None and no events)."""

    report: RunReport | None
    events: tuple[StageEvent, ...]

    def __init__(self, message: str = "", report: RunReport | None = None,
                 events: Sequence[StageEvent] = ()) -> None:
        super().__init__(message)
        self.report = report
        self.events = tuple(events)


class StageError(RuntimeError):
    """An exception inside a stage, with where it happened."""

    def __init__(self, stage: int, device: str, chunk: int, layer: int | None, cause: BaseException) -> None:
        self.stage, self.device, self.chunk, self.layer = stage, device, chunk, layer
        where = f"stage {stage} ({device}), chunk {chunk}" + (f", layer {layer}" if layer is not None else "")
        super().__init__(f"{where}: {type(cause).__name__}: {cause}")
        self.__cause__ = cause


class NonFiniteError(RuntimeError):
    pass


class DeviceMemoryError(RuntimeError):
    """A device ran out of memory; the message names the device, what was being allocated and
    what to change."""

    def __init__(self, device: str, what: str, nbytes: int, advice: str) -> None:
        self.device, self.what, self.nbytes, self.advice = device, what, nbytes, advice
        super().__init__(f"out of memory on {device} allocating {what} ({nbytes / 2**30:.2f} GiB): {advice}")
