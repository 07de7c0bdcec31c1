"""Trainer: the loop, top to bottom. Setup and argument checks live beside it (``setup.py``, ``checks.py``).

Per training step the Trainer does exactly: time the DataLoader's ``next`` (two ``perf_counter`` calls), move
the batch (skipped on CPU), ``split_batch``, forward and loss under the precision's autocast, backward, and
every ``accumulate_grad_batches`` micro-batches an optimizer step. In fp32 with a step per batch and nothing
between backward and step, that is the hand-written step itself (``_plain_step``); every other setting goes
through ``_full_step``. Nothing in a step reads a device value on the host; the loss stays a tensor and is
converted once per ``log_every_n_steps`` (the one CPU-GPU sync point of training).
"""
from __future__ import annotations

import math
import time
from typing import Any

import torch

from .checks import check_loss, limit_batches
from .data import batch_size_of
from .errors import NonFiniteLossError
from .logbook import stack_scalars
from .module import TaskModule
from .setup import TrainerSetup, _length


class Trainer(TrainerSetup):
    """Fits, validates, tests and predicts with a `TaskModule`. Every argument: docs/trainer.md."""

    # ---- entry points -------------------------------------------------------------------------
    def fit(self, task: TaskModule, ckpt_path: str | None = None) -> dict[str, float]:
        """Train ``task``; resume from ``ckpt_path`` ("last", "best" or a path). Returns the final metrics."""
        self._check_entry(task, "fit")
        return self.strategy.launch(self._run, "fit", task, ckpt_path)

    def validate(self, task: TaskModule, ckpt_path: str | None = None) -> list[dict[str, float]]:
        """Run one validation pass; returns ``[metrics]``."""
        self._check_entry(task, "validate")
        return self.strategy.launch(self._run, "validate", task, ckpt_path)

    def test(self, task: TaskModule, ckpt_path: str | None = None) -> list[dict[str, float]]:
        """Run one pass over ``task.test_dataloader()``; returns ``[metrics]``."""
        self._check_entry(task, "test")
        return self.strategy.launch(self._run, "test", task, ckpt_path)

    def predict(self, task: TaskModule, ckpt_path: str | None = None) -> list[Any]:
        """Return ``task(inputs)`` for every batch of ``task.predict_dataloader()``."""
        self._check_entry(task, "predict")
        return self.strategy.launch(self._run, "predict", task, ckpt_path)

    # ---- fit ----------------------------------------------------------------------------------
    def _fit(self, ckpt_path: str | None) -> dict[str, float]:
        self._setup_fit(ckpt_path)
        self._call("on_fit_start")
        for name in ("on_train_batch_start", "on_train_batch_end"):  # a per-step call only where it does something
            self._hooks[name] = [fn for fn in self._hooks[name] if fn.__self__.needs_batch_hooks(self)]
        if self.num_sanity_val_steps and self._val_loader is not None and not self._resumed:
            self._validate(sanity=True)
        while True:
            finished = self._finished()  # under ddp this also agrees on stop flags and signals across ranks
            if self._preempt_requested():
                self._preempt()  # saves a checkpoint and exits the process
            if finished:
                break
            self._train_epoch()
        self.state.stage = "idle"
        self._call("on_fit_end")
        return dict(self.state.metrics)

    def _finished(self) -> bool:
        self._agree_stop()  # ddp: a stop set on one rank only is agreed here, once per epoch
        st = self.state
        return (st.should_stop or (self.max_steps is not None and st.global_step >= self.max_steps)
                or (self.max_epochs is not None and st.epoch >= self.max_epochs))

    def _train_epoch(self) -> None:
        st, task, loader = self.state, self.task, self._train_loader
        self._set_epoch(loader, st.epoch, st.batches_done)
        st.stage = "train"
        self._call("on_train_epoch_start")
        self._wrapped.train()  # once per epoch (and after each validation), not per step
        n = self.num_train_batches
        on_start, on_end = self._hooks["on_train_batch_start"], self._hooks["on_train_batch_end"]
        validating = self._val_enabled_this_epoch()
        exhausted = True
        clock = time.perf_counter
        waited = clock()  # creating the DataLoader iterator counts as waiting for data
        for batch_idx, batch in enumerate(loader, st.batches_done):
            st.data_wait_s += clock() - waited  # host time spent in the DataLoader (ThroughputMonitor reports it)
            if batch_idx >= n:
                break
            st.batch_idx = batch_idx
            for fn in on_start:
                fn(self, task)
            stepped = self._train_step(batch, batch_idx)
            st.batches_done = batch_idx + 1
            if validating and self._val_due(batch_idx):
                self._validate()
                self._wrapped.train()
            for fn in on_end:
                fn(self, task)
            if stepped and self._should_break():
                exhausted = st.batches_done >= n
                break
            waited = clock()
        else:
            if n == float("inf") and st.batches_done and validating:
                self._validate()  # a loader without len(): validate when it is exhausted
        if st.batches_done == 0 and n:
            self._empty_train_loader()  # a loader without len() that yielded nothing
        self._epoch_end(completed=exhausted and (st.batches_done >= n or n == float("inf")))

    def _train_step(self, batch, batch_idx: int) -> bool:
        """Forward, loss, backward; an optimizer step when the accumulation group is complete. True if it stepped."""
        if self._move_batches:  # on the CPU a batch stays where it is, without even a call
            batch = self.strategy.batch_to_device(batch)
        inputs, targets = self.task.split_batch(batch)
        opt = self.optimizer
        if self._plain_step:  # fp32, a step per batch, nothing between backward and step: the hand-written step
            loss = self.task.loss(self._wrapped(inputs), targets)
            self._losses.append(loss.detach())  # the losses since the last log: converted there, not here (no sync)
            loss.backward()
            opt.step()
            stepped = True
        else:
            stepped = self._full_step(inputs, targets, batch_idx)
            if stepped is None:
                return False
        opt.zero_grad(set_to_none=True)
        st = self.state
        st.global_step += 1
        if stepped:
            for config in self._step_schedulers:
                if st.global_step % config.frequency == 0:
                    self._scheduler_step(config)
        if st.global_step % self.log_every_n_steps == 0:
            self._log_train_step()
        return True

    def _full_step(self, inputs: Any, targets: Any, batch_idx: int) -> bool | None:
        """The step with every setting: accumulation (ddp ``no_sync``), autocast, GradScaler, clipping, the
        ``on_before_optimizer_step`` hook. None: no optimizer step (a micro-batch that waits for its group, or a
        skipped non-finite loss); False: the GradScaler skipped the step (the gradients overflowed)."""
        step, divide = (True, 1) if self.accumulate_grad_batches == 1 else self._accumulation(batch_idx)
        if step:
            ran = self._forward_backward(inputs, targets, divide)
        else:
            with self.strategy.no_sync(self._wrapped):  # ddp: no gradient all-reduce for a micro-batch that waits
                ran = self._forward_backward(inputs, targets, divide)
        if not (ran and step):
            return None
        opt = self.optimizer
        if self.gradient_clip_val is not None or self._before_step_hooks:
            self.precision.unscale(opt)
            for fn in self._before_step_hooks:
                fn(self, self.task)
            if self.gradient_clip_val is not None:
                self._clip(opt)
        return self.precision.step(opt)

    def _forward_backward(self, inputs: Any, targets: Any, divide: int) -> bool:
        """Loss and backward of one micro-batch; False when a non-finite loss is skipped (``nonfinite_loss="skip"``)."""
        task = self.task
        with self.precision.autocast:  # the forward and the loss only, as torch.autocast asks
            loss = task.loss(self._wrapped(inputs), targets)
        if self._first_step:
            check_loss(loss, task)
            self._first_step = False
            self._plain_step = self._plain_step_possible  # from now on, where the settings allow it
        detached = loss.detach()
        self._losses.append(detached)
        if self.nonfinite_loss == "skip" and not torch.isfinite(detached):  # a sync, opted into
            self.state.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
            return False
        self.precision.backward(loss if divide == 1 else loss / divide)
        return True

    def _epoch_end(self, completed: bool) -> None:
        st = self.state
        st.epoch_done = completed
        pending = self._losses
        if self._raise_nonfinite_loss and pending and not torch.isfinite(torch.stack(pending)).all():
            self._raise_nonfinite(pending)  # the losses since the last log (a sync, once per epoch)
        self._publish(self._to_floats(self._reduce_book(self._train_book, suffix="_epoch")))
        if completed:
            for config in self._epoch_schedulers:
                if (st.epoch + 1) % config.frequency == 0:
                    self._scheduler_step(config)
        self._call("on_train_epoch_end")
        if completed:
            st.epoch, st.batches_done, st.epoch_done = st.epoch + 1, 0, False
            self._train_book.reset()
            self._track_loss()
            self._fold_mark = (st.global_step, 0)

    # ---- validation / test / predict ------------------------------------------------------------
    def _validate(self, sanity: bool = False) -> dict[str, float]:
        st = self.state
        previous, st.stage = st.stage, "sanity" if sanity else "val"
        self._call("on_validation_start")
        limit = min(self.num_sanity_val_steps, self.num_val_batches) if sanity else self.num_val_batches
        metrics = self._evaluate("val", self._val_loader, limit)
        if not sanity:
            self._publish(metrics)
            self._agree_stop()
        self._call("on_validation_end")
        st.stage = previous
        return metrics

    def _evaluate(self, prefix: str, loader, limit: float) -> dict[str, float]:
        """One pass without gradients; loss and ``self.log`` values are sample-weighted means over all ranks."""
        task, module = self.task, self.strategy.eval_module(self._wrapped)
        module.eval()
        book = self._enter_book(prefix)
        metrics = self._metrics.get(prefix, {})
        self._set_epoch(loader, 0, 0)
        with torch.no_grad():
            for i, batch in enumerate(loader):
                if i >= limit:
                    break
                inputs, targets = task.split_batch(self.strategy.batch_to_device(batch))
                book.weight = batch_size_of(targets)
                with self.precision.autocast:
                    outputs = module(inputs)
                    loss = task.loss(outputs, targets)
                if i == 0:  # the sanity check may run before any training step: check the loss here too
                    check_loss(loss, task, training=False)
                book.add(f"{prefix}/loss", loss.detach())
                for metric in metrics.values():
                    metric.update(outputs, targets)
        values = self._reduce_book(book)
        for name, metric in metrics.items():  # torchmetrics syncs its states across ranks in compute()
            values.update(self._metric_values(f"{prefix}/{name}", metric.compute()))
            metric.reset()
        self._enter_book(self._train_book.stage)
        return self._to_floats(values)

    def _run_eval_stage(self, stage: str) -> list[dict[str, float]]:
        prefix = "val" if stage == "validate" else "test"
        loader = self._setup_eval(stage)
        self.state.stage = prefix
        self._call("on_validation_start" if prefix == "val" else "on_test_start")
        metrics = self._evaluate(prefix, loader, limit_batches(_length(loader), self._limits[prefix]))
        self._publish(metrics)
        self._call("on_validation_end" if prefix == "val" else "on_test_end")
        self.state.stage = "idle"
        return [metrics]

    def _predict(self) -> list:
        loader = self._setup_eval("predict")
        module = self.strategy.eval_module(self._wrapped)
        module.eval()
        self.state.stage = "predict"
        predictions, limit = [], limit_batches(_length(loader), self._limits["predict"])
        with torch.no_grad():
            for i, batch in enumerate(loader):
                if i >= limit:
                    break
                with self.precision.autocast:
                    predictions.append(module(self._predict_inputs(self.strategy.batch_to_device(batch))))
        self.state.stage = "idle"
        return predictions

    # ---- logging: the one sync point per interval -------------------------------------------------
    def _log_train_step(self) -> None:
        """Convert the latest logged values (one ``tolist()``), check the losses since the last log for NaN/Inf."""
        book, series = self._train_book, self._loss_series
        pending = list(series.pending)  # fold empties it; kept to name a bad step
        book.fold()  # one stack and sum per logged key: the loss total now includes every pending loss...
        last = book.last_values()
        floats = stack_scalars([*last.values(), series.total], series.last.device).tolist()  # CPU-GPU sync point
        if self._raise_nonfinite_loss and not math.isfinite(floats[-1]):  # ...so it is finite iff each loss is
            self._raise_nonfinite(pending)
        self._fold_mark = (self.state.global_step, self.state.batch_idx + 1)  # where the next pending loss is from
        self._publish(dict(zip(last, floats)))
        self._agree_stop()

    def _raise_nonfinite(self, pending: list) -> None:
        bad_steps = (~torch.isfinite(torch.stack(pending))).nonzero()
        if not len(bad_steps):  # finite losses whose sum overflowed: nothing to report
            return
        bad = int(bad_steps[0])
        step, batches = self._fold_mark
        batch_idx = batches + bad
        raise NonFiniteLossError(
            f"The training loss is {float(pending[bad])} at epoch {self.state.epoch}, batch {batch_idx} "
            f"(global step {step + bad // self.accumulate_grad_batches}).",
            "lower the learning rate, clip gradients (gradient_clip_val=1.0), check the data for NaN/Inf, "
            "or pass nonfinite_loss='skip' to skip such steps (costs a sync per step). Losses are checked at "
            "every log_every_n_steps, so the run may have gone on a few steps past the bad one.")
