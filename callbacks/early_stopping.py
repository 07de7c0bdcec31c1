"""EarlyStopping: stop fit when a monitored metric stops improving, reaches a target or diverges
(Lightning's)."""
from __future__ import annotations

import difflib
import enum
import math
import warnings
from typing import Any

import torch

from ..arguments import arguments_checked
from ..callback import Callback
from ..console import echo
from ..errors import MisconfigurationError


class EarlyStoppingReason(enum.Enum):
    """Why EarlyStopping stopped the run (Lightning's enum, same values)."""

    NOT_STOPPED = 0
    STOPPING_THRESHOLD = 1
    DIVERGENCE_THRESHOLD = 2
    PATIENCE_EXHAUSTED = 3
    NON_FINITE_METRIC = 4


class EarlyStopping(Callback):
    """Sets ``trainer.state.should_stop`` when ``monitor`` has not improved for ``patience`` checks.

    Lightning's arguments in Lightning's order, with Lightning's meanings. A check runs at the end
    of every training epoch when validation runs once per epoch at its end
    (``val_check_interval=1.0``, ``check_val_every_n_epoch=1``), else after every validation in fit
    (never the sanity check); ``check_on_train_epoch_end`` forces one or the other. The run then
    ends at the next step boundary (``Trainer(min_epochs=...)`` may defer it); the reason is printed
    once (rank 0) and kept in ``trainer.state.stop_reason`` and :attr:`stopping_reason_message`.

    Args:
        monitor: the logged key to watch, e.g. ``"val/loss"`` or ``"val/acc"``.
        min_delta: the least change that counts as an improvement.
        patience: how many checks without improvement are tolerated.
        verbose: also print every check's result (Lightning's messages), not only the stop.
        mode: ``"min"`` (lower is better) or ``"max"``.
        strict: a monitor that is not logged at a check is an error; False: one warning, and no
            check.
        check_finite: stop as soon as the value is NaN or infinite.
        stopping_threshold: stop as soon as the value is better than this (the goal is reached).
        divergence_threshold: stop as soon as the value is worse than this (the run has diverged).
        check_on_train_epoch_end: check at each training epoch's end (True) or after each validation
            (False).
        log_rank_zero_only: under ddp, ``verbose`` prints on rank 0 only (else on every rank,
            prefixed).

    Attributes (Lightning's): ``wait_count``, ``best_score`` (a tensor), ``stopped_epoch`` (0 until
    it stops), ``stopping_reason`` (:class:`EarlyStoppingReason`), ``stopping_reason_message``. They
    are saved in checkpoints. """

    monitors_epoch_values = True  # checks what the epoch logged (hooks.hook_table)

    # a monitoring callback: after the others in each hook (as Lightning), before ModelCheckpoint
    # (1000)
    order = 990

    @arguments_checked(docs="docs/callbacks.md")
    def __init__(
        self,
        monitor: str = "val/loss",
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
        log_rank_zero_only: bool = False,
    ) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise MisconfigurationError(f"EarlyStopping(monitor={monitor!r}) is not valid.",
                                        'pass the logged key to watch, e.g. monitor="val/loss".')
        if mode not in ("min", "max"):
            raise MisconfigurationError(f"EarlyStopping(mode={mode!r}) is not valid (`mode` can be "
                                        f"min, max, got {mode}).",
                                        'use mode="min" (lower is better, e.g. a loss) or '
                                        'mode="max" (e.g. accuracy).')
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise MisconfigurationError(f"EarlyStopping(patience={patience!r}) is not valid.",
                                        "pass the number of checks without improvement to tolerate "
                                        "(an int >= 0).")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or min_delta < 0:
            raise MisconfigurationError(f"EarlyStopping(min_delta={min_delta!r}) is not valid.",
                                        "pass a number >= 0: the least change that counts as an "
                                        "improvement.")
        self.monitor, self.mode, self.patience, self.min_delta = (
            monitor,
            mode,
            patience,
            float(min_delta),
        )
        self.verbose, self.strict, self.check_finite = verbose, strict, check_finite
        self.stopping_threshold, self.divergence_threshold = (
            stopping_threshold,
            divergence_threshold,
        )
        self.check_on_train_epoch_end, self.log_rank_zero_only = (
            check_on_train_epoch_end,
            log_rank_zero_only,
        )
        self._on_epoch_end = bool(check_on_train_epoch_end)  # resolved at fit start
        self._best = math.inf if mode == "min" else -math.inf
        # checks since the last improvement; the epoch it stopped in
        self.wait_count = self.stopped_epoch = 0
        self.stopping_reason, self.stopping_reason_message = EarlyStoppingReason.NOT_STOPPED, None
        self._warned_missing = False

    @property
    def best_score(self) -> torch.Tensor:
        """The best value so far (a 0-dim tensor, as Lightning's; ``float(es.best_score)`` for a
        number)."""
        return torch.tensor(self._best)

    @property
    def state_key(self) -> str:
        # Lightning's key: the state in a Lightning checkpoint restores (and taskfit's in Lightning)
        return f"{type(self).__qualname__}{ {'monitor': self.monitor, 'mode': self.mode}!r}"

    def state_dict(self) -> dict[str, Any]:
        return {
            "best_score": self._best,
            "wait_count": self.wait_count,
            "stopped_epoch": self.stopped_epoch,
            "stopping_reason": self.stopping_reason.value,
            "stopping_reason_message": self.stopping_reason_message,
            "monitor": self.monitor,
            "mode": self.mode,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        old = "best" in state  # written by taskfit before it used Lightning's names
        self._best = float(state["best" if old else "best_score"])
        self.wait_count = int(state["wait" if old else "wait_count"])
        self.stopped_epoch = state["stopped_epoch"] or 0
        self.stopping_reason = EarlyStoppingReason(state.get("stopping_reason", 0))
        self.stopping_reason_message = state.get("stopping_reason_message")

    def on_load_checkpoint(self, trainer: Any, task: Any, checkpoint: dict[str, Any]) -> None:
        """A taskfit checkpoint written before the key was Lightning's: its state, older key."""
        states = checkpoint.get("callbacks", {})
        older = f"EarlyStopping{{monitor={self.monitor}, mode={self.mode}}}"
        if self.state_key not in states and older in states:
            self.load_state_dict(states[older])

    # ---- hooks -----------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, task: Any) -> None:
        # a new run starts afresh; a resumed one (restored before) continues
        if not trainer.state.resumed:
            self._best, self.wait_count = (math.inf if self.mode == "min" else -math.inf), 0
            self.stopped_epoch, self.stopping_reason, self.stopping_reason_message = \
                0, EarlyStoppingReason.NOT_STOPPED, None
        self._on_epoch_end = (
            self.check_on_train_epoch_end
            if self.check_on_train_epoch_end is not None
            else trainer.val_check_interval == 1.0 and trainer.check_val_every_n_epoch == 1
        )  # Lightning's rule
        self._warned_missing = False
        if self.monitor.startswith("val/") and not trainer.num_val_batches:
            what = (f"EarlyStopping monitors {self.monitor!r}, but {type(task).__name__} has no "
                    "validation data, so it would never be checked.")
            hint = ("define val_dataloader() (with limit_val_batches > 0), or monitor a training "
                    "key such as 'train/loss_epoch'.")
            if self.strict:
                raise MisconfigurationError(what, hint)
            warnings.warn(f"{what} HINT: {hint}", stacklevel=2)
            self._warned_missing = True

    def on_validation_end(self, trainer: Any, task: Any) -> None:
        if trainer.state.fn == "fit" and not self._on_epoch_end:  # not a Trainer.validate call
            self._check(trainer)

    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        if self._on_epoch_end:
            self._check(trainer)

    # ---- the decision ----------------------------------------------------------------------------
    def _check(self, trainer: Any) -> None:
        if trainer.fast_dev_run:
            return
        metrics = trainer.state.metrics
        if self.monitor not in metrics:
            what = (f"EarlyStopping monitors {self.monitor!r}, which was not logged (Lightning's "
                    f"words: Early stopping conditioned on metric `{self.monitor}` which is not "
                    f"available). Logged keys: {', '.join(sorted(metrics)) or 'none'}.")
            close = difflib.get_close_matches(self.monitor, sorted(metrics), n=1, cutoff=0.5)
            hint = (
                (f"did you mean {close[0]!r}? " if close else "")
                + "set EarlyStopping(monitor=...) to one of "
                "the logged keys, or log it with self.log(name, value)."
            )
            if self.strict:
                raise MisconfigurationError(what, hint)
            if not self._warned_missing:
                warnings.warn(
                    f"{what} EarlyStopping(strict=False) skips the check. HINT: {hint}",
                    stacklevel=2,
                )
                self._warned_missing = True
            return
        should_stop, message = self._evaluate(float(metrics[self.monitor]))
        st = trainer.state
        if should_stop:
            first = not st.should_stop  # the first stop decision of the run says why it ends
            self.stopped_epoch, self.stopping_reason_message, st.should_stop = (
                st.epoch,
                message,
                True,
            )
            if first:
                st.stop_reason = f"EarlyStopping: {message}"
            if first and not self.verbose and trainer.is_main:
                echo(f"EarlyStopping: stopping at epoch {st.epoch} (global step {st.global_step}): "
                     f"{message}",
                     name="taskfit.early_stopping")
        if message and self.verbose:
            self._say(trainer, message)

    def _evaluate(self, value: float) -> tuple[bool, str | None]:
        """Lightning's ``_evaluate_stopping_criteria``: update the best value and the count; (stop?,
        message)."""
        key, lower, best = self.monitor, self.mode == "min", self._best
        if self.check_finite and not math.isfinite(value):
            self.stopping_reason = EarlyStoppingReason.NON_FINITE_METRIC
            return True, (f"Monitored metric {key} = {value} is not finite. Previous best value "
                          f"was {best:.3f}. Signaling Trainer to stop.")
        if self.stopping_threshold is not None and (
                value < self.stopping_threshold if lower else value > self.stopping_threshold):
            self.stopping_reason = EarlyStoppingReason.STOPPING_THRESHOLD
            return True, (f"Stopping threshold reached: {key} = {value} {'<' if lower else '>'} "
                          f"{self.stopping_threshold}. Signaling Trainer to stop.")
        if self.divergence_threshold is not None and (
                value > self.divergence_threshold if lower else value < self.divergence_threshold):
            self.stopping_reason = EarlyStoppingReason.DIVERGENCE_THRESHOLD
            return True, (f"Divergence threshold reached: {key} = {value} {'>' if lower else '<'} "
                          f"{self.divergence_threshold}. Signaling Trainer to stop.")
        if value + self.min_delta < best if lower else value - self.min_delta > best:
            self._best, self.wait_count = value, 0
            if math.isfinite(best):
                return False, (f"Metric {key} improved by {abs(best - value):.3f} >= min_delta = "
                               f"{self.min_delta}. New best score: {value:.3f}")
            return False, f"Metric {key} improved. New best score: {value:.3f}"
        self.wait_count += 1
        if self.wait_count >= self.patience:
            self.stopping_reason = EarlyStoppingReason.PATIENCE_EXHAUSTED
            return True, (f"Monitored metric {key} did not improve in the last {self.wait_count} "
                          f"records. Best score: {best:.3f}. Signaling Trainer to stop.")
        return False, None

    def _say(self, trainer: Any, message: str) -> None:
        """``verbose``: Lightning's messages, on every rank prefixed with it (rank 0 only:
        ``log_rank_zero_only``)."""
        strategy = trainer.strategy
        if strategy.world_size > 1:
            if self.log_rank_zero_only and not trainer.is_main:
                return
            message = f"[rank: {strategy.rank}] {message}"
        echo(message, name="taskfit.early_stopping")
