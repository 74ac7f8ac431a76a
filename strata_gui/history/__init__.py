"""The run history (SQLite), its record checks, and the comparison of two runs (no widgets)."""
