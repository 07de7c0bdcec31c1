"""Callback: the hooks the Trainer calls, in this order (the table in docs/callbacks.md says when
each fires)::

    fit:      on_fit_start
              [sanity check: on_sanity_check_start, on_sanity_check_end]
              per epoch: on_train_epoch_start
                per batch: (on_logged_batch_start, before a batch whose step logs)
                           on_train_batch_start (on_before_optimizer_step)
                           (on_log_interval, every log_every_n_steps optimizer steps)
                           [validation: on_validation_start, on_validation_end]
                           on_train_batch_end
                on_train_epoch_end
              on_fit_end
              (on_exception instead, when any entry point raises or is interrupted)
    validate: on_validation_start, on_validation_end
    test:     on_test_start, on_test_end
    predict:  on_predict_start, per batch on_predict_batch_end, on_predict_end
    on_log    whenever values are written out (log interval, after each validation/epoch/test,
              callbacks' values)

Every hook receives ``(trainer, task, ...)``; read ``trainer.state`` for where the run is
(``state.fn`` is the entry point: "fit", "validate", "test" or "predict"). The Trainer calls a hook
only on callbacks that override it, sorted by ``order`` (lower first), so an unused hook costs
nothing; ``needs_batch_hooks`` lets a callback skip its per-batch hooks for a whole fit. Lightning's
further hooks (``setup``, ``on_train_start``, ``on_validation_epoch_end``, ``on_before_backward``,
``on_save_checkpoint``...) are called too, with Lightning's meaning and arguments, when a callback
defines them: callbacks/lightning_hooks.py lists them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:
    import torch

# What every hook receives: the running Trainer and its TaskModule. Named, not imported: this module
# is a leaf of the package (tests/test_layers.py), below trainer.py and module.py.
Trainer = TaskModule = Any

HOOKS = (
    "on_fit_start",
    "on_fit_end",
    "on_sanity_check_start",
    "on_sanity_check_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_optimizer_step",
    "on_logged_batch_start",
    "on_log_interval",
    "on_validation_start",
    "on_validation_end",
    "on_test_start",
    "on_test_end",
    "on_predict_start",
    "on_predict_batch_end",
    "on_predict_end",
    "on_log",
    "on_exception",
)


def default_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a base class's no-op hook (``DataModule.setup``): a subclass that keeps it does not
    define the hook."""
    fn.default_hook = True  # type: ignore[attr-defined]
    return fn


class StopRun(Exception):
    """Raised by a callback to end the running entry point at once, cleanly: ``teardown`` runs, no
    ``on_exception`` hook fires, and ``fit``/``validate``/``test``/``predict`` return (fit: ``{}``,
    the others: ``[]``/None) with the counters as they were. The Tuner's finders end its entry
    point with it after their search (Lightning's ``_TunerExitException``)."""


