"""The Trainer's configuration as one typed, frozen object: :class:`TrainerConfig`.

``Trainer.__init__`` builds it once from its arguments (the signature is the one source of their
names and defaults: no field here has a default), and the Run of each entry point holds it
(``run.config``). The code below the Trainer (``loop/``, ``checkpoint/``, ``logs/``, ``data/``,
``strategies/``) reads this object, or the part of it it needs, never the Trainer.
``fast_dev_run``, ``overfit_batches`` and fit's default ``max_epochs`` give a new object
(``dataclasses.replace``), so a Run's configuration never changes under it.
"""
from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Limits:
    """``limit_{train,val,test,predict}_batches``: an int (batches) or a float (a fraction of
    the loader), by stage; ``limits["val"]`` reads one, as the dict it replaces did."""

    train: int | float
    val: int | float
    test: int | float
    predict: int | float

    def __getitem__(self, stage: str) -> int | float:
        return getattr(self, stage)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """What ``Trainer(...)`` was asked for, checked and normalized (docs/trainer.md describes
    each argument).

    The names are the Trainer's arguments, except ``precision`` (normalized: ``"bf16-mixed"``),
    ``limits`` (the four ``limit_*_batches``), ``preempt_signals`` (full names: ``"SIGTERM"``),
    ``requeue`` (decided) and ``command_config`` (``Trainer(config=...)``: the taskfit command's
    resolved config, or None).
    """

    # what to run on
    precision: str
    compile: bool
    channels_last: bool
    activation_checkpointing: Any
    # how long, and how each step is taken
    max_epochs: int | None
    max_steps: int | None
    min_epochs: int | None
    min_steps: int | None
    accumulate_grad_batches: int
    gradient_clip_val: float | None
    gradient_clip_algorithm: str
    nonfinite_loss: str
    seed: int | None
    deterministic: bool
    # how much data, and when to validate and log
    limits: Limits
    overfit_batches: int | float
    # a duration ("DD:HH:MM:SS", a dict) is held as a datetime.timedelta
    val_check_interval: int | float | datetime.timedelta
    check_val_every_n_epoch: int | None
    reload_dataloaders_every_n_epochs: int
    num_sanity_val_steps: int
    log_every_n_steps: int
    fast_dev_run: int
    # where runs write, and what a preemption signal does
    default_root_dir: str | None
    preempt_signals: tuple[str, ...]
    preempt_exit_code: int | None
    requeue: bool
    command_config: Mapping[str, Any] | None

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any], **normalized: Any) -> TrainerConfig:
        """The configuration of ``Trainer(**arguments)``: each field is the argument of its name,
        unless ``normalized`` gives its value (the checked or converted form, or a field no
        argument names)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: normalized[name] if name in normalized else arguments[name]
                      for name in names})

    def for_fast_dev_run(self) -> TrainerConfig:
        """``fast_dev_run=n``: n batches of everything, one epoch (``max_steps=n``, as
        Lightning's), no sanity check, validation at the epoch's end (a duration does not apply),
        a log line per step."""
        n = self.fast_dev_run
        return dataclasses.replace(self, limits=Limits(n, n, n, n), max_epochs=1, max_steps=n,
                                   num_sanity_val_steps=0, val_check_interval=1.0,
                                   check_val_every_n_epoch=1, log_every_n_steps=1)

    def for_overfit_batches(self) -> TrainerConfig:
        """``overfit_batches``: the same batches for training and validation."""
        limits = dataclasses.replace(self.limits, train=self.overfit_batches,
                                     val=self.overfit_batches)
        return dataclasses.replace(self, limits=limits)
