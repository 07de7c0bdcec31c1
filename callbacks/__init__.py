"""taskfit callbacks. Heavy dependencies (tensorboard, tqdm) load only when their callback is used."""
from __future__ import annotations

import importlib
from typing import Any

from .base import HOOKS, Callback

LAZY = {  # class name: its module, relative to this package (imported on first use)
    "ProgressBar": ".progress",
    "ModelSummary": ".summary",
    "ModelCheckpoint": ".checkpoint",
    "TensorBoardLogger": ".tensorboard",
    "EarlyStopping": ".early_stopping",
    "LearningRateMonitor": ".lr_monitor",
    "ThroughputMonitor": ".throughput",
}

__all__ = ["Callback", "HOOKS", *LAZY]


def __getattr__(name: str) -> Any:
    if name in LAZY:
        return getattr(importlib.import_module(LAZY[name], __name__), name)
    raise AttributeError(f"module 'taskfit.callbacks' has no attribute {name!r}")
