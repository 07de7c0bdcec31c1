"""taskfit callbacks. Heavy dependencies (tensorboard, tqdm) load only when their callback is used."""
from __future__ import annotations

import importlib
from typing import Any

from ..errors import MisconfigurationError
from .base import HOOKS, Callback, callback_states, drop_idle_batch_hooks, hook_table, load_callback_states

LAZY = {  # class name: its module, relative to this package (imported on first use)
    "ProgressBar": ".progress",
    "ModelSummary": ".summary",
    "ModelCheckpoint": ".checkpoint",
    "TensorBoardLogger": ".tensorboard",
    "EarlyStopping": ".early_stopping",
    "LearningRateMonitor": ".lr_monitor",
    "ThroughputMonitor": ".throughput",
}

__all__ = ["Callback", "HOOKS", "callback_states", "drop_idle_batch_hooks", "hook_table", "load_callback_states",
           "with_defaults", *LAZY]


def __getattr__(name: str) -> Any:
    if name in LAZY:
        return getattr(importlib.import_module(LAZY[name], __name__), name)
    raise AttributeError(f"module 'taskfit.callbacks' has no attribute {name!r}")


def with_defaults(callbacks: Any, *, progress: bool, summary: bool, checkpointing: bool,
                  logger: bool) -> list[Callback]:
    """The user's callbacks plus the default ones the Trainer's switches ask for (unless the user passed one of
    that class), sorted by ``order``."""
    if isinstance(callbacks, Callback):  # one callback, as Lightning accepts
        callbacks = [callbacks]
    if callbacks is not None and not isinstance(callbacks, (list, tuple)):
        raise MisconfigurationError(f"Trainer(callbacks=...) got {type(callbacks).__name__}, not a list of callbacks.",
                                    "pass a list of taskfit.callbacks.Callback instances, e.g. "
                                    "callbacks=[EarlyStopping()].")
    callbacks = list(callbacks or [])
    for cb in callbacks:
        if not isinstance(cb, Callback):
            raise MisconfigurationError(f"Trainer(callbacks=[...]) got {type(cb).__name__}, not a Callback.",
                                        "subclass `taskfit.callbacks.Callback` and pass instances.")
    present = {type(cb) for cb in callbacks}
    for wanted, name in ((progress, "ProgressBar"), (summary, "ModelSummary"), (checkpointing, "ModelCheckpoint"),
                         (logger, "TensorBoardLogger"), (logger, "LearningRateMonitor"),
                         (logger, "ThroughputMonitor")):
        if wanted:
            cls = __getattr__(name)
            if not any(issubclass(t, cls) for t in present):
                callbacks.append(cls())
    return sorted(callbacks, key=lambda cb: cb.order)