class Callback:
    """Base class: override the hooks you need. ``order`` sorts callbacks (lower runs first)."""

    order: int = 0
    # True: on_train_epoch_end after the task's own (it reads what that logs)
    monitors_epoch_values: bool = False
    # Methods that share a hook's name but are not hooks (a Logger's ``setup(trainer)``)
    not_hooks: frozenset[str] = frozenset()

    def on_fit_start(self, trainer: Trainer, task: TaskModule) -> None:
        """Before the first epoch (after the module is on its device and a checkpoint, if any, is
        restored)."""

    def on_fit_end(self, trainer: Trainer, task: TaskModule) -> None:
        """After training ended normally (max_epochs/max_steps reached or ``should_stop`` set)."""

    def on_sanity_check_start(self, trainer: Trainer, task: TaskModule) -> None:
        """Before the sanity check: ``num_sanity_val_steps`` validation batches before the first
        epoch."""

    def on_sanity_check_end(self, trainer: Trainer, task: TaskModule) -> None:
        """After the sanity check (its values are not logged and no validation hook fired for
        it)."""

    def on_train_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        """At the start of each training epoch."""

    def on_train_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        """At the end of each training epoch, after its validation and epoch-level logging."""

    def on_train_batch_start(
        self, trainer: Trainer, task: TaskModule, batch: Any, batch_idx: int
    ) -> None:
        """Before each training batch (``batch`` as the DataLoader gave it, before it moves to the
        device)."""

    def on_train_batch_end(self, trainer: Trainer, task: TaskModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """After each training batch, its optimizer step and any validation due at this batch;
        ``outputs`` is what the step returned, detached: the loss, or a ``training_step``'s dict
        (device tensors: reading one on the host is a sync)."""

    def on_before_optimizer_step(
        self, trainer: Trainer, task: TaskModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Gradients are ready (unscaled, before clipping); ``optimizer`` steps next."""

    def on_logged_batch_start(self, trainer: Trainer, task: TaskModule) -> None:
        """Before each training batch whose step is logged (the one ``on_log_interval`` follows),
        before ``on_train_batch_start`` and the batch's optimizer and scheduler steps: the place to
        read what that step uses (``LearningRateMonitor`` reads the rates there, as Lightning's
        does in ``on_train_batch_start``). Values published here are at the step the batch's
        values are logged at; under ``accumulate_grad_batches`` every batch of the stepping group
        starts here, as in Lightning."""

    def on_log_interval(self, trainer: Trainer, task: TaskModule) -> None:
        """Every ``log_every_n_steps`` optimizer steps, after the training values of that step were
        logged: the place for values a callback logs at the same cadence
        (``trainer.log_metrics``)."""

    def on_validation_start(self, trainer: Trainer, task: TaskModule) -> None:
        """Before a validation pass, in fit or ``Trainer.validate`` (``trainer.state.fn`` says
        which)."""

    def on_validation_end(self, trainer: Trainer, task: TaskModule) -> None:
        """After a validation pass; its metrics are in ``trainer.state.metrics``."""

    def on_test_start(self, trainer: Trainer, task: TaskModule) -> None:
        """Before a test pass."""

    def on_test_end(self, trainer: Trainer, task: TaskModule) -> None:
        """After a test pass; its metrics are in ``trainer.state.metrics``."""

    def on_predict_start(self, trainer: Trainer, task: TaskModule) -> None:
        """Before a predict pass (``trainer.predict_dataloader`` is the loader, sharded under
        ddp)."""

    def on_predict_batch_end(self, trainer: Trainer, task: TaskModule, outputs: Any, batch: Any,
                             batch_idx: int) -> None:
        """After each predict batch; ``outputs`` is its prediction (what ``PredictionWriter`` writes
        to disk)."""

    def on_predict_end(self, trainer: Trainer, task: TaskModule) -> None:
        """After a predict pass, on every rank."""

    def on_log(self, trainer: Trainer, task: TaskModule, metrics: dict[str, float]) -> None:
        """Values to write out, already Python floats, at ``trainer.state.global_step``."""

    def on_exception(self, trainer: Trainer, task: TaskModule, exception: BaseException) -> None:
        """An entry point (``trainer.state.fn``) ended by an exception (including KeyboardInterrupt
        and a preemption exit)."""

    # ---- Lightning's callback hooks beyond the ones above (LIGHTNING_HOOKS says when each is calle
    def setup(self, trainer: Trainer, task: TaskModule, stage: str) -> None:
        """At the start of fit/validate/test/predict, before the module moves to its device."""

    def teardown(self, trainer: Trainer, task: TaskModule, stage: str) -> None:
        """At the end of fit/validate/test/predict (not after an exception)."""

    def on_train_start(self, trainer: Trainer, task: TaskModule) -> None:
        """After the sanity check, before the first training epoch."""

    def on_train_end(self, trainer: Trainer, task: TaskModule) -> None:
        """After the last training epoch, before on_fit_end."""

    def on_validation_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        """After on_validation_start, before the first validation batch."""

    def on_validation_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        """After the validation batches; the pass's values are in callback_metrics."""

    def on_test_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        """After on_test_start."""

    def on_test_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        """As on_validation_epoch_end, for test."""

    def on_predict_epoch_start(self, trainer: Trainer, task: TaskModule) -> None:
        """After on_predict_start."""

    def on_predict_epoch_end(self, trainer: Trainer, task: TaskModule) -> None:
        """Before on_predict_end."""

    def on_validation_batch_start(
        self,
        trainer: Trainer,
        task: TaskModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Before each validation batch (on its device)."""

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        task: TaskModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """After each validation batch: what the step returned (default step: the loss)."""

    def on_test_batch_start(self, trainer: Trainer, task: TaskModule, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None:
        """Before each test batch."""

    def on_test_batch_end(
        self,
        trainer: Trainer,
        task: TaskModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """After each test batch."""

    def on_predict_batch_start(self, trainer: Trainer, task: TaskModule, batch: Any, batch_idx: int,
                               dataloader_idx: int = 0) -> None:
        """Before each predict batch."""

    def on_before_zero_grad(
        self, trainer: Trainer, task: TaskModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Before zero_grad, at each accumulation group's first batch."""

    def on_before_backward(self, trainer: Trainer, task: TaskModule, loss: torch.Tensor) -> None:
        """The loss backward is called on (divided by the group's size under accumulation)."""

    def on_after_backward(self, trainer: Trainer, task: TaskModule) -> None:
        """After backward: the gradients are there (scaled under 16-mixed)."""

    def on_save_checkpoint(
        self, trainer: Trainer, task: TaskModule, checkpoint: dict[str, Any]
    ) -> None:
        """The checkpoint dict about to be written: add your own keys."""

    def on_load_checkpoint(
        self, trainer: Trainer, task: TaskModule, checkpoint: dict[str, Any]
    ) -> None:
        """The checkpoint dict read, before its state is restored."""

    # ---- taskfit's -------------------------------------------------------------------------------
    def needs_batch_hooks(self, trainer: Trainer) -> bool:
        """Asked once per fit, after ``on_fit_start``: False and the Trainer does not call this
        callback's ``on_train_batch_start``/``on_train_batch_end`` in this fit (a per-step call
        saved when, as configured, they would do nothing)."""
        return True

    def state_dict(self) -> dict[str, Any]:
        """What this callback needs to continue after a resume (plain containers and primitives
        only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint."""
        return type(self).__qualname__


def callback_states(callbacks: Iterable[Callback]) -> dict[str, dict[str, Any]]:
    """Every callback's non-empty ``state_dict()`` by its ``state_key`` (what a checkpoint
    holds)."""
    return {cb.state_key: state for cb in callbacks if (state := cb.state_dict())}


def load_callback_states(callbacks: Iterable[Callback], states: dict[str, dict[str, Any]]) -> None:
    """Give each callback the state saved under its ``state_key`` (a callback added since starts
    afresh)."""
    for cb in callbacks:
        if cb.state_key in states:
            cb.load_state_dict(states[cb.state_key])
