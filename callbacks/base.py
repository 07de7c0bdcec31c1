"""Callback: the hooks the Trainer calls, in this order (see docs/callbacks.md)::

    on_fit_start
      [sanity validation: on_validation_start, on_validation_end]
      per epoch:  on_train_epoch_start
        per batch:  on_train_batch_start, (on_before_optimizer_step), [validation], on_train_batch_end
        on_train_epoch_end
    on_fit_end                      (on_exception instead, when fit raises or is interrupted)
    test:  on_test_start, on_test_end
    on_log whenever values are written out (every log_every_n_steps, after each validation/epoch/test)

Every hook receives ``(trainer, task)``; read ``trainer.state`` for where the run is. The Trainer calls a
hook only on callbacks that override it, sorted by ``order`` (lower first), so an unused hook costs nothing;
``needs_batch_hooks`` lets a callback skip its per-batch hooks for a whole fit.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .. import TaskModule, Trainer

HOOKS = ("on_fit_start", "on_fit_end", "on_train_epoch_start", "on_train_epoch_end", "on_train_batch_start",
         "on_train_batch_end", "on_before_optimizer_step", "on_validation_start", "on_validation_end",
         "on_test_start", "on_test_end", "on_log", "on_exception")


class Callback:
    """Base class: override the hooks you need. ``order`` sorts callbacks (lower runs first)."""

    order: int = 0

    def on_fit_start(self, trainer: Trainer, task: TaskModule) -> None:
        """Before the first epoch (after the module is on its device and a checkpoint, if any, is restored)."""

    def on_fit_end(self, trainer: Trainer, task: TaskModule) -> None:
        """After training ended normally (max_epochs/max_steps reached or ``should_stop`` set)."""

    def on_train_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        """At the start of each training epoch."""

    def on_train_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        """At the end of each training epoch, after its validation and epoch-level logging."""

    def on_train_batch_start(self, trainer: Trainer, task: TaskModule) -> None:
        """Before each training batch (``trainer.state.batch_idx``)."""

    def on_train_batch_end(self, trainer: Trainer, task: TaskModule) -> None:
        """After each training batch, its optimizer step and any validation due at this batch."""

    def on_before_optimizer_step(self, trainer: Trainer, task: TaskModule) -> None:
        """Gradients are ready (unscaled, before clipping); the optimizer steps next."""

    def on_validation_start(self, trainer: Trainer, task: TaskModule) -> None:
        """Before a validation pass (also the sanity check: ``trainer.state.stage == "sanity"``)."""

    def on_validation_end(self, trainer: Trainer, task: TaskModule) -> None:
        """After a validation pass; its metrics are in ``trainer.state.metrics``."""

    def on_test_start(self, trainer: Trainer, task: TaskModule) -> None:
        """Before a test pass."""

    def on_test_end(self, trainer: Trainer, task: TaskModule) -> None:
        """After a test pass; its metrics are in ``trainer.state.metrics``."""

    def on_log(self, trainer: Trainer, task: TaskModule, metrics: dict[str, float]) -> None:
        """Values to write out, already Python floats, at ``trainer.state.global_step``."""

    def on_exception(self, trainer: Trainer, task: TaskModule, exception: BaseException) -> None:
        """Fit ended by an exception (including KeyboardInterrupt and a preemption exit)."""

    def needs_batch_hooks(self, trainer: Trainer) -> bool:
        """Asked once per fit, after ``on_fit_start``: False and the Trainer does not call this callback's
        ``on_train_batch_start``/``on_train_batch_end`` in this fit (a per-step call saved when, as configured,
        they would do nothing)."""
        return True

    def state_dict(self) -> dict[str, Any]:
        """What this callback needs to continue after a resume (plain containers and primitives only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint."""
        return type(self).__qualname__
