"""The passes without gradients: a validation/test pass (loss, ``self.log`` values and metrics,
sample-weighted over all ranks) and a predict pass, each with the task's own step or the default
one, and Lightning's hooks around them. Plain functions of what they use; the Trainer calls them
with itself (``run_entry``, ``evaluation_pass``)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..data.loaders import (
    batch_size_of,
    epoch_batches,
    eval_loader,
    indexed_parts,
    length,
    limit_batches,
    parts,
    sample_order,
    set_epoch,
)
from ..errors import MisconfigurationError
from ..logs.metrics import metric_values
from ..module import TaskModule, predict_inputs
from ..precision import warn_once
from ..strategies.base import Strategy
from ..strategies.wrapped_step import Step, ThroughWrapper, own_step
from . import modes
from .checks import check_loss
from .hooks import is_task_hook
from .steps import defines

if TYPE_CHECKING:
    from .run import Run

STAGES = {"validate": "val", "test": "test", "predict": "predict"}
# Lightning's hook names by stage
HOOK = {"val": "validation", "test": "test", "predict": "predict"}


def eval_step(
    task: TaskModule, module: torch.nn.Module, stage: str, metrics: dict[str, Any]
) -> Step:
    """One evaluation batch: the task's own ``validation_step``/``test_step``/``predict_step``
    (through ``module`` when that wraps the task), or the default: ``forward``, then ``loss`` and
    the metrics' update (val/test) or the outputs (predict)."""
    name = {"val": "validation_step", "test": "test_step", "predict": "predict_step"}[stage]
    if defines(task, name):
        return own_step(task, name) if module is task else ThroughWrapper(module, task, name)
    if stage == "predict":
        return lambda batch, batch_idx, dataloader_idx=0: module(predict_inputs(task, batch))

    def forward_loss_metrics(batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        inputs, targets = task.split_batch(batch)
        outputs = module(inputs)
        for metric in metrics.values():
            metric.update(outputs, targets)
        return task.loss(outputs, targets)
    return forward_loss_metrics


def run_entry(run: Run, fn: str, keep: bool = True) -> list[Any] | None:
    """``validate``/``test`` (returns ``[metrics]``) or ``predict`` (the predictions) inside the
    run: the loader, ``on_<stage>_start``, the pass, ``on_<stage>_end``."""
    stage = STAGES[fn]
    load_eval_loader(run)
    run.state.stage = stage
    run.call_hooks(f"on_{HOOK[stage]}_start")
    # (a callback may have loaded it again there: BatchSizeFinder's batch size)
    loader = run.eval_dataloader
    if fn == "predict":
        result = predict_pass(run, loader, keep)
    else:
        values = evaluation_pass(run, stage, loader, math.inf)
        run.publish(run.logs.to_floats(values))
        # as Lightning
        shown = {k: v for k, v in values.items() if k not in run.logs.eval_step_names}
        count = len(parts(loader))
        result = [per_loader(shown, idx, count, run.logs.eval_loaders) for idx in range(count)]
    run.call_hooks(f"on_{HOOK[stage]}_end")
    run.state.stage = "idle"
    return result


def load_eval_loader(run: Run) -> None:
    """The loader of the run's ``validate``/``test``/``predict`` from its data source: before
    ``on_<stage>_start``, and again when a callback changed what it reads
    (``trainer.reload_dataloaders()``)."""
    run.eval_dataloader = eval_loader(run.data, run.fn, run.data_seed, run.strategy)
    run.predict_dataloader = run.eval_dataloader if run.fn == "predict" else None


def per_loader(values: dict[str, float], idx: int, count: int,
               loaders: dict[str, int | None]) -> dict[str, float]:
    """The result ``validate``/``test`` return for loader ``idx`` of ``count``, as Lightning's: what
    was logged while that loader ran (its ``/dataloader_idx_<idx>`` values, and those it logged
    with ``add_dataloader_idx=False``), and what no loader in particular logged (the epoch-end
    hooks, ``configure_metrics``). ``loaders``: each logged name's loader (None: none)."""
    if count == 1:
        return values
    own = f"/dataloader_idx_{idx}"

    def mine(key: str) -> bool:
        if key in loaders:
            return loaders[key] in (None, idx)
        return key.endswith(own) or "/dataloader_idx_" not in key

    return {k: v for k, v in values.items() if mine(k)}


def sanity_pass(run: Run, limit: float) -> None:
    """The sanity check's validation batches (at most ``limit`` of each loader), with the hooks
    Lightning calls there (while the run's state says it is sanity checking), except the callbacks'
    ``on_validation_start``/``on_validation_end``: those mean a real validation in taskfit
    (ModelCheckpoint, EarlyStopping and the loggers react to them). Nothing is published."""
    task_only = {name: [fn for fn in run.hooks[name] if is_task_hook(fn)]
                 for name in ("on_validation_start", "on_validation_end")}
    for fn in task_only["on_validation_start"]:
        fn(run.trainer, run.task)
    evaluation_pass(run, "val", run.val_loader, limit, sanity=True)
    for fn in task_only["on_validation_end"]:
        fn(run.trainer, run.task)


def evaluation_pass(
    run: Run, stage: str, loader: Any, limit: float, sanity: bool = False
) -> dict[str, float]:
    """One validation/test pass (at most ``limit`` batches of each loader, and ``limit_*_batches``)
    with Lightning's hooks: ``on_<stage>_epoch_start``, per batch ``on_<stage>_batch_start/end``,
    the pass's values computed into ``state.metrics`` (callback_metrics; not in the sanity check),
    ``on_<stage>_epoch_end`` (its torchmetrics not yet reset; what it logs joins the values), then
    the metrics reset. Returns the values, as floats."""
    name, logs = HOOK[stage], run.logs
    run.call_hooks(f"on_{name}_epoch_start")
    book = logs.enter(stage)
    metrics, module = run.metrics.get(stage, {}), run.strategy.eval_module(run.model)
    kept = modes.capture(run.task)
    values = evaluate(run, stage, module, loader, limit)
    if not sanity:
        run.state.metrics.update(logs.callback_view(values))
    book.epoch_level = True  # self.log in on_validation_epoch_end: an epoch value
    run.call_hooks(f"on_{name}_epoch_end")
    values.update(logs.late_values(book))
    book.reset_metrics()
    for metric in metrics.values():
        metric.reset()
    logs.enter("train")
    # each submodule's own mode back, as Lightning after validation and test
    modes.restore(module, run.task, kept)
    return values


def evaluate(run: Run, prefix: str, module: torch.nn.Module, loader: Any,
             limit: float) -> dict[str, float]:
    """At most ``limit`` batches of each loader of ``loader`` (and ``limit_<prefix>_batches``)
    through ``module`` (the run's model as evaluation calls it): ``{prefix}/loss`` (what the step
    returned: the loss, or a dict's ``"loss"``), ``self.log`` values and the stage's metrics, as
    floats (the metrics computed, not reset). Several loaders (:class:`SequentialLoaders`) run one
    after the other, as Lightning's: the step and the batch hooks get ``dataloader_idx``, and each
    name (the loss's too) gets ``/dataloader_idx_<i>``."""
    task, logs, precision = run.task, run.logs, run.precision
    metrics, trainer, fraction = run.metrics.get(prefix, {}), run.trainer, run.config.limits[prefix]
    on_start = run.hooks[f"on_{HOOK[prefix]}_batch_start"]
    on_end = run.hooks[f"on_{HOOK[prefix]}_batch_end"]
    module.eval()
    book = logs.current
    # under autocast, or a true mode's dtype
    step = precision.wrap_step(eval_step(task, module, prefix, metrics))
    source = {"val": "validation_step", "test": "test_step"}[prefix]
    source = source if defines(task, source) else "loss"
    with torch.no_grad():
        # extra: (dataloader_idx,) only with several loaders, as Lightning
        for part, extra in indexed_parts(loader):
            book.dataloader_idx = extra[0] if extra else None
            set_epoch(part, 0)
            builtin = book.builtin_loss(None, f"{prefix}/loss{book.suffix}")
            cap = min(limit, limit_batches(length(part), fraction))
            # no fetch past cap; one batch ahead without a length (Lightning's fetcher)
            for i, batch in enumerate(epoch_batches(part, cap)):
                if i >= cap:
                    break
                batch = run.batch_to_device(batch)
                book.weight = batch_size_of(batch)
                book.batch_idx = i
                for fn in on_start:
                    fn(trainer, task, batch, i, *extra)
                out = step(batch, i, *extra)
                for fn in on_end:
                    fn(trainer, task, out, batch, i, *extra)
                loss = out.get("loss") if isinstance(out, Mapping) else out
                if source != "loss" and not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                    continue  # a step of its own may return nothing to log (it logs with self.log)
                # the sanity check may run before any training step: check the loss here too
                if i == 0:
                    check_loss(loss, task, training=False, source=source)
                builtin.add(loss.detach(), book.weight)
    book.dataloader_idx = None
    # on_step=True values: the last batch's, published, not in validate()'s result
    steps = book.step_values()
    logs.eval_step_names, logs.eval_loaders = set(steps), dict(book.loaders)
    logs.eval_step_seen |= logs.eval_step_names
    values = {**logs.reduce(book), **steps, **book.compute_metrics()}
    for name, metric in metrics.items():  # torchmetrics syncs its states across ranks in compute()
        # its own step never updated it
        if source != "loss" and getattr(metric, "update_count", 1) == 0:
            warn_once(f"configure_metrics()'s {name!r} was not updated by "
                      f"{type(task).__name__}.{source}, so {prefix}/{name} is not logged. HINT: "
                      f"call self.stage_metrics[{name!r}].update(outputs, targets) in the step "
                      "(docs/steps.md), or log a value of your own with self.log.")
            continue
        computed = metric_values(f"{prefix}/{name}", metric.compute())
        clash = sorted(set(computed) & set(values))
        if clash:
            raise MisconfigurationError(
                f"{clash[0]!r} is both the metric {name!r} of configure_metrics() and a value "
                "logged with self.log (or the loss); one would silently overwrite the other.",
                f"rename one of them, e.g. configure_metrics() -> {{'{name}_metric': ...}} or "
                f"self.log('{name}_batch', ...).")
        values.update(computed)
    book.late = set()  # what the epoch-end hooks log from here on comes from LogBuffer.late_values
    return logs.to_floats(values)


def predict_pass(run: Run, loader: Any, keep: bool = True) -> list[Any] | None:
    """``on_predict_epoch_start``, :func:`predict` with the batch hooks (of each loader: then a list
    per loader, and ``dataloader_idx`` for the step and hooks, as Lightning's),
    ``on_predict_epoch_end``."""
    run.call_hooks("on_predict_epoch_start")
    hooks, task = run.hooks, run.task
    trainer, module, kept = run.trainer, run.strategy.eval_module(run.model), modes.capture(task)
    results = []
    # extra: (dataloader_idx,), for the step and the batch hooks
    for part, extra in indexed_parts(loader):
        start = [
            lambda *a, fn=fn, e=extra: fn(trainer, task, *a, *e)
            for fn in hooks["on_predict_batch_start"]
        ]
        end = [
            lambda *a, fn=fn, e=extra: fn(trainer, task, *a, *e)
            for fn in hooks["on_predict_batch_end"]
        ]
        limit = limit_batches(length(part), run.config.limits["predict"])
        results.append(
            predict(
                task,
                module,
                part,
                limit,
                strategy=run.strategy,
                precision=run.precision,
                keep=keep,
                on_batch_start=start,
                on_batch_end=end,
                dataloader_idx=extra,
            )
        )
    modes.restore(module, task, kept)
    result = (results if keep else None) if len(results) > 1 else results[0]
    run.call_hooks("on_predict_epoch_end")
    return result


def predict(
    task: TaskModule,
    module: torch.nn.Module,
    loader: Any,
    limit: float,
    *,
    strategy: Strategy,
    precision: Any,
    on_batch_end: list[Any],
    keep: bool = True,
    on_batch_start: list[Any] | None = None,
    dataloader_idx: tuple[int, ...] = (),
) -> list[Any] | None:
    """``predict_step(batch, batch_idx)``, or ``module(inputs)``, for at most ``limit`` batches of
    ``loader``; each batch's prediction goes to the ``on_predict_batch_end`` hooks, and is kept only
    when ``keep``. Under ddp the kept predictions of every rank come back in dataset order (see
    :func:`in_dataset_order`)."""
    module.eval()
    predictions: list[Any] = []
    # under autocast, or a true mode's dtype
    step = precision.wrap_step(eval_step(task, module, "predict", {}))
    move = precision.batch_mover(strategy.batch_to_device)
    with torch.no_grad():
        for i, batch in enumerate(epoch_batches(loader, limit)):
            if i >= limit:
                break
            batch = move(batch)
            for fn in on_batch_start or ():
                fn(batch, i)
            out = step(batch, i, *dataloader_idx)
            for fn in on_batch_end:
                fn(out, batch, i)
            if keep:
                predictions.append(out)
    if not keep:
        return None
    if strategy.world_size == 1:
        return predictions
    order = sample_order(loader)
    gathered = strategy.all_gather_object(
        (None if order is None else list(order), to_cpu(predictions))
    )
    return in_dataset_order(gathered, getattr(loader, "batch_size", None))


def to_cpu(tree: Any) -> Any:
    """Tensors (in tuples, lists, dicts) on the CPU: what crosses process boundaries and goes to
    disk."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(v) for v in tree)
    if isinstance(tree, Mapping):
        return {k: to_cpu(v) for k, v in tree.items()}
    return tree


def _concat(batches: list[Any]) -> Any:
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches)
    if isinstance(first, (list, tuple)):
        return type(first)(_concat([b[i] for b in batches]) for i in range(len(first)))
    return {k: _concat([b[k] for b in batches]) for k in first}


def _take(tree: Any, index: torch.Tensor) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree[index]
    if isinstance(tree, (list, tuple)):
        return type(tree)(_take(v, index) for v in tree)
    return {k: _take(v, index) for k, v in tree.items()}


def _per_sample(tree: Any) -> bool:
    """A prediction made of tensors with a batch dimension (in tuples, lists, dicts): it can be
    reordered."""
    if isinstance(tree, torch.Tensor):
        return tree.dim() > 0
    if isinstance(tree, (list, tuple)):
        return len(tree) > 0 and all(_per_sample(v) for v in tree)
    return (
        isinstance(tree, Mapping) and len(tree) > 0 and all(_per_sample(v) for v in tree.values())
    )


def in_dataset_order(
    gathered: list[tuple[list[int] | None, list[Any]]], batch_size: int | None
) -> list[Any]:
    """Every rank's ``(sample order, predictions)`` as one process would have returned them: batches
    of ``batch_size`` in dataset order. Evaluation shards samples ``rank, rank + world, ...``, so
    per-sample tensors are concatenated, sorted by sample index and split again. Predictions that
    are not per-sample tensors, or a loader whose order taskfit does not know, come back rank after
    rank (docs/strategies.md)."""
    batches = [b for _, predictions in gathered for b in predictions]
    if (
        not batches
        or any(order is None for order, _ in gathered)
        or not all(map(_per_sample, batches))
    ):
        return batches
    indices = torch.tensor(
        [
            i
            for order, predictions in gathered
            for i in order[: len(_first_leaf(_concat(predictions))) if predictions else 0]
        ]
    )
    samples = _concat([_concat(predictions) for _, predictions in gathered if predictions])
    ordered = _take(samples, torch.argsort(indices))
    size = batch_size or len(_first_leaf(gathered[0][1][0]))
    total = len(indices)
    return [
        _take(ordered, torch.arange(start, min(start + size, total)))
        for start in range(0, total, size)
    ]


def _first_leaf(tree: Any) -> torch.Tensor:
    while not isinstance(tree, torch.Tensor):
        tree = tree[0] if isinstance(tree, (list, tuple)) else next(iter(tree.values()))
    return tree
