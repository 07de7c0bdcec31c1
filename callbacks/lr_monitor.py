"""LearningRateMonitor: the learning rate (and momentum, weight decay) of every param group of every
optimizer.

A monitor you add writes Lightning's names (``lr-SGD``, ``lr-SGD/pg2``, ``lr-Adam-1``,
``lr-SGD-momentum``) and keeps Lightning's
``lrs``/``last_momentum_values``/``last_weight_decay_values``; the one taskfit adds with any logger
writes its vitals (``vitals/lr/SGD/pg0``), grouped after train/ and val/ in every logger's UI.
"""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

from ..arguments import arguments_checked
from ..callback import Callback
from ..errors import MisconfigurationError

# the group of the trainer's own measurements: after train/ and val/ in every logger's UI
MONITORS = "vitals"


class LearningRateMonitor(Callback):
    """Logs the learning rate of every param group of every optimizer, through the Trainer (every
    logger, and ``trainer.callback_metrics``: ``monitor="lr-SGD"`` works).

    Names (``names="lightning"``, Lightning's): ``lr-<Optimizer>`` for an optimizer of one param
    group, ``lr-<Optimizer>/<group>`` for several (``<group>`` is the group's ``"name"``, else
    ``pg1``, ``pg2``...); a second optimizer of the same class is ``lr-<Optimizer>-1``; a scheduler
    config's ``"name"`` replaces ``lr-<Optimizer>``; momentum and weight decay add ``-momentum``,
    ``-weight_decay``. ``names="vitals"`` (the monitor taskfit adds with a logger):
    ``vitals/lr/<Optimizer>/<group>`` (``pg0``, ``pg1``...), ``vitals/momentum/...``,
    ``vitals/weight_decay/...``.

    Reading ``param_groups`` is host-side: no device sync.

    Args:
        logging_interval: None (Lightning's default): an optimizer is logged at its schedulers'
            intervals (per epoch: at each epoch start; per step: at every ``log_every_n_steps``),
            one without a scheduler at both (``names="vitals"``: at the steps only); ``"step"``:
            all at every ``log_every_n_steps``; ``"epoch"``: all at each epoch start (the rate that
            epoch starts with). A value at step ``s`` is the rate the optimizer step from ``s`` to
            ``s + 1`` uses, read before it (and before its scheduler step), as Lightning's.
        log_momentum: also log the momentum (``momentum``, or ``betas[0]`` for Adam-like optimizers;
            Lightning's names log 0 for an optimizer without either, as Lightning does).
        log_weight_decay: also log the weight decay.
        log_key_prefix: a prefix for every name (``"optim/"``: ``optim/lr-Adam``); Lightning's names
            only.
        names: ``"lightning"`` or ``"vitals"``, as above.
    """

    @arguments_checked(docs="docs/logging.md")
    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False,
                 log_weight_decay: bool = False, log_key_prefix: str | None = None,
                 names: str = "lightning") -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise MisconfigurationError(
                f"LearningRateMonitor(logging_interval={logging_interval!r}) is not valid "
                "(logging_interval should be `step` or `epoch` or `None`).",
                                        'use None (each scheduler\'s interval), "step" (every '
                                        'log_every_n_steps) or "epoch" (at each epoch start).')
        if names not in ("lightning", "vitals"):
            raise MisconfigurationError(f"LearningRateMonitor(names={names!r}) is not valid.",
                                        'use "lightning" (lr-SGD, as Lightning) or "vitals" '
                                        '(vitals/lr/SGD/pg0).')
        self.logging_interval, self.log_momentum, self.log_weight_decay, self.names = \
            logging_interval, log_momentum, log_weight_decay, names
        self.log_key_prefix = log_key_prefix or ""
        # the step the rates were last logged at, at a batch's start (on_log_interval logs the rest)
        self._logged_at: int | None = None
        # (optimizer, group, name)
        self._keys: dict[str, list[tuple[Any, int, str]]] = {"step": [], "epoch": []}
        # every group once, in Lightning's order (optimizers with a scheduler first)
        self._groups: list[tuple[Any, int, str]] = []
        self._counts: list[int] = []  # each optimizer's parameter groups when they were named
        self.lrs: dict[str, list[float]] = {}  # Lightning's: every logged rate, by name
        self.last_momentum_values: dict[str, float | None] = {}
        self.last_weight_decay_values: dict[str, float | None] = {}

    def on_fit_start(self, trainer: Any, task: Any) -> None:
        """Name every optimizer's groups once (not at every log), and sort them by when they are
        logged."""
        if self.names == "lightning" and not trainer.loggers:
            raise MisconfigurationError(
                "LearningRateMonitor() was added to a Trainer without a logger: its values would "
                "go nowhere (Lightning's words: Cannot use `LearningRateMonitor` callback with "
                "`Trainer` that has no logger).",
                "pass a logger (logger=True for TensorBoard, or CSVLogger()...), or remove the "
                "LearningRateMonitor (Lightning raises here too).")
        self._name_groups(trainer)
        if self.log_momentum and self.names == "lightning" and any(
                "momentum" not in o.defaults and "betas" not in o.defaults
                for o in trainer.optimizers):
            warnings.warn("LearningRateMonitor: You have set log_momentum=True, but some "
                          "optimizers do not have momentum. This will log a value 0 for the "
                          "momentum (an optimizer with neither momentum nor betas, as Lightning "
                          "does). HINT: "
                          "log_momentum=False if that is not wanted.", RuntimeWarning, stacklevel=2)
        named = [name for _, _, name in self._groups]
        self.lrs = {self._key("lr", name): [] for name in named}
        self.last_momentum_values = {self._key("momentum", name): None for name in named}
        self.last_weight_decay_values = {self._key("weight_decay", name): None for name in named}

    def _name_groups(self, trainer: Any) -> None:
        """Every optimizer's groups by name, sorted by when they are logged; the group counts they
        were named at."""
        configs = list(getattr(trainer.schedulers, "configs", []))
        self._counts = [len(optimizer.param_groups) for optimizer in trainer.optimizers]
        self._keys, self._groups = {"step": [], "epoch": []}, []
        seen: Counter[str] = Counter()
        scheduled: list[tuple[Any, int, str]] = []
        for optimizer in trainer.optimizers:
            mine = [c for c in configs if getattr(c.scheduler, "optimizer", None) is optimizer]
            intervals = self._intervals([c.interval for c in mine])
            name = next((c.name for c in mine if getattr(c, "name", None)), None)
            if name is None:
                kind = type(optimizer).__name__
                seen[kind] += 1
                name = kind if seen[kind] == 1 else f"{kind}-{seen[kind] - 1}"
                name = f"lr-{name}" if self.names == "lightning" else name
            groups = optimizer.param_groups
            given = [g["name"] for g in groups if g.get("name")]
            if len(given) != len(set(given)):
                raise MisconfigurationError(
                    f"An optimizer ({type(optimizer).__name__}) has several parameter groups with "
                    f"the same \"name\" ({sorted({n for n in given if given.count(n) > 1})}): "
                    "their learning rates would be logged under one key (Lightning's words: A "
                    "single `Optimizer` cannot have multiple parameter groups with identical "
                    "`name` values).",
                    "give each parameter group its own name (Lightning refuses this too).")
            named = [
                (optimizer, i, self._group_name(name, groups, i)) for i in range(len(groups))
            ]
            for interval in intervals:
                self._keys[interval] += named
            (scheduled if mine else self._groups).extend(named)
        self._groups[:0] = scheduled

    def _intervals(self, scheduled: list[str]) -> tuple[str, ...]:
        """When an optimizer whose schedulers step at ``scheduled`` intervals is logged: at each
        scheduler's interval (Lightning's); without a scheduler, at both, as Lightning's monitor
        logs it at every epoch start and every logged step (the vitals: at logged steps); a
        ``logging_interval`` decides for all."""
        if self.logging_interval:
            return (self.logging_interval,)
        if self.names == "vitals":
            return ("epoch",) if scheduled and set(scheduled) == {"epoch"} else ("step",)
        return tuple(i for i in ("step", "epoch") if i in scheduled or not scheduled)

    def _rename(self, trainer: Any) -> None:
        """Groups were added since the names were made (BaseFinetuning): name them again and move
        each renamed group's history to its new name, at the end (Lightning's order: ``lr-SGD``
        becomes ``lr-SGD/pg1``)."""
        before = {(id(o), i): name for o, i, name in self._groups}
        self._name_groups(trainer)
        for optimizer, i, name in self._groups:
            old = before.get((id(optimizer), i))
            for kind, values in (("lr", self.lrs), ("momentum", self.last_momentum_values),
                                 ("weight_decay", self.last_weight_decay_values)):
                if old is None:
                    values.setdefault(self._key(kind, name), [] if kind == "lr" else None)
                elif old != name:
                    values[self._key(kind, name)] = values.pop(self._key(kind, old))

    def _key(self, kind: str, name: str) -> str:
        """The published name of a group's ``kind`` (``"lr"``, ``"momentum"``, ``"weight_decay"``):
        Lightning's ``lr-SGD``, ``lr-SGD-momentum``; the vitals' ``vitals/lr/SGD/pg0``,
        ``vitals/momentum/SGD/pg0``."""
        if self.names == "vitals":
            return f"{MONITORS}/{kind}/{name}"
        return name if kind == "lr" else f"{name}-{kind}"

    def _group_name(self, name: str, groups: list[dict[str, Any]], i: int) -> str:
        """``lr-SGD``, ``lr-SGD/pg2``, ``lr-SGD/<"name">`` (Lightning: a suffix only for several or
        named groups, counted from 1); ``SGD/pg0``, ``SGD/<"name">`` (vitals: always, counted from
        0)."""
        given = groups[i].get("name")
        if self.names == "vitals":
            return f"{name}/{given or f'pg{i}'}"
        if len(groups) > 1 or given:
            return f"{self.log_key_prefix}{name}/{given or f'pg{i + 1}'}"
        return self.log_key_prefix + name

    def values(self, trainer: Any, interval: str = "step") -> dict[str, float]:
        """The current rate (and momentum, weight decay) of the param groups logged at
        ``interval``."""
        out: dict[str, float] = {}
        if any(len(o.param_groups) != n for o, n in zip(trainer.optimizers, self._counts)):
            self._rename(trainer)
        for optimizer, i, name in self._keys[interval]:
            group = optimizer.param_groups[i]  # looked up: load_state_dict replaces the group dicts
            momentum = group.get("momentum", group.get("betas", (None,))[0])
            if momentum is None and self.names == "lightning":
                # Lightning logs 0 for an optimizer without momentum (on_fit_start warned)
                momentum = 0.0
            key = self._key("lr", name)
            out[key] = float(group["lr"])  # a Python float (or a CPU tensor): no device sync
            self.lrs[key].append(out[key])
            if self.log_momentum and momentum is not None:
                key = self._key("momentum", name)
                out[key] = self.last_momentum_values[key] = float(momentum)
            if self.log_weight_decay and group.get("weight_decay") is not None:
                key = self._key("weight_decay", name)
                out[key] = self.last_weight_decay_values[key] = float(group["weight_decay"])
        return out

    def on_logged_batch_start(self, trainer: Any, task: Any) -> None:
        """The rates this batch's optimizer step uses, before it and its scheduler step, at the
        step its values are logged at (Lightning's ``on_train_batch_start``)."""
        if self._keys["step"]:
            self._logged_at = trainer.state.log_step
            trainer.log_metrics(self.values(trainer, "step"))

    def on_log_interval(self, trainer: Any, task: Any) -> None:
        """An epoch shorter than ``log_every_n_steps`` logs its last step at its end (taskfit's
        curves of a short run): the vitals log the rate there too. Lightning's names log where
        Lightning's monitor does, only."""
        if (self.names == "vitals" and self._keys["step"]
                and self._logged_at != trainer.state.log_step):
            trainer.log_metrics(self.values(trainer, "step"))

    def on_train_epoch_start(self, trainer: Any, task: Any) -> None:
        if self._keys["epoch"]:
            trainer.log_metrics(self.values(trainer, "epoch"))
