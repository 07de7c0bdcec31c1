"""Building a run and tearing it down: :func:`new_run`, :func:`running` (seed, the run directory,
data preparation and ``setup``, device and wrapper, precision, logging buffer; ``teardown`` and
``on_exception``), :func:`setup_fit` (what fit adds: optimizers, loaders, cadence, the step's
callables, a checkpoint to resume) and :func:`fitted_task`."""
from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import torch

from ..callback import Callback, StopRun
from ..checkpoint.files import CheckpointWriter
from ..checkpoint.rng import isolated_rng
from ..data.loaders import ASK, fit_loaders
from ..data.workers import restore_sigchld
from ..datamodule import DataSource
from ..errors import MisconfigurationError
from ..logs.buffer import LogBuffer
from ..logs.outputs import run_directory
from ..logs.metrics import build_metrics
from ..module import TaskModule, rank_zero_only
from ..optim import Schedulers, parse_optimizers
from ..seed import deterministic_algorithms, run_seed, seed_everything, seeds_workers
from ..state import TrainerFn, TrainerState
from ..strategies.base import Strategy
from ..strategies.model_memory import prepare_module
from ..trainer_config import TrainerConfig
from . import modes
from .cadence import ValidationSchedule
from .checkpointer import Checkpointer, CheckpointPolicy
from .checkpointing import load_weights, open_checkpoint, restore
from .hooks import Hook, hook_table, warn_uncalled
from .overrides import backward_call, clip_call, scheduler_step, task_optimizer_step, zero_grad_call
from ..precision import Precision
from .preemption import Preemption
from .run import Run
from .steps import ManualOptimizer, defines, training_step


def new_run(
    trainer: object,
    task: TaskModule,
    fn: str,
    data: DataSource,
    callbacks: list[Callback],
    state: TrainerState,
    log_dir: str | None,
    verbose: bool = True,
    policies: Sequence[CheckpointPolicy] = (),
    *,
    config: TrainerConfig,
    strategy: Strategy,
    writer: CheckpointWriter,
) -> Run:
    """The run of ``fn`` (nothing built yet but its hook table): the Trainer holds it before any
    hook fires. ``trainer`` is handed to hooks, never read; the Trainer hands down its
    ``config``, ``strategy`` and checkpoint ``writer`` (background saves outlive a run).
    ``policies``: the ModelCheckpoint callbacks, which configure the run's checkpoint manager."""
    run = Run(trainer, config, fn, task, data, strategy, callbacks, state, writer, {}, log_dir,
              verbose=verbose)
    run.hooks = hook_table(callbacks, task, data.datamodule, publish=late_publisher(run))
    warn_uncalled(callbacks, task, data.datamodule)
    run.checkpointer = Checkpointer(run, list(policies))
    return run


def late_publisher(run: Run) -> Hook:
    """In ``on_train_epoch_end``'s list (hook_table): publish the epoch values logged in the
    hooks before it."""
    def publish_late(trainer: Any, task: Any) -> None:
        values = run.logs.late_values(run.logs.train)
        if values:
            run.publish(LogBuffer.to_floats(values))
    return publish_late


@contextlib.contextmanager
def running(run: Run, weights: str | None = None) -> Iterator[Run]:
    """Inside a launched process: seed, attach the task (``prepare_data``, ``setup(stage)``, device,
    wrapper, precision, logging buffer), load the ``weights`` checkpoint (validate/test/predict);
    ``teardown(stage)`` after a normal end; on the way out restore what changed (``on_exception``
    after an error). Yields the run."""
    config, strategy, task = run.config, run.strategy, run.task
    # a run inside another's hook (a finder's trial): the task goes back to the outer run after
    outer = task.trainer
    strategy.setup_environment()
    if config.seed is not None:
        seed_everything(config.seed, workers=seeds_workers())  # as a seed_everything call set it
    with deterministic_algorithms(config.deterministic):  # the process's setting comes back after
        try:
            run.state.status = "running"
            yield _attach(run, weights)
            run.call_hooks("teardown", run.fn)
            run.state.status = "finished"
        except StopRun:  # a callback ended the run cleanly (the Tuner's finders)
            run.state.stage = "idle"
            run.call_hooks("teardown", run.fn)
            run.state.status = "finished"
            raise
        except BaseException as exc:
            run.state.status = "interrupted"
            run.checkpoint_writer.close_quietly()  # finish the background files before reporting
            run.call_hooks("on_exception", exc)
            raise
        finally:
            run.checkpointer.release()
            if run.preemption is not None:
                run.preemption.uninstall()
            restore_sigchld()
            if run.fn == "fit" and config.accumulate_grad_batches > 1 and run.model is not None:
                strategy.gradient_sync(run.model, True)  # a group cut short (an error) left it off
            # (a data module keeps its trainer after the run, as Lightning's)
            task.trainer = outer
            if outer is not None and run.data.datamodule is not None:
                run.data.datamodule.trainer = outer


