"""Transfer learning: train a head on a frozen backbone, then add the backbone to the optimizer.

``BaseFinetuning`` and ``BackboneFinetuning`` are Lightning 2.6's callbacks of the same names, with
their arguments, hooks and checkpoint state: ``freeze_before_training(task)`` runs in ``setup``
(before ``configure_optimizers``, so the optimizer can take only the trainable parameters) and
``finetune_function(task, epoch, optimizer)`` at each training epoch's start. The parameter groups
the callback added are recorded by parameter name and rebuilt when a fit resumes, before the
optimizer's state is loaded into them (docs/callbacks.md, "Fine-tuning a frozen backbone").
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Iterable, Iterator, Union

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim import Optimizer

from ..callback import Callback
from ..errors import MisconfigurationError

log = logging.getLogger(__name__)
Modules = Union[nn.Module, Iterable[Any]]  # a module, or (nested) iterables of modules


def multiplicative(epoch: int) -> float:
    """BackboneFinetuning's default schedule: the backbone's learning rate doubles each epoch."""
    return 2.0


class BaseFinetuning(Callback):
    """Override ``freeze_before_training`` and ``finetune_function``; filter the optimizer's
    parameters on ``requires_grad`` in ``configure_optimizers``."""

    def __init__(self) -> None:
        # Lightning's name: optimizer index -> its parameter groups, parameters by name
        self._internal_optimizer_metadata: dict[int, list[dict[str, Any]]] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"internal_optimizer_metadata": self._internal_optimizer_metadata}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # (a Lightning checkpoint older than 1.6 holds the metadata itself)
        metadata = state_dict.get("internal_optimizer_metadata", state_dict)
        self._internal_optimizer_metadata = metadata

    def on_load_checkpoint(self, trainer: Any, task: Any, checkpoint: dict[str, Any]) -> None:
        """Rebuild the parameter groups this callback added, so that the optimizer's state loads
        into them, and make their parameters trainable again (Lightning 2.6 leaves them frozen:
        its resume is not exact)."""
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if not state:
            return
        self.load_state_dict(state)
        named = dict(task.named_parameters())
        for index, optimizer in enumerate(trainer.optimizers):
            if index in self._internal_optimizer_metadata:
                before = len(optimizer.param_groups)
                groups = _with_parameters(self._internal_optimizer_metadata[index], named)
                optimizer.param_groups = groups
                added = {id(p) for group in groups[before:] for p in group["params"]}
                self.make_trainable([m for m in task.modules()
                                     if any(id(p) in added for p in m.parameters(recurse=False))])

    @staticmethod
    def flatten_modules(modules: Modules) -> list[nn.Module]:
        """The leaf modules of ``modules``, and every module that holds parameters of its own."""
        if isinstance(modules, nn.ModuleDict):
            modules = modules.values()
        if isinstance(modules, nn.Module):
            found = list(modules.modules())
        else:
            found = [m for item in modules for m in BaseFinetuning.flatten_modules(item)]
        return [m for m in found
                if not list(m.children()) or any(True for _ in m.parameters(recurse=False))]

    @staticmethod
    def filter_params(modules: Modules, train_bn: bool = True,
                      requires_grad: bool = True) -> Iterator[Any]:
        """The parameters of ``modules`` whose ``requires_grad`` is ``requires_grad`` (batch norms'
        skipped unless ``train_bn``)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and not train_bn:
                continue
            own = module.parameters(recurse=False)
            yield from (p for p in own if p.requires_grad == requires_grad)

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        """Unfreeze ``modules`` (batch norms track their running statistics again)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm):
                module.track_running_stats = True
            for param in module.parameters(recurse=False):
                param.requires_grad = True

    @staticmethod
    def freeze_module(module: nn.Module) -> None:
        """Freeze one module's own parameters (a batch norm stops tracking running stats)."""
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for param in module.parameters(recurse=False):
            param.requires_grad = False

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freeze ``modules``; with ``train_bn`` their batch norms stay trainable."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(module)
            else:
                BaseFinetuning.freeze_module(module)

    @staticmethod
    def filter_on_optimizer(optimizer: Optimizer, params: Iterable[Any]) -> list[Any]:
        """``params`` less those ``optimizer`` already holds (Lightning's warning if any)."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        params = list(params)
        fresh = [p for p in params if id(p) not in held]
        if len(fresh) < len(params):
            warnings.warn(
                "The provided params to be frozen already exist within another group of this "
                "optimizer. Those parameters will be skipped.\nHINT: Did you init your optimizer "
                "in `configure_optimizer` as such:\n "
                f"{type(optimizer)}(filter(lambda p: p.requires_grad, self.parameters()), ...) ",
                UserWarning, stacklevel=3)
        return fresh

    @staticmethod
    def unfreeze_and_add_param_group(modules: Modules, optimizer: Optimizer,
                                     lr: float | None = None, initial_denom_lr: float = 10.0,
                                     train_bn: bool = True) -> None:
        """Unfreeze ``modules`` and add their parameters to ``optimizer`` as one new group: learning
        rate ``lr``, or the first group's divided by ``initial_denom_lr``."""
        BaseFinetuning.make_trainable(modules)
        first = optimizer.param_groups[0]["lr"]
        group_lr = first / initial_denom_lr if lr is None else float(lr)
        trainable = BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True)
        params = BaseFinetuning.filter_on_optimizer(optimizer, trainable)
        if params:
            optimizer.add_param_group({"params": params, "lr": group_lr})

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.freeze_before_training(pl_module)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        for index, optimizer in enumerate(trainer.optimizers):
            before = len(optimizer.param_groups)
            self.finetune_function(pl_module, trainer.current_epoch, optimizer)
            self._store(pl_module, index, before, optimizer.param_groups)

    def _store(self, task: Any, index: int, before: int, groups: list[dict[str, Any]]) -> None:
        names = {p: n for n, p in task.named_parameters()}
        metadata = self._internal_optimizer_metadata
        if index not in metadata:
            metadata[index] = _with_parameters(groups, names)
        elif before != len(groups):
            metadata[index].extend(_with_parameters(groups[before:], names))

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: Optimizer) -> None:
        """Override: unfreeze what this epoch trains (``unfreeze_and_add_param_group``)."""
        raise NotImplementedError

    def freeze_before_training(self, pl_module: Any) -> None:
        """Override: freeze what the first epochs do not train (``freeze``)."""
        raise NotImplementedError


