"""Predictions of a saved run on other hardware or settings (no Qt)."""
