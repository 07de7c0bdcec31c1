"""TaskModule: the one class a user subclasses. It says *what* to train; the Trainer decides *how*."""
from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from .checkpoint import load_module
from .errors import MisconfigurationError, TaskModuleError
from .optim import gradient_clipper

if TYPE_CHECKING:
    from .trainer import Trainer

_PRIMITIVES = (int, float, str, bool, type(None))
# torch.compiler.disable, applied at the first call: the decorator imports torch._dynamo (about a second), which
# `import taskfit` should not pay. torch.optim defers it the same way, with this helper; where a torch lacks it,
# the public decorator (and the import at once).
_EAGER = getattr(torch, "_disable_dynamo", torch.compiler.disable)


def _plain(value: Any) -> Any:
    """An init argument as a primitive (hparams must be loggable and safe to store in a checkpoint)."""
    if isinstance(value, _PRIMITIVES):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    func = getattr(value, "func", None)  # functools.partial, e.g. a Hydra `_partial_: true` optimizer
    if func is not None:
        args = {k: _plain(v) for k, v in getattr(value, "keywords", {}).items()}
        return {"_target_": f"{func.__module__}.{func.__qualname__}", **args}
    return repr(value)


class TaskModule(nn.Module):
    """Subclass this and provide ``forward``, ``loss`` and ``train_dataloader``.

    Optional: ``val_dataloader``/``test_dataloader``/``predict_dataloader``, ``configure_optimizers``
    (or pass ``optimizer=``/``scheduler=`` factories to ``__init__``), ``configure_metrics``,
    ``split_batch``. Call ``self.log(name, value)`` from any of them to record a value.

    Beyond forward and loss (docs/steps.md): define ``training_step(batch, batch_idx)`` (returns the loss, or a
    dict with ``"loss"``), ``validation_step``/``test_step``/``predict_step(batch, batch_idx)``; set
    ``automatic_optimization = False`` to step the optimizers yourself (:meth:`optimizers`, :meth:`manual_backward`).

    The arguments a subclass is constructed with are recorded automatically in :attr:`hparams`
    (they are written to TensorBoard's HParams tab and to every checkpoint).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "TaskModule":
        self = super().__new__(cls)
        init_args: dict[str, Any] = {}
        try:  # record the init arguments; unpickling calls __new__ without them, then restores __dict__
            signature = inspect.signature(cls.__init__)
            bound = signature.bind(None, *args, **kwargs)
            bound.apply_defaults()
            for name, value in list(bound.arguments.items())[1:]:
                kind = signature.parameters[name].kind
                if kind is inspect.Parameter.VAR_KEYWORD:
                    init_args.update({k: _plain(v) for k, v in value.items()})
                elif kind is not inspect.Parameter.VAR_POSITIONAL:
                    init_args[name] = _plain(value)
        except TypeError:
            init_args = {}
        object.__setattr__(self, "_init_args", init_args)
        return self

    trainer: Trainer | None = None  # the Trainer running this module (set for the length of fit/validate/...)
    automatic_optimization: bool = True  # False: training_step calls manual_backward and steps self.optimizers()

    def __init__(self, optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 scheduler: Callable[..., Any] | None = None) -> None:
        super().__init__()
        # Factories (e.g. Hydra `_partial_: true` targets): optimizer(params), scheduler(optimizer).
        object.__setattr__(self, "optimizer_factory", optimizer)
        object.__setattr__(self, "scheduler_factory", scheduler)

    # ---- what the user provides ------------------------------------------------------------
    def loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """Return the scalar loss of ``outputs`` against ``targets``."""
        raise TaskModuleError(
            f"{type(self).__name__} does not define `loss`.",
            "add `def loss(self, outputs, targets) -> torch.Tensor:` returning a scalar tensor, "
            "e.g. `return torch.nn.functional.cross_entropy(outputs, targets)`.")

    def train_dataloader(self) -> Any:
        """Return the training DataLoader (required for fit)."""
        raise TaskModuleError(
            f"{type(self).__name__} does not define `train_dataloader`, which fit needs.",
            "add `def train_dataloader(self) -> torch.utils.data.DataLoader:`.")

    def val_dataloader(self) -> Any:
        """Return the validation DataLoader, or None to skip validation."""
        return None

    def test_dataloader(self) -> Any:
        """Return the test DataLoader, or None."""
        return None

    def predict_dataloader(self) -> Any:
        """Return the DataLoader for :meth:`Trainer.predict`, or None."""
        return None

    def configure_optimizers(self) -> Any:
        """Return an optimizer, ``(optimizer, scheduler)`` or a dict ``{"optimizer", "lr_scheduler"}``.

        The default builds them from the ``optimizer``/``scheduler`` factories given to ``__init__``.
        """
        factory = self.__dict__.get("optimizer_factory")
        if factory is None:
            raise TaskModuleError(
                f"{type(self).__name__} has no optimizer.",
                "define `def configure_optimizers(self): return torch.optim.Adam(self.parameters(), lr=1e-3)` "
                "or pass `optimizer=functools.partial(torch.optim.Adam, lr=1e-3)` to TaskModule.__init__.")
        optimizer = factory(self.parameters())
        scheduler = self.__dict__.get("scheduler_factory")
        return optimizer if scheduler is None else (optimizer, scheduler(optimizer))

    def configure_metrics(self) -> Mapping[str, Any] | None:
        """Return ``{name: torchmetrics.Metric}`` updated on every validation/test batch with ``(outputs, targets)``.

        The Trainer keeps one copy per stage, computes it once per epoch, logs it as ``val/<name>`` /
        ``test/<name>`` and resets it.
        """
        return None

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """Split a batch into ``(inputs, targets)``: ``batch[0], batch[1]`` or ``batch["inputs"], batch["targets"]``."""
        if type(batch) in (list, tuple) and len(batch) == 2:  # the common case first: concrete types are cheap
            return batch[0], batch[1]
        if isinstance(batch, Mapping) and "inputs" in batch and "targets" in batch:
            return batch["inputs"], batch["targets"]
        if isinstance(batch, Sequence) and not isinstance(batch, str) and len(batch) == 2:
            return batch[0], batch[1]
        kind = f"a mapping with keys {sorted(map(str, batch))}" if isinstance(batch, Mapping) else (
            f"a sequence of length {len(batch)}" if isinstance(batch, Sequence) else f"a {type(batch).__name__}")
        raise TaskModuleError(
            f"Cannot split the batch into (inputs, targets): got {kind}.",
            "return `(inputs, targets)` or `{'inputs': ..., 'targets': ...}` from the dataset, or override "
            "`def split_batch(self, batch): return inputs, targets` in your TaskModule.")

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str, /, *, map_location: Any = "cpu",
                             **kwargs: Any) -> "TaskModule":
        """Rebuild the module from a checkpoint, for inference: ``MyTask.load_from_checkpoint("last.ckpt")``.

        The module is constructed with the init arguments the checkpoint recorded (``kwargs`` override them),
        its weights are loaded (safely: ``torch.load(weights_only=True)``), it is moved to ``map_location``
        and put in eval mode. Also reads plain state dicts (then the module is built from ``kwargs`` alone).
        """
        return load_module(cls, checkpoint_path, map_location=map_location, **kwargs)

    # ---- what the Trainer provides ---------------------------------------------------------
    @property
    def hparams(self) -> dict[str, Any]:
        """The arguments this module was constructed with, as primitives."""
        return dict(self.__dict__.get("_init_args", {}))

    @property
    def stage(self) -> str | None:
        """The running stage ("train", "val", "test", "predict"), or None outside a Trainer."""
        stage = None if self.trainer is None else self.trainer.state.stage
        return {"sanity": "val", "idle": None}.get(stage, stage)  # type: ignore[arg-type]

    @_EAGER  # under compile=True: run eagerly (a graph break), not traced into guards per key
    def log(self, name: str, value: torch.Tensor | float, prog_bar: bool = False) -> None:
        """Record ``value`` under ``name``; averaged over the epoch (and across ddp ranks).

        A name without a ``/`` gets the stage as prefix: ``self.log("acc", a)`` during validation is ``val/acc``.
        Tensors stay on the device: logging costs no host-device sync.
        """
        if self.trainer is None:
            raise MisconfigurationError(
                f"self.log({name!r}, ...) was called outside a Trainer run.",
                "call self.log only from methods the Trainer calls (forward, loss, split_batch...).")
        self.trainer.logs.current.log(name, value, prog_bar)


    # ---- manual optimization and custom steps (docs/steps.md) ----------------------------------------------
    def optimizers(self) -> Any:
        """The optimizer (or list of them) of ``configure_optimizers``; with manual optimization each one's
        ``step()`` goes through the precision (GradScaler), the hooks, the ddp gradient average and global_step."""
        trainer = self._running_trainer("self.optimizers()")
        found = trainer.manual_optimizers if trainer.manual else trainer.optimizers
        if not found:
            raise MisconfigurationError("self.optimizers() was called outside fit: there are no optimizers.",
                                        "call it from training_step.")
        return found[0] if len(found) == 1 else list(found)

    def lr_schedulers(self) -> Any:
        """The scheduler (or list of them) of ``configure_optimizers``, None without; with manual optimization
        call their ``step()`` yourself."""
        found = [c.scheduler for c in self._running_trainer("self.lr_schedulers()").schedulers.configs]
        return None if not found else found[0] if len(found) == 1 else found

    def manual_backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with the precision's loss scaling (16-mixed); use it instead of ``loss.backward()``."""
        trainer = self._running_trainer("self.manual_backward(loss)")
        trainer.precision.backward(loss)
        for optimizer in trainer.manual_optimizers:  # ddp: their gradients are averaged before clipping/stepping
            optimizer.synced = False

    def clip_gradients(self, optimizer: Any, gradient_clip_val: float,
                       gradient_clip_algorithm: str = "norm") -> None:
        """Clip the gradients of ``optimizer``'s parameters (unscaled first under 16-mixed), before its step."""
        if hasattr(optimizer, "sync_gradients"):  # a ManualOptimizer: clip the gradients averaged over ranks
            optimizer.sync_gradients()
        optimizer = getattr(optimizer, "optimizer", optimizer)
        self._running_trainer("self.clip_gradients(...)").precision.unscale(optimizer)
        gradient_clipper(optimizer, gradient_clip_val, gradient_clip_algorithm)()

    @property
    def stage_metrics(self) -> dict[str, Any]:
        """This stage's copies of ``configure_metrics()`` (``{name: Metric}``): in your own validation_step/test_step
        call ``self.stage_metrics["acc"].update(preds, targets)``; the Trainer computes, logs and resets them."""
        trainer = self._running_trainer("self.stage_metrics")
        return trainer.metrics.get({"sanity": "val"}.get(trainer.state.stage, trainer.state.stage), {})

    def _running_trainer(self, what: str) -> Trainer:
        if self.trainer is None:
            raise MisconfigurationError(f"{what} was called outside a Trainer run.",
                                        "call it from training_step (or another method the Trainer calls during fit).")
        return self.trainer


def predict_inputs(task: TaskModule, batch: Any) -> Any:
    """The inputs of a predict batch: ``split_batch``'s first item if the task overrides it, else the batch's
    ``inputs`` key, its first item (of ``(inputs,)`` or ``(inputs, targets)``), or the batch itself."""
    if type(task).split_batch is not TaskModule.split_batch:
        return task.split_batch(batch)[0]
    if isinstance(batch, Mapping) and "inputs" in batch:
        return batch["inputs"]
    if isinstance(batch, (list, tuple)) and len(batch) in (1, 2):
        return batch[0]
    return batch


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{"a.b": value}`` with loggable values (anything else as its ``str``)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return out
