"""The Trainer's Lightning layer, attached where trainer.py's ``class Trainer(LightningNames,
metaclass=LightningArguments)`` names it, and in the entry points' one call of
:func:`entry_keywords`:

- :class:`LightningArguments`, the metaclass: ``Trainer(...)`` reads Lightning's spellings of a
  default as taskfit's (``precision=None``, ``max_steps=-1``...) and a call the signature does not
  bind (a typo, a Lightning-only argument, positional arguments) is one catalogued error, before
  ``__init__`` runs. ``__init__`` itself is not wrapped: the signature a reader sees in trainer.py
  is the one that runs.
- :class:`LightningNames`: Lightning's names for what the Trainer keeps under its own
  (``current_epoch`` is ``state.epoch``...), as read-only properties.
- :func:`entry_keywords`: ``fit``/``validate``/``test``/``predict``/``save_checkpoint`` take
  Lightning's keywords (``model=``, ``weights_only=``, ``filepath=``); any other keyword they do not
  take is a catalogued error.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ... import callbacks, console
from ...arguments import argument_error
from ...data.loaders import parts
from ...errors import MisconfigurationError
from .trainer_arguments import (
    ENTRY_POINT_ARGUMENTS,
    TRAINER_ARGUMENTS,
    batch_limit_notes,
    lightning_values,
)

_RENAMED = {"model": "task", "filepath": "path"}  # Lightning's keyword -> taskfit's argument


class LightningArguments(type):
    """The Trainer's metaclass: Lightning's values and one catalogued error for a call ``__init__``
    cannot bind."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        given = {k: v for k, v in kwargs.items() if v is not None}  # None: Lightning's default
        kwargs = lightning_values(cls.__init__, kwargs)
        signature = inspect.signature(cls.__init__)
        try:
            signature.bind(None, *args, **kwargs)
        except TypeError:
            raise argument_error(
                cls.__name__, signature, args, kwargs, TRAINER_ARGUMENTS, "docs/trainer.md"
            ) from None
        trainer = super().__call__(*args, **kwargs)
        # Lightning's lines for a batch limit passed as 1 or 1.0, on rank 0; not for the taskfit
        # command's Trainer (config=...), which passes every argument and prints its config
        if kwargs.get("config") is None and trainer.strategy.rank == 0:
            for note in batch_limit_notes(given):
                console.echo(note, name="taskfit.trainer")
        return trainer


