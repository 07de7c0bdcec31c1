"""TrainerState: the one object every callback reads (and may change: ``should_stop``)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

# Fields that describe this process's call, not the training run: never written into a checkpoint.
_NOT_SAVED = ("fn", "resumed", "data_wait_s", "status")


class _StrEnum(str, Enum):
    """A str whose members compare, print and format as their value (Python 3.11's StrEnum)."""

    __str__ = str.__str__
    __format__ = str.__format__


class TrainerFn(_StrEnum):
    """``trainer.state.fn``: the entry point running, Lightning's enum (``.value``; equal to its
    string)."""

    FITTING = "fit"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"


class TrainerStatus(_StrEnum):
    """The values of ``trainer.state.status``, Lightning's enum (each equal to its string)."""

    INITIALIZING = "initializing"
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"


@dataclass
class TrainerState:
    """Where the run is. ``global_step`` counts optimizer steps; ``batch_idx`` is the batch within
    the epoch.

    ``Trainer.state_dict()`` holds everything else a resume needs (weights, optimizer, the logging
    buffer's partial-epoch values, RNG and data positions, callback states); this object holds the
    counters.
    """

    # the entry point running: TrainerFn, equal to "fit", "validate", "test" or "predict" ("" before
    # the first)
    fn: TrainerFn | str = ""
    # Lightning's: "running", then "finished" or "interrupted" (an error, Ctrl-C)
    status: str = "initializing"
    stage: str = "idle"  # "sanity", "train", "val", "test", "predict" or "idle"
    epoch: int = 0
    global_step: int = 0
    # batches that ended with an optimizer step (under manual optimization: every batch), the
    # current one included once it stepped: Lightning's `_batches_that_stepped`, which log_step (the
    # loggers' x-axis) is read from
    stepped_batches: int = 0
    # from a batch's step to its end, and from an epoch's end to the next epoch (or the fit's end):
    # what is published is at the count before the last stepped batch (Lightning's x-axis:
    # log_step). Saved: a resumed logger continues after the step the checkpoint's values were at
    log_at_previous: bool = False
    batch_idx: int = 0  # index of the batch being (or last) trained in this epoch
    batches_done: int = 0  # batches of this epoch already trained (where a resume continues)
    # batches trained in this fit's completed epochs: with batch_idx, Lightning's total_batch_idx,
    # what check_val_every_n_epoch=None counts when the training loader has no length
    batches_before_epoch: int = 0
    epoch_done: bool = False  # every batch of this epoch is trained (set before on_train_epoch_end)
    should_stop: bool = False
    stop_reason: str = ""
    resumed: bool = False  # this fit continued from a checkpoint (restored before on_fit_start)
    data_wait_s: float = 0.0  # seconds this fit's loop has waited for training batches
    skipped_steps: int = 0  # steps skipped for a non-finite loss (nonfinite_loss="skip")
    metrics: dict[str, float] = field(default_factory=dict)  # latest logged value of every key

    @property
    def finished(self) -> bool:
        """The last entry point ran to its end (Lightning's ``trainer.state.finished``)."""
        return self.status == "finished"

    @property
    def log_step(self) -> int:
        """The step loggers record a value at, as Lightning's: the batches that stepped before the
        one being trained (a value logged after optimizer step k is at k - 1; an epoch's values at
        its last batch's step), all of them between batches; under manual optimization batches are
        counted, not optimizer steps."""
        return self.stepped_batches - self.log_at_previous

    @property
    def checkpoint_epoch(self) -> int:
        """The epoch a checkpoint of this state belongs to (its file name's ``{epoch}``, Lightning's
        ``"epoch"`` key): between two epochs, the one just completed."""
        return (
            self.epoch - 1
            if self.epoch and not self.batches_done and not self.epoch_done
            else self.epoch
        )

    def state_dict(self) -> dict[str, Any]:
        """The counters for a checkpoint: every field but ``fn``, ``resumed`` and ``data_wait_s`` (a
        timing)."""
        # Numbers, strings and (metrics) a dict of floats: no deep copy (asdict) needed.
        return {
            f.name: dict(self.metrics) if f.name == "metrics" else getattr(self, f.name)
            for f in fields(self)
            if f.name not in _NOT_SAVED
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: idle, and after an epoch saved complete, at the start of the
        next one."""
        for key, value in state.items():
            if hasattr(self, key) and key not in _NOT_SAVED:
                setattr(self, key, dict(value) if key == "metrics" else value)
        # a checkpoint from before the count: its steps, the nearest value
        if "stepped_batches" not in state:
            self.stepped_batches = self.global_step
        self.stage = "idle"
        if self.epoch_done:
            self.epoch, self.batches_done, self.epoch_done = self.epoch + 1, 0, False
