"""LearningRateMonitor: the learning rate of every param group of every optimizer, as
``vitals/lr/<Optimizer>/<group>`` (docs/logging.md maps Lightning's ``lr-<Optimizer>`` names to these)."""
from __future__ import annotations

from typing import Any

from ..arguments import arguments_checked
from ..callback import Callback
from ..errors import MisconfigurationError

MONITORS = "vitals"  # the group of the trainer's own measurements: after train/ and val/ in every logger's UI


class LearningRateMonitor(Callback):
    """Logs ``vitals/lr/<Optimizer>/<group>`` for every optimizer (``<group>`` is the param group's ``"name"``, else
    ``pg<i>``; a second optimizer of the same class is ``<Optimizer>-1``; a scheduler config's ``"name"``, when
    given, replaces ``<Optimizer>``).

    Added by default with the logger (``Trainer(logger=True)``); pass your own instance to change it.
    Reading ``param_groups`` is host-side: no device sync.

    Args:
        logging_interval: None (Lightning's default): an optimizer whose scheduler steps per epoch is logged at each
            epoch start, the others at every ``log_every_n_steps``; ``"step"``: all at every ``log_every_n_steps``
            (the value at global step ``s`` is the rate the next optimizer step uses); ``"epoch"``: all at each
            epoch start (the rate that epoch starts with).
        log_momentum: also log ``vitals/momentum/<Optimizer>/<group>`` (``momentum``, or ``betas[0]`` for Adam-like
            optimizers).
        log_weight_decay: also log ``vitals/weight_decay/<Optimizer>/<group>``.
    """

    @arguments_checked(docs="docs/logging.md")
    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False,
                 log_weight_decay: bool = False) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise MisconfigurationError(f"LearningRateMonitor(logging_interval={logging_interval!r}) is not valid.",
                                        'use None (each scheduler\'s interval), "step" (every log_every_n_steps) '
                                        'or "epoch" (at each epoch start).')
        self.logging_interval, self.log_momentum, self.log_weight_decay = \
            logging_interval, log_momentum, log_weight_decay
        self._keys: dict[str, list[tuple[Any, int, str]]] = {"step": [], "epoch": []}  # (optimizer, group, name)

    def on_fit_start(self, trainer: Any, task: Any) -> None:
        """Name every optimizer's groups once (not at every log), and sort them by when they are logged."""
        configs = list(getattr(trainer.schedulers, "configs", []))
        self._keys = {"step": [], "epoch": []}
        seen: dict[str, int] = {}
        for optimizer in trainer.optimizers:
            mine = [c for c in configs if getattr(c.scheduler, "optimizer", None) is optimizer]
            name = next((c.name for c in mine if getattr(c, "name", None)), None)
            if name is None:
                name = type(optimizer).__name__
                seen[name] = seen.get(name, 0) + 1
                name = name if seen[name] == 1 else f"{name}-{seen[name] - 1}"
            interval = self.logging_interval or ("epoch" if mine and all(c.interval == "epoch" for c in mine)
                                                 else "step")
            for i, group in enumerate(optimizer.param_groups):
                self._keys[interval].append((optimizer, i, f"{name}/{group.get('name') or f'pg{i}'}"))

    def values(self, trainer: Any, interval: str = "step") -> dict[str, float]:
        """The current rate (and momentum, weight decay) of the param groups logged at ``interval``."""
        out: dict[str, float] = {}
        for optimizer, i, name in self._keys[interval]:
            group = optimizer.param_groups[i]  # looked up: load_state_dict replaces the group dicts
            out[f"{MONITORS}/lr/{name}"] = float(group["lr"])  # a Python float (or a CPU tensor): no device sync
            if self.log_momentum:
                momentum = group.get("momentum", group.get("betas", (None,))[0])
                if momentum is not None:
                    out[f"{MONITORS}/momentum/{name}"] = float(momentum)
            if self.log_weight_decay and group.get("weight_decay") is not None:
                out[f"{MONITORS}/weight_decay/{name}"] = float(group["weight_decay"])
        return out

    def on_log_interval(self, trainer: Any, task: Any) -> None:
        if self._keys["step"]:
            trainer.log_metrics(self.values(trainer, "step"))

    def on_train_epoch_start(self, trainer: Any, task: Any) -> None:
        if self._keys["epoch"]:
            trainer.log_metrics(self.values(trainer, "epoch"))
