"""The passes without gradients: a validation/test pass (loss, ``self.log`` values and metrics, sample-weighted
over all ranks) and a predict pass, each with the task's own step or the default one. Plain functions of what they use; the Trainer calls them with its parts."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .checks import check_loss
from .data import batch_size_of, set_epoch
from .errors import MisconfigurationError
from .logbook import LogBuffer
from .metrics import metric_values
from .module import TaskModule, predict_inputs
from .precision import Precision, warn_once
from .steps import Step, ThroughWrapper, defines
from .strategies import Strategy


def eval_step(task: TaskModule, module: torch.nn.Module, stage: str, metrics: dict[str, Any]) -> Step:
    """One evaluation batch: the task's own ``validation_step``/``test_step``/``predict_step`` (through ``module``
    when that wraps the task), or the default: ``forward``, then ``loss`` and the metrics' update (val/test) or
    the outputs (predict)."""
    name = {"val": "validation_step", "test": "test_step", "predict": "predict_step"}[stage]
    if defines(task, name):
        return getattr(task, name) if module is task else ThroughWrapper(module, task, name)
    if stage == "predict":
        return lambda batch, batch_idx: module(predict_inputs(task, batch))

    def forward_loss_metrics(batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = task.split_batch(batch)
        outputs = module(inputs)
        for metric in metrics.values():
            metric.update(outputs, targets)
        return task.loss(outputs, targets)
    return forward_loss_metrics


def evaluate(task: TaskModule, module: torch.nn.Module, loader: Any, limit: float, *, prefix: str,
             strategy: Strategy, precision: Precision, logs: LogBuffer, metrics: dict[str, Any],
             data_seed: int) -> dict[str, float]:
    """At most ``limit`` batches of ``loader``: ``{prefix}/loss`` (what the step returned: the loss, or a dict's
    ``"loss"``), ``self.log`` values and ``metrics``, as floats."""
    module.eval()
    book = logs.enter(prefix)
    set_epoch(loader, 0, data_seed)
    step = eval_step(task, module, prefix, metrics)
    source = {"val": "validation_step", "test": "test_step"}[prefix]
    source = source if defines(task, source) else "loss"
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if i >= limit:
                break
            batch = strategy.batch_to_device(batch)
            book.weight = batch_size_of(batch)
            with precision.autocast:
                out = step(batch, i)
            loss = out.get("loss") if isinstance(out, Mapping) else out
            if source != "loss" and not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                continue  # a step of its own may return nothing to log (it logs with self.log)
            if i == 0:  # the sanity check may run before any training step: check the loss here too
                check_loss(loss, task, training=False, source=source)
            book.add(f"{prefix}/loss", loss.detach())
    values = {**logs.reduce(book), **book.compute_metrics()}
    for name, metric in metrics.items():  # torchmetrics syncs its states across ranks in compute()
        if source != "loss" and getattr(metric, "update_count", 1) == 0:  # its own step never updated it
            warn_once(f"configure_metrics()'s {name!r} was not updated by {type(task).__name__}.{source}, so "
                      f"{prefix}/{name} is not logged. HINT: call self.stage_metrics[{name!r}].update(outputs, "
                      "targets) in the step (docs/steps.md), or log a value of your own with self.log.")
            continue
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
    """``predict_step(batch, batch_idx)``, or ``module(inputs)``, for at most ``limit`` batches of ``loader``."""
    module.eval()
    predictions = []
    step = eval_step(task, module, "predict", {})
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if i >= limit:
                break
            with precision.autocast:
                predictions.append(step(strategy.batch_to_device(batch), i))
    return predictions
