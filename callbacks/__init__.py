"""taskfit callbacks. Heavy dependencies (tensorboard, tqdm) load only when their callback is
used."""
from __future__ import annotations

import importlib
from typing import Any

from ..callback import Callback, callback_states, load_callback_states
from ..errors import MisconfigurationError
from ..logs.outputs import run_directory
from ..loop.hooks import (
    HOOKS,
    drop_idle_batch_hooks,
    hook_table,
    is_task_hook,
    merge_task_callbacks,
    warn_uncalled,
)
from .loggers.logger import Logger

LAZY = {  # class name: its module, relative to this package (imported on first use)
    "ProgressBar": ".progress",
    "ModelSummary": ".summary",
    "ModelCheckpoint": ".checkpoint.model_checkpoint",
    "TensorBoardLogger": ".loggers.tensorboard",
    "EarlyStopping": ".early_stopping",
    "EarlyStoppingReason": ".early_stopping",
    "LearningRateMonitor": ".lr_monitor",
    "ThroughputMonitor": ".throughput",
    "PredictionWriter": ".prediction_writer",
    "BasePredictionWriter": ".prediction_writer",
    "CSVLogger": ".loggers.csv_logger",
    "ExperimentWriter": ".loggers.csv_logger",
    "MLFlowLogger": ".loggers.mlflow_logger",
    "WandbLogger": ".loggers.wandb_logger",
    "WeightAveraging": ".weight_averaging",
    "EMAWeightAveraging": ".weight_averaging",
    "StochasticWeightAveraging": ".weight_averaging",
    "BaseFinetuning": ".finetuning",
    "BackboneFinetuning": ".finetuning",
    "LearningRateFinder": ".lr_finder",
}

__all__ = ["Callback", "HOOKS", "Logger", "callback_states", "drop_idle_batch_hooks", "hook_table",
           "is_task_hook", "load_callback_states", "merge_task_callbacks",
           "refuse_checkpoint_callbacks", "run_directory", "warn_uncalled", "with_defaults", *LAZY]


def __getattr__(name: str) -> Any:
    if name in LAZY:
        return getattr(importlib.import_module(LAZY[name], __name__), name)
    raise AttributeError(f"module 'taskfit.callbacks' has no attribute {name!r}")


# the built-in one: taskfit's own names
DEFAULT_ARGUMENTS = {"LearningRateMonitor": {"names": "vitals"}}


def with_defaults(callbacks: Any, *, progress: bool, summary: bool, checkpointing: bool,
                  logger: bool | Logger | list[Logger] | None) -> list[Callback]:
    """The user's callbacks, the ``logger`` argument's loggers and the default callbacks the
    Trainer's switches ask for (unless the user passed one of that class), sorted by ``order``.

    ``logger``: True (or None) adds a TensorBoardLogger unless a Logger is among the callbacks; a
    Logger or a list of them is added instead; False (or ``[]``) adds none. Any logger brings a
    LearningRateMonitor (taskfit's vitals names) and a ThroughputMonitor (their values go to every
    logger).
    """
    if isinstance(callbacks, Callback):  # one callback, as Lightning accepts
        callbacks = [callbacks]
    if callbacks is not None and not isinstance(callbacks, (list, tuple)):
        raise MisconfigurationError(f"Trainer(callbacks=...) got {type(callbacks).__name__}, not a "
                                    "list of callbacks.",
                                    "pass a list of taskfit.callbacks.Callback instances, e.g. "
                                    "callbacks=[EarlyStopping()].")
    callbacks = list(callbacks or [])
    for cb in callbacks:
        if not isinstance(cb, Callback):
            raise MisconfigurationError(f"Trainer(callbacks=[...]) got {type(cb).__name__}, not a "
                                        "Callback.",
                                        "subclass `taskfit.callbacks.Callback` and pass instances.")
    loggers = _loggers(logger)
    callbacks += [lg for lg in loggers if not any(lg is cb for cb in callbacks)]
    logging = bool(loggers) or logger is True or logger is None
    present = {type(cb) for cb in callbacks}
    default_tb = logging and not any(isinstance(cb, Logger) for cb in callbacks)
    for wanted, name in (
        (progress, "ProgressBar"),
        (summary, "ModelSummary"),
        (checkpointing, "ModelCheckpoint"),
        (default_tb, "TensorBoardLogger"),
        (logging, "LearningRateMonitor"),
        (logging, "ThroughputMonitor"),
    ):
        if wanted:
            cls = __getattr__(name)
            if not any(issubclass(t, cls) for t in present):
                callbacks.append(cls(**DEFAULT_ARGUMENTS.get(name, {})))
    _refuse_shared_checkpoint_keys(callbacks)
    return sorted(callbacks, key=lambda cb: cb.order)


