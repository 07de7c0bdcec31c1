"""Lightning's hooks in taskfit: which ones the Trainer calls, on whom, in which order, and the one
warning for the rest. The core Callback API (callbacks/base.py) stays small; a Lightning callback or
LightningModule keeps its hooks, with Lightning's meaning and order (docs/callbacks.md, "Lightning's
hooks"):

- a callback's Lightning hook is called with ``(trainer, task, ...)``, a TaskModule's or
  DataModule's with Lightning's arguments (``task.on_train_batch_end(outputs, batch, batch_idx)``);
- callbacks first (in their ``order``), then the data module / task, as Lightning's
  ``trainer/call.py``; except ``setup``/``teardown`` (data module first), ``on_load_checkpoint``
  (the task first) and ``on_train_epoch_end`` (the task's just before the first monitoring callback,
  ModelCheckpoint or EarlyStopping, which then see what the task logged there; among callbacks of
  equal ``order`` the monitoring ones come last, as in Lightning);
- a hook that no one defines is not in the table: it costs nothing per step (the table is built once
  per run).
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any, Callable

from torch import nn

from ..callback import HOOKS as CORE_HOOKS
from ..callback import Callback

Hook = Callable[..., Any]

# Lightning's callback hooks beyond the core ones: name -> when taskfit calls it (each receives
# (trainer, task, ...)).
LIGHTNING_HOOKS: dict[str, str] = {
    "setup": "(stage) at the start of fit/validate/test/predict, before the module moves to its "
    "device",
    "teardown": "(stage) at the end of fit/validate/test/predict (not after an exception)",
    "on_train_start": "after the sanity check, before the first training epoch",
    "on_train_end": "after the last training epoch, before on_fit_end",
    "on_validation_epoch_start": "after on_validation_start, before the first validation batch",
    "on_validation_epoch_end": "after the validation batches; the pass's values are in "
    "callback_metrics, its torchmetrics computed and not yet reset",
    "on_test_epoch_start": "after on_test_start",
    "on_test_epoch_end": "as on_validation_epoch_end, for test",
    "on_predict_epoch_start": "after on_predict_start",
    "on_predict_epoch_end": "before on_predict_end",
    "on_validation_batch_start": "(batch, batch_idx) before each validation batch (batch on the "
    "device)",
    "on_validation_batch_end": "(outputs, batch, batch_idx): what the step returned (default step: "
    "the loss)",
    "on_test_batch_start": "(batch, batch_idx)",
    "on_test_batch_end": "(outputs, batch, batch_idx)",
    "on_predict_batch_start": "(batch, batch_idx) before each predict batch",
    "on_before_zero_grad": "(optimizer) before zero_grad, at each accumulation group's first batch",
    "on_before_backward": "(loss) the loss backward is called on (divided by the group's size "
    "under accumulation)",
    "on_after_backward": "() after backward: gradients are there (scaled under 16-mixed)",
    "on_save_checkpoint": "(checkpoint) the dict about to be written: add your own keys",
    "on_load_checkpoint": "(checkpoint) the dict read, before its state is restored",
}
HOOKS: tuple[str, ...] = (*CORE_HOOKS, *LIGHTNING_HOOKS)
# taskfit's own callback hooks: not Lightning names on a task
LOGGING_HOOKS = ("on_log", "on_logged_batch_start", "on_log_interval")

# Lightning's hooks of a LightningModule that the Trainer calls on a TaskModule (with Lightning's
# arguments).
MODULE_HOOKS: tuple[str, ...] = (
    "prepare_data",
    "setup",
    "teardown",
    "configure_model",
    "on_fit_start",
    "on_fit_end",
    "on_train_start",
    "on_train_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_start",
    "on_test_end",
    "on_test_epoch_start",
    "on_test_epoch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_start",
    "on_predict_end",
    "on_predict_epoch_start",
    "on_predict_epoch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_save_checkpoint",
    "on_load_checkpoint",
)
# Lightning's overrides of the automatic step, called on a task that writes its own (overrides.py)
AUTOMATIC_OVERRIDES = (
    "optimizer_step",
    "optimizer_zero_grad",
    "backward",
    "configure_gradient_clipping",
    "lr_scheduler_step",
)
# ... and on a DataModule (its state_dict/load_state_dict are saved in and restored from
# checkpoints).
DATAMODULE_HOOKS: tuple[str, ...] = ("prepare_data", "setup", "teardown", "on_exception")

# Lightning hook names taskfit does not call: what to do instead (named in one warning when a run
# starts).
NOT_CALLED: dict[str, str] = {
    "on_validation_model_eval": "the Trainer calls module.eval() before validation; change a "
    "submodule's mode in on_validation_epoch_start",
    "on_validation_model_train": "after validation the Trainer puts each submodule back in the "
    "mode it had",
    "on_validation_model_zero_grad": "the gradients are left as the step made them (zeroed before "
    "the next group)",
    "on_test_model_eval": "the Trainer calls module.eval() before test",
    "on_test_model_train": "nothing runs after test",
    "on_predict_model_eval": "the Trainer calls module.eval() before predict",
    "configure_sharded_model": "build the layers in configure_model or __init__",
    "on_before_batch_transfer": (
        "change the batch in split_batch, or in the DataLoader's collate_fn"),
    "transfer_batch_to_device": "batches of tensors (in tuples, lists, dicts) are moved for you; "
    "move other types in split_batch",
    "on_after_batch_transfer": "change the batch in split_batch (it runs on the device batch)",
    # removed in Lightning 2.0 (a port of 1.x code)
    "training_epoch_end": "on_train_epoch_end, collecting what it needs in training_step (or "
    "self.log / torchmetrics, which average for you)",
    "validation_epoch_end": "on_validation_epoch_end, with self.log or torchmetrics in "
    "validation_step",
    "test_epoch_end": "on_test_epoch_end, with self.log or torchmetrics in test_step",
    "on_epoch_start": "on_train_epoch_start",
    "on_epoch_end": "on_train_epoch_end",
    "on_batch_start": "on_train_batch_start",
    "on_batch_end": "on_train_batch_end",
    "on_pretrain_routine_start": "on_fit_start",
    "on_pretrain_routine_end": "on_fit_start",
    "on_init_start": "__init__",
    "on_init_end": "__init__",
    "on_keyboard_interrupt": "on_exception",
}


def defines(obj: Any, name: str) -> bool:
    """``obj``'s class has a callable ``name`` of its own: not ``Callback``'s no-op, not a base
    class's :func:`default_hook`, not torch.nn.Module's."""
    method = getattr(type(obj), name, None)
    if (
        not callable(method)
        or getattr(method, "default_hook", False)
        or method is getattr(nn.Module, name, None)
    ):
        return False
    if isinstance(obj, Callback) and method is getattr(Callback, name, None):
        return False
    return name not in getattr(obj, "not_hooks", ())  # a Logger's setup(trainer) is its own API


def _adapter(bound: Hook) -> Hook:
    """A task's or data module's hook as the table calls hooks: ``(trainer, task, *args)`` ->
    ``bound(*args)``."""
    def call(trainer: Any, task: Any, *args: Any) -> Any:
        return bound(*args)
    call.__name__ = bound.__name__
    call.task_hook = True  # type: ignore[attr-defined]  # not a callback's (is_task_hook)
    return call


def is_task_hook(fn: Hook) -> bool:
    """``fn`` in a hook list is the task's or data module's hook, not a callback's."""
    return getattr(fn, "task_hook", False)