def _with_parameters(groups: list[dict[str, Any]],
                     mapping: dict[Any, Any]) -> list[dict[str, Any]]:
    """``groups`` with each parameter replaced through ``mapping`` (parameter <-> its name)."""
    return [{**{k: v for k, v in g.items() if k != "params"},
             "params": [mapping[p] for p in g["params"]]} for g in groups]


class BackboneFinetuning(BaseFinetuning):
    """Train the module's ``backbone`` attribute from epoch ``unfreeze_backbone_at_epoch`` on, at a
    learning rate that starts at ``backbone_initial_lr`` (default: the first group's times
    ``backbone_initial_ratio_lr``) and is multiplied by ``lambda_func(epoch + 1)`` each later epoch,
    capped at the first group's rate when ``should_align``."""

    def __init__(self, unfreeze_backbone_at_epoch: int = 10,
                 lambda_func: Callable[[int], float] = multiplicative,
                 backbone_initial_ratio_lr: float = 10e-2,
                 backbone_initial_lr: float | None = None, should_align: bool = True,
                 initial_denom_lr: float = 10.0, train_bn: bool = True, verbose: bool = False,
                 rounding: int = 12) -> None:
        super().__init__()
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.train_bn = train_bn
        self.verbose = verbose
        self.rounding = rounding
        self.previous_backbone_lr: float | None = None

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        return {**state, "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.previous_backbone_lr = state_dict["previous_backbone_lr"]
        super().load_state_dict(state_dict)

    def on_load_checkpoint(self, trainer: Any, task: Any, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(trainer, task, checkpoint)
        # unfrozen before the checkpoint: trainable again (batch norms too)
        if self.previous_backbone_lr is not None:
            self.make_trainable(task.backbone)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if not isinstance(getattr(pl_module, "backbone", None), nn.Module):
            raise MisconfigurationError(
                f"{type(pl_module).__name__} has no `backbone` to fine-tune (Lightning's words: "
                "The LightningModule should have a nn.Module `backbone` attribute).",
                "assign the pretrained part to self.backbone in __init__ (an nn.Module), or write "
                "a BaseFinetuning subclass that freezes the part you name.")
        super().setup(trainer, pl_module, stage)

    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: Optimizer) -> None:
        current_lr = optimizer.param_groups[0]["lr"]
        if epoch == self.unfreeze_backbone_at_epoch:
            backbone_lr = self.backbone_initial_lr
            if backbone_lr is None:
                backbone_lr = current_lr * self.backbone_initial_ratio_lr
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, backbone_lr,
                                              train_bn=self.train_bn,
                                              initial_denom_lr=self.initial_denom_lr)
        elif epoch > self.unfreeze_backbone_at_epoch:
            backbone_lr = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            if self.should_align and backbone_lr > current_lr:
                backbone_lr = current_lr
            optimizer.param_groups[-1]["lr"] = backbone_lr
        else:
            return
        self.previous_backbone_lr = backbone_lr
        if self.verbose:
            log.info(f"Current lr: {round(current_lr, self.rounding)}, "
                     f"Backbone lr: {round(backbone_lr, self.rounding)}")