def _refuse_shared_checkpoint_keys(callbacks: list[Callback]) -> None:
    """Two ModelCheckpoints with one ``state_key`` would keep one ranking in a checkpoint: the
    other's is lost on resume. Refused, as Lightning refuses it (its phrase kept)."""
    checkpoint, seen = __getattr__("ModelCheckpoint"), set()
    for cb in callbacks:
        if isinstance(cb, checkpoint):
            if cb.state_key in seen:
                raise MisconfigurationError(
                    f"Found more than one stateful callback of type `{type(cb).__name__}` with "
                    f"the state key {cb.state_key}: a checkpoint would keep only one of their "
                    "rankings. The `callback.state_key` must be unique among all callbacks in the "
                    "Trainer.",
                    "give each ModelCheckpoint its own monitor, mode or trigger (every_n_epochs, "
                    "every_n_train_steps, train_time_interval), or keep one of them.")
            seen.add(cb.state_key)


def refuse_checkpoint_callbacks(callbacks: Any) -> None:
    """``Trainer(enable_checkpointing=False)`` with a ModelCheckpoint among ``callbacks``: one of
    the two settings would do nothing (Lightning refuses it with the phrase kept here)."""
    given = [callbacks] if isinstance(callbacks, Callback) else callbacks
    checkpoint = __getattr__("ModelCheckpoint")
    found = isinstance(given, (list, tuple)) and any(isinstance(cb, checkpoint) for cb in given)
    if found:
        raise MisconfigurationError(
            "Trainer was configured with `enable_checkpointing=False` but found `ModelCheckpoint` "
            "in callbacks list.",
            "remove the ModelCheckpoint to save nothing, or leave enable_checkpointing at True "
            "to save with it.")


def _loggers(logger: Any) -> list[Logger]:
    """The Logger instances that ``Trainer(logger=...)`` names: none for a bool or None."""
    if logger is None or isinstance(logger, bool):
        return []
    items = list(logger) if isinstance(logger, (list, tuple)) else [logger]
    if not isinstance(logger, (list, tuple, Logger)):
        raise MisconfigurationError(
            f"Trainer(logger={logger!r}) is not valid: expected True, False, a Logger or a list of "
            "Loggers.",
            "pass logger=True (TensorBoard), False (none), a logger such as CSVLogger() or "
            "MLFlowLogger() from taskfit.callbacks, or a list of them; from the command line "
            "choose the group: taskfit logger=csv.")
    for item in items:
        if not isinstance(item, Logger):
            raise MisconfigurationError(
                f"Trainer(logger=[...]) got {_describe(item)}, not a Logger instance.",
                "list instances of taskfit.callbacks.Logger subclasses, e.g. "
                "logger=[TensorBoardLogger(), CSVLogger()]; other callbacks go in callbacks=[...].")
    return items


def _describe(value: Any) -> str:
    """``'csv'``, ``the class CSVLogger``, ``an object of type EarlyStopping``: what an error says
    it got."""
    if isinstance(value, type):
        return f"the class {value.__name__}"
    if value is None or isinstance(value, (str, int, float)):
        return repr(value)
    return f"an object of type {type(value).__name__}"
