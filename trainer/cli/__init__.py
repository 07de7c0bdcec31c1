"""The ``taskfit`` command (``python -m taskfit``): the Hydra app (``app.py``), its structured
configs (``schemas.py``, ``config.py``), its errors (``config_errors.py``), modes and sweeps.
docs/configuration.md."""
from __future__ import annotations

from .app import SweepSummary, build_callbacks, build_trainer, compose_config, main

__all__ = ["main", "SweepSummary", "build_callbacks", "build_trainer", "compose_config"]
