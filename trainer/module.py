"""TaskModule: the one class a user subclasses. It says *what* to train; the Trainer decides
*how*."""
from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable

import torch
from torch import nn

from .callback import default_hook
from .checkpoint.lookup import load_module
from .cluster import global_rank
from .errors import MisconfigurationError, TaskModuleError
from .init_args import AttributeDict, recorded_init_args, select_hparams
from .optim import gradient_clipper, plain_scheduler_step

# torch.compiler.disable, applied at the first call: the decorator imports torch._dynamo (about a
# second), which `import taskfit` should not pay. torch.optim defers it the same way, with this
# helper; where a torch lacks it, the public decorator (and the import at once).
_EAGER = getattr(torch, "_disable_dynamo", torch.compiler.disable)
# graph_tracing() is on: torch.jit reads every attribute of the module (Lightning's
# _jit_is_scripting), and the properties that need a run answer empty instead of raising
_TRACING = [False]


@contextlib.contextmanager
def graph_tracing() -> Iterator[None]:
    """While a module's graph is traced (``SummaryWriter.add_graph``), outside a run too:
    ``torch.jit`` reads every attribute, and :attr:`TaskModule.stage_metrics` is then empty."""
    before, _TRACING[0] = _TRACING[0], True
    try:
        yield
    finally:
        _TRACING[0] = before