def hook_table(callbacks: Iterable[Callback], task: Any, datamodule: Any = None,
               publish: Hook | None = None) -> dict[str, list[Hook]]:
    """For each hook, what the Trainer calls, in Lightning's order: callbacks (sorted by ``order``)
    that define it, and the task's/data module's own. Monitoring callbacks
    (``Callback.monitors_epoch_values``: ModelCheckpoint, EarlyStopping) come last among equals in
    ``on_train_epoch_end``; the task's runs before them, and ``publish(trainer, task)`` right after
    it and last (it publishes what was logged there)."""
    callbacks = list(callbacks)
    table: dict[str, list[Hook]] = {}
    for name in (*HOOKS, "prepare_data", "configure_model"):
        owners = [cb for cb in callbacks if name in HOOKS and defines(cb, name)]
        mine = (
            [_adapter(getattr(task, name))] if name in MODULE_HOOKS and defines(task, name) else []
        )
        data = (
            [_adapter(getattr(datamodule, name))]
            if (datamodule is not None and name in DATAMODULE_HOOKS and defines(datamodule, name))
            else []
        )
        # in `order`, monitors last among equals; the task's just before them
        if name == "on_train_epoch_end":
            owners.sort(key=lambda cb: (cb.order, cb.monitors_epoch_values))
            first = next(
                (i for i, cb in enumerate(owners) if cb.monitors_epoch_values), len(owners)
            )
            late = [publish] if publish is not None else []
            own = [getattr(cb, name) for cb in owners]
            table[name] = own[:first] + mine + late + own[first:] + late
            continue
        own = [getattr(cb, name) for cb in owners]
        if name in ("setup", "teardown", "prepare_data"):
            table[name] = data + own + mine
        elif name == "on_load_checkpoint":
            table[name] = mine + own
        else:
            table[name] = own + mine + data
    return table


