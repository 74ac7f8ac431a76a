"""Settings that survive a restart, in QSettings (the caller chooses where: tests use a temp file)."""
from __future__ import annotations

import logging

from PySide6.QtCore import QByteArray, QSettings

from .settings_model import MAX_PROMPT_TEXT_CHARS, RunSettings

log = logging.getLogger(__name__)

GROUP = "run"


class SettingsStore:
    def __init__(self, qsettings: QSettings) -> None:
        self.qs = qsettings

    @property
    def has_run_settings(self) -> bool:
        self.qs.beginGroup(GROUP)
        try:
            return bool(self.qs.childKeys())
        finally:
            self.qs.endGroup()

    def load_run_settings(self, default: RunSettings) -> tuple[RunSettings, list[str]]:
        """The saved form, every value checked on the way in (`RunSettings.from_dict_checked`):
        one out of its field's range or of the wrong type takes `default`'s value, and is named
        in the notes returned (the window shows them) — a saved value never stops the app."""
        self.qs.beginGroup(GROUP)
        try:
            data = {k: self.qs.value(k) for k in self.qs.childKeys()}
        finally:
            self.qs.endGroup()
        stored = {k: v for k, v in data.items() if v is not None}
        settings, notes = RunSettings.from_dict_checked(stored, max_text=MAX_PROMPT_TEXT_CHARS, base=default)
        for note in notes:
            log.warning("saved setting replaced by its default: %s", note)
        return settings, notes

    def save_run_settings(self, s: RunSettings) -> None:
        self.qs.beginGroup(GROUP)
        try:
            for k, v in s.to_dict().items():
                self.qs.setValue(k, v)
        finally:
            self.qs.endGroup()
        self.qs.sync()

    def load_bytes(self, key: str) -> QByteArray | None:
        v = self.qs.value(f"window/{key}")
        return v if isinstance(v, QByteArray) else None

    def save_bytes(self, key: str, data: QByteArray) -> None:
        self.qs.setValue(f"window/{key}", data)