class TaskModule(nn.Module):
    """Subclass this and provide ``forward``, ``loss`` and ``train_dataloader``.

    Optional: ``val_dataloader``/``test_dataloader``/``predict_dataloader``,
    ``configure_optimizers`` (or pass ``optimizer=``/``scheduler=`` factories to ``__init__``),
    ``configure_metrics``, ``split_batch``. Call ``self.log(name, value)`` from any of them to
    record a value.

    Beyond forward and loss (docs/steps.md): define ``training_step(batch, batch_idx)`` (returns the
    loss, or a dict with ``"loss"``), ``validation_step``/``test_step``/``predict_step(batch,
    batch_idx)``; set ``automatic_optimization = False`` to step the optimizers yourself
    (:meth:`optimizers`, :meth:`manual_backward`). Lightning's hooks (``setup``,
    ``on_train_epoch_end``...) are called when defined (docs/taskmodule.md).

    The arguments a subclass is constructed with are recorded automatically in :attr:`hparams`
    (they are written to TensorBoard's HParams tab and to every checkpoint).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "TaskModule":
        self = super().__new__(cls)
        # unpickling calls __new__ without the arguments, then restores __dict__
        object.__setattr__(self, "_hparams", AttributeDict(recorded_init_args(cls, args, kwargs)))
        return self

    # the taskfit.Trainer running this module, for the length of fit/validate/... (not imported:
    # module.py sits below trainer.py)
    trainer: Any = None
    # False: training_step calls manual_backward and steps self.optimizers()
    automatic_optimization: bool = True

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
        """Return an optimizer, ``(optimizer, scheduler)`` or a dict ``{"optimizer",
        "lr_scheduler"}``.

        The default builds them from the ``optimizer``/``scheduler`` factories given to
        ``__init__``.
        """
        factory = self.__dict__.get("optimizer_factory")
        if factory is None:
            raise TaskModuleError(
                f"{type(self).__name__} has no optimizer.",
                "define `def configure_optimizers(self): return "
                "torch.optim.Adam(self.parameters(), lr=1e-3)` or pass "
                "`optimizer=functools.partial(torch.optim.Adam, lr=1e-3)` to TaskModule.__init__.")
        optimizer = factory(self.parameters())
        scheduler = self.__dict__.get("scheduler_factory")
        return optimizer if scheduler is None else (optimizer, scheduler(optimizer))

    def configure_metrics(self) -> Mapping[str, Any] | None:
        """Return ``{name: torchmetrics.Metric}`` updated on every validation/test batch with
        ``(outputs, targets)``.

        The Trainer keeps one copy per stage, computes it once per epoch, logs it as ``val/<name>``
        / ``test/<name>`` and resets it.
        """
        return None

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """Split a batch into ``(inputs, targets)``: ``batch[0], batch[1]`` or ``batch["inputs"],
        batch["targets"]``."""
        # the common case first: concrete types are cheap
        if type(batch) in (list, tuple) and len(batch) == 2:
            return batch[0], batch[1]
        if isinstance(batch, Mapping) and "inputs" in batch and "targets" in batch:
            return batch["inputs"], batch["targets"]
        if isinstance(batch, Sequence) and not isinstance(batch, str) and len(batch) == 2:
            return batch[0], batch[1]
        kind = (
            f"a mapping with keys {sorted(map(str, batch))}"
            if isinstance(batch, Mapping)
            else (
                f"a sequence of length {len(batch)}"
                if isinstance(batch, Sequence)
                else f"a {type(batch).__name__}"
            )
        )
        raise TaskModuleError(
            f"Cannot split the batch into (inputs, targets): got {kind}.",
            "return `(inputs, targets)` or `{'inputs': ..., 'targets': ...}` from the dataset, or "
            "override `def split_batch(self, batch): return inputs, targets` in your TaskModule.")

    @default_hook
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The default prediction, ``self(inputs)`` (see :func:`predict_inputs`), for an override
        that calls ``super().predict_step(batch, batch_idx)`` as in Lightning; the Trainer calls it
        only through one."""
        batch = kwargs.get("batch", args[0] if args else None)
        return self(predict_inputs(self, batch))

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str, /, *, map_location: Any = "cpu",
                             **kwargs: Any) -> "TaskModule":
        """Rebuild the module from a checkpoint, for inference:
        ``MyTask.load_from_checkpoint("last.ckpt")``.

        The module is constructed with the init arguments the checkpoint recorded (``kwargs``
        override them), its weights are loaded (safely: ``torch.load(weights_only=True)``), it is
        moved to ``map_location`` and put in eval mode. Also reads plain state dicts (then the
        module is built from ``kwargs`` alone).
        """
        return load_module(cls, checkpoint_path, map_location=map_location, **kwargs)

    # ---- what the Trainer provides ---------------------------------------------------------
    @property
    def hparams(self) -> AttributeDict:
        """The arguments this module was constructed with (``self.hparams.lr``), or those
        :meth:`save_hyperparameters` kept. Checkpoints and loggers get them as primitives."""
        return self.__dict__.setdefault("_hparams", AttributeDict())

    def save_hyperparameters(
        self, *args: Any, ignore: Any = None, frame: Any = None, logger: bool = True
    ) -> None:
        """Lightning's call. taskfit records every ``__init__`` argument already; this keeps only
        ``args`` (names), or all but ``ignore`` (``ignore=["net"]``); ``logger=False`` keeps them
        out of the loggers' hyperparameters."""
        select_hparams(self, args, ignore)
        object.__setattr__(self, "_log_hparams", bool(logger))

    @property
    def stage(self) -> str | None:
        """The running stage ("train", "val", "test", "predict"), or None outside a Trainer."""
        stage = None if self.trainer is None else self.trainer.state.stage
        return {"sanity": "val", "idle": None}.get(stage, stage)  # type: ignore[arg-type]

    @_EAGER  # under compile=True: run eagerly (a graph break), not traced into guards per key
    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str | Callable[..., Any] = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """Record ``value`` (a scalar tensor, a number or a torchmetrics Metric) under ``name``, as
        Lightning's ``self.log``: in training hooks every ``log_every_n_steps`` (``on_step``), in
        validation/test and epoch-end hooks as the epoch's ``reduce_fx`` ("mean" weighted by
        ``batch_size``, "sum", "max", "min") over all ranks (``on_epoch``); both on: ``<name>_step``
        and ``<name>_epoch``. ``prog_bar`` shows it on the progress bar, ``logger=False`` keeps it
        out of the loggers (callbacks still read it).

        ``name`` is published as given, as in Lightning (``"val_loss"`` is ``val_loss``;
        ``"val/acc"`` groups it with taskfit's ``val/loss`` in TensorBoard). Tensors stay on the
        device: logging costs no host-device sync (step values are converted at the log interval,
        epoch values once per epoch). ``sync_dist``: epoch values are always reduced over ranks,
        step values never (docs/taskmodule.md).
        """
        if metric_attribute is None and isinstance(value, nn.Module) and all(
                hasattr(value, a) for a in ("update", "compute", "reset")):
            self._check_metric_attribute(name, value)
        trainer = self.trainer
        if trainer is None:
            raise MisconfigurationError(
                f"self.log({name!r}, ...) was called outside a Trainer run.",
                "call self.log only from methods the Trainer calls (forward, loss, split_batch, "
                "the steps, hooks).")
        trainer.logs.current.log(
            name,
            value,
            add_dataloader_idx,
            prog_bar=prog_bar,
            logger=logger,
            on_step=on_step,
            on_epoch=on_epoch,
            reduce_fx=reduce_fx,
            batch_size=batch_size,
            rank_zero_only=rank_zero_only,
            enable_graph=enable_graph,
            sync_dist_group=sync_dist_group,
        )

    def _check_metric_attribute(self, name: str, metric: nn.Module) -> None:
        """A torchmetrics Metric logged must be one of the task's attributes, as Lightning requires:
        else its state is in no checkpoint and it is not moved with the task."""
        found = self.__dict__.get("_metric_attributes")
        if found is None or id(metric) not in found:
            found = {id(m): n for n, m in self.named_modules()
                     if all(hasattr(m, a) for a in ("update", "compute", "reset"))}
            object.__setattr__(self, "_metric_attributes", found)
        if id(metric) in found:
            return
        what = ("Could not find the `LightningModule` attribute for the `torchmetrics.Metric` "
                f"logged as {name!r}.")
        if not found:
            raise MisconfigurationError(
                f"{what} You can fix this by setting an attribute for the metric in your "
                "`LightningModule`.",
                "create it in __init__ (self.acc = Accuracy(...)) and log self.acc: then it moves "
                "with the task and its state is checkpointed.")
        raise MisconfigurationError(
            f"{what} You can fix this by calling `self.log({name}, ..., metric_attribute=name)` "
            f"where `name` is one of {list(found.values())}",
            "log the metric attribute itself (self.log(name, self.acc)), or name it with "
            "metric_attribute=.")

    def log_dict(
        self,
        dictionary: Mapping[str, Any],
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str | Callable[..., Any] = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """:meth:`log` each ``name: value`` of ``dictionary`` with the same options (Lightning's
        ``log_dict``)."""
        for name, value in dictionary.items():
            self.log(
                name,
                value,
                prog_bar=prog_bar,
                logger=logger,
                on_step=on_step,
                on_epoch=on_epoch,
                reduce_fx=reduce_fx,
                enable_graph=enable_graph,
                sync_dist=sync_dist,
                sync_dist_group=sync_dist_group,
                add_dataloader_idx=add_dataloader_idx,
                batch_size=batch_size,
                rank_zero_only=rank_zero_only,
            )

    # ---- Lightning's attributes, read from the running Trainer -----------------------------------
    @property
    def current_epoch(self) -> int:
        """The epoch being trained, from 0 (``trainer.state.epoch``; 0 outside a run)."""
        return 0 if self.trainer is None else self.trainer.state.epoch

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (``trainer.state.global_step``; 0 outside a run)."""
        return 0 if self.trainer is None else self.trainer.state.global_step

    @property
    def global_rank(self) -> int:
        """This process's rank (0 in one process)."""
        return 0 if self.trainer is None else self.trainer.strategy.rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine."""
        return 0 if self.trainer is None else self.trainer.strategy.local_rank

    @property
    def device(self) -> torch.device:
        """The device of the module's parameters (the Trainer's device during a run; batches arrive
        on it)."""
        if "_device" in self.__dict__:
            return self.__dict__["_device"]
        tensor = next(itertools.chain(self.parameters(), self.buffers()), None)
        return tensor.device if tensor is not None else torch.device("cpu")

    @device.setter
    def device(self, value: Any) -> None:  # a subclass that sets self.device keeps its own value
        self.__dict__["_device"] = torch.device(value)

    @property
    def logger(self) -> Any:
        """The first logger (``self.logger.experiment.add_image(...)`` with TensorBoard), None
        without one."""
        if "_logger" in self.__dict__:
            return self.__dict__["_logger"]
        return None if self.trainer is None else self.trainer.logger

    @logger.setter
    # e.g. self.logger = logging.getLogger(...) in an older subclass
    def logger(self, value: Any) -> None:
        self.__dict__["_logger"] = value

    @property
    def loggers(self) -> list[Any]:
        """Every logger of the running Trainer (``[]`` outside a run)."""
        return [] if self.trainer is None else self.trainer.loggers

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only (Lightning's ``self.print``)."""
        if self.trainer is None or self.trainer.is_main:
            print(*args, **kwargs)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Only ``optimizer``'s parameters require grad until :meth:`untoggle_optimizer`
        (Lightning's call, for manual optimization of several optimizers; not needed when the other
        losses ``.detach()``)."""
        optimizer = getattr(optimizer, "optimizer", optimizer)
        saved: dict[Any, bool] = {}
        for opt in self._running_trainer("self.toggle_optimizer(...)").optimizers:
            for group in opt.param_groups:
                for param in group["params"]:
                    if param not in saved:
                        saved[param] = param.requires_grad
                        param.requires_grad = False
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.requires_grad = saved[param]
        object.__setattr__(self, "_requires_grad_saved", saved)

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Give the other optimizers' parameters back the ``requires_grad`` they had before
        :meth:`toggle_optimizer`."""
        optimizer = getattr(optimizer, "optimizer", optimizer)
        saved = self.__dict__.get("_requires_grad_saved", {})
        for opt in self._running_trainer("self.untoggle_optimizer(...)").optimizers:
            if opt is not optimizer:
                for group in opt.param_groups:
                    for param in group["params"]:
                        if param in saved:
                            param.requires_grad = saved[param]
        object.__setattr__(self, "_requires_grad_saved", {})

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """:meth:`toggle_optimizer` for the length of a ``with`` block."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    # ---- manual optimization and custom steps (docs/steps.md) ------------------------------------
    def optimizers(self) -> Any:
        """The optimizer (or list of them) of ``configure_optimizers``; with manual optimization
        each one's ``step()`` goes through the precision (GradScaler), the hooks, the ddp gradient
        average and global_step."""
        trainer = self._running_trainer("self.optimizers()")
        found = trainer.manual_optimizers if trainer.manual else trainer.optimizers
        if not found:
            raise MisconfigurationError("self.optimizers() was called outside fit: there are no "
                                        "optimizers.",
                                        "call it from training_step.")
        return found[0] if len(found) == 1 else list(found)

    def lr_schedulers(self) -> Any:
        """The scheduler (or list of them) of ``configure_optimizers``, None without; with manual
        optimization call their ``step()`` yourself."""
        found = [
            c.scheduler for c in self._running_trainer("self.lr_schedulers()").schedulers.configs
        ]
        return None if not found else found[0] if len(found) == 1 else found

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward(*args, **kwargs)`` with the precision's loss scaling (16-mixed) and the
        backward hooks; use it instead of ``loss.backward()`` (``retain_graph=True`` passes through,
        as in Lightning)."""
        trainer = self._running_trainer("self.manual_backward(loss)")
        # with on_before_backward/on_after_backward when defined
        trainer.run.backward(loss, *args, **kwargs)
        # ddp: their gradients are averaged before clipping/stepping
        for optimizer in trainer.manual_optimizers:
            optimizer.synced = False

    def clip_gradients(self, optimizer: Any, gradient_clip_val: float | None = None,
                       gradient_clip_algorithm: str | None = "norm") -> None:
        """Clip the gradients of ``optimizer``'s parameters (unscaled first under 16-mixed), before
        its step; with no ``gradient_clip_val``, nothing (Lightning's meaning)."""
        if gradient_clip_val is None:
            return
        gradient_clip_algorithm = gradient_clip_algorithm or "norm"
        # a ManualOptimizer: clip the gradients averaged over ranks
        if hasattr(optimizer, "sync_gradients"):
            optimizer.sync_gradients()
        optimizer = getattr(optimizer, "optimizer", optimizer)
        self._running_trainer("self.clip_gradients(...)").run.precision.unscale(optimizer)
        gradient_clipper(optimizer, gradient_clip_val, gradient_clip_algorithm)()

    @property
    def on_gpu(self) -> bool:
        """The module's parameters are on a CUDA device (Lightning's ``self.on_gpu``)."""
        return self.device.type == "cuda"

    @property
    def stage_metrics(self) -> dict[str, Any]:
        """This stage's copies of ``configure_metrics()`` (``{name: Metric}``): in your own
        validation_step/test_step call ``self.stage_metrics["acc"].update(preds, targets)``; the
        Trainer computes, logs and resets them."""
        if self.trainer is None and _TRACING[0]:
            return {}
        trainer = self._running_trainer("self.stage_metrics")
        return trainer.metrics.get(
            {"sanity": "val"}.get(trainer.state.stage, trainer.state.stage), {}
        )

    # ---- Lightning's LightningModule hooks: no-ops, so that ``super().on_train_start()`` works ---
    # @default_hook: a subclass that keeps one does not "define" it, so the hook table
    # (loop/hooks.py) leaves it out
    # and it costs nothing per step. docs/taskmodule.md says when each is called.
    @default_hook
    def prepare_data(self) -> None:
        """Download or write data, once per machine (local rank 0), before ``setup``."""

    @default_hook
    def setup(self, stage: str) -> None:
        """At the start of fit/validate/test/predict (``stage``), before the module moves to its
        device."""

    @default_hook
    def teardown(self, stage: str) -> None:
        """At the end of fit/validate/test/predict (not after an exception)."""

    @default_hook
    def configure_model(self) -> None:
        """Build layers here to have them made on the strategy's device (or the meta device)."""

    @default_hook
    def on_fit_start(self) -> None:
        """Before the first epoch."""

    @default_hook
    def on_fit_end(self) -> None:
        """After training ended normally."""

    @default_hook
    def on_train_start(self) -> None:
        """After the sanity check, before the first training epoch."""

    @default_hook
    def on_train_end(self) -> None:
        """After the last training epoch."""

    @default_hook
    def on_train_epoch_start(self) -> None:
        """At the start of each training epoch."""

    @default_hook
    def on_train_epoch_end(self) -> None:
        """At the end of each training epoch (``self.log`` here logs an epoch value)."""

    @default_hook
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        """Before each training batch (on its device)."""

    @default_hook
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After each training batch: ``outputs`` is ``{"loss": loss}`` or the step's dict,
        detached."""

    @default_hook
    def on_validation_start(self) -> None:
        """Before a validation pass."""

    @default_hook
    def on_validation_end(self) -> None:
        """After a validation pass."""

    @default_hook
    def on_validation_epoch_start(self) -> None:
        """After on_validation_start, before the first validation batch."""

    @default_hook
    def on_validation_epoch_end(self) -> None:
        """After the validation batches (their values are in ``trainer.callback_metrics``)."""

    @default_hook
    def on_validation_batch_start(
        self, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Before each validation batch."""

    @default_hook
    def on_validation_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """After each validation batch: ``outputs`` is what the step returned."""

    @default_hook
    def on_test_start(self) -> None:
        """Before the test pass."""

    @default_hook
    def on_test_end(self) -> None:
        """After the test pass."""

    @default_hook
    def on_test_epoch_start(self) -> None:
        """After on_test_start."""

    @default_hook
    def on_test_epoch_end(self) -> None:
        """After the test batches."""

    @default_hook
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Before each test batch."""

    @default_hook
    def on_test_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """After each test batch."""

    @default_hook
    def on_predict_start(self) -> None:
        """Before the predict pass."""

    @default_hook
    def on_predict_end(self) -> None:
        """After the predict pass."""

    @default_hook
    def on_predict_epoch_start(self) -> None:
        """After on_predict_start."""

    @default_hook
    def on_predict_epoch_end(self) -> None:
        """Before on_predict_end."""

    @default_hook
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Before each predict batch."""

    @default_hook
    def on_predict_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """After each predict batch: ``outputs`` is the prediction."""

    @default_hook
    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Before the gradients are zeroed (a group's first batch)."""

    @default_hook
    def on_before_backward(self, loss: torch.Tensor) -> None:
        """Before backward, with the loss it runs on."""

    @default_hook
    def on_after_backward(self) -> None:
        """After backward: the gradients are there (scaled under 16-mixed)."""

    @default_hook
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Before each optimizer step, the gradients unscaled."""

    @default_hook
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The checkpoint about to be written: add your own keys."""

    @default_hook
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The checkpoint read, before its state is restored."""

    # ---- Lightning's overrides of the automatic step: called when a subclass defines them (loop/ov
    @default_hook
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any,
                       optimizer_closure: Callable[[], Any] | None = None) -> None:
        """Step ``optimizer``; the closure returns the step's loss (taskfit has run forward and
        backward already). Override to warm up the learning rate or skip steps, calling
        ``optimizer.step(closure=optimizer_closure)``."""
        optimizer.step(closure=optimizer_closure)

    @default_hook
    def optimizer_zero_grad(
        self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer
    ) -> None:
        """Zero the gradients at an accumulation group's first batch."""
        optimizer.zero_grad()

    @default_hook
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()`` (the loss arrives scaled under 16-mixed)."""
        loss.backward(*args, **kwargs)

    @default_hook
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip before each optimizer step, with the Trainer's
        ``gradient_clip_val``/``gradient_clip_algorithm``."""
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)

    @default_hook
    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Step ``scheduler`` (ReduceLROnPlateau with its monitored ``metric``)."""
        plain_scheduler_step(scheduler, metric)

    def _running_trainer(self, what: str) -> Any:
        if self.trainer is None:
            raise MisconfigurationError(f"{what} was called outside a Trainer run.",
                                        "call it from training_step (or another method the Trainer "
                                        "calls during fit).")
        return self.trainer


def predict_inputs(task: TaskModule, batch: Any) -> Any:
    """The inputs of a predict batch: ``split_batch``'s first item if the task overrides it, else
    the batch's ``inputs`` key, its first item (of ``(inputs,)`` or ``(inputs, targets)``), or the
    batch itself."""
    if type(task).split_batch is not TaskModule.split_batch:
        return task.split_batch(batch)[0]
    if isinstance(batch, Mapping) and "inputs" in batch:
        return batch["inputs"]
    if isinstance(batch, (list, tuple)) and len(batch) in (1, 2):
        return batch[0]
    return batch


def rank_zero_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` on rank 0 only; elsewhere the call returns None (Lightning's decorator; the
    Trainer sets ``rank_zero_only.rank`` when a run starts)."""
    @functools.wraps(fn)
    def on_rank_zero(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs) if rank_zero_only.rank == 0 else None
    return on_rank_zero


rank_zero_only.rank = global_rank()  # torchrun's RANK or SLURM_PROCID  # type: ignore[attr-defined]
