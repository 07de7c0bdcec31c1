"""Logger: the interface of every logger (TensorBoard, CSV, MLflow, your own), a callback with five small methods.

The Trainer publishes values as Python floats through ``on_log`` (docs/logging.md lists them). A logger turns
the callback hooks into calls a writer understands, so a new logger only writes these methods:

=====================  =====================================================================================
``setup(trainer)``     open what the writes need (a file, a run); raise MisconfigurationError when it cannot
``log_hyperparams(p)`` the run's hyperparameters, once at fit start (``trainer.hparams``, flattened)
``log_metrics(m, s)``  values of global step ``s``; called several times per step (loss, lr, throughput...)
``save()``             flush what is buffered (every epoch end)
``finalize(status)``   the run ended: ``"success"``, ``"failed"`` or ``"interrupted"``; write the rest, close
=====================  =====================================================================================

Only rank 0 writes: on other ranks none of them is called. A logger that cannot write (a bad URI, a directory
that is not writable) fails in ``on_fit_start``, on every rank, before the first training step.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

from ..errors import MisconfigurationError, TaskfitError
from ..serialization import write_probe
from .base import Callback

STATUSES = ("success", "failed", "interrupted")


class Logger(Callback):
    """Base class of loggers: subclasses implement :meth:`log_metrics` and, as needed, :meth:`setup`,
    :meth:`log_hyperparams`, :meth:`save`, :meth:`finalize` and :attr:`experiment`; the hooks do the rest.

    A run is ``trainer.log_dir``: one per ``fit``; a ``validate``/``test`` after it writes into the same run
    (``setup`` is called again first), one on its own starts a run of its own.
    """

    order = 900  # after the callbacks that log (lower orders); before ModelCheckpoint (1000)
    _run_dir: str | None = None  # the trainer.log_dir this logger writes for (rank 0)
    _active = False  # set up and not finalized

    # ---- what a logger writes: override these -------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        """Open what :meth:`log_metrics` needs (rank 0, when a run starts writing, and again when a finalized run
        writes more). Raise :class:`~taskfit.MisconfigurationError` if it cannot write: at fit start every rank
        stops before training."""

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """The run's hyperparameters, flattened (``{"task.optimizer.lr": 0.01, ...}``), once at fit start."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Values published at global step ``step``. One step arrives in several calls (the loss, the learning
        rate and the throughput separately): merge or buffer them as the format needs."""
        raise NotImplementedError(f"{type(self).__name__} must implement log_metrics(metrics, step)")

    def save(self) -> None:
        """Write out what is buffered (called at every epoch end)."""

    def finalize(self, status: str) -> None:
        """The run ended with ``status`` (``"success"``, ``"failed"``, ``"interrupted"``): write the rest, close."""

    @property
    def experiment(self) -> Any:
        """The underlying writer (SummaryWriter, MlflowClient...), for what the interface does not cover."""
        return None

    @property
    def log_dir(self) -> str | None:
        """The directory this logger writes into (the run's ``trainer.log_dir``; None before a run and on ranks
        other than 0)."""
        return self._run_dir

    @property
    def save_dir(self) -> str | None:
        """The folder that holds the runs (``log_dir``'s parent)."""
        return os.path.dirname(self._run_dir) if self._run_dir else None

    # ---- the hooks that call them ----------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, task: Any) -> None:
        problem: BaseException | None = None
        if trainer.is_main:
            try:
                self._start(trainer)
                self.log_hyperparams(dict(trainer.hparams))
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                problem = exc
        shared = trainer.strategy.broadcast(_portable(problem))  # under ddp the other ranks stop too
        if problem is not None:
            raise problem
        if shared is not None:
            raise shared

    def on_log(self, trainer: Any, task: Any, metrics: dict[str, float]) -> None:
        if not trainer.is_main or trainer.log_dir is None:
            return
        if not self._active or self._run_dir != trainer.log_dir:  # a validate/test on its own, or after fit
            self._start(trainer)
        self.log_metrics(metrics, trainer.state.global_step)

    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        if self._active:
            self.save()

    def on_validation_end(self, trainer: Any, task: Any) -> None:
        if trainer.state.fn == "validate":  # a Trainer.validate on its own: its values are all there
            self._finish("success")

    def on_test_end(self, trainer: Any, task: Any) -> None:
        self._finish("success")

    def on_fit_end(self, trainer: Any, task: Any) -> None:
        self._finish("success")

    def on_exception(self, trainer: Any, task: Any, exception: BaseException) -> None:
        # an error fails the run; Ctrl-C or a preemption exit (resumable later) interrupts it
        try:
            self._finish("failed" if isinstance(exception, Exception) else "interrupted")
        except Exception as exc:  # noqa: BLE001 - the error on its way matters more; other callbacks still run
            warnings.warn(f"{type(self).__name__} could not close its run after {type(exception).__name__}: "
                          f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)

    def _start(self, trainer: Any) -> None:
        if self._active and self._run_dir != trainer.log_dir:
            self._finish("success")
        self._run_dir = trainer.log_dir
        self.setup(trainer)
        self._active = True

    def _finish(self, status: str) -> None:
        if self._active:
            self._active = False
            self.finalize(status)


def _portable(problem: BaseException | None) -> BaseException | None:
    """What the other ranks raise for rank 0's ``problem``: taskfit's errors as they are, others as text."""
    if problem is None or isinstance(problem, TaskfitError):
        return problem
    return RuntimeError(f"rank 0's logger failed at fit start: {type(problem).__name__}: {problem}")


def check_writable(folder: str, who: str) -> None:
    """Create ``folder`` and write, fsync and remove a probe file in it; a MisconfigurationError says why not."""
    try:
        write_probe(folder)
    except OSError as exc:
        raise MisconfigurationError(
            f"{who} cannot write to {folder}: {exc.strerror or exc} ({type(exc).__name__}).",
            "make the folder writable (permissions, a read-only or full file system), or pass "
            "Trainer(default_root_dir=...) elsewhere.") from exc
