"""Sweeps from the app: the model and the job (no Qt), its history records, controller and presenter."""
