"""The TaskModule's overrides of the automatic step that Lightning calls (``optimizer_step``,
``optimizer_zero_grad``, ``backward``, ``configure_gradient_clipping``; ``lr_scheduler_step`` goes
to optim.Schedulers), each found once per fit and made into the callable the step calls. A task that
overrides none of them gets the plain calls of a hand-written loop (``optimizer.zero_grad``,
``loss.backward``, ``optimizer.step``; with a GradScaler the precision's scaled backward and step):
nothing is added per step.

Lightning runs the forward and backward inside ``optimizer.step(closure)``; taskfit has run them
when the task's ``optimizer_step`` is called, and its closure returns that step's loss. What a
warm-up or a skipped step does with it is the same; gradients read in the override before calling
the closure are already there.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import MisconfigurationError
from ..optim import gradient_clipper
from .hooks import defines as overrides  # the task replaces TaskModule's default_hook
from ..precision import Precision


def zero_grad_call(task: Any, state: Any, optimizer: torch.optim.Optimizer) -> Callable[..., None]:
    """``optimizer.zero_grad``, or the task's ``optimizer_zero_grad(epoch, batch_idx,
    optimizer)``."""
    if not overrides(task, "optimizer_zero_grad"):
        return optimizer.zero_grad

    def task_zero_grad(set_to_none: bool = True) -> None:
        task.optimizer_zero_grad(state.epoch, state.batch_idx, optimizer)
    return task_zero_grad


def backward_call(task: Any, precision: Precision) -> Callable[..., None]:
    """``precision.backward_call()`` (``Tensor.backward`` unless a GradScaler scales the loss), or
    the task's ``backward(loss)`` with the loss scaled as precision's would be."""
    if not overrides(task, "backward"):
        return precision.backward_call()

    def task_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        task.backward(precision.scale(loss), *args, **kwargs)
    return task_backward


def clip_call(task: Any, optimizer: torch.optim.Optimizer, value: float | None,
              algorithm: str) -> Callable[[], Any] | None:
    """The clipping before each step: the Trainer's (None without ``gradient_clip_val``), or the
    task's ``configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)``,
    called every step."""
    if not overrides(task, "configure_gradient_clipping"):
        return gradient_clipper(optimizer, value, algorithm)

    def task_clip() -> None:
        task.configure_gradient_clipping(
            optimizer, gradient_clip_val=value, gradient_clip_algorithm=algorithm
        )
    return task_clip


class StepOptimizer:
    """What the task's ``optimizer_step`` receives as ``optimizer``: the optimizer, whose
    ``step(closure)`` calls the closure and steps through the precision (the GradScaler skips a step
    whose gradients overflowed). Everything else (``param_groups``, ``zero_grad``) is the
    optimizer's. Built once per fit."""

    def __init__(self, optimizer: torch.optim.Optimizer, precision: Precision) -> None:
        self.optimizer, self.precision = optimizer, precision
        self.stepped = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        result = closure() if closure is not None else None
        self.stepped = self.precision.step(self.optimizer)
        return result


class TaskOptimizerStep:
    """The step of a task that overrides ``optimizer_step``: ``task.optimizer_step(epoch, batch_idx,
    optimizer, closure)``; returns whether the optimizer stepped. Lightning refuses an override that
    never runs the closure (the step's work would be lost): so does this."""

    def __init__(
        self, task: Any, state: Any, optimizer: torch.optim.Optimizer, precision: Precision
    ) -> None:
        self.task, self.state = task, state
        self.optimizer = StepOptimizer(optimizer, precision)
        self.loss: torch.Tensor | None = None
        self.closed = False

    def closure(self) -> torch.Tensor | None:
        self.closed = True
        return self.loss

    def __call__(self, loss: torch.Tensor) -> bool:
        self.loss, self.closed, self.optimizer.stepped = loss, False, False
        self.task.optimizer_step(
            self.state.epoch, self.state.batch_idx, self.optimizer, self.closure
        )
        if not self.closed:
            raise MisconfigurationError(
                f"{type(self.task).__name__}.optimizer_step did not run the optimizer closure.",
                "call optimizer.step(closure=optimizer_closure) in your optimizer_step (or "
                "optimizer_closure() before skipping the step), as Lightning requires.")
        return self.optimizer.stepped


def task_optimizer_step(task: Any, state: Any, optimizer: torch.optim.Optimizer,
                        precision: Precision) -> TaskOptimizerStep | None:
    """The task's ``optimizer_step`` made callable by the loop, or None when the task keeps
    TaskModule's."""
    return (
        TaskOptimizerStep(task, state, optimizer, precision)
        if overrides(task, "optimizer_step")
        else None
    )


def scheduler_step(task: Any) -> Callable[[Any, Any], None] | None:
    """The task's ``lr_scheduler_step(scheduler, metric)``, or None (the scheduler's own
    ``step``)."""
    return task.lr_scheduler_step if overrides(task, "lr_scheduler_step") else None


__all__ = [ "zero_grad_call", "backward_call", "clip_call",
           "task_optimizer_step", "scheduler_step", "StepOptimizer", "TaskOptimizerStep"]