def _attach(run: Run, weights: str | None) -> Run:
    """The run's parts, in Lightning's order: the run directory, precision and logging buffer, the
    task attached, ``prepare_data``, ``setup``, ``configure_model``, the wrapped module, metrics,
    data seed, preemption."""
    strategy, task, datamodule, config = run.strategy, run.task, run.data.datamodule, run.config
    run.state.fn = TrainerFn(run.fn)  # Lightning's enum, equal to the string
    if run.log_dir is None:  # chosen on rank 0
        chosen = strategy.is_main and run_directory(run.callbacks, config.default_root_dir)
        run.log_dir = strategy.broadcast(chosen)
    run.precision = Precision(config.precision, strategy.device)
    run.moves_batches = strategy.moves_batches or run.precision.true
    run.batch_to_device = run.precision.batch_mover(strategy.batch_to_device)
    # a Lightning program (its own training_step): its keys only (logs/buffer.py)
    run.logs = LogBuffer(strategy, config.nonfinite_loss, run.precision.scales_loss,
                         config.accumulate_grad_batches, exact=defines(task, "training_step"))
    task.trainer = run.trainer
    if datamodule is not None:
        datamodule.trainer = run.trainer
    rank_zero_only.rank = strategy.rank
    if run.hooks["prepare_data"]:  # downloads: once per machine, the other ranks wait
        if strategy.local_rank == 0:
            run.call_hooks("prepare_data")
        strategy.barrier()
    # the module is still where the user built it (Lightning's order)
    run.call_hooks("setup", run.fn)
    with run.precision.init_context():  # a true mode's layers are built in its dtype
        run.call_hooks("configure_model")
    # meta layers, activation checkpointing, channels_last, then a true mode's dtype, then the
    # strategy's wrapper
    prepared = prepare_module(task, strategy, config.activation_checkpointing, config.channels_last)
    wrapped = strategy.setup_module(run.precision.convert_module(prepared), run.precision)
    run.model = torch.compile(wrapped) if config.compile else wrapped
    run.metrics = build_metrics(task, strategy.device)
    run.data_seed = int(strategy.broadcast(run_seed()))  # the data order: rank 0's on every rank
    run.preemption = Preemption(config.preempt_signals, strategy, install=run.fn == "fit")
    if weights is not None:
        load_weights(run, weights)
    return run


def setup_fit(run: Run, ckpt_path: str | None) -> None:
    """Optimizers, schedulers, the step, the loaders and their schedule, the per-fit choices of the
    step (hooks around zero_grad and backward only where defined), then the checkpoint to resume
    from."""
    config, task, strategy, hooks = run.config, run.task, run.strategy, run.hooks
    # each submodule trains in its own mode (Lightning 2.6)
    modes.check_fit_start(task, warn=strategy.is_main)
    run.manual = not task.automatic_optimization  # the task's training_step steps its optimizers
    run.optimizers, configs = parse_optimizers(
        task.configure_optimizers(), automatic=not run.manual
    )
    run.optimizer = run.optimizers[0]
    run.schedulers = Schedulers(
        configs, automatic=not run.manual, lr_scheduler_step=scheduler_step(task)
    )
    run.manual_optimizers = [ManualOptimizer(o, run) for o in run.optimizers] if run.manual else []
    # Lightning's overrides of the automatic step (overrides.py): the plain calls unless the task
    # writes its own
    run.clip_gradients = clip_call(task, run.optimizer, config.gradient_clip_val,
                                   config.gradient_clip_algorithm)
    run.task_optimizer_step = task_optimizer_step(task, run.state, run.optimizer, run.precision)
    # used when the task keeps TaskModule's
    run.optimizer_step = run.precision.step_call(run.optimizer)
    # the forward and the loss only under autocast, as torch.autocast asks
    run.training_step = run.precision.wrap_step(
        training_step(task, run.model, run.manual, strategy.eval_module(run.model)))
    run.checkpointer.hold_folders()
    # before the loaders
    checkpoint = open_checkpoint(run, ckpt_path) if ckpt_path is not None else None
    load_fit_loaders(run, resuming=checkpoint is not None)
    run.before_step_work = run.precision.scales_loss or bool(hooks["on_before_optimizer_step"])
    run.zero_grad = with_hooks(
        run,
        zero_grad_call(task, run.state, run.optimizer),
        hooks["on_before_zero_grad"],
        [],
        run.optimizer,
    )
    run.backward = with_hooks(run, backward_call(task, run.precision), hooks["on_before_backward"],
                              hooks["on_after_backward"])
    if checkpoint is not None:
        restore(run, *checkpoint)
        run.checkpointer.resumed_from(checkpoint[0])
        run.state.resumed = True
        run.loaders_epoch = run.state.epoch  # the loaders serve the resumed epoch on


