"""LearningRateMonitor: the learning rate of every optimizer param group, as ``lr/<Optimizer>/<group>``."""
from __future__ import annotations

from typing import Any

from ..errors import MisconfigurationError

from .base import Callback


class LearningRateMonitor(Callback):
    """Logs ``lr/<Optimizer>/<group>`` (``<group>`` is the param group's ``"name"``, else ``pg<i>``).

    Added by default with the logger (``Trainer(logger=True)``); pass your own instance to change it.
    Reading ``param_groups`` is host-side: no device sync.

    Args:
        logging_interval: ``"step"``: at every ``log_every_n_steps``, the value at global step ``s`` is the rate
            the next optimizer step uses (after the scheduler stepped ``s`` times); ``"epoch"``: at each epoch
            start, the rate that epoch starts with.
        log_momentum: also log ``momentum/<Optimizer>/<group>`` (``momentum``, or ``betas[0]`` for Adam-like).
    """

    def __init__(self, logging_interval: str = "step", log_momentum: bool = False) -> None:
        if logging_interval not in ("step", "epoch"):
            raise MisconfigurationError(f"LearningRateMonitor(logging_interval={logging_interval!r}) is not valid.",
                                        'use "step" (every log_every_n_steps) or "epoch" (at each epoch start).')
        self.logging_interval, self.log_momentum = logging_interval, log_momentum
        self._keys: list[tuple[str, str]] = []

    def on_fit_start(self, trainer: Any, task: Any) -> None:
        optimizer = trainer.optimizer
        prefix = type(optimizer).__name__
        names = [f"{prefix}/{group.get('name') or f'pg{i}'}" for i, group in enumerate(optimizer.param_groups)]
        self._keys = [(f"lr/{name}", f"momentum/{name}") for name in names]  # built once, not at every log

    def values(self, trainer: Any) -> dict[str, float]:
        """The current rate (and momentum) of every param group."""
        out: dict[str, float] = {}
        for (lr_key, momentum_key), group in zip(self._keys, trainer.optimizer.param_groups):
            out[lr_key] = float(group["lr"])  # a Python float (or a CPU tensor): no device sync
            if self.log_momentum:
                momentum = group.get("momentum", group.get("betas", (None,))[0])
                if momentum is not None:
                    out[momentum_key] = float(momentum)
        return out

    def on_log_interval(self, trainer: Any, task: Any) -> None:
        if self.logging_interval == "step":
            trainer.log_metrics(self.values(trainer))

    def on_train_epoch_start(self, trainer: Any, task: Any) -> None:
        if self.logging_interval == "epoch":
            trainer.log_metrics(self.values(trainer))
