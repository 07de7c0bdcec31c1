"""One run of an entry point: what ``fit``/``validate``/``test``/``predict`` set up inside the launched process (seed,
hooks, the run directory, data preparation and ``setup``, device and wrapper, precision, logging buffer) and tear
down; and what fit adds (optimizers, loaders, schedules, the hooks around zero_grad and backward, a checkpoint).
The loop itself is in trainer.py."""
from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..callbacks import (
    EarlyStopping,
    ModelCheckpoint,
    hook_table,
    merge_task_callbacks,
    publish_late,
    run_directory,
    warn_uncalled,
)
from ..checkpoint.run_state import load_weights, open_checkpoint, restore
from ..data.loaders import fit_loaders
from ..datamodule import DataSource
from ..errors import MisconfigurationError
from ..logs.buffer import LogBuffer
from ..logs.metrics import build_metrics
from ..module import TaskModule, rank_zero_only
from ..optim import Schedulers, gradient_clipper, parse_optimizers
from ..seed import deterministic_algorithms, run_seed, seed_everything
from ..state import TrainerState
from ..strategies.model_memory import prepare_module
from .cadence import ValidationSchedule
from .precision import Precision
from .preemption import Preemption
from .steps import ManualOptimizer, training_step

if TYPE_CHECKING:
    from ..trainer import Trainer


@contextlib.contextmanager
def running(trainer: Trainer, task: TaskModule, fn: str, data: DataSource,
            weights: str | None = None) -> Iterator[None]:
    """Inside a launched process: seed, hooks, attach ``task`` (``prepare_data``, ``setup(stage)``, device, wrapper,
    precision, logging buffer), load the ``weights`` checkpoint (validate/test/predict); ``teardown(stage)`` after a
    normal end; on the way out restore what changed (``on_exception`` after an error)."""
    strategy = trainer.strategy
    strategy.setup_environment()
    if trainer.seed is not None:
        seed_everything(trainer.seed)
    trainer.callbacks = merge_task_callbacks(trainer.callbacks, task)  # the task's configure_callbacks()
    datamodule = data.datamodule
    trainer.task, trainer.data, trainer.preemption = task, data, None
    trainer.hooks = hook_table(trainer.callbacks, task, datamodule, publish=publish_late,
                               monitors=(ModelCheckpoint, EarlyStopping))
    warn_uncalled(trainer.callbacks, task, datamodule)
    with deterministic_algorithms(trainer.deterministic):  # the process's setting comes back after
        try:
            if fn == "fit":
                trainer.state, trainer.log_dir = TrainerState(), None
                if trainer.max_epochs is None and trainer.max_steps is None:  # Lightning's default, and its warning
                    trainer.max_epochs = 1000
                    if strategy.rank == 0:
                        warnings.warn("Trainer: max_epochs was not set, so fit stops after 1000 epochs (Lightning's "
                                      "default). HINT: pass Trainer(max_epochs=N) or max_steps=N.", stacklevel=5)
            trainer.state.fn = fn
            if trainer.log_dir is None:  # chosen on rank 0
                trainer.log_dir = strategy.broadcast(trainer.is_main and run_directory(trainer))  # the first logger's
            trainer.moves_batches = strategy.moves_batches  # read once: the loop asks it every batch
            trainer.precision = Precision(trainer.precision_name, strategy.device)
            trainer.logs = LogBuffer(strategy, trainer.nonfinite_loss, trainer.precision,
                                     trainer.accumulate_grad_batches)
            task.trainer = trainer
            if datamodule is not None:
                datamodule.trainer = trainer
            rank_zero_only.rank = strategy.rank
            if trainer.hooks["prepare_data"]:  # downloads: once per machine, the other ranks wait
                if strategy.local_rank == 0:
                    trainer.call_hooks("prepare_data")
                strategy.barrier()
            trainer.call_hooks("setup", fn)  # the module is still where the user built it (Lightning's order)
            trainer.call_hooks("configure_model")
            wrapped = strategy.setup_module(prepare_module(task, trainer))  # meta layers, checkpointing, channels_last
            trainer.model = torch.compile(wrapped) if trainer.compile else wrapped  # what the loop calls
            trainer.metrics = build_metrics(task, strategy.device)
            trainer.data_seed = int(strategy.broadcast(run_seed()))  # the data order: rank 0's on every rank
            trainer.preemption = Preemption(trainer.preempt_signals, strategy, install=fn == "fit")
            if weights is not None:
                load_weights(trainer, weights)
            yield
            trainer.call_hooks("teardown", fn)
        except BaseException as exc:
            trainer.checkpoint_writer.close_quietly()  # finish the background files before reporting
            trainer.call_hooks("on_exception", exc)
            raise
        finally:
            if trainer.preemption is not None:
                trainer.preemption.uninstall()
            if fn == "fit" and trainer.accumulate_grad_batches > 1 and trainer.model is not None:
                strategy.gradient_sync(trainer.model, True)  # a group cut short (an error) left it off
            task.trainer = None
            if datamodule is not None:
                datamodule.trainer = None


