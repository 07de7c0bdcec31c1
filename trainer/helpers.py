"""LoopHelpers: the small decisions the loop delegates (when to validate, when to stop, how to log).

Kept out of trainer.py so that the loop reads top to bottom; each helper is a few lines and costs nothing
per step unless its feature is on.
"""
from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

import torch

from .data import set_epoch
from .errors import MisconfigurationError
from .logbook import LogBook, stack_scalars
from .optim import SchedulerConfig


class LoopHelpers:
    def _call(self, hook: str, *args: Any) -> None:
        for fn in self._hooks.get(hook, ()):
            fn(self, self.task, *args)

    def _set_epoch(self, loader: Any, epoch: int, skip_batches: int) -> None:
        set_epoch(loader, epoch, self.data_seed, skip_batches)

    def _val_enabled_this_epoch(self) -> bool:
        return self._val_loader is not None and (self.state.epoch + 1) % self.check_val_every_n_epoch == 0

    def _val_due(self, batch_idx: int) -> bool:
        """Validation is due after this batch (the loop asks only in epochs that validate)."""
        done = batch_idx + 1
        return done % self._val_every == 0 or (done == self.num_train_batches and isinstance(self.val_check_interval, float))

    def _should_break(self) -> bool:
        if self.max_steps is not None and self.state.global_step >= self.max_steps:
            return True
        if self.strategy.world_size > 1:
            return self._stop_agreed
        return self.state.should_stop or self._signal is not None

    def _preempt_requested(self) -> bool:
        """A preemption signal arrived (under ddp: one that every rank has agreed on, so all save together)."""
        return self._signal_agreed if self.strategy.world_size > 1 else self._signal is not None

    def _agree_stop(self) -> None:
        """Under ddp, make every rank agree on should_stop/a signal: one tiny all-reduce per log interval."""
        if self.strategy.world_size == 1:
            return
        flags = torch.tensor([float(self.state.should_stop), float(self._signal is not None)],
                             device=self.strategy.device)
        flags = self.strategy.all_reduce(flags, op="max").tolist()
        self.state.should_stop = self.state.should_stop or bool(flags[0])
        if flags[1] and self._signal is None:
            self._signal = signal.SIGTERM
        self._signal_agreed = bool(flags[1])
        self._stop_agreed = bool(flags[0] or flags[1])

    def _track_loss(self) -> None:
        """Point the loop at the training-loss series of the current book (its list is appended to per step)."""
        self._loss_series = self._train_book.series_for("train/loss")
        self._losses = self._loss_series.pending

    def _accumulation(self, batch_idx: int) -> tuple[bool, int]:
        """(step after this micro-batch?, size of its group): the epoch's last group may be short."""
        k, n = self.accumulate_grad_batches, self.num_train_batches
        start = batch_idx - batch_idx % k
        size = k if start + k <= n else int(n - start)
        return batch_idx + 1 - start == size, size

    def _clip(self, optimizer: torch.optim.Optimizer) -> None:
        if self.gradient_clip_algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(self._clip_params, self.gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_value_(self._clip_params, self.gradient_clip_val)

    def _scheduler_step(self, config: SchedulerConfig) -> None:
        if not config.on_plateau:
            config.scheduler.step()
            return
        value = self.state.metrics.get(config.monitor)
        if value is None:
            raise MisconfigurationError(
                f"ReduceLROnPlateau monitors {config.monitor!r}, which has not been logged.",
                f"set 'monitor' to one of {sorted(self.state.metrics) or 'the logged keys'} in configure_optimizers.")
        config.scheduler.step(value)

    def _enter_book(self, stage: str) -> LogBook:
        book = self._train_book if stage == "train" else LogBook(stage)
        self.task.__dict__["_logbook"] = book
        return book

    def _reduce_book(self, book: LogBook, suffix: str = "") -> dict[str, Any]:
        """Sample-weighted means of everything in ``book`` over all ranks (one all-reduce, no host sync)."""
        keys, flat = book.totals()
        if not keys:
            return {}
        device = self.strategy.device
        packed = self.strategy.all_reduce(stack_scalars(flat, device), op="sum")
        means = packed[0::2] / packed[1::2].clamp_min(1e-12)
        return {key + suffix: means[i] for i, key in enumerate(keys)}

    def _publish(self, metrics: dict[str, float]) -> None:
        """Hand Python floats (see ``_to_floats``) to ``state.metrics`` and every callback's ``on_log``."""
        if metrics:
            self.state.metrics.update(metrics)
            self._call("on_log", metrics)

    @staticmethod
    def _to_floats(values: Mapping[str, Any]) -> dict[str, float]:
        tensors = [v for v in values.values() if isinstance(v, torch.Tensor)]
        if not tensors:
            return {k: float(v) for k, v in values.items()}
        converted = iter(stack_scalars([t.detach() for t in tensors], tensors[0].device).tolist())  # a CPU-GPU sync
        return {k: next(converted) if isinstance(v, torch.Tensor) else float(v) for k, v in values.items()}

    @staticmethod
    def _metric_values(name: str, value: Any) -> dict[str, Any]:
        if isinstance(value, Mapping):
            return {f"{name}/{k}": v for k, v in value.items()}
        if isinstance(value, torch.Tensor) and value.numel() > 1:
            return {f"{name}_{i}": v for i, v in enumerate(value.flatten())}
        return {name: value}

    def _predict_inputs(self, batch: Any) -> Any:
        from .module import TaskModule

        if type(self.task).split_batch is not TaskModule.split_batch:
            return self.task.split_batch(batch)[0]
        if isinstance(batch, Mapping) and "inputs" in batch:
            return batch["inputs"]
        if isinstance(batch, (list, tuple)) and len(batch) in (1, 2):
            return batch[0]
        return batch
