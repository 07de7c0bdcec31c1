"""The passes without gradients: a validation/test pass (loss, ``self.log`` values and metrics, sample-weighted
over all ranks) and a predict pass. Plain functions of what they use; the Trainer calls them with its parts."""
from __future__ import annotations

from typing import Any

import torch

from .checks import check_loss
from .data import batch_size_of, set_epoch
from .errors import MisconfigurationError
from .logbook import LogBuffer
from .metrics import metric_values
from .module import TaskModule, predict_inputs
from .precision import Precision
from .strategies import Strategy


def evaluate(task: TaskModule, module: torch.nn.Module, loader: Any, limit: float, *, prefix: str,
             strategy: Strategy, precision: Precision, logs: LogBuffer, metrics: dict[str, Any],
             data_seed: int) -> dict[str, float]:
    """At most ``limit`` batches of ``loader``: ``{prefix}/loss``, ``self.log`` values and ``metrics``, as floats."""
    module.eval()
    book = logs.enter(prefix)
    set_epoch(loader, 0, data_seed)
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if i >= limit:
                break
            inputs, targets = task.split_batch(strategy.batch_to_device(batch))
            book.weight = batch_size_of(targets)
            with precision.autocast:
                outputs = module(inputs)
                loss = task.loss(outputs, targets)
            if i == 0:  # the sanity check may run before any training step: check the loss here too
                check_loss(loss, task, training=False)
            book.add(f"{prefix}/loss", loss.detach())
            for metric in metrics.values():
                metric.update(outputs, targets)
    values = logs.reduce(book)
    for name, metric in metrics.items():  # torchmetrics syncs its states across ranks in compute()
        computed = metric_values(f"{prefix}/{name}", metric.compute())
        clash = sorted(set(computed) & set(values))
        if clash:
            raise MisconfigurationError(
                f"{clash[0]!r} is both the metric {name!r} of configure_metrics() and a value logged with self.log "
                f"(or the loss); one would silently overwrite the other.",
                f"rename one of them, e.g. configure_metrics() -> {{'{name}_metric': ...}} or "
                f"self.log('{name}_batch', ...).")
        values.update(computed)
        metric.reset()
    logs.enter("train")
    return logs.to_floats(values)


def predict(task: TaskModule, module: torch.nn.Module, loader: Any, limit: float, *, strategy: Strategy,
            precision: Precision) -> list[Any]:
    """``module(inputs)`` for at most ``limit`` batches of ``loader``, in order."""
    module.eval()
    predictions = []
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if i >= limit:
                break
            with precision.autocast:
                predictions.append(module(predict_inputs(task, strategy.batch_to_device(batch))))
    return predictions
