"""``Tuner(trainer)``: Lightning's tuner, its two searches run before the real run (docs/tuning.md).

``scale_batch_size`` runs the entry point ``method`` with a :class:`BatchSizeFinder` in front of the
Trainer's callbacks; the finder searches at the start and ends the entry point there, so the call
trains nothing and leaves the task's weights, the Trainer's counters and its callbacks as they
were, with the size found set on the task's (or data module's) attribute and the Trainer's loaders
built with it. ``lr_find`` is :func:`taskfit.tools.lr_find` with Lightning's signature.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

from ..callbacks import Callback
from ..callbacks.batch_size_finder import DISTRIBUTED_HINT, METHODS, BatchSizeFinder
from ..console import echo
from ..errors import MisconfigurationError
from .lr_finder import LRFinder, lr_find


class Tuner:
    """Lightning's ``Tuner(trainer)``: :meth:`scale_batch_size` and :meth:`lr_find` on
    ``trainer``."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def scale_batch_size(
        self,
        model: Any,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        method: str = "fit",
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
    ) -> int | None:
        """The largest batch size of ``model`` that runs ``method`` without running out of memory
        (BatchSizeFinder's arguments: docs/tuning.md), set on its ``batch_arg_name`` attribute
        (or its data module's); None under ``fast_dev_run``. Passed loaders are refused: their
        batch size is fixed."""
        check_method(method, train_dataloaders, val_dataloaders, dataloaders)
        trainer = self.trainer
        if trainer.world_size > 1:
            raise MisconfigurationError(
                "Tuning the batch size is currently not supported with distributed strategies.",
                DISTRIBUTED_HINT)
        if any(isinstance(cb, BatchSizeFinder) for cb in trainer.callbacks):
            raise MisconfigurationError(
                "Trainer is already configured with a `BatchSizeFinder` callback: it searches "
                "at the start of every run.",
                "remove it from Trainer(callbacks=...) to use the Tuner, or call trainer."
                f"{method}(...) and let the callback search.")
        finder = BatchSizeFinder(mode, steps_per_trial, init_val, max_trials, batch_arg_name,
                                 margin, max_val, end_run=True)
        with _first_callback(trainer, finder):
            if method == "fit":
                trainer.fit(model, train_dataloaders, val_dataloaders, datamodule)
            elif method == "predict":
                trainer.predict(model, dataloaders, datamodule=datamodule,
                                return_predictions=False)
            else:
                getattr(trainer, method)(model, dataloaders, datamodule=datamodule, verbose=False)
        return finder.optimal_batch_size

    def lr_find(
        self,
        model: Any,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        method: str = "fit",
        min_lr: float = 1e-8,
        max_lr: float = 1,
        num_training: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
        weights_only: bool | None = None,
    ) -> LRFinder | None:
        """:func:`taskfit.tools.lr_find` with Lightning's arguments (``update_attr`` defaults to
        True, as Lightning's Tuner; ``weights_only`` is accepted and unused: the finder loads no
        file)."""
        if method != "fit":
            raise MisconfigurationError(
                "method='fit' is the only valid configuration to run lr finder; got "
                f"method={method!r}.", "the range test trains: drop method=.")
        check_method(method, train_dataloaders, val_dataloaders, dataloaders)
        return lr_find(self.trainer, model, min_lr, max_lr, num_training, mode,
                       early_stop_threshold, update_attr, attr_name,
                       train_dataloaders=train_dataloaders, val_dataloaders=val_dataloaders,
                       datamodule=datamodule)


def check_method(method: Any, train_dataloaders: Any, val_dataloaders: Any,
                 dataloaders: Any) -> None:
    """``method`` is an entry point, and the loaders passed are the ones it takes."""
    if method not in METHODS:
        raise MisconfigurationError(f"method {method!r} is invalid. Should be one of {METHODS}.",
                                    'pass the Trainer method the tuner runs, e.g. method="fit".')
    if method == "fit" and dataloaders is not None:
        raise MisconfigurationError(
            "In tuner with method='fit', `dataloaders` argument should be None, please consider "
            "setting `train_dataloaders` and `val_dataloaders` instead.",
            "fit takes train_dataloaders= and val_dataloaders=.")
    if method != "fit" and (train_dataloaders is not None or val_dataloaders is not None):
        raise MisconfigurationError(
            f"In tuner with `method`={method!r}, `train_dataloaders` and `val_dataloaders` "
            "arguments should be None, please consider setting `dataloaders` instead.",
            f"{method} takes dataloaders=.")


@contextlib.contextmanager
def _first_callback(trainer: Any, callback: Callback) -> Iterator[None]:
    """``callback`` first among ``trainer.callbacks`` for the ``with`` block, then removed."""
    trainer.callbacks.insert(0, callback)
    try:
        yield
    finally:
        # (fit may have given the Trainer a new list: the task's configure_callbacks)
        if callback in trainer.callbacks:
            trainer.callbacks.remove(callback)


# ---- the taskfit command's mode=scale_batch_size -------------------------------------------------
def scale_batch_size_command(
    trainer: Any, task: Any, config: Mapping[str, Any], run_dir: str
) -> dict[str, Any]:
    """``taskfit mode=scale_batch_size``: the batch size finder on fit with the
    ``scale_batch_size.*`` settings; prints the size and the override that uses it. Returns what
    the sweep summary shows."""
    settings = dict(config.get("scale_batch_size") or {})
    started = time.perf_counter()
    size = Tuner(trainer).scale_batch_size(task, **settings)
    name = settings.get("batch_arg_name", "batch_size")
    key = f"task.{name}" if name in config["task"] else None
    if trainer.is_main:
        use = f"taskfit {key}={size}" if key else f"set your task's {name} to it"
        echo("\n".join([
            f"taskfit: scale_batch_size in {time.perf_counter() - started:.1f} s "
            f"(mode {settings.get('mode', 'power')})",
            f"  run directory:   {run_dir}",
            f"  batch size:      {size}",
            *([f"  use it:          {use}"] if size is not None else []),
        ]), name="taskfit.cli")
    return {
        "run_dir": run_dir,
        "run_mode": "scale_batch_size",
        "batch_size": size,
        "override": f"{key}={size}" if key and size is not None else None,
        "metrics": {"scale_batch_size/batch_size": size} if size is not None else {},
        "score": size,
        "monitor": "scale_batch_size/batch_size",
        "mode": "max",
        "kind": "final",
        "log_dir": None,
        "test": None,
        "best_checkpoint": None,
        "loggers": [],
    }