def entry_keywords(
    method: Callable[..., Any], given: Any, lightning: Mapping[str, Any], required: bool = False
) -> Any:
    """The value of ``method``'s first argument (``task``, or ``path`` for save_checkpoint), also
    when passed under Lightning's name (``model=``, ``filepath=``); ``weights_only=True``/``None``
    is what taskfit always does. Any other keyword in ``lightning`` (what the method's
    ``**lightning`` caught) is a catalogued error, and so is no value at all where it is
    ``required``."""
    name = f"Trainer.{method.__name__}"
    # without its **lightning: the keywords the method itself takes
    signature = inspect.signature(method)
    signature = signature.replace(
        parameters=[p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    )
    first = next(iter(signature.parameters))
    for key, value in lightning.items():
        if _RENAMED.get(key) == first:
            if given is not None:
                raise MisconfigurationError(f"{name}() got both {first} and {key}= (Lightning's "
                                            "name for it).",
                                            f"pass one of them: {name}({first}=...) or "
                                            f"{name}({key}=...).")
            given = value
        elif (key == "weights_only" and method.__name__ != "save_checkpoint"
              and value in (None, True)):
            continue  # taskfit always loads with torch.load(weights_only=True)
        else:
            raise argument_error(
                name, signature, (), {key: value}, ENTRY_POINT_ARGUMENTS, "docs/trainer.md"
            )
    if given is None and required:
        raise MisconfigurationError(f"{name}() is missing the argument {first!r}.",
                                    f"pass it, e.g. {name}({first}=...); docs/trainer.md describes "
                                    "it.")
    return given


class LightningNames:
    """Lightning's names for what the Trainer keeps in ``state``, its strategy and its run
    (docs/migrating-lightning.md)."""

    current_epoch = property(lambda self: self.state.epoch, doc="``state.epoch`` (Lightning's "
                                                                "name).")
    global_step = property(lambda self: self.state.global_step, doc="``state.global_step`` "
                                                                    "(Lightning's name).")
    sanity_checking = property(
        lambda self: self.state.stage == "sanity", doc="The sanity check is running."
    )
    training = property(
        lambda self: self.state.stage == "train", doc="A training epoch is running."
    )
    interrupted = property(lambda self: self.state.status == "interrupted",
                           doc="The last entry point ended with an error or Ctrl-C "
                               "(``state.status``).")
    lightning_module = property(lambda self: self.task, doc="The TaskModule of the current or last "
                                                            "run.")
    datamodule = property(
        lambda self: getattr(self.data, "datamodule", None), doc="The run's DataModule, or None."
    )
    world_size = property(lambda self: self.strategy.world_size, doc="The number of processes.")
    global_rank = property(lambda self: self.strategy.rank, doc="This process's rank.")
    local_rank = property(
        lambda self: self.strategy.local_rank, doc="This process's rank on its machine."
    )
    node_rank = property(lambda self: self.strategy.node_rank,
                         doc="This machine's index among the run's machines.")
    num_nodes = property(lambda self: self.strategy.num_nodes,
                         doc="How many machines the run spans.")
    is_global_zero = property(lambda self: self.strategy.is_main, doc="Rank 0 (``is_main``).")
    val_dataloaders = property(
        lambda self: self.val_loader,
        doc="The fit's validation loader(s) (a loader, or the list/dict passed), or None.")
    num_training_batches = property(
        lambda self: self.num_train_batches, doc="Training batches per epoch."
    )
    callback_metrics = property(
        lambda self: {k: torch.tensor(v) for k, v in _views(self)[0].items()},
        doc="Every published value, as tensors (``state.metrics`` holds them as floats), as "
            "Lightning's: no evaluation step values, and only the task's keys once it logs "
            "training values of its own.",
    )
    logged_metrics = property(
        lambda self: {k: torch.tensor(v) for k, v in _views(self)[1].items()},
        doc="The published values loggers received, as tensors (only the task's keys once it "
            "logs training values of its own).",
    )
    checkpoint_callbacks = property(
        lambda self: [cb for cb in self.callbacks if _named_base(cb, "ModelCheckpoint")],
        doc="Every ModelCheckpoint among the callbacks.",
    )
    early_stopping_callbacks = property(
        lambda self: [cb for cb in self.callbacks if _named_base(cb, "EarlyStopping")],
        doc="Every EarlyStopping among the callbacks.",
    )
    early_stopping_callback = property(lambda self: next(iter(self.early_stopping_callbacks), None),
                                       doc="The first EarlyStopping, or None.")
    progress_bar_callback = property(
        lambda self: next((cb for cb in self.callbacks if _named_base(cb, "ProgressBar")), None),
        doc="The progress bar callback, or None.",
    )
    lr_scheduler_configs = property(
        lambda self: [] if self.schedulers is None else list(self.schedulers.configs),
        doc="The fit's scheduler configs (``scheduler``, ``interval``, ``frequency``, ``monitor``, "
            "``strict``, ``name``, ``reduce_on_plateau``).")
    progress_bar_metrics = property(lambda self: {} if self.logs is None else {
        k: v for k, v in self.state.metrics.items() if k in self.logs.prog_bar},
        doc="The latest value of every key logged with ``prog_bar=True`` (floats).")

    limit_train_batches = property(lambda self: self.limits["train"],
                                   doc='``limits["train"]`` (Lightning\'s name).')
    limit_val_batches = property(lambda self: self.limits["val"],
                                 doc='``limits["val"]`` (Lightning\'s name).')
    limit_test_batches = property(lambda self: self.limits["test"],
                                  doc='``limits["test"]`` (Lightning\'s name).')
    limit_predict_batches = property(lambda self: self.limits["predict"],
                                     doc='``limits["predict"]`` (Lightning\'s name).')
    val_dataloaders = property(
        lambda self: _as_given(
            self.val_loader if self.state.fn == "fit" else _eval(self, "validate")),
        doc="The validation loader of the current or last fit or validate (a list when several).")
    test_dataloaders = property(lambda self: _as_given(_eval(self, "test")),
                                doc="The loader of the current or last test (a list when several).")
    predict_dataloaders = property(
        lambda self: _as_given(_eval(self, "predict")),
        doc="The loader of the current or last predict (a list when several).")


def _eval(trainer: Any, fn: str) -> Any:
    """The loader of the current or last run when it was ``fn``, else None."""
    run = trainer.run
    return run.eval_dataloader if run is not None and run.fn == fn else None


def _as_given(loader: Any) -> Any:
    """One loader as itself, several as a list (Lightning's ``trainer.val_dataloaders``)."""
    if loader is None:
        return None
    loaders = parts(loader)
    return loaders[0] if len(loaders) == 1 else list(loaders)


def _views(trainer: Any) -> tuple[dict[str, float], dict[str, float]]:
    """Lightning's callback_metrics and logged_metrics, as floats (LogBuffer.lightning_views)."""
    if trainer.logs is None:
        return trainer.state.metrics, trainer.state.metrics
    return trainer.logs.lightning_views(trainer.state.metrics)


def _named_base(obj: Any, name: str) -> bool:
    """``obj`` is an instance of ``taskfit.callbacks.<name>`` (loaded on first use, as the package
    does)."""
    return isinstance(obj, getattr(callbacks, name))
