"""Profilers, callbacks that time a fit's stages: ``SimpleProfiler`` (``simple.py``),
``PyTorchProfiler`` (``pytorch.py``, loaded on first use) and the choice ``Trainer(profiler=...)``
makes (``choice.py``)."""
from __future__ import annotations

import importlib
from typing import Any

from .choice import PassThroughProfiler, profiler_for
from .simple import SimpleProfiler

__all__ = ["SimpleProfiler", "PyTorchProfiler", "PassThroughProfiler", "profiler_for"]


def __getattr__(name: str) -> Any:
    if name == "PyTorchProfiler":
        return importlib.import_module(".pytorch", __name__).PyTorchProfiler
    raise AttributeError(f"module 'taskfit.profilers' has no attribute {name!r}")
