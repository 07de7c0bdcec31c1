"""Trainer: the loop, top to bottom, in this one file; its configuration, and the current run
(loop/run.py).

One batch: ``fit`` -> ``strategy.launch`` -> ``_fit`` -> ``_train_step`` -> ``optimizer.step``
(16-mixed: through ``precision.step``, the GradScaler's). Manual optimization: ``_manual_step``,
whose task's training_step steps its optimizers itself. The step is the one written by hand: batch
to the device (not on the CPU), zero_grad at a group's start, forward and loss under autocast,
backward, every ``accumulate_grad_batches`` batches unscale -> hooks -> clip -> step. No device
value is read per step: the loss is converted once per ``log_every_n_steps`` (the one CPU-GPU sync).
The step's callables (``run.zero_grad``, ``run.training_step``, ``run.backward``,
``run.clip_gradients``, ``run.optimizer_step``) are fields of loop/run.py's Run, chosen once per fit
in loop/lifecycle.py's ``setup_fit``. docs/concepts.md maps the folders; Lightning's names and
argument checks come from compat/lightning/trainer.py.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from . import console
from .callback import StopRun
from .callbacks import (Callback, Logger, ModelCheckpoint, refuse_checkpoint_callbacks,
                        with_defaults)
from .callbacks.loggers.logger import DUMMY_LOGGER
from .checkpoint.files import CheckpointWriter
from .checkpoint.rng import isolated_rng
from .compat.lightning.trainer import LightningArguments, LightningNames, entry_keywords
from .data.loaders import (
    OneAhead,
    batch_size_of,
    empty_train_loader,
    epoch_batches,
    length,
    limit_batches,
    set_epoch,
)
from .datamodule import DataModule, DataSource
from .errors import MisconfigurationError
from .init_args import run_hparams
from .logs.buffer import LogBuffer
from .logs.outputs import run_directory
from .loop import lifecycle, user_errors
from .loop.cadence import accumulation_group, steps_per_epoch
from .loop.checkpointing import load_run_state, no_training_state, preempt, run_state
from .loop.checks import (
    check_arguments,
    check_loss,
    check_manual,
    check_task,
    val_check_duration,
)
from .loop.evaluation import evaluation_pass, load_eval_loader, run_entry, sanity_pass
from .loop.hooks import drop_idle_batch_hooks, merge_task_callbacks
from .loop.preemption import normalize_signals, requeue_setting
from .loop.run import Run
from .loop.steps import batch_outputs, defines, step_loss
from .module import TaskModule
from .precision import building, check_strategy, normalize_precision
from .profilers.choice import profiler_for
from .state import TrainerState
from .strategies import model_memory
from .strategies.model_memory import checkpoint_policy
from .strategies.registry import select_strategy
from .trainer_config import Limits, TrainerConfig


def fitted_counters(state: TrainerState) -> tuple[int, int, int]:
    """Where a finished fit left off, for the next fit: (epoch, global_step, stepped_batches). A fit
    stopped mid-epoch (``max_steps``) continues at the next epoch, as Lightning's, whose
    ``current_epoch`` has moved on."""
    return state.epoch + (1 if state.batches_done else 0), state.global_step, state.stepped_batches


def _run_part(name: str, doc: str, empty: Any = None) -> property:
    """A read-only Trainer property: ``name`` of the current (or last) run, ``empty`` before any
    run."""
    return property(
        lambda self: getattr(self.run, name) if self.run is not None else empty, doc=doc
    )


def _configured(name: str, doc: str) -> property:
    """A Trainer property: the field ``name`` of its :class:`TrainerConfig` (trainer_config.py).
    Assigning it (``trainer.max_epochs = 3`` between fits) gives the Trainer a new configuration
    object with that field replaced; a run keeps the one it started with (``run.config``)."""
    def replace(self: Trainer, value: Any) -> None:
        self.trainer_config = dataclasses.replace(self.trainer_config, **{name: value})
    return property(lambda self: getattr(self.trainer_config, name), replace, doc=doc)


def _limit(stage: str) -> property:
    """``trainer.limit_<stage>_batches`` (Lightning's attribute): ``limits[stage]`` of the
    configuration; assigning it replaces that limit for the next run, as ``_configured`` does."""
    def replace(self: Trainer, value: Any) -> None:
        limits = dataclasses.replace(self.trainer_config.limits, **{stage: value})
        self.trainer_config = dataclasses.replace(self.trainer_config, limits=limits)
    return property(lambda self: self.trainer_config.limits[stage], replace,
                    doc=f"``Trainer(limit_{stage}_batches=...)``: batches (int) or a fraction "
                        "(float) of each loader.")


# compat/lightning/trainer.py: Lightning's names, Trainer(num_nodes=2) and Trainer(max_epoch=3) as
# one catalogued error, precision=None and max_steps=-1
class Trainer(LightningNames, metaclass=LightningArguments):
    """Fits, validates, tests and predicts with a `TaskModule`. Every argument: docs/trainer.md."""
    def __init__(
        self,
        *,
        max_epochs: int | None = None,
        min_epochs: int | None = None,
        max_steps: int | None = None,
        min_steps: int | None = None,
        accelerator: str = "auto",
        devices: int | str | Sequence[int] = "auto",
        strategy: Any = "auto",
        precision: str | int = "32",
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        limit_train_batches: int | float = 1.0,
        limit_val_batches: int | float = 1.0,
        limit_test_batches: int | float = 1.0,
        limit_predict_batches: int | float = 1.0,
        val_check_interval: int | float | str | datetime.timedelta | Mapping[str, float] = 1.0,
        check_val_every_n_epoch: int | None = 1,
        reload_dataloaders_every_n_epochs: int = 0,
        num_sanity_val_steps: int = 2,
        log_every_n_steps: int = 50,
        fast_dev_run: bool | int = False,
        overfit_batches: int | float = 0,
        deterministic: bool = False,
        callbacks: Sequence[Callback] | None = None,
        default_root_dir: str | None = None,
        profiler: Any = None,
        enable_progress_bar: bool = True,
        enable_model_summary: bool = True,
        enable_checkpointing: bool = True,
        logger: bool | Logger | Sequence[Logger] = True,
        nonfinite_loss: str = "raise",
        seed: int | None = None,
        compile: bool = False,
        channels_last: bool = False,
        preempt_signals: Sequence[str] = ("SIGTERM", "SIGUSR1", "SIGINT"),
        preempt_exit_code: int | None = None,
        requeue: bool | None = None,
        config: Mapping[str, Any] | None = None,
        activation_checkpointing: Any = None,
    ) -> None:
        check_arguments(locals())
        precision_name = normalize_precision(precision)
        self.strategy = select_strategy(strategy, accelerator, devices)
        policy = checkpoint_policy(activation_checkpointing)  # strategies/model_memory.py
        signals = normalize_signals(preempt_signals)
        # The one configuration object (trainer_config.py), every run holds it: built here from
        # the arguments, replaced (never changed) by fast_dev_run, overfit_batches and fit's
        # default max_epochs.
        limits = Limits(limit_train_batches, limit_val_batches, limit_test_batches,
                        limit_predict_batches)
        self.trainer_config = TrainerConfig.from_arguments(
            locals(), precision=precision_name, activation_checkpointing=policy, limits=limits,
            val_check_interval=val_check_duration(val_check_interval) or val_check_interval,
            fast_dev_run=int(fast_dev_run), preempt_signals=signals,
            requeue=requeue_setting(requeue, signals),
            command_config=dict(config) if config is not None else None)
        if enable_checkpointing is False:
            refuse_checkpoint_callbacks(callbacks)
        if self.fast_dev_run:  # n batches of everything, one epoch, nothing written
            self.trainer_config = self.trainer_config.for_fast_dev_run()
            enable_checkpointing = logger = False
        if overfit_batches:
            self.trainer_config = self.trainer_config.for_overfit_batches()
        self.callbacks, self.profiler = profiler_for(
            profiler,
            with_defaults(
                callbacks,
                progress=enable_progress_bar,
                # None: adds nothing
                summary=enable_model_summary,
                checkpointing=enable_checkpointing,
                logger=logger,
            ),
        )
        self.state = TrainerState()  # the counters of the current or last run (a new one per fit)
        # the current or last run: task, model, optimizers, loaders... (loop/run.py)
        self.run: Run | None = None
        # a self-launched fit's run directory and task, as its rank 0 reported them
        self._log_dir: str | None = None
        self._spawned_task: TaskModule | None = None
        # (epoch, global_step) where the last fit that ran to its end left off: the next fit without
        # ckpt_path continues from there, as Lightning's fit loop does (nothing left: it returns at
        # once)
        self._fitted: tuple[int, int, int] | None = None  # (and state.stepped_batches)
        # writes checkpoint files off the training thread
        self.checkpoint_writer = CheckpointWriter()
        # the task's configure_callbacks() join each run's callbacks (not in trial_trainer's runs)
        self._task_callbacks = True

    def init_module(self, empty_init: bool | None = None) -> Any:
        """``with trainer.init_module(empty_init=True): task = MyTask()``: layers on the meta device
        (strategies/model_memory.py; docs/big-models.md); under a true precision ("bf16-true"),
        built in its dtype (precision.py)."""
        return building(self.precision_name, model_memory.init_module(self.strategy, empty_init))

    # ---- entry points (Lightning's arguments, in Lightning's positions) --------------------------
    def fit(
        self,
        task: TaskModule | None = None,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | None = None,
        **lightning: Any,
    ) -> dict[str, float]:
        """Train ``task`` (its loaders, those passed or ``datamodule``'s), resuming ``ckpt_path``;
        the final metrics. ``lightning``: Lightning's keywords (``model=``, ``weights_only=``;
        compat/lightning/trainer.py)."""
        task = entry_keywords(self.fit, task, lightning, required=True)
        data = DataSource(task, "fit", datamodule, train_dataloaders, val_dataloaders)
        check_task(task, "fit", data=data)
        check_manual(
            task, self.accumulate_grad_batches, self.gradient_clip_val, self.nonfinite_loss
        )
        check_strategy(self.precision_name, self.strategy)
        if ckpt_path is None and self._nothing_left_to_fit():  # Lightning's early return
            return {}
        try:
            return self.strategy.launch(self._fit, task, data, ckpt_path)
        except StopRun:  # a callback ended the fit after its work (the Tuner's finders)
            return {}
        except Exception as exc:  # the user's error: its message, plus where (loop/user_errors.py)
            raise user_errors.explain(exc, self.run)

    def validate(
        self,
        task: TaskModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        verbose: bool = True,
        datamodule: DataModule | None = None,
        **lightning: Any,
    ) -> list[dict[str, float]]:
        """One validation pass; returns ``[metrics]``. Without ``task``: the fitted one, from
        ``ckpt_path``."""
        task = entry_keywords(self.validate, task, lightning) if lightning else task
        return self._entry("validate", task, dataloaders, datamodule, ckpt_path, True, verbose)

    def test(
        self,
        task: TaskModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        verbose: bool = True,
        datamodule: DataModule | None = None,
        **lightning: Any,
    ) -> list[dict[str, float]]:
        """One pass over the test loader; returns ``[metrics]``. Without ``task``: the fitted
        one."""
        task = entry_keywords(self.test, task, lightning) if lightning else task
        return self._entry("test", task, dataloaders, datamodule, ckpt_path, True, verbose)

    def predict(
        self,
        task: TaskModule | None = None,
        dataloaders: Any = None,
        datamodule: DataModule | None = None,
        return_predictions: bool | None = None,
        ckpt_path: str | None = None,
        **lightning: Any,
    ) -> list[Any] | None:
        """``predict_step`` (default ``task(inputs)``) per batch; ddp: all ranks', in order."""
        task = entry_keywords(self.predict, task, lightning) if lightning else task
        return self._entry(
            "predict", task, dataloaders, datamodule, ckpt_path, return_predictions is not False
        )

    def _entry(
        self,
        fn: str,
        task: TaskModule | None,
        loaders: Any,
        datamodule: Any,
        ckpt_path: str | None,
        *more: Any,
    ) -> Any:
        task, ckpt_path = lifecycle.fitted_task(self.task, fn, task, ckpt_path)
        data = DataSource(task, fn, datamodule, loaders=loaders)
        check_task(task, fn, data=data)
        check_strategy(self.precision_name, self.strategy)
        try:
            return self.strategy.launch(self._run_eval, fn, task, data, ckpt_path, *more)
        except StopRun:  # a callback ended the pass after its work (the Tuner's finders)
            return None if fn == "predict" else []
        except Exception as exc:  # the user's error: its message, plus where (loop/user_errors.py)
            raise user_errors.explain(exc, self.run)

    # ---- fit: epochs and batches -----------------------------------------------------------------
    def _fit(self, task: TaskModule, data: DataSource, ckpt_path: str | None) -> dict[str, float]:
        self._default_max_epochs()
        # Lightning's fit loop continues its counters from the last finished fit
        epoch, step, stepped = self._fitted if ckpt_path is None and self._fitted else (0, 0, 0)
        self.state = TrainerState(epoch=epoch, global_step=step, stepped_batches=stepped)
        # the task's configure_callbacks()
        if self._task_callbacks:
            self.callbacks = merge_task_callbacks(self.callbacks, task)
        self.run = run = lifecycle.new_run(self, task, "fit", data, self.callbacks, self.state,
                                           log_dir=None, policies=self._checkpoint_policies(),
                                           **self._run_parts())
        with lifecycle.running(run):
            lifecycle.setup_fit(run, ckpt_path)
            st = self.state
            run.call_hooks("on_fit_start")
            # a per-batch call only where it does work
            on_start, on_end = drop_idle_batch_hooks(run.hooks, self)
            on_logged_start = run.hooks["on_logged_batch_start"]
            config = run.config
            max_steps = math.inf if config.max_steps is None else config.max_steps
            log_every = config.log_every_n_steps
            # automatic or manual optimization: one plain function each, chosen once per fit
            train_step = self._manual_step if run.manual else self._train_step
            # each batch counts as stepped
            every_batch = run.manual or config.accumulate_grad_batches == 1
            if config.num_sanity_val_steps and run.val_loader is not None and not st.resumed:
                self._sanity_check()
            reload_every = config.reload_dataloaders_every_n_epochs
            # the first epoch's iterator, before on_train_start, as Lightning's
            batches = self._epoch_batches()
            self._epoch_hooks("on_train_start")
            run.val_schedule.start()  # a duration val_check_interval counts from here
            while not self._finished():  # (a preemption signal: save a checkpoint and exit, here)
                # every n-th epoch counted from 0 (a resumed fit reloads where the uninterrupted one
                # did), not twice in an epoch: the *_dataloader() methods again, before its hooks
                if reload_every and st.epoch % reload_every == 0 and st.epoch != run.loaders_epoch:
                    lifecycle.load_fit_loaders(run, resuming=True)
                loader, n, validating = self._start_epoch()
                completed, clock = True, time.perf_counter
                waited = clock()  # creating the DataLoader iterator counts as waiting for data
                # epochs after the first: after on_train_epoch_start (the first too when a
                # callback reloaded the loaders there: run.batches is None then)
                if batches is None or run.batches is None:
                    batches = self._epoch_batches()
                for batch_idx, batch in enumerate(batches, st.batches_done):
                    # host time spent in the DataLoader (ThroughputMonitor)
                    st.data_wait_s += clock() - waited
                    if batch_idx >= n:  # an iterable yielding more than its length (not resumable)
                        break
                    st.batch_idx = batch_idx
                    # on the CPU a batch stays where it is, without even a call
                    if run.moves_batches:
                        batch = run.batch_to_device(batch)
                    # this batch's step logs (Lightning's should_update_logs: the count with it, if
                    # it steps, is a multiple of log_every_n_steps); its rates are read before it
                    logs_step = (st.stepped_batches + 1) % log_every == 0
                    if logs_step and on_logged_start:
                        for fn in on_logged_start:
                            fn(self, task)
                    for fn in on_start:
                        fn(self, task, batch, batch_idx)
                    step = st.global_step
                    outputs = train_step(batch, batch_idx)
                    st.log_at_previous = stepped = every_batch or st.global_step != step
                    # Lightning's log_every_n_steps counts these (manual: batches)
                    st.stepped_batches += stepped
                    if stepped and logs_step:
                        # at state.log_step: the count before this batch, as Lightning
                        self._log_interval()
                    st.batches_done = batch_idx + 1
                    # outputs: Lightning's mapping with "loss" (steps.batch_outputs)
                    for fn in on_end:
                        fn(self, task, outputs, batch, batch_idx)
                    if validating and run.val_schedule.due(st.epoch, batch_idx):
                        self._validate()  # after the batch's hooks, as Lightning
                    # what is published from here on is at the count with this batch
                    st.log_at_previous = False
                    # the batch stepped: step-interval ReduceLROnPlateau (it may read a value
                    # logged in this step), then leave the epoch?
                    if st.global_step != step:
                        if run.schedulers.plateau_per_step:
                            run.schedulers.after_step(
                                st.global_step, run.logs.monitored(st.metrics), plateau=True
                            )
                        stop = run.preemption.should_break(st) and self._can_stop
                        if stop or st.global_step >= max_steps:
                            completed = st.batches_done >= n
                            break
                    waited = clock()
                else:
                    if run.val_schedule.at_exhaustion and st.batches_done and validating:
                        self._validate()  # a loader without len(): validate when it is exhausted
                batches = None  # the next epoch's: after its on_train_epoch_start, as Lightning's
                if st.batches_done == 0 and n:
                    raise empty_train_loader(loader)  # a loader without len() that yielded nothing
                self._end_epoch(completed=completed and (st.batches_done >= n or n == float("inf")))
            st.stage = "idle"
            run.call_hooks("on_train_end")
            run.call_hooks("on_fit_end")
            # a validate/test after fit: at the fit's count (Lightning's)
            st.log_at_previous = False
            self.checkpoint_writer.close()  # every checkpoint file is in place before fit returns
            self._fitted = fitted_counters(st)
            return dict(st.metrics)

    def _nothing_left_to_fit(self) -> bool:
        """Lightning's fit loop keeps its progress: after a fit that reached
        ``max_steps``/``max_epochs``, another fit trains nothing. Lightning's message, and its
        emptied ``callback_metrics``."""
        epoch, step, _ = self._fitted or (0, 0, 0)
        if self._fitted is None or not (
            self._max_steps_reached_at(step) or self._max_epochs_reached_at(epoch)
        ):
            return False
        name = "max_steps" if self._max_steps_reached_at(step) else "max_epochs"
        console.echo(f"`Trainer.fit` stopped: `{name}={getattr(self, name)!r}` reached. (This "
                     "Trainer's last fit reached it: this one trains nothing, as in Lightning. "
                     f"HINT: raise trainer.{name} to train on from there, or fit with a new "
                     "Trainer to start over.)")
        self.state.metrics.clear()
        return True

    def _max_steps_reached_at(self, step: int) -> bool:
        return self.max_steps is not None and step >= self.max_steps

    def _max_epochs_reached_at(self, epoch: int) -> bool:
        # max_epochs=-1: no epoch limit (Lightning's)
        return self.max_epochs is not None and self.max_epochs != -1 and epoch >= self.max_epochs

    def _default_max_epochs(self) -> None:
        """No max_epochs nor max_steps: Lightning's default of 1000 epochs, with its warning.
        ``max_epochs=-1`` without ``max_steps``: a fit without an end of its own, said once."""
        if self.max_epochs is None and self.max_steps is None:
            self.trainer_config = dataclasses.replace(self.trainer_config, max_epochs=1000)
            if self.strategy.rank == 0:
                warnings.warn("Trainer: max_epochs was not set, so fit stops after 1000 epochs "
                              "(Lightning's default). HINT: pass Trainer(max_epochs=N) or "
                              "max_steps=N.", stacklevel=5)
        elif self.max_epochs == -1 and self.max_steps is None and self.strategy.rank == 0:
            ends = ("its EarlyStopping stops it, " if self.early_stopping_callbacks else
                    "a callback sets trainer.should_stop = True, ")
            console.echo(f"Trainer(max_epochs=-1) without max_steps: this fit has no epoch or step "
                         f"limit and trains until {ends}or it is interrupted (Ctrl-C, or SIGTERM, "
                         "which saves a checkpoint that fit(task, ckpt_path='last') continues).",
                         name="taskfit.trainer")

    def _train_step(self, batch: Any, batch_idx: int) -> Any:
        """Automatic optimization, one batch, in a hand-written loop's order: zero_grad at a
        group's start, the step (forward and loss, steps.py), backward, and at a group's end
        unscale -> hooks -> clip -> optimizer.step. Returns what on_train_batch_end gets
        (Lightning's mapping with the detached loss)."""
        run, st = self.run, self.state
        # epoch means of logged values weigh by the batch's size
        run.logs.train.weight = samples = batch_size_of(batch)
        k = run.config.accumulate_grad_batches
        group, steps = (1, True) if k == 1 else accumulation_group(batch_idx, k,
                                                                    run.num_train_batches)
        if k > 1:
            # ddp/fsdp reduce gradients only on the micro-batch that steps (a flag, no context)
            self.strategy.gradient_sync(run.model, steps)
        if batch_idx % k == 0:
            # a group's first batch: zero_grad before the forward (+ on_before_zero_grad hooks)
            run.zero_grad(set_to_none=True)
        # under autocast (the forward and the loss only: lifecycle.setup_fit)
        out = run.training_step(batch, batch_idx)
        if type(out) is torch.Tensor:
            # the usual step: a loss, detached once for the log and the batch hooks
            loss, outputs = out, {"loss": out.detach()}
        else:
            loss, outputs = step_loss(out, run.task, False), batch_outputs(out)
        if loss is None:
            # The task skips this batch (Lightning's meaning): no backward; the batch still ends
            # its group as any other, so the optimizer steps on the gradients the group has (none:
            # the parameters stay as they are) and global_step counts it, as Lightning's
            if not steps:
                return outputs
            if run.precision.scales_loss:
                # Lightning's 16-mixed neither unscales nor steps the optimizer after a batch
                # without a loss (not an overflow: the schedulers step, as Lightning's)
                st.global_step += 1
                if run.schedulers.per_step:
                    run.schedulers.after_step(st.global_step, st.metrics)
                return outputs
        else:
            if not run.loss_checked:
                source = "training_step" if defines(run.task, "training_step") else "loss"
                check_loss(loss, run.task, True, source)
                run.loss_checked = True
            # kept as a tensor, converted at the log interval (no sync here)
            run.logs.add_loss(outputs["loss"], samples)
            if run.config.nonfinite_loss == "skip" and not torch.isfinite(loss):
                # a sync per step, opted into; this group's gradients so far go with the step
                st.skipped_steps += 1
                run.optimizer.zero_grad(set_to_none=True)
                return outputs
            # loss.backward() (+ the backward hooks, if any)
            run.backward(loss if group == 1 else loss / group)
            if not steps:
                return outputs
        if run.before_step_work:
            # a GradScaler to unscale, or on_before_optimizer_step hooks (else: no call)
            run.before_optimizer_step(run.optimizer)
        if run.clip_gradients is not None:
            run.clip_gradients()
        if run.task_optimizer_step is None:
            # optimizer.step (None), or through the GradScaler: False when it skipped the step
            stepped = run.optimizer_step() is not False
        else:
            # the task's optimizer_step (Lightning's override, loop/overrides.py)
            stepped = run.task_optimizer_step(loss)
        st.global_step += 1
        if stepped and run.schedulers.per_step:
            run.schedulers.after_step(st.global_step, st.metrics)
        return outputs

    def _manual_step(self, batch: Any, batch_idx: int) -> Any:
        """Manual optimization, one batch: the task's training_step zeroes, backpropagates
        (``self.manual_backward``) and steps its optimizers itself (steps.py's ManualOptimizer:
        unscale, hooks, ddp average, global_step); the loop logs the loss it returns. Returns
        what on_train_batch_end gets."""
        run = self.run
        run.logs.train.weight = samples = batch_size_of(batch)
        out = run.training_step(batch, batch_idx)
        loss, outputs = step_loss(out, run.task, True), batch_outputs(out)
        if loss is None:
            return outputs
        if not run.loss_checked:
            check_loss(loss, run.task, False, "training_step")
            run.loss_checked = True
        run.logs.add_loss(outputs["loss"], samples)
        return outputs

    def _log_interval(self) -> None:
        """This step's training values as floats (one tolist(): the sync point), ranks agree on
        stops, hooks."""
        self.run.publish(self.run.logs.interval(self.state))
        self.run.preemption.agree(self.state)
        self.run.call_hooks("on_log_interval")

    def _finished(self) -> bool:
        """max_epochs, max_steps or should_stop (ddp: agreed). After a preemption signal: save and
        exit, here."""
        st, preemption = self.state, self.run.preemption
        preemption.agree(st)
        if preemption.requested:
            preempt(self.run)
        return (st.should_stop and self._can_stop) or self._max_steps_reached or (
            self._max_epochs_reached_at(st.epoch))

    @property
    def _can_stop(self) -> bool:
        """should_stop ends training once min_epochs and min_steps are reached (Lightning's rule:
        min_steps alone implies min_epochs=1); a preemption signal at once."""
        st, min_epochs = (
            self.state,
            self.min_epochs if self.min_epochs is not None else int(self.min_steps is not None),
        )
        if (
            self.run.preemption.requested
            or min_epochs <= st.epoch
            and (self.min_steps or 0) <= st.global_step
        ):
            return True
        warnings.warn(f"should_stop was set, but min_epochs={self.min_epochs} / "
                      f"min_steps={self.min_steps} are not reached: training continues until they "
                      "are (as Lightning).", UserWarning, stacklevel=2)
        return False

    @property
    def _max_steps_reached(self) -> bool:
        return self._max_steps_reached_at(self.state.global_step)

    def _epoch_batches(self) -> Any:
        """The epoch's training batches from where it stands, fetched as Lightning's loop fetches
        them (loaders.epoch_batches); creating the iterator draws from the global RNG as torch's
        DataLoader does."""
        st, run = self.state, self.run
        set_epoch(run.train_dataloader, st.epoch, st.batches_done)
        run.batches = epoch_batches(run.train_dataloader, run.num_train_batches, st.batches_done)
        return run.batches

    # the loader set to this epoch, its batches, validating?
    def _start_epoch(self) -> tuple[Any, float, bool]:
        st, run = self.state, self.run
        st.stage, st.log_at_previous = "train", False
        self._epoch_hooks("on_train_epoch_start")  # (each submodule keeps its mode: loop/modes.py)
        run.val_schedule.start_epoch(st.batches_before_epoch)
        return run.train_dataloader, run.num_train_batches, run.val_schedule.in_epoch(st.epoch)

    def _end_epoch(self, completed: bool) -> None:
        st, run, logs = self.state, self.run, self.run.logs
        # the epoch's values, and the fit's closing ones after the last epoch: at the last batch's
        # step (Lightning)
        st.epoch_done, st.log_at_previous = completed, True
        # an epoch shorter than log_every_n_steps
        if not logs.logged_this_epoch and logs.step_logged:
            self._log_interval()  # logs its last step here: a short run still has its curves
        logs.check_pending(st.epoch)  # the losses since the last log (a sync, once per epoch)
        run.publish(logs.epoch_values(logs.train))  # torchmetrics computed, reset after the hooks
        if completed:
            run.schedulers.after_epoch(st.epoch, st.metrics)
        # hook_table publishes what the task logged there, before monitors
        self._epoch_hooks("on_train_epoch_end")
        logs.train.reset_metrics()
        if completed:
            st.batches_before_epoch += st.batches_done
            st.epoch, st.batches_done, st.epoch_done = st.epoch + 1, 0, False
            logs.new_epoch(st.global_step)

    def _epoch_hooks(self, hook: str) -> None:
        """An epoch-level hook: self.log there defaults to the epoch's value (on_epoch=True), as in
        Lightning."""
        self.run.logs.train.epoch_level = True
        try:
            self.run.call_hooks(hook)
        finally:
            self.run.logs.train.epoch_level = False

    # ---- validation, test, predict (evaluation.py) -----------------------------------------------
    def _sanity_check(self) -> None:
        """A few validation batches before training, to fail fast; nothing is logged. The callbacks'
        on_validation_start/end do not fire for it (Lightning's epoch and batch hooks do:
        evaluation.sanity_pass)."""
        run = self.run
        self.state.stage = "sanity"
        run.call_hooks("on_sanity_check_start")
        # what the sanity check draws does not shift training's random numbers (Lightning's)
        with isolated_rng():
            sanity_pass(run, self.num_sanity_val_steps)  # batches of each validation loader
        run.call_hooks("on_sanity_check_end")
        self.state.stage = "idle"

    def _validate(self) -> None:
        run = self.run
        self.state.stage = "val"
        run.call_hooks("on_validation_start")
        # limit_val_batches of each loader
        run.publish(evaluation_pass(run, "val", run.val_loader, math.inf))
        run.preemption.agree(self.state)
        run.call_hooks("on_validation_end")
        run.val_schedule.validated()
        self.state.stage = "train"

    def _run_eval(self, fn: str, task: TaskModule, data: DataSource, ckpt_path: str | None,
                  keep: bool = True, verbose: bool = True) -> list[Any] | None:
        """One pass of ``validate``/``test`` (returns ``[metrics]``; ``verbose``: the results table
        printed) or ``predict`` (returns the predictions if ``keep``)."""
        if self._task_callbacks:
            self.callbacks = merge_task_callbacks(self.callbacks, task)
        # callback_metrics hold this pass's values only, as Lightning's after validate/test
        if fn != "predict":
            self.state.metrics.clear()
        self.run = run = lifecycle.new_run(
            self,
            task,
            fn,
            data,
            self.callbacks,
            self.state,
            log_dir=self.log_dir,
            verbose=verbose,
            policies=self._checkpoint_policies(),
            **self._run_parts(),
        )
        with lifecycle.running(run, weights=ckpt_path):
            return run_entry(run, fn, keep)

    def _run_parts(self) -> dict[str, Any]:
        """What a run takes from this Trainer: its configuration, strategy and checkpoint writer
        (handed down: nothing below the Trainer reads it)."""
        return dict(config=self.trainer_config, strategy=self.strategy,
                    writer=self.checkpoint_writer)

    # ---- what tools run: short runs on the task, loaders read again ------------------------------
    def trial_trainer(self, callbacks: Sequence[Callback], **settings: Any) -> Trainer:
        """A Trainer (of this one's class) for a tool's short runs on its task (lr_find's range
        test, BatchSizeFinder's trials): this Trainer's strategy, precision, accumulation,
        clipping, seed and determinism, ``callbacks`` only (not the task's
        ``configure_callbacks()``), no sanity check, nothing written and nothing shown;
        ``settings`` are Trainer arguments that replace those (``max_steps=3``)."""
        arguments: dict[str, Any] = dict(
            strategy=self.strategy,
            precision=self.precision_name,
            accumulate_grad_batches=self.accumulate_grad_batches,
            gradient_clip_val=self.gradient_clip_val,
            gradient_clip_algorithm=self.gradient_clip_algorithm,
            deterministic=self.deterministic,
            seed=self.seed,
            channels_last=self.channels_last,
            num_sanity_val_steps=0,
            default_root_dir=self.default_root_dir,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            logger=False,
            preempt_signals=(),
        )
        # this Trainer's class, built past the metaclass: its Lightning notes about limit_*_batches
        # are about the user's arguments, not the tool's
        trainer = type(self).__new__(type(self))
        trainer.__init__(callbacks=list(callbacks), **{**arguments, **settings})
        trainer._task_callbacks = False
        return trainer

    def reload_dataloaders(self) -> None:
        """Build the running entry point's loaders again from their source (the task's or data
        module's ``*_dataloader()`` methods), for a callback that changed what they read (the batch
        size: BatchSizeFinder): in fit from ``on_fit_start`` or ``on_train_epoch_start`` (the
        epoch's batches come from the new loader), in validate/test/predict from their
        ``on_*_start``."""
        run = self.run
        if run is None or run.state.status != "running":
            raise MisconfigurationError(
                "Trainer.reload_dataloaders() was called outside a run.",
                "call it from a callback hook during fit/validate/test/predict (e.g. "
                "on_fit_start); outside a run the next entry point reads the loaders anyway.")
        if run.fn != "fit":
            load_eval_loader(run)
            return
        if self.state.batches_done:
            raise MisconfigurationError(
                "Trainer.reload_dataloaders() was called in the middle of a training epoch "
                f"(after its batch {self.state.batches_done - 1}, e.g. in a fit resumed there): "
                "the epoch's position belongs to the old loaders.",
                "call it from on_fit_start or on_train_epoch_start of a fit that starts its "
                "epoch from the beginning (resume a mid-epoch checkpoint without "
                "BatchSizeFinder).")
        lifecycle.load_fit_loaders(run)
        # an epoch's batches from the new loader, made when the loop reads them
        run.batches = None

    # ---- hooks and published values --------------------------------------------------------------
    def call_hooks(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on every callback (and task, data module) of the current run that defines
        it."""
        self.run.call_hooks(hook, *args)

    # ---- what callbacks read and call ------------------------------------------------------------
    def log_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Publish values from a callback at the current step (``state.log_step``): into
        ``state.metrics`` and every ``on_log``."""
        self.run.publish(LogBuffer.to_floats(metrics))

    @property
    def precision(self) -> str:
        """The precision's name, before a run too: "32", "bf16-mixed", "16-mixed", "bf16-true",
        "16-true" (Lightning's ``trainer.precision``). The run's
        :class:`~taskfit.precision.Precision`: :attr:`precision_plugin`."""
        return self.precision_name

    @property
    def is_main(self) -> bool:
        """True on the process that logs, draws progress and writes files (rank 0)."""
        return self.strategy.is_main

    @property
    def hparams(self) -> dict[str, Any]:
        """The run's hyperparameters: the flattened resolved config (CLI) or the TaskModule's init
        arguments."""
        return run_hparams(self.config, self.task)

    @property
    def should_stop(self) -> bool:
        """Set to True (from a callback) to end training cleanly at the next batch boundary."""
        return self.state.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self.state.should_stop = bool(value)

    @property
    def loggers(self) -> list[Logger]:
        """The loggers among the callbacks; under ``fast_dev_run`` without one, Lightning's
        ``[DummyLogger()]`` (``self.logger.experiment.add_image(...)`` runs and writes nothing)."""
        loggers = [cb for cb in self.callbacks if isinstance(cb, Logger)]
        return [DUMMY_LOGGER] if self.fast_dev_run and not loggers else loggers

    @property
    # the first logger: ``trainer.logger.experiment`` is TensorBoard's writer
    def logger(self) -> Logger | None:
        return next(iter(self.loggers), None)

    @property
    # the first ModelCheckpoint of the callbacks, or None
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        return next((cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)), None)

    def _checkpoint_policies(self) -> list[ModelCheckpoint]:
        """The ModelCheckpoint callbacks: the configuration and ranking of the run's checkpoint
        manager."""
        return [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]

    # ---- the configuration: Lightning's names for trainer_config.py's fields -----------------
    precision_name = _configured("precision",
                                 '``Trainer(precision=...)`` normalized (``"bf16-mixed"``).')
    compile = _configured("compile", "``Trainer(compile=...)``: torch.compile the wrapped module.")
    channels_last = _configured("channels_last", "``Trainer(channels_last=...)``.")
    activation_checkpointing = _configured(
        "activation_checkpointing", "The checked activation checkpointing policy.")
    max_epochs = _configured("max_epochs",
                             "The epochs a fit runs at most (-1: no limit; None: 1000 unless "
                             "max_steps is set).")
    max_steps = _configured("max_steps",
                            "The optimizer steps a fit takes at most (None: no limit).")
    min_epochs = _configured("min_epochs", "should_stop waits for this many epochs.")
    min_steps = _configured("min_steps", "should_stop waits for this many optimizer steps.")
    accumulate_grad_batches = _configured("accumulate_grad_batches", "Batches per optimizer step.")
    gradient_clip_val = _configured("gradient_clip_val",
                                    "The clipping threshold (None: no clipping).")
    gradient_clip_algorithm = _configured("gradient_clip_algorithm", '``"norm"`` or ``"value"``.')
    nonfinite_loss = _configured("nonfinite_loss", '``"raise"`` or ``"skip"`` a NaN/Inf loss.')
    seed = _configured("seed", "The seed every run starts from (None: not seeded).")
    deterministic = _configured("deterministic", "torch.use_deterministic_algorithms during runs.")
    limits = _configured("limits", '``limit_*_batches`` by stage: ``trainer.limits["val"]``.')
    overfit_batches = _configured("overfit_batches", "``Trainer(overfit_batches=...)``.")
    val_check_interval = _configured(
        "val_check_interval", "Validation within an epoch: a fraction, batches or a duration "
                              "(a datetime.timedelta).")
    limit_train_batches = _limit("train")
    limit_val_batches = _limit("val")
    limit_test_batches = _limit("test")
    limit_predict_batches = _limit("predict")
    check_val_every_n_epoch = _configured("check_val_every_n_epoch", "Validation every n epochs.")
    reload_dataloaders_every_n_epochs = _configured(
        "reload_dataloaders_every_n_epochs", "The fit's loaders are built again every n epochs "
                                             "(0: once per fit).")
    num_sanity_val_steps = _configured("num_sanity_val_steps",
                                       "Validation batches of the sanity check.")
    log_every_n_steps = _configured("log_every_n_steps",
                                    "Optimizer steps between two log intervals.")
    fast_dev_run = _configured("fast_dev_run",
                               "``Trainer(fast_dev_run=n)``: n batches of everything (0: off).")
    default_root_dir = _configured("default_root_dir",
                                   "Where runs write without a logger's save_dir.")
    preempt_signals = _configured("preempt_signals", "The signals that save a checkpoint and exit.")
    preempt_exit_code = _configured("preempt_exit_code",
                                    "The status of that exit (None: 128 + the signal).")
    requeue = _configured("requeue", "A SIGUSR1 also requeues the SLURM job.")
    config = _configured("command_config",
                         "The taskfit command's resolved config (``Trainer(config=...)``) or None.")

    # ---- the current (or last) run's parts, read-only: loop/run.py declares each -----------------
    @property
    def task(self) -> TaskModule | None:
        """The TaskModule of the current or last run (after a self-launched ddp fit: the fitted one,
        in the parent)."""
        return self.run.task if self.run is not None else self._spawned_task

    @property
    def log_dir(self) -> str | None:
        """The run directory of the current or last run: logs and checkpoints go there. Before the
        first run, where it will go (Lightning's ``trainer.log_dir`` before fit: the first
        logger's ``log_dir``), as far as the folders on disk tell now."""
        if self.run is not None:
            return self.run.log_dir
        if self._log_dir is None:
            return run_directory(self.callbacks, self.default_root_dir)
        return self._log_dir

    data = _run_part("data", "Where the run's loaders come from (loop/run.py's DataSource).")
    model = _run_part("model", "The module the loop calls: the task wrapped by the strategy (and "
                               "torch.compile).")
    optimizer = _run_part("optimizer", "The first optimizer of the fit.")
    optimizers = _run_part("optimizers", "Every optimizer of the fit.", empty=[])
    manual = _run_part("manual", "The task steps its own optimizers (automatic_optimization = "
                                 "False).", empty=False)
    manual_optimizers = _run_part("manual_optimizers", "What self.optimizers() returns under "
                                                       "manual optimization.",
                                  empty=[])
    schedulers = _run_part("schedulers", "The fit's learning-rate schedulers (optim.py's "
                                         "Schedulers).")
    precision_plugin = _run_part("precision",
                                 "The run's Precision: autocast, GradScaler... (precision.py).")
    logs = _run_part("logs", "The run's logging buffer (logs/buffer.py).")
    hooks = _run_part("hooks", "Hook name -> what the run calls for it, in Lightning's order "
                               "(loop/hooks.py).")
    metrics = _run_part("metrics", "configure_metrics()' torchmetrics by stage.")
    preemption = _run_part("preemption", "The run's preemption signals (loop/preemption.py).")
    checkpointer = _run_part("checkpointer", "The run's checkpoint manager (loop/checkpointer.py).")
    data_seed = _run_part("data_seed", "The seed of the run's data order.")
    train_dataloader = _run_part("train_dataloader", "The fit's training loader.")
    val_loader = _run_part("val_loader", "The fit's validation loader, or None.")
    predict_dataloader = _run_part("predict_dataloader", "The loader of the current or last "
                                                         "predict.")
    num_train_batches = _run_part("num_train_batches", "Training batches per epoch.", empty=0)
    num_val_batches = _run_part("num_val_batches", "Validation batches of each loader per pass "
                                "(Lightning's list; [] without "
                                "validation).", empty=[])
    val_schedule = _run_part("val_schedule", "When the fit validates (loop/cadence.py).")

    @property
    def is_last_batch(self) -> bool:
        """The training batch being (or last) run is its epoch's last: known one batch ahead for a
        loader without a length, as Lightning's prefetching fetcher knows it."""
        run = self.run
        if run is None or run.batches is None:
            return False
        if isinstance(run.batches, OneAhead):
            return run.batches.done
        return self.state.batch_idx + 1 >= run.num_train_batches

    # ---- a self-launched ddp fit (strategies/spawn.py): what the parent process sees of rank 0's r
    def worker_snapshot(self) -> dict[str, Any]:
        """Rank 0's counters, run directory and callback states, to send to the parent process."""
        return {"state": dataclasses.asdict(self.state), "log_dir": self.log_dir,
                "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks}}

    def load_worker_snapshot(self, snapshot: Mapping[str, Any], task: TaskModule | None) -> None:
        """In the parent process: continue from :meth:`worker_snapshot` of rank 0, with the fitted
        ``task``."""
        self.state = TrainerState(**snapshot["state"])
        if self.state.fn == "fit" and self.state.finished:
            self._fitted = fitted_counters(self.state)
        self.run, self._log_dir, self._spawned_task = None, snapshot["log_dir"], task
        for cb in self.callbacks:
            if cb.state_key in snapshot["callbacks"]:
                cb.load_state_dict(snapshot["callbacks"][cb.state_key])

    @property
    def estimated_stepping_batches(self) -> float:
        """Optimizer steps this fit will take (``max_steps``, or ``max_epochs`` of the training
        loader)."""
        loader = (
            self.data.train_dataloader() if self.train_dataloader is None else self.train_dataloader
        )
        batches = limit_batches(length(loader), self.limits["train"])
        per_epoch = steps_per_epoch(batches, self.accumulate_grad_batches)
        epochs = float("inf") if self.max_epochs in (None, -1) else self.max_epochs * per_epoch
        return epochs if self.max_steps is None else min(epochs, self.max_steps)

    # ---- the run's state, as checkpoints hold it -------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this fit exactly, each part asked for its own state
        (checkpoint.py's ``run_state``; docs/checkpointing.md). During fit only; every rank calls it
        (RNG states are gathered)."""
        return run_state(self.run)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where :meth:`state_dict` left off (``fit(ckpt_path=...)`` calls it, once the
        file is checked)."""
        load_run_state(self.run, state)

    def save_checkpoint(
        self, path: str | None = None, *, background: bool = False, **lightning: Any
    ) -> None:
        """Write :meth:`state_dict` atomically to ``path`` (every rank calls it); asynchronously
        with ``background``."""
        path = entry_keywords(self.save_checkpoint, path, lightning, required=True)
        if self.run is None:
            raise no_training_state(path)
        self.run.checkpointer.save(path, background)
