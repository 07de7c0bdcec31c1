"""The steps a TaskModule may write itself, how the Trainer calls them, and manual optimization's
optimizer.

By default a training step is ``split_batch -> forward -> loss``, the forward through the strategy's
wrapper (DDP, DataParallel, torch.compile). A task that defines ``training_step`` (or
``validation_step``, ``test_step``, ``predict_step``) has its own step called instead. The training
step then runs *inside* the wrapper's forward, as Lightning and Fabric do (:class:`ThroughWrapper`):
DDP prepares its gradient all-reduce around the whole step and ``self(inputs)`` inside it is an
ordinary forward. Which step runs is chosen once per run, not per batch. docs/steps.md shows each.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..errors import MisconfigurationError, TaskModuleError
from ..strategies.wrapped_step import Step, ThroughWrapper, own_step

if TYPE_CHECKING:
    from ..module import TaskModule
    from .run import Run

STEPS = ("training_step", "validation_step", "test_step", "predict_step")


def defines(task: TaskModule, step: str) -> bool:
    """The task writes ``step`` itself (TaskModule has none, or a ``default_hook``: the default is
    the Trainer's)."""
    method = getattr(type(task), step, None)
    return callable(method) and not getattr(method, "default_hook", False)


def training_step(task: TaskModule, model: nn.Module, manual: bool, unsynced: nn.Module) -> Step:
    """What the loop calls for one training batch: the task's own ``training_step`` (through
    ``model``, the wrapped module; with manual optimization through ``unsynced``, the module without
    DDP's gradient hooks, because the optimizers average the gradients when they step), or the
    default forward and loss."""
    if manual and not defines(task, "training_step"):
        raise TaskModuleError(
            f"{type(task).__name__} sets automatic_optimization = False but defines no "
            "training_step.",
            "add `def training_step(self, batch, batch_idx):` that calls "
            "self.manual_backward(loss) and steps self.optimizers() (docs/steps.md).")
    if defines(task, "training_step"):
        through = unsynced if manual else model
        return (
            own_step(task, "training_step")
            if through is task
            else ThroughWrapper(through, task, "training_step")
        )
    split, loss = task.split_batch, task.loss

    # the default: today's hand-written step
    def forward_and_loss(batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = split(batch)
        return loss(model(inputs), targets)
    return forward_and_loss


def step_loss(out: Any, task: TaskModule, manual: bool) -> torch.Tensor | None:
    """The loss in what a training step returned: the tensor itself or its mapping's ``"loss"``;
    None with manual optimization (which has already done its backward), or to skip the batch's
    backward (Lightning's meaning: the batch still counts toward its accumulation group)."""
    if isinstance(out, torch.Tensor) or not defines(task, "training_step"):
        return out  # (the default step returns what loss returned: check_loss names it)
    if isinstance(out, Mapping) and "loss" in out:
        return out["loss"]
    if out is None:
        return None
    raise TaskModuleError(
        f"{type(task).__name__}.training_step returned {type(out).__name__}"
        f"{f' with keys {sorted(map(str, out))}' if isinstance(out, Mapping) else ''}, not a loss.",
        "return the scalar loss tensor, or a dict with a 'loss' key (other keys reach the "
        "callbacks' on_train_batch_end as `outputs`).")


def batch_outputs(out: Any) -> dict[str, Any]:
    """What a training step returned, as Lightning's ``on_train_batch_end`` gets it, detached:
    ``{"loss": loss}`` for a loss, the step's mapping (its tensors detached), ``{}`` for a step that
    returned nothing."""
    if isinstance(out, Mapping):
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    if out is None:
        return {}
    return {"loss": out.detach() if isinstance(out, torch.Tensor) else out}


class ManualOptimizer:
    """What ``self.optimizers()`` returns with ``automatic_optimization = False``: the optimizer,
    whose ``step()`` averages the gradients over ddp ranks (unless ``self.clip_gradients`` already
    did), unscales them (16-mixed), calls ``on_before_optimizer_step``, steps through the GradScaler
    (which skips a step whose gradients overflowed) and counts ``global_step`` as Lightning does:
    one per optimizer step. Everything else (``zero_grad``, ``param_groups``) is the optimizer's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, run: Run) -> None:
        self.optimizer, self.run = optimizer, run
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        # no backward since the gradients were last averaged (manual_backward resets it)
        self.synced = True

    def sync_gradients(self) -> None:
        """Average this optimizer's gradients over ddp ranks, once after the last backward: before
        clipping and stepping (a no-op in one process). Accumulating over several backwards costs
        one all-reduce per step."""
        if not self.synced:
            self.run.strategy.average_gradients(self.params)
            self.synced = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def step(self, closure: Callable[[], Any] | None = None) -> bool:
        """Step the optimizer; returns False when the GradScaler skipped the step (inf/NaN
        gradients)."""
        if closure is not None:
            raise MisconfigurationError("ManualOptimizer.step(closure) is not supported.",
                                        "compute the loss and call self.manual_backward(loss) "
                                        "before opt.step().")
        run = self.run
        self.sync_gradients()
        run.before_optimizer_step(self.optimizer)
        stepped = run.precision.step(self.optimizer)
        run.state.global_step += 1
        return stepped

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
