"""Sweeps from the app: the model (no Qt), its worker and controller."""
