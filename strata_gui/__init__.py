"""Strata GUI: the Qt front end of the embedded layer-split prefill engine (imports engine, never
the reverse).  `app.main` is the `strata-gui` entry point."""

__all__ = ["__version__"]

__version__ = "0.1.0"