def setup_fit(trainer: Trainer, ckpt_path: str | None) -> None:
    """Optimizers, schedulers, the step, the loaders and their schedule, the per-fit choices of the step (hooks around
    zero_grad and backward only where defined), then the checkpoint to resume from."""
    task, strategy, hooks = trainer.task, trainer.strategy, trainer.hooks
    trainer.train_dataloader = None  # estimated_stepping_batches in configure_optimizers asks this fit's loader
    trainer.manual = not task.automatic_optimization  # the task's training_step steps its optimizers
    trainer.optimizers, configs = parse_optimizers(task.configure_optimizers(), automatic=not trainer.manual)
    trainer.optimizer, trainer.schedulers = trainer.optimizers[0], Schedulers(configs, automatic=not trainer.manual)
    trainer.manual_optimizers = [ManualOptimizer(o, trainer) for o in trainer.optimizers] if trainer.manual else []
    trainer.clip_gradients = gradient_clipper(trainer.optimizer, trainer.gradient_clip_val,
                                              trainer.gradient_clip_algorithm)
    trainer.training_step = trainer.precision.autocasting(  # the forward and the loss only, as torch.autocast asks
        training_step(task, trainer.model, trainer.manual, strategy.eval_module(trainer.model)))
    checkpoint = open_checkpoint(trainer, ckpt_path) if ckpt_path is not None else None  # before the loaders
    trainer.train_dataloader, trainer.num_train_batches, trainer.val_loader, trainer.num_val_batches = fit_loaders(
        trainer.data, trainer.limits, bool(trainer.overfit_batches), trainer.data_seed, strategy,
        trainer.preempt_signals)
    trainer.val_schedule = ValidationSchedule(trainer.val_check_interval, trainer.check_val_every_n_epoch,
                                              trainer.num_train_batches, trainer.val_loader is not None)
    trainer.loss_checked = False
    trainer.before_step_work = trainer.precision.scaler is not None or bool(hooks["on_before_optimizer_step"])
    # Chosen once: the plain calls when no hook is defined (nothing added per step), else the hooks around them.
    trainer.zero_grad = with_hooks(trainer, trainer.optimizer.zero_grad, hooks["on_before_zero_grad"], [],
                                   trainer.optimizer)
    trainer.backward = with_hooks(trainer, trainer.precision.backward, hooks["on_before_backward"],
                                  hooks["on_after_backward"])
    if checkpoint is not None:
        restore(trainer, *checkpoint)
        trainer.state.resumed = True


def with_hooks(trainer: Trainer, call: Callable[..., Any], before: list[Any], after: list[Any],
               argument: Any = None) -> Callable[..., Any]:
    """``call`` itself when no hook is defined, else ``call`` between ``before(argument or call's first
    argument)`` and ``after()`` hooks (on_before_zero_grad(optimizer); on_before_backward(loss), on_after_backward)."""
    if not before and not after:
        return call

    @functools.wraps(call)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        for fn in before:
            fn(trainer, trainer.task, argument if argument is not None else args[0])
        result = call(*args, **kwargs)
        for fn in after:
            fn(trainer, trainer.task)
        return result
    return hooked


def fitted_task(trainer: Trainer, fn: str, task: TaskModule | None, ckpt_path: Any) -> tuple[TaskModule, Any]:
    """``validate``/``test``/``predict`` without a task: the one of the last fit, from its best checkpoint unless
    ``ckpt_path`` says otherwise (Lightning's rule); before any fit, an error."""
    if task is not None:
        return task, ckpt_path
    if trainer.task is None:
        raise MisconfigurationError(
            f"Trainer.{fn}() was called without a task, and this Trainer has not fitted one.",
            f"pass the task: trainer.{fn}(task, ckpt_path=...), or call trainer.fit(task) first.")
    if ckpt_path is None:
        ckpt_path = "best"
        warnings.warn(f"Trainer.{fn}() without a task uses the fitted one, with the weights of its best checkpoint "
                      f"(ckpt_path='best'). HINT: pass ckpt_path='best' or 'last' to choose (and silence this), or "
                      f"the task to use its weights as they are.", UserWarning, stacklevel=4)
    return trainer.task, ckpt_path