def load_fit_loaders(run: Run, resuming: bool = False) -> None:
    """The fit's training and validation loaders, their batch counts and the validation schedule,
    from the run's data source: in ``setup_fit``, again every
    ``reload_dataloaders_every_n_epochs`` epochs (the loop's ``reload_loaders``), and when a
    callback changed what the loaders read (``trainer.reload_dataloaders()``: BatchSizeFinder)."""
    config, strategy = run.config, run.strategy
    val_source = ASK
    if config.num_sanity_val_steps and config.limits["val"] and not config.overfit_batches \
            and not resuming:
        # a sanity check will run: Lightning asks for the validation loader first, inside its
        # isolate_rng (what that draws from the global RNG is undone), then the training loader
        with isolated_rng():
            val_source = run.data.val_dataloader()
    run.train_dataloader, run.num_train_batches, run.val_loader, run.num_val_batches = fit_loaders(
        run.data, config.limits, bool(config.overfit_batches), run.data_seed, strategy,
        config.preempt_signals, val_source)
    # Lightning: `task.validation_step = None`
    if "validation_step" in vars(run.task) and run.task.validation_step is None:
        # turns validation off (the sanity check too)
        run.val_loader, run.num_val_batches = None, []
    run.val_schedule = ValidationSchedule(
        config.val_check_interval, config.check_val_every_n_epoch, run.num_train_batches,
        run.val_loader is not None, sync_every=config.log_every_n_steps,
        broadcast=strategy.broadcast if strategy.world_size > 1 else None)
    run.loaders_epoch = run.state.epoch


def with_hooks(run: Run, call: Callable[..., Any], before: list[Hook], after: list[Hook],
               argument: Any = None) -> Callable[..., Any]:
    """``call`` itself when no hook is defined, else ``call`` between ``before(argument or call's
    first argument)`` and ``after()`` hooks (on_before_zero_grad(optimizer);
    on_before_backward(loss), on_after_backward)."""
    if not before and not after:
        return call

    @functools.wraps(call)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        for fn in before:
            fn(run.trainer, run.task, argument if argument is not None else args[0])
        result = call(*args, **kwargs)
        for fn in after:
            fn(run.trainer, run.task)
        return result
    return hooked


def fitted_task(fitted: TaskModule | None, fn: str, task: TaskModule | None,
                ckpt_path: Any) -> tuple[TaskModule, Any]:
    """``validate``/``test``/``predict`` without a task: the one of the last fit, from its best
    checkpoint unless ``ckpt_path`` says otherwise (Lightning's rule); before any fit (``fitted`` is
    None), an error."""
    if task is not None:
        return task, ckpt_path
    if fitted is None:
        raise MisconfigurationError(
            f"Trainer.{fn}() was called without a task, and this Trainer has not fitted one.",
            f"pass the task: trainer.{fn}(task, ckpt_path=...), or call trainer.fit(task) first.")
    if ckpt_path is None:
        ckpt_path = "best"
        warnings.warn(f"Trainer.{fn}() without a task uses the fitted one, with the weights of its "
                      "best checkpoint (ckpt_path='best'). HINT: pass ckpt_path='best' or 'last' "
                      "to choose (and silence this), or the task to use its weights as they "
                      "are.", UserWarning, stacklevel=4)
    return fitted, ckpt_path
