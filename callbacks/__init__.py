"""taskfit callbacks. Heavy dependencies (tensorboard, tqdm) load only when their callback is used."""
from __future__ import annotations

import importlib
from typing import Any

from .base import HOOKS, Callback

_LAZY = {
    "ProgressBar": "callbacks.progress",
    "ModelSummary": "callbacks.summary",
    "ModelCheckpoint": "callbacks.checkpoint",
    "TensorBoardLogger": "callbacks.tensorboard",
    "EarlyStopping": "callbacks.early_stopping",
    "LearningRateMonitor": "callbacks.lr_monitor",
    "ThroughputMonitor": "callbacks.throughput",
}

__all__ = ["Callback", "HOOKS", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'callbacks' has no attribute {name!r}")
