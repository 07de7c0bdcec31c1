"""EarlyStopping: stop fit when a monitored metric stops improving (or reaches a target, or diverges)."""
from __future__ import annotations

import math
from typing import Any

from ..console import echo
from ..errors import MisconfigurationError

from .base import Callback


class EarlyStopping(Callback):
    """Sets ``trainer.state.should_stop`` when ``monitor`` has not improved for ``patience`` checks.

    A check happens after every validation in fit for ``val/*`` keys (not after the sanity check) and at every epoch
    end for ``train/*`` keys. The run then ends cleanly at the next step boundary; the reason is printed (rank 0)
    and kept in ``trainer.state.stop_reason``. ``best`` and the patience counter are saved in checkpoints.

    Args:
        monitor: the logged key to watch, e.g. ``"val/loss"`` or ``"val/acc"``.
        mode: ``"min"`` (lower is better) or ``"max"``.
        patience: how many checks without improvement are tolerated.
        min_delta: the least change that counts as an improvement.
        check_finite: stop as soon as the value is NaN or infinite.
        stopping_threshold: stop as soon as the value is at least this good (the goal is reached).
        divergence_threshold: stop as soon as the value is worse than this (the run has diverged).
        verbose: print why training stopped.
    """

    def __init__(self, monitor: str = "val/loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0,
                 check_finite: bool = True, stopping_threshold: float | None = None,
                 divergence_threshold: float | None = None, verbose: bool = True) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise MisconfigurationError(f"EarlyStopping(monitor={monitor!r}) is not valid.",
                                        'pass the logged key to watch, e.g. monitor="val/loss".')
        if mode not in ("min", "max"):
            raise MisconfigurationError(f"EarlyStopping(mode={mode!r}) is not valid.",
                                        'use mode="min" (lower is better, e.g. a loss) or mode="max" (e.g. accuracy).')
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise MisconfigurationError(f"EarlyStopping(patience={patience!r}) is not valid.",
                                        "pass the number of checks without improvement to tolerate (an int >= 0).")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or min_delta < 0:
            raise MisconfigurationError(f"EarlyStopping(min_delta={min_delta!r}) is not valid.",
                                        "pass a number >= 0: the least change that counts as an improvement.")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, float(min_delta)
        self.check_finite, self.verbose = check_finite, verbose
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self.best = math.inf if mode == "min" else -math.inf
        self.wait = 0  # checks since the last improvement
        self.stopped_epoch: int | None = None

    @property
    def state_key(self) -> str:
        return f"EarlyStopping{{monitor={self.monitor}, mode={self.mode}}}"

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait, "stopped_epoch": self.stopped_epoch,
                "monitor": self.monitor, "mode": self.mode}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.wait, self.stopped_epoch = float(state["best"]), int(state["wait"]), state["stopped_epoch"]

    # ---- hooks --------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, task: Any) -> None:
        self.stopped_epoch = None
        if trainer.state.global_step == 0:  # a new run starts afresh; a resumed one (restored before) continues
            self.best, self.wait = (math.inf if self.mode == "min" else -math.inf), 0
        if self.monitor.startswith("val/") and not trainer.num_val_batches:
            raise MisconfigurationError(
                f"EarlyStopping monitors {self.monitor!r}, but {type(task).__name__} has no validation data, "
                "so it would never be checked.",
                "define val_dataloader() (with limit_val_batches > 0), or monitor a training key such as "
                "'train/loss_epoch'.")

    def on_validation_end(self, trainer: Any, task: Any) -> None:
        if trainer.state.fn == "fit" and not self.monitor.startswith("train/"):  # not a Trainer.validate call
            self._check(trainer)

    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        if self.monitor.startswith("train/"):
            self._check(trainer)

    # ---- the decision -------------------------------------------------------------------------------
    def _check(self, trainer: Any) -> None:
        metrics = trainer.state.metrics
        if self.monitor not in metrics:
            raise MisconfigurationError(
                f"EarlyStopping monitors {self.monitor!r}, which was not logged. Logged keys: "
                f"{', '.join(sorted(metrics)) or 'none'}.",
                "set EarlyStopping(monitor=...) to one of the logged keys, or log it with self.log(name, value).")
        value = metrics[self.monitor]
        reason = self._reason(value)
        if reason is None or trainer.state.should_stop:
            return
        epoch = trainer.state.epoch
        self.stopped_epoch = epoch
        trainer.state.should_stop = True
        trainer.state.stop_reason = f"EarlyStopping: {reason}"
        if self.verbose and trainer.is_main:
            echo(f"EarlyStopping: stopping at epoch {epoch} (global step {trainer.state.global_step}): {reason}",
                 name="taskfit.early_stopping")

    def _reason(self, value: float) -> str | None:
        """Update best/wait with ``value``; return why training should stop, or None."""
        key, lower = self.monitor, self.mode == "min"
        if self.check_finite and not math.isfinite(value):
            return f"{key} = {value} is not finite (best was {self.best:.6g})."
        if self.stopping_threshold is not None and (
                value <= self.stopping_threshold if lower else value >= self.stopping_threshold):
            return f"{key} = {value:.6g} reached the stopping threshold {self.stopping_threshold}."
        if self.divergence_threshold is not None and (
                value > self.divergence_threshold if lower else value < self.divergence_threshold):
            return f"{key} = {value:.6g} is worse than the divergence threshold {self.divergence_threshold}."
        improved = value < self.best - self.min_delta if lower else value > self.best + self.min_delta
        if improved:
            self.best, self.wait = value, 0
            return None
        self.wait += 1
        if self.wait >= self.patience:
            by = f" by more than {self.min_delta:g}" if self.min_delta else ""
            return (f"{key} did not improve{by} for {self.wait} checks in a row "
                    f"(best {self.best:.6g}, last {value:.6g}).")
        return None
