"""A task's own step called through the strategy's wrapper (DDP, DataParallel, torch.compile):
:class:`ThroughWrapper` swaps the step in for ``task.forward`` for one call, so DDP prepares its
gradient all-reduce around the whole step, as Lightning and Fabric do; :func:`own_step` calls a step
written with or without ``batch_idx``."""
from __future__ import annotations

import inspect
from typing import Any, Callable

from torch import nn

from ..errors import MisconfigurationError

Step = Callable[[Any, int], Any]


def own_step(task: Any, step: str) -> Step:
    """``task.<step>`` called as ``(batch, batch_idx)``: a step written without ``batch_idx``
    (Lightning allows ``training_step(self, batch)``) gets only the batch. Decided once per run."""
    method = getattr(task, step)
    try:
        params = [p for p in inspect.signature(method).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    except (TypeError, ValueError):
        return method
    if len(params) == 1 and params[0].kind is not params[0].VAR_POSITIONAL:
        return lambda batch, batch_idx: method(batch)
    return method


class ThroughWrapper:
    """Calls ``task.<step>(batch, batch_idx)`` inside ``wrapper``'s forward: ``task.forward`` is
    swapped for the step for the length of one call (and restored before the step runs, so
    ``self(x)`` in it is the real forward).

    Built once per run: the swap is two dict writes per step, no object is created per batch.
    """

    def __init__(self, wrapper: nn.Module, task: Any, step: str) -> None:
        if isinstance(wrapper, nn.DataParallel) and len(wrapper.device_ids) > 1:
            raise MisconfigurationError(
                f"{type(task).__name__}.{step} cannot run under strategy='dp' on "
                f"{len(wrapper.device_ids)} GPUs: DataParallel splits forward(inputs) over copies "
                "of the module, and a whole step cannot be split that "
                "way.", "use strategy='ddp' (one process per GPU), or remove the step to use "
                "forward + loss.")
        self.wrapper, self.task, self.step = wrapper, task, own_step(task, step)
        # an instance attribute to put back, if the task had one
        self.own_forward = task.__dict__.get("forward")
        self.redirect = self.run_step  # one bound method for the run

    def run_step(self, *args: Any) -> Any:
        self.restore()
        return self.step(*args)

    def restore(self) -> None:
        if self.own_forward is None:
            self.task.__dict__.pop("forward", None)
        else:
            self.task.__dict__["forward"] = self.own_forward

    def __call__(self, batch: Any, batch_idx: int) -> Any:
        self.task.__dict__["forward"] = self.redirect
        try:
            return self.wrapper(batch, batch_idx)
        finally:
            self.restore()  # also when the wrapper raised before it reached the step
