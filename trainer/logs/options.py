"""What ``self.log``'s arguments mean, as Lightning defines them: the per-hook defaults of
``on_step``/``on_epoch``, the published names (``<name>``, or ``<name>_step`` and ``<name>_epoch``
when both), ``reduce_fx``, and the errors for combinations Lightning refuses. The logging buffer
(logbook.py, logbuffer.py) keeps the values; this decides their names."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import MisconfigurationError

REDUCE_FX = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min",
             torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min",
             max: "max", min: "min", sum: "sum"}  # Python's builtins, as Lightning takes them


@dataclass(frozen=True)
class LogOptions:
    """One logged key's options, fixed at its first ``self.log`` in a pass (a later call must
    agree)."""

    on_step: bool
    on_epoch: bool
    reduce_fx: str = "mean"
    logger: bool = True
    prog_bar: bool = False
    rank_zero_only: bool = False

    def names(self, key: str, suffix: str = "") -> tuple[str | None, str | None]:
        """The published names: ``(step name, epoch name)``, None where it is not logged;
        ``suffix`` (a loader's ``/dataloader_idx_<i>``) goes last, as Lightning's
        ``val_loss_epoch/dataloader_idx_0``."""
        both = self.on_step and self.on_epoch
        return ((f"{key}_step" if both else key) + suffix if self.on_step else None,
                (f"{key}_epoch" if both else key) + suffix if self.on_epoch else None)


def log_options(
    key: str,
    stage: str,
    epoch_level: bool,
    *,
    on_step: bool | None,
    on_epoch: bool | None,
    reduce_fx: Any,
    logger: bool | None,
    prog_bar: bool,
    rank_zero_only: bool,
    enable_graph: bool,
    sync_dist_group: Any,
) -> LogOptions:
    """``self.log``'s options with Lightning's defaults: in a training step or batch hook
    ``on_step=True, on_epoch=False``; in validation/test and in epoch-level hooks
    (``on_train_epoch_end``...) the reverse."""
    stepping = stage == "train" and not epoch_level
    if on_step is None:
        on_step = stepping
    if on_epoch is None:
        on_epoch = not stepping
    if not on_step and not on_epoch:
        # taskfit's words, then Lightning's (people search for them)
        raise MisconfigurationError(f"self.log({key!r}, on_step=False, on_epoch=False) logs "
                                    "nothing. `self.log(on_step=False, on_epoch=False)` is not "
                                    "useful.",
                                    "log it per step (on_step=True) or per epoch (on_epoch=True), "
                                    "or remove the call.")
    if on_step and epoch_level:
        raise MisconfigurationError(
            f"self.log({key!r}, on_step=True) in an epoch-level hook (on_train_start, "
            "on_train_epoch_start/end, on_validation_epoch_end...): there is no step to log it "
            "at.",
            "remove on_step=True: values logged there are epoch values (as Lightning requires).")
    fx = REDUCE_FX.get(reduce_fx.lower() if isinstance(reduce_fx, str) else reduce_fx)
    if fx is None:
        raise MisconfigurationError(f"self.log({key!r}, reduce_fx={reduce_fx!r}) is not a "
                                    "reduction taskfit knows. Only `self.log(..., "
                                    "reduce_fx={min,max,mean,sum})` are supported.",
                                    'use reduce_fx="mean" (weighted by batch_size), "sum", "max" '
                                    'or "min"; for another reduction, log a torchmetrics Metric.')
    if enable_graph or sync_dist_group is not None:
        warnings.warn(f"self.log({key!r}, "
                      f"{'enable_graph=True' if enable_graph else 'sync_dist_group=...'}) does "
                      "nothing in taskfit: logged tensors are always detached, and epoch values "
                      "are reduced over all ranks. HINT: remove the argument (docs/taskmodule.md, "
                      "'self.log').", UserWarning, stacklevel=4)
    return LogOptions(
        on_step, on_epoch, fx, logger is not False, bool(prog_bar), bool(rank_zero_only)
    )


def check_same(key: str, old: LogOptions, new: LogOptions, where: str = "a pass") -> None:
    """A key logged again in a pass with different options: Lightning refuses it too (one key, one
    meaning). ``where`` names the pass as Lightning's message names the hook (``training_step``)."""
    if old != new:
        changed = [
            f"{f}={getattr(old, f)!r} then {getattr(new, f)!r}"
            for f in old.__dataclass_fields__
            if getattr(old, f) != getattr(new, f)
        ]
        raise MisconfigurationError(f"self.log({key!r}) was called with different options in "
                                    f"one pass: {', '.join(changed)}. You called "
                                    f"`self.log({key}, ...)` twice in `{where}` with different "
                                    "arguments.",
                                    "log each key with the same options every time in a pass (its "
                                    "step and its batch hooks), or give it another name.")