def drop_idle_batch_hooks(
    hooks: dict[str, list[Hook]], trainer: Any
) -> tuple[list[Hook], list[Hook]]:
    """Remove from ``hooks`` the training batch hooks of callbacks whose ``needs_batch_hooks`` says
    False for this fit; return the ``on_train_batch_start`` and ``on_train_batch_end`` lists that
    remain."""
    for name in ("on_train_batch_start", "on_train_batch_end"):
        hooks[name] = [
            fn for fn in hooks[name] if is_task_hook(fn) or fn.__self__.needs_batch_hooks(trainer)
        ]
    return hooks["on_train_batch_start"], hooks["on_train_batch_end"]


def uncalled_hooks(callbacks: Iterable[Callback], task: Any, datamodule: Any = None) -> list[str]:
    """``Class.hook`` for every Lightning hook name defined on a callback, the task or the data
    module that taskfit does not call on it."""
    found = []
    for obj, called in [
        *((cb, HOOKS) for cb in callbacks),
        (task, MODULE_HOOKS),
        (datamodule, DATAMODULE_HOOKS),
    ]:
        if obj is None:
            continue
        candidates = list(NOT_CALLED) + (
            [] if called is HOOKS else [h for h in HOOKS if h not in LOGGING_HOOKS]
        )
        found += [
            f"{type(obj).__name__}.{name}"
            for name in candidates
            if name not in called and defines(obj, name)
        ]
    # Lightning calls them in automatic optimization only
    if not getattr(task, "automatic_optimization", True):
        found += [
            f"{type(task).__name__}.{name}" for name in AUTOMATIC_OVERRIDES if defines(task, name)
        ]
    return found


def warn_uncalled(callbacks: Iterable[Callback], task: Any, datamodule: Any = None) -> None:
    """One warning naming every Lightning hook defined here that taskfit does not call, with what to
    use."""
    names = uncalled_hooks(callbacks, task, datamodule)
    if not names:
        return
    advice = "; ".join(f"`{n}`: {_advice(n.rsplit('.', 1)[1])}"
                       for n in names)
    listed = ", ".join(f"`{n}`" for n in names)
    verb = "is a Lightning hook" if len(names) == 1 else "are Lightning hooks"
    warnings.warn(f"{listed} {verb} taskfit does not call. Use instead: {advice}. HINT: "
                  "docs/callbacks.md lists the hooks taskfit calls and "
                  "when.", UserWarning, stacklevel=4)


def _advice(name: str) -> str:
    if name in AUTOMATIC_OVERRIDES:
        return ("with automatic_optimization = False the task steps, zeroes and clips itself in "
                "training_step")
    return NOT_CALLED.get(name, "a callback hook: put it in a Callback")


def merge_task_callbacks(callbacks: list[Callback], task: Any) -> list[Callback]:
    """Lightning's ``configure_callbacks``: the task's callbacks replace the Trainer's of the same
    class; sorted by ``order``. Without the method, ``callbacks`` unchanged."""
    if not defines(task, "configure_callbacks"):
        return callbacks
    extra = task.configure_callbacks()
    extra = [extra] if isinstance(extra, Callback) else list(extra or [])
    replaced = {type(cb) for cb in extra}
    return sorted(
        [cb for cb in callbacks if type(cb) not in replaced] + extra, key=lambda cb: cb.order
    )
