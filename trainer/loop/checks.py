"""Validation of Trainer arguments and of the TaskModule contract: one clear error, before any work
starts."""
from __future__ import annotations

import datetime
import difflib
import inspect
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..errors import MisconfigurationError, TaskModuleError
from ..module import TaskModule
from .hooks import MODULE_HOOKS
from .steps import defines


def _fail(name: str, value: Any, expected: str) -> MisconfigurationError:
    return MisconfigurationError(f"Trainer({name}={value!r}) is not valid: expected {expected}.",
                                 f"pass {name}=<{expected}>, e.g. the default (see "
                                 "docs/trainer.md).")


def check_count(name: str, value: Any, minimum: int = 0, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(name, value, f"an integer >= {minimum}" + (" or None" if allow_none else ""))


def check_limit(name: str, value: Any) -> None:
    """``limit_*_batches``/``val_check_interval``: an int >= 0 (batches) or a float in [0, 1]
    (fraction)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
            isinstance(value, float) and value > 1.0):
        raise _fail(name, value, "an int >= 0 (number of batches) or a float in [0.0, 1.0] "
                                 "(fraction of the epoch)")


_DURATION_FORMS = ("a duration: a 'DD:HH:MM:SS' string, a datetime.timedelta or a dict of "
                   "timedelta's arguments such as {'seconds': 30}")


def val_check_duration(value: Any) -> datetime.timedelta | None:
    """``val_check_interval`` as a duration (Lightning 2.6: ``"DD:HH:MM:SS"``, a
    ``datetime.timedelta`` or a dict of timedelta's keyword arguments), or None for a count or a
    fraction; a malformed or non-positive duration is refused with Lightning's words."""
    if isinstance(value, datetime.timedelta):
        duration = value
    elif isinstance(value, Mapping):
        try:
            duration = datetime.timedelta(**dict(value))
        except TypeError as exc:
            raise MisconfigurationError(
                f"Trainer(val_check_interval={dict(value)!r}) is not valid: {exc}.",
                "use timedelta's keywords: days, hours, minutes, seconds... e.g. "
                "{'minutes': 30}.") from None
    elif isinstance(value, str):
        parts = value.split(":")
        if len(parts) != 4:
            raise MisconfigurationError(
                f"Invalid time format for `val_check_interval`: {value!r}. Expected "
                "'DD:HH:MM:SS'.", "e.g. val_check_interval='00:00:30:00' validates every 30 "
                "minutes of training.")
        try:
            days, hours, minutes, seconds = (int(p) for p in parts)
        except ValueError:
            raise MisconfigurationError(
                f"Non-integer component in `val_check_interval` string: {value!r}. Use "
                "'DD:HH:MM:SS'.", "write each part as a whole number, e.g. '00:01:30:00'.") \
                from None
        duration = datetime.timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    else:
        return None
    if duration.total_seconds() <= 0:
        raise _fail("val_check_interval", value, "a positive duration")
    return duration


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise _fail(name, value, "one of " + ", ".join(repr(c) for c in choices))


def _signature(method: str) -> str:
    return {
        "forward": "def forward(self, inputs):",
        "loss": "def loss(self, outputs, targets) -> torch.Tensor:",
        "train_dataloader": "def train_dataloader(self) -> torch.utils.data.DataLoader:",
    }[method]


def check_arguments(args: dict[str, Any]) -> None:
    """The Trainer's arguments (``args``: its keyword arguments by name), before anything is
    built."""
    # Lightning's max_epochs=-1: no epoch limit (the Trainer says when nothing else ends the fit)
    epochs = args["max_epochs"]
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or
                               epochs < -1):
        raise _fail("max_epochs", epochs, "an integer >= 0, -1 (no epoch limit) or None")
    for name, minimum in (
        ("max_steps", 0),
        ("min_epochs", 0),
        ("min_steps", 0),
        ("accumulate_grad_batches", 1),
        ("check_val_every_n_epoch", 1),
        ("num_sanity_val_steps", 0),
        ("log_every_n_steps", 1),
        ("seed", 0),
        ("reload_dataloaders_every_n_epochs", 0),
    ):
        check_count(
            name,
            args[name],
            minimum,
            allow_none=name
            in (
                "max_epochs",
                "max_steps",
                "min_epochs",
                "min_steps",
                "seed",
                "check_val_every_n_epoch",
            ),
        )
    for name in (
        "limit_train_batches",
        "limit_val_batches",
        "limit_test_batches",
        "limit_predict_batches",
        "overfit_batches",
    ):
        check_limit(name, args[name])
    if val_check_duration(args["val_check_interval"]) is None:
        try:
            check_limit("val_check_interval", args["val_check_interval"])
        except MisconfigurationError:
            raise _fail("val_check_interval", args["val_check_interval"],
                        "an int >= 0 (number of batches), a float in [0.0, 1.0] (fraction of the "
                        f"epoch) or {_DURATION_FORMS}") from None
    if args["check_val_every_n_epoch"] is None and isinstance(args["val_check_interval"], float):
        # Lightning's words, then what each choice means
        raise MisconfigurationError(
            "`val_check_interval` should be an integer or a time-based duration (str "
            "'DD:HH:MM:SS', datetime.timedelta, or dict kwargs for timedelta) when "
            "`check_val_every_n_epoch=None`. Trainer(val_check_interval="
            f"{args['val_check_interval']}) is a fraction of an epoch, but "
            "check_val_every_n_epoch=None counts batches across epochs.",
            "pass an int val_check_interval (validate every N training batches), a duration, or "
            "check_val_every_n_epoch=1.")
    check_choice("gradient_clip_algorithm", args["gradient_clip_algorithm"], ("norm", "value"))
    check_choice("nonfinite_loss", args["nonfinite_loss"], ("raise", "skip"))
    root = args["default_root_dir"]
    if root is not None and not isinstance(root, (str, os.PathLike)):
        raise _fail("default_root_dir", root, "a folder path (str or pathlib.Path) or None")
    clip = args["gradient_clip_val"]
    if clip is not None and (
        isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip <= 0
    ):
        raise MisconfigurationError(f"Trainer(gradient_clip_val={clip!r}) is not valid.",
                                    "pass a positive number (e.g. 1.0), or None to turn clipping "
                                    "off.")


def check_task(task: Any, stage: str, data: Any = None) -> None:
    """The TaskModule defines what ``stage`` needs; the training loader may come from ``data``
    (loaders passed to fit, a DataModule) instead."""
    if not isinstance(task, TaskModule):
        raise TaskModuleError(f"Trainer.{stage} expects a TaskModule, got {type(task).__name__}.",
                              "subclass `taskfit.TaskModule` (it is a torch.nn.Module) and pass an "
                              "instance.")
    if "_parameters" not in task.__dict__:
        raise TaskModuleError(f"{type(task).__name__}.__init__ did not call super().__init__().",
                              "call `super().__init__()` first thing in your __init__.")
    step = {
        "fit": "training_step",
        "validate": "validation_step",
        "test": "test_step",
        "predict": "predict_step",
    }
    own_step = defines(task, step[stage])  # its own step: forward and loss are its business
    needed = ([] if own_step else ["forward"] + (["loss"] if stage != "predict" else [])) + (
        ["train_dataloader"]
        if stage == "fit" and not (data is not None and data.provides("train_dataloader"))
        else []
    )
    for method in needed:
        owner = next(c for c in type(task).__mro__ if method in c.__dict__)
        if owner in (TaskModule, nn.Module):
            raise TaskModuleError(f"{type(task).__name__} does not define `{method}`, which "
                                  f"{stage} needs.",
                                  f"add `{_signature(method)}` to your TaskModule.")
    warn_misspelt_hooks(task)
    if (
        stage == "fit"
        and own_step
        and "optimizer_idx" in inspect.signature(type(task).training_step).parameters
    ):
        raise TaskModuleError(  # Lightning 2 refuses it too, with the same advice
            f"{type(task).__name__}.training_step takes `optimizer_idx`: Lightning 1.x's way to "
            "step several optimizers, which Lightning 2 and taskfit do not call.",
            "set `self.automatic_optimization = False`, remove optimizer_idx, and step each "
            "optimizer yourself in training_step: `opt_g, opt_d = self.optimizers()` "
            "(docs/steps.md, manual optimization).")
    sig = inspect.signature(type(task).loss)
    required = [p for p in sig.parameters.values()
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if "loss" in needed and len(required) > 3:
        raise TaskModuleError(f"{type(task).__name__}.loss{sig} takes more arguments than "
                              "(outputs, targets).",
                              f"use `{_signature('loss')}`.")


def check_manual(task: Any, accumulate_grad_batches: int, gradient_clip_val: float | None,
                 nonfinite_loss: str) -> None:
    """With ``automatic_optimization = False`` the task steps its optimizers: the Trainer settings
    that would then do nothing are errors, before any work (as Lightning refuses them)."""
    if getattr(task, "automatic_optimization", True):
        return
    name = type(task).__name__
    for setting, value, hint in (
            ("accumulate_grad_batches", accumulate_grad_batches != 1,
             "accumulate in training_step: call opt.step() and opt.zero_grad() every N batches "
             "(docs/steps.md)"),
            ("gradient_clip_val", gradient_clip_val is not None,
             "call self.clip_gradients(opt, gradient_clip_val=1.0) in training_step, before "
             "opt.step()"),
            ("nonfinite_loss", nonfinite_loss == "skip",
             "check the loss in training_step and skip opt.step() yourself")):
        if value:
            raise MisconfigurationError(
                f"Trainer({setting}=...) does nothing for {name}, which sets "
                "automatic_optimization = False.",
                f"remove it from the Trainer and {hint}.")


# What the Trainer calls on a TaskModule (and Lightning's step names): a method a letter or two away
# is a typo.
_CALLED = (
    "forward",
    "loss",
    "split_batch",
    "train_dataloader",
    "val_dataloader",
    "test_dataloader",
    "predict_dataloader",
    "configure_optimizers",
    "configure_metrics",
    "training_step",
    "validation_step",
    "test_step",
    "predict_step",
    "configure_callbacks",
    *MODULE_HOOKS,
)


def warn_misspelt_hooks(task: Any) -> None:
    """Warn about a method that looks like a misspelt hook (``val_dataloder``): as written, nothing
    calls it."""
    own = {name for cls in type(task).__mro__ if cls not in (TaskModule, nn.Module, object)
           for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}
    for name in sorted(own - set(_CALLED)):
        close = difflib.get_close_matches(name, _CALLED, n=1, cutoff=0.85)
        if close and close[0] not in own:
            warnings.warn(f"{type(task).__name__}.{name} looks like a misspelling of {close[0]}; "
                          "as written, the Trainer never calls it. HINT: rename it to "
                          f"{close[0]}.", stacklevel=3)


def check_loss(loss: Any, task: Any, training: bool = True, source: str = "loss") -> None:
    """``loss`` (what ``task.<source>`` returned) is a scalar tensor (checked on the first
    step/batch only: isinstance costs per step)."""
    where = f"{type(task).__name__}.{source}"
    if not isinstance(loss, torch.Tensor):
        raise TaskModuleError(f"{where} returned {type(loss).__name__}, not a tensor.",
                              "return a scalar torch.Tensor (e.g. `F.cross_entropy(outputs, "
                              "targets)`); do not call .item() on it.")
    if loss.numel() != 1:
        raise TaskModuleError(
            f"{where} returned a tensor of shape {tuple(loss.shape)}, not a scalar.",
            "reduce it, e.g. `.mean()` (or reduction='mean' in the loss function).",
        )
    if training and not loss.requires_grad:
        raise TaskModuleError(f"{where} returned a tensor that does not require grad.",
                              "compute the loss from the model outputs without .detach(), "
                              "torch.no_grad() or .item().")
