"""Each submodule's train/eval mode as the user set it, kept through fit as Lightning 2.6 keeps it:
an evaluation pass puts the model in eval mode and afterwards restores every submodule's own mode (a
frozen BatchNorm or a backbone left in ``eval()`` for fine-tuning stays so), and fit never resets
them to ``train()``."""
from __future__ import annotations

import warnings

import torch


def capture(task: torch.nn.Module) -> dict[str, bool]:
    """``{submodule name: training}`` of every submodule of ``task`` (its own too, as ``""``)."""
    return {name: module.training for name, module in task.named_modules()}


def restore(module: torch.nn.Module, task: torch.nn.Module, modes: dict[str, bool]) -> None:
    """After an evaluation pass: ``module`` (the strategy's evaluation module, which may wrap
    ``task``) back in training mode (under fsdp that frees the gathered parameters), then each
    submodule of ``task`` as captured."""
    module.train()
    for name, sub in task.named_modules():
        if name in modes:
            sub.training = modes[name]


def check_fit_start(task: torch.nn.Module, warn: bool = True) -> None:
    """Fit trains each submodule in the mode it is in. A task entirely in eval mode (as
    ``load_from_checkpoint`` returns it) is put in train mode, with a warning; submodules in eval
    mode in a training task stay so, with Lightning's warning naming them."""
    if not task.training:
        task.train()
        if warn:
            warnings.warn(f"{type(task).__name__} was in eval mode (task.eval(), or "
                          "load_from_checkpoint) when fit started, so fit put it in train mode. "
                          "HINT: to keep parts of it frozen, put those submodules in eval mode "
                          "(task.backbone.eval()) and leave the task itself in train mode.",
                          UserWarning, stacklevel=5)
        return
    frozen = [name for name, module in task.named_modules() if not module.training]
    if frozen and warn:
        shown = ", ".join(frozen[:3]) + (f" and {len(frozen) - 3} more" if len(frozen) > 3 else "")
        warnings.warn(f"{len(frozen)} submodule(s) of {type(task).__name__} are in eval mode at "
                      f"the start of training ({shown}); they stay in eval mode through fit, as in "
                      "Lightning 2.6. HINT: nothing to do if they are frozen on purpose; else "
                      "call task.train() before fit.", UserWarning,
                      stacklevel=5)
