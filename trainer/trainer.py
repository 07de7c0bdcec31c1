"""Trainer: the loop, top to bottom, in this one file. docs/concepts.md maps the modules it delegates to.

One batch: ``fit`` -> ``strategy.launch`` -> ``_fit`` -> ``_train_step`` -> ``precision.step`` -> ``optimizer.step``.
The step is the one written by hand: batch to the device (not on the CPU), zero_grad at a group's start, forward
and loss under autocast, backward, every ``accumulate_grad_batches`` batches unscale -> hooks -> clip -> step. No
device value is read per step: the loss is converted once per ``log_every_n_steps`` (the one CPU-GPU sync).
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from .callbacks import Callback, Logger, ModelCheckpoint, drop_idle_batch_hooks, hook_table, with_defaults
from .checkpoint import load_run_state, load_weights, next_version_dir, restore, run_state, save_checkpoint
from .arguments import arguments_checked
from .checks import check_arguments, check_loss, check_manual, check_task
from .data import batch_size_of, empty_train_loader, eval_loader, fit_loaders, length, limit_batches, set_epoch
from .evaluation import evaluate, predict
from .logbook import LogBuffer
from .metrics import build_metrics
from .module import TaskModule, flatten
from .optim import Schedulers, gradient_clipper, parse_optimizers
from .precision import Precision, normalize_precision
from .preemption import Preemption, normalize_signals, preempt, requeue_setting
from .schedule import ValidationSchedule, accumulation_group
from .seed import deterministic_algorithms, run_seed, seed_everything
from .serialization import CheckpointWriter
from .state import TrainerState
from .steps import ManualOptimizer, defines, detached, step_loss, training_step
from .strategy_registry import select_strategy


class Trainer:
    """Fits, validates, tests and predicts with a `TaskModule`. Every argument: docs/trainer.md."""

    @arguments_checked(docs="docs/trainer.md")  # Trainer(max_epoch=3): one error naming max_epochs (arguments.py)
    def __init__(
        self, *, max_epochs: int | None = None, max_steps: int | None = None, accelerator: str = "auto",
        devices: int | str | Sequence[int] = "auto", strategy: Any = "auto", precision: str | int = "32",
        accumulate_grad_batches: int = 1, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm", limit_train_batches: int | float = 1.0,
        limit_val_batches: int | float = 1.0, limit_test_batches: int | float = 1.0,
        limit_predict_batches: int | float = 1.0, val_check_interval: int | float = 1.0,
        check_val_every_n_epoch: int | None = 1, num_sanity_val_steps: int = 2, log_every_n_steps: int = 50,
        fast_dev_run: bool | int = False, overfit_batches: int | float = 0, deterministic: bool = False,
        callbacks: Sequence[Callback] | None = None, default_root_dir: str | None = None,
        enable_progress_bar: bool = True, enable_model_summary: bool = True, enable_checkpointing: bool = True,
        logger: bool | Logger | Sequence[Logger] = True, nonfinite_loss: str = "raise", seed: int | None = None, compile: bool = False,
        channels_last: bool = False, preempt_signals: Sequence[str] = ("SIGTERM", "SIGUSR1", "SIGINT"),
        preempt_exit_code: int | None = None, requeue: bool | None = None, config: Mapping[str, Any] | None = None,
    ) -> None:
        check_arguments(locals())
        self.precision_name = normalize_precision(precision)
        self.strategy = select_strategy(strategy, accelerator, devices)
        self.max_epochs, self.max_steps = max_epochs, max_steps
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val, self.gradient_clip_algorithm = gradient_clip_val, gradient_clip_algorithm
        self.limits = {"train": limit_train_batches, "val": limit_val_batches, "test": limit_test_batches,
                       "predict": limit_predict_batches}  # limit_*_batches by stage
        self.val_check_interval, self.check_val_every_n_epoch = val_check_interval, check_val_every_n_epoch
        self.num_sanity_val_steps, self.log_every_n_steps = num_sanity_val_steps, log_every_n_steps
        self.overfit_batches, self.deterministic, self.seed = overfit_batches, deterministic, seed
        self.default_root_dir, self.nonfinite_loss = default_root_dir, nonfinite_loss
        self.compile, self.channels_last = compile, channels_last
        self.preempt_signals, self.preempt_exit_code = normalize_signals(preempt_signals), preempt_exit_code
        self.requeue = requeue_setting(requeue, self.preempt_signals)  # SIGUSR1 under SLURM: save, requeue, exit
        self.config = dict(config) if config is not None else None
        self.fast_dev_run = int(fast_dev_run)
        if self.fast_dev_run:  # n batches of everything, one epoch, nothing written
            self.limits = dict.fromkeys(self.limits, self.fast_dev_run)
            self.max_epochs, self.max_steps, self.num_sanity_val_steps = 1, None, 0
            self.val_check_interval, self.log_every_n_steps = 1.0, 1
            enable_checkpointing = logger = False
        if overfit_batches:
            self.limits["train"] = self.limits["val"] = overfit_batches
        self.callbacks = with_defaults(callbacks, progress=enable_progress_bar, summary=enable_model_summary,
                                       checkpointing=enable_checkpointing, logger=logger)
        self.state, self.log_dir, self.task = TrainerState(), None, None  # fit starts each run with a new state
        self.model = self.optimizer = self.train_dataloader = self.val_loader = self.predict_dataloader = None
        self.optimizers, self.manual_optimizers, self.manual = [], [], False  # set by fit
        self.checkpoint_writer = CheckpointWriter()  # fsyncs and renames checkpoint files off the training thread

    # ---- entry points -------------------------------------------------------------------------------
    def fit(self, task: TaskModule, ckpt_path: str | None = None) -> dict[str, float]:
        """Train ``task``; resume from ``ckpt_path`` ("last", "best" or a path). Returns the final metrics."""
        check_task(task, "fit", self.max_epochs, self.max_steps)
        check_manual(task, self.accumulate_grad_batches, self.gradient_clip_val, self.nonfinite_loss)
        return self.strategy.launch(self._fit, task, ckpt_path)

    def validate(self, task: TaskModule, ckpt_path: str | None = None) -> list[dict[str, float]]:
        """Run one validation pass; returns ``[metrics]``."""
        check_task(task, "validate")
        return self.strategy.launch(self._run_eval, "validate", task, ckpt_path)

    def test(self, task: TaskModule, ckpt_path: str | None = None) -> list[dict[str, float]]:
        """Run one pass over ``task.test_dataloader()``; returns ``[metrics]``."""
        check_task(task, "test")
        return self.strategy.launch(self._run_eval, "test", task, ckpt_path)

    def predict(self, task: TaskModule, ckpt_path: str | None = None, return_predictions: bool = True) -> list[Any]:
        """``predict_step`` (default ``task(inputs)``) per batch of ``predict_dataloader()``; ddp: all ranks', in order."""
        check_task(task, "predict")
        return self.strategy.launch(self._run_eval, "predict", task, ckpt_path, return_predictions)

    # ---- fit: epochs and batches ----------------------------------------------------------------------
    def _fit(self, task: TaskModule, ckpt_path: str | None) -> dict[str, float]:
        with self._running(task, "fit"):
            self._setup_fit(ckpt_path)
            st = self.state
            self._call("on_fit_start")
            on_start, on_end = drop_idle_batch_hooks(self.hooks, self)  # a per-batch call only where it does work
            if self.num_sanity_val_steps and self.val_loader is not None and not st.resumed:
                self._sanity_check()
            while not self._finished():  # (a preemption signal: save a checkpoint and exit, here)
                loader, n, validating = self._start_epoch()
                completed, clock = True, time.perf_counter
                waited = clock()  # creating the DataLoader iterator counts as waiting for data
                for batch_idx, batch in enumerate(loader, st.batches_done):
                    st.data_wait_s += clock() - waited  # host time spent in the DataLoader (ThroughputMonitor)
                    if batch_idx >= n:
                        break
                    st.batch_idx = batch_idx
                    for fn in on_start:
                        fn(self, task, batch, batch_idx)
                    step = st.global_step
                    outputs = self._train_step(batch, batch_idx)
                    if st.global_step // self.log_every_n_steps != step // self.log_every_n_steps:
                        self._log_interval()  # every log_every_n_steps optimizer steps
                    st.batches_done = batch_idx + 1
                    if validating and self.val_schedule.due(st.epoch, batch_idx):
                        self._validate()
                    for fn in on_end:
                        fn(self, task, outputs, batch, batch_idx)
                    if st.global_step != step and (self.preemption.should_break(st) or self._max_steps_reached):
                        completed = st.batches_done >= n
                        break
                    waited = clock()
                else:
                    if self.val_schedule.at_exhaustion and st.batches_done and validating:
                        self._validate()  # a loader without len(): validate when it is exhausted
                if st.batches_done == 0 and n:
                    raise empty_train_loader(loader)  # a loader without len() that yielded nothing
                self._end_epoch(completed=completed and (st.batches_done >= n or n == float("inf")))
            st.stage = "idle"
            self._call("on_fit_end")
            self.checkpoint_writer.close()  # every checkpoint file is in place before fit returns
            return dict(st.metrics)

    def _train_step(self, batch: Any, batch_idx: int) -> Any:
        """One batch: the step (steps.py), backward, an optimizer step when its group is complete; outputs, detached."""
        task, optimizer, precision, st = self.task, self.optimizer, self.precision, self.state
        if self.moves_batches:  # on the CPU a batch stays where it is, without even a call
            batch = self.strategy.batch_to_device(batch)
        self.logs.train.weight = samples = batch_size_of(batch)  # epoch means of logged values weigh by it
        k = self.accumulate_grad_batches
        group, steps = (1, True) if k == 1 else accumulation_group(batch_idx, k, self.num_train_batches)
        if k > 1:  # ddp/fsdp reduce the gradients only on the micro-batch that steps (a flag: no context per batch)
            self.strategy.gradient_sync(self.model, steps)
        if batch_idx % k == 0 and not self.manual:  # a group's first batch: zero_grad before the forward, where a
            optimizer.zero_grad(set_to_none=True)  # hand-written loop and Lightning put it (manual: the task does)
        out = self.training_step(batch, batch_idx)  # under autocast (forward and loss only: _setup_fit)
        loss = out if type(out) is torch.Tensor else step_loss(out, task, self.manual)
        outputs = out.detach() if type(out) is torch.Tensor else detached(out)  # what on_train_batch_end gets
        if not self._loss_checked and loss is not None:
            check_loss(loss, task, not self.manual, "training_step" if defines(task, "training_step") else "loss")
            self._loss_checked = True
        if loss is not None:  # kept as a tensor, converted at the log interval (no sync here)
            self.logs.add_loss(outputs if out is loss else loss.detach(), samples)
        if self.manual:  # the task's step did backward and stepped (ManualOptimizer counts global_step)
            return outputs
        if self.nonfinite_loss == "skip" and not torch.isfinite(loss):  # a sync per step, opted into
            st.skipped_steps += 1
            optimizer.zero_grad(set_to_none=True)  # this group's gradients so far go with it
            return outputs
        precision.backward(loss if group == 1 else loss / group)
        if not steps:
            return outputs
        if self.before_step_work:  # a GradScaler to unscale, or on_before_optimizer_step hooks (else: no call)
            self.before_optimizer_step(optimizer)
        if self.clip_gradients is not None:
            self.clip_gradients()
        stepped = precision.step(optimizer)  # False: the GradScaler skipped a step whose gradients overflowed
        st.global_step += 1
        if stepped and self.schedulers.per_step:
            self.schedulers.after_step(st.global_step, st.metrics)
        return outputs

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Before every optimizer step (also a manual ``opt.step()``): unscaled gradients, then the hooks."""
        self.precision.unscale(optimizer)
        for fn in self.hooks["on_before_optimizer_step"]:
            fn(self, self.task, optimizer)

    def _log_interval(self) -> None:
        """This step's training values as floats (one tolist(): the sync point), ranks agree on stops, hooks."""
        self._publish(self.logs.interval(self.state))
        self.preemption.agree(self.state)
        self._call("on_log_interval")

    def _finished(self) -> bool:
        """max_epochs, max_steps or should_stop (ddp: agreed). After a preemption signal: save and exit, here."""
        st = self.state
        self.preemption.agree(st)
        if self.preemption.requested:
            preempt(self)
        return st.should_stop or self._max_steps_reached or (
            self.max_epochs is not None and st.epoch >= self.max_epochs)

    @property
    def _max_steps_reached(self) -> bool:
        return self.max_steps is not None and self.state.global_step >= self.max_steps

    def _start_epoch(self) -> tuple[Any, float, bool]:  # the loader set to this epoch, its batches, validating?
        st = self.state
        set_epoch(self.train_dataloader, st.epoch, self.data_seed, st.batches_done)
        st.stage = "train"
        self._call("on_train_epoch_start")
        self.model.train()  # once per epoch (and after each validation), not per step
        return self.train_dataloader, self.num_train_batches, self.val_schedule.in_epoch(st.epoch)

    def _end_epoch(self, completed: bool) -> None:
        st = self.state
        st.epoch_done = completed
        if self.logs.losses and not self.logs.logged_this_epoch:  # an epoch shorter than log_every_n_steps logs
            self._log_interval()  # its last step here: a short run still has its curves
        self.logs.check_pending(st.epoch)  # the losses since the last log (a sync, once per epoch)
        self._publish(self.logs.epoch_means())
        if completed:
            self.schedulers.after_epoch(st.epoch, st.metrics)
        self._call("on_train_epoch_end")
        if completed:
            st.epoch, st.batches_done, st.epoch_done = st.epoch + 1, 0, False
            self.logs.new_epoch(st.global_step)

    # ---- validation, test, predict ------------------------------------------------------------------------
    def _sanity_check(self) -> None:
        """A few validation batches before training, to fail fast; nothing is logged, no validation hook fires."""
        self.state.stage = "sanity"
        self._call("on_sanity_check_start")
        self._evaluate("val", self.val_loader, min(self.num_sanity_val_steps, self.num_val_batches))
        self._call("on_sanity_check_end")
        self.state.stage = "idle"

    def _validate(self) -> None:
        self.state.stage = "val"
        self._call("on_validation_start")
        self._publish(self._evaluate("val", self.val_loader, self.num_val_batches))
        self.preemption.agree(self.state)
        self._call("on_validation_end")
        self.state.stage = "train"
        self.model.train()

    def _evaluate(self, prefix: str, loader: Any, limit: float) -> dict[str, float]:
        return evaluate(self.task, self.strategy.eval_module(self.model), loader, limit, prefix=prefix,
                        strategy=self.strategy, precision=self.precision, logs=self.logs,
                        metrics=self.metrics.get(prefix, {}), data_seed=self.data_seed)

    def _run_eval(self, fn: str, task: TaskModule, ckpt_path: str | None, keep: bool = True) -> list[Any] | None:
        """One pass of ``validate``/``test`` (returns ``[metrics]``) or ``predict`` (returns the predictions)."""
        with self._running(task, fn, ckpt_path):
            loader = eval_loader(task, fn, self.data_seed, self.strategy)
            stage = {"validate": "val", "test": "test", "predict": "predict"}[fn]
            limit, self.state.stage = limit_batches(length(loader), self.limits[stage]), stage
            hook = {"validate": "validation", "test": "test", "predict": "predict"}[fn]
            self.predict_dataloader = loader if fn == "predict" else None
            self._call(f"on_{hook}_start")
            if fn == "predict":
                on_batch_end = [functools.partial(call, self, task) for call in self.hooks["on_predict_batch_end"]]
                result = predict(task, self.strategy.eval_module(self.model), loader, limit, strategy=self.strategy,
                                 precision=self.precision, on_batch_end=on_batch_end, keep=keep)
            else:
                result = [self._evaluate(stage, loader, limit)]
                self._publish(result[0])
            self._call(f"on_{hook}_end")
            self.state.stage = "idle"
            return result

    # ---- one run: what fit/validate/test/predict set up and tear down ---------------------------------------
    @contextlib.contextmanager
    def _running(self, task: TaskModule, fn: str, weights: str | None = None) -> Iterator[None]:
        """Inside a launched process: seed, attach ``task`` (device, wrapper, precision, logging buffer), load the
        ``weights`` checkpoint (validate/test/predict); on the way out restore what changed (``on_exception``)."""
        self.strategy.setup_environment()
        if self.seed is not None:
            seed_everything(self.seed)
        self.task, self.hooks, self.preemption = task, hook_table(self.callbacks), None
        with deterministic_algorithms(self.deterministic):  # the process's setting comes back after
            try:
                if fn == "fit":
                    self.state, self.log_dir = TrainerState(), None
                self.state.fn = fn
                if self.log_dir is None:  # chosen on rank 0
                    self.log_dir = self.strategy.broadcast(self.is_main and next_version_dir(self.default_root_dir))
                self.moves_batches = self.strategy.moves_batches  # read once: the step asks it every batch
                if self.channels_last:
                    task.to(memory_format=torch.channels_last)
                wrapped = self.strategy.setup_module(task)
                self.model = torch.compile(wrapped) if self.compile else wrapped  # what the loop calls
                self.precision = Precision(self.precision_name, self.strategy.device)
                self.metrics = build_metrics(task, self.strategy.device)
                self.logs = LogBuffer(self.strategy, self.nonfinite_loss, self.precision, self.accumulate_grad_batches)
                self.data_seed = int(self.strategy.broadcast(run_seed()))  # the data order: rank 0's on every rank
                self.preemption = Preemption(self.preempt_signals, self.strategy, install=fn == "fit")
                task.trainer = self
                if weights is not None:
                    load_weights(self, weights)
                yield
            except BaseException as exc:
                self.checkpoint_writer.close_quietly()  # finish the background files before reporting
                self._call("on_exception", exc)
                raise
            finally:
                if self.preemption is not None:
                    self.preemption.uninstall()
                if fn == "fit" and self.accumulate_grad_batches > 1 and self.model is not None:
                    self.strategy.gradient_sync(self.model, True)  # a group cut short (an error) left it off
                task.trainer = None

    def _setup_fit(self, ckpt_path: str | None) -> None:
        task, strategy = self.task, self.strategy
        self.manual = not task.automatic_optimization  # the task's training_step steps its optimizers
        self.optimizers, configs = parse_optimizers(task.configure_optimizers(), automatic=not self.manual)
        self.optimizer, self.schedulers = self.optimizers[0], Schedulers(configs, automatic=not self.manual)
        self.manual_optimizers = [ManualOptimizer(o, self) for o in self.optimizers] if self.manual else []
        self.clip_gradients = gradient_clipper(self.optimizer, self.gradient_clip_val, self.gradient_clip_algorithm)
        self.training_step = self.precision.autocasting(  # the forward and the loss only, as torch.autocast asks
            training_step(task, self.model, self.manual, strategy.eval_module(self.model)))
        self.train_dataloader, self.num_train_batches, self.val_loader, self.num_val_batches = fit_loaders(
            task, self.limits, bool(self.overfit_batches), self.data_seed, strategy, self.preempt_signals)
        self.val_schedule = ValidationSchedule(self.val_check_interval, self.check_val_every_n_epoch,
                                               self.num_train_batches, self.val_loader is not None)
        self._loss_checked = False
        self.before_step_work = self.precision.scaler is not None or bool(self.hooks["on_before_optimizer_step"])
        if ckpt_path is not None:
            self.state.resumed = restore(self, ckpt_path)  # False: "last" found nothing, a fresh start

    def _call(self, hook: str, *args: Any) -> None:
        for fn in self.hooks[hook]:
            fn(self, self.task, *args)

    def _publish(self, metrics: dict[str, float]) -> None:  # floats into state.metrics and every on_log
        if metrics:
            self.state.metrics.update(metrics)
            self._call("on_log", metrics)

    # ---- what callbacks read and call -------------------------------------------------------------------
    def log_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Publish values from a callback at the current global step: into ``state.metrics`` and every ``on_log``."""
        self._publish(LogBuffer.to_floats(metrics))

    @property
    def is_main(self) -> bool:
        """True on the process that logs, draws progress and writes files (rank 0)."""
        return self.strategy.is_main

    @property
    def hparams(self) -> dict[str, Any]:
        """The run's hyperparameters: the flattened resolved config (CLI) or the TaskModule's init arguments."""
        return flatten(self.config if self.config is not None else self.task.hparams if self.task is not None else {})

    @property
    def should_stop(self) -> bool:
        """Set to True (from a callback) to end training cleanly at the next batch boundary."""
        return self.state.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self.state.should_stop = bool(value)

    @property
    def loggers(self) -> list[Logger]:  # the loggers among the callbacks
        return [cb for cb in self.callbacks if isinstance(cb, Logger)]

    @property
    def logger(self) -> Logger | None:  # the first logger: ``trainer.logger.experiment`` is TensorBoard's writer
        return next(iter(self.loggers), None)

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:  # the first ModelCheckpoint of the callbacks, or None
        return next((cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)), None)

    # ---- the run's state, as checkpoints hold it ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this fit exactly, each part asked for its own state (checkpoint.py's
        ``run_state``; docs/checkpointing.md). During fit only; every rank calls it (RNG states are gathered)."""
        return run_state(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where :meth:`state_dict` left off (``fit(ckpt_path=...)`` calls it, once the file is checked)."""
        load_run_state(self, state)

    def save_checkpoint(self, path: str, background: bool = False) -> None:
        """Write :meth:`state_dict` atomically to ``path`` on rank 0 (every rank calls it). ``background=True``: the
        fsync and rename finish on :attr:`checkpoint_writer`'s thread (by the next save or fit's end)."""
        save_checkpoint(self, path, background)
