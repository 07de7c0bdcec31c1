"""Optimization pieces: whatever ``configure_optimizers`` returns as one optimizer and scheduler
configs, how a scheduler steps, and gradient clipping."""
from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .errors import CheckpointError, MisconfigurationError, TaskModuleError

_ACCEPTED = ('an optimizer, `(optimizer, scheduler)`, or `{"optimizer": opt, "lr_scheduler": '
             'sched}` where sched is a scheduler or `{"scheduler": s, "interval": "step"|"epoch", '
             '"frequency": n, "monitor": "val/loss"}`')


@dataclass
class SchedulerConfig:
    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    # False: a monitor that is not logged skips the step (one warning), as Lightning
    strict: bool = True
    warned: bool = False  # the warning of strict=False was given
    name: str | None = None  # LearningRateMonitor's name for its optimizer's rates

    @property
    def on_plateau(self) -> bool:
        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    @property
    def reduce_on_plateau(self) -> bool:
        """Lightning's name for :attr:`on_plateau` (in ``trainer.lr_scheduler_configs``)."""
        return self.on_plateau


def _scheduler_config(value: Any) -> SchedulerConfig:
    if isinstance(value, Mapping):
        unknown = set(value) - {"scheduler", "interval", "frequency", "monitor", "name", "strict"}
        if "scheduler" not in value or unknown:
            raise TaskModuleError(
                f"configure_optimizers returned an lr_scheduler dict with keys {sorted(value)}.",
                "give `scheduler` and optionally `interval`, `frequency`, `monitor`. Accepted: "
                f"{_ACCEPTED}.")
        config = SchedulerConfig(
            value["scheduler"],
            value.get("interval", "epoch"),
            value.get("frequency", 1),
            value.get("monitor"),
            bool(value.get("strict", True)),
            name=value.get("name"),
        )
    else:
        config = SchedulerConfig(value)
    if not hasattr(config.scheduler, "step") or not hasattr(config.scheduler, "state_dict"):
        raise TaskModuleError(f"configure_optimizers returned {type(config.scheduler).__name__} as "
                              "a scheduler.",
                              f"return a torch.optim.lr_scheduler object. Accepted: {_ACCEPTED}.")
    if config.interval not in ("step", "epoch"):
        raise MisconfigurationError(f"Scheduler interval {config.interval!r} is not valid.",
                                    'use interval="step" or interval="epoch".')
    if not isinstance(config.frequency, int) or config.frequency < 1:
        raise MisconfigurationError(f"Scheduler frequency {config.frequency!r} is not valid.",
                                    "use a positive integer.")
    if config.on_plateau and config.monitor is None:
        config.monitor = "val/loss"
    return config


def _one(result: Any) -> tuple[torch.optim.Optimizer, list[SchedulerConfig]]:
    """One optimizer with its schedulers: an optimizer, ``(optimizer, scheduler)`` or a dict."""
    optimizer, schedulers = result, []
    if isinstance(result, Mapping):
        if "optimizer" not in result:
            raise TaskModuleError("configure_optimizers returned a dict with keys "
                                  f"{sorted(result)}, without 'optimizer'.", f"return {_ACCEPTED}.")
        optimizer = result["optimizer"]
        scheduler = result.get("lr_scheduler")
        if (
            scheduler is not None
            and not isinstance(scheduler, Mapping)
            and result.get("monitor") is not None
        ):
            # Lightning's top-level "monitor"
            scheduler = {"scheduler": scheduler, "monitor": result["monitor"]}
        if scheduler is not None:
            schedulers = [_scheduler_config(scheduler)]
    elif (
        isinstance(result, (tuple, list))
        and len(result) == 2
        and isinstance(result[0], torch.optim.Optimizer)
    ):
        optimizer, schedulers = result[0], [_scheduler_config(result[1])]
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TaskModuleError(f"configure_optimizers returned {type(result).__name__} "
                              f"({result!r:.80}).",
                              f"return {_ACCEPTED}.")
    return optimizer, schedulers


def parse_optimizers(result: Any, automatic: bool = True) -> tuple[list[torch.optim.Optimizer],
                                                                   list[SchedulerConfig]]:
    """Validate the return value of ``configure_optimizers``: the optimizers (several only with
    manual optimization: a list of optimizers, ``([optimizers], [schedulers])`` or a list of dicts)
    and the schedulers."""
    optimizers, configs = [], []
    is_list = isinstance(result, (list, tuple)) and len(result) > 0
    if is_list and all(isinstance(o, (torch.optim.Optimizer, Mapping)) for o in result) and not (
            len(result) == 2 and isinstance(result[0], torch.optim.Optimizer) and not isinstance(
                result[1], (torch.optim.Optimizer, Mapping))):
        for item in result:  # [opt1, opt2] or [{"optimizer": ..., "lr_scheduler": ...}, ...]
            optimizer, schedulers = _one(item)
            optimizers.append(optimizer)
            configs += schedulers
    elif is_list and len(result) == 2 and all(isinstance(part, (list, tuple)) for part in result):
        # ([optimizers], [schedulers]), as Lightning accepts
        optimizers = [_one(o)[0] for o in result[0]]
        configs = [_scheduler_config(s) for s in result[1]]
    else:
        optimizer, configs = _one(result)
        optimizers = [optimizer]
    if automatic and len(optimizers) > 1:
        raise TaskModuleError(
            f"configure_optimizers returned {len(optimizers)} optimizers; with automatic "
            "optimization taskfit steps one (as Lightning 2 does).",
            "set `automatic_optimization = False` on the TaskModule and step them yourself in "
            "training_step: `opt_g, opt_d = self.optimizers()` (docs/steps.md), or combine the "
            "parameter groups into one optimizer: `torch.optim.AdamW([{'params': a.parameters()}, "
            "{'params': b.parameters(), 'lr': 1e-4}])`.")
    return optimizers, configs


class Schedulers:
    """A fit's learning-rate schedulers and when each steps: ``interval="step"`` after every
    ``frequency``-th optimizer step (counted over the run), ``"epoch"`` after every ``frequency``-th
    completed epoch."""

    def __init__(self, configs: list[SchedulerConfig], automatic: bool = True,
                 lr_scheduler_step: Callable[[Any, Any], None] | None = None) -> None:
        # all of them (checkpointed); with manual optimization the task steps them itself
        self.configs = configs
        # the task's own (Lightning's override), or None: scheduler.step
        self.lr_scheduler_step = lr_scheduler_step
        self.per_step = [
            c for c in configs if c.interval == "step" and automatic and not c.on_plateau
        ]
        # ReduceLROnPlateau steps after the batch's hooks and validation: it may monitor a value
        # logged this step
        self.plateau_per_step = [
            c for c in configs if c.interval == "step" and automatic and c.on_plateau
        ]
        self.per_epoch = [c for c in configs if c.interval == "epoch" and automatic]

    def __len__(self) -> int:
        return len(self.configs)

    def after_step(
        self, global_step: int, metrics: Mapping[str, Any], plateau: bool = False
    ) -> None:
        """Optimizer step ``global_step`` was taken: the step-interval schedulers due (``plateau``:
        the ReduceLROnPlateau ones, after the batch's hooks and validation)."""
        for config in self.plateau_per_step if plateau else self.per_step:
            if global_step % config.frequency == 0:
                step_scheduler(config, metrics, self.lr_scheduler_step)

    def pause(self) -> None:
        """Step none of them from here on (a callback that sets the learning rate itself: SWA, the
        lr finder)."""
        self.per_step, self.per_epoch = [], []

    def after_epoch(self, epoch: int, metrics: Mapping[str, float]) -> None:
        """``epoch`` (from 0) has just completed."""
        for config in self.per_epoch:
            if (epoch + 1) % config.frequency == 0:
                step_scheduler(config, metrics, self.lr_scheduler_step)

    def state_dict(self) -> list[dict[str, Any]]:
        return [config.scheduler.state_dict() for config in self.configs]

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        for config, state in zip(self.configs, states):
            config.scheduler.load_state_dict(state)


def lr_course(schedulers: Schedulers, steps: int, epochs: int) -> list[str]:
    """What each (restored) scheduler will do to the learning rate over the rest of a run of
    ``steps`` optimizer steps and ``epochs`` epochs: a copy steps on a stand-in optimizer (the real
    one and the model are untouched)."""
    lines = []
    for config in schedulers.configs:
        optimizer = getattr(config.scheduler, "optimizer", None)
        if config.on_plateau or optimizer is None:  # its course depends on the metrics to come
            continue
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [torch.zeros(1, requires_grad=True)],
            }
            for g in optimizer.param_groups
        ]
        stand_in = torch.optim.SGD(groups, lr=groups[0]["lr"])
        twin = copy.deepcopy(config.scheduler, {id(optimizer): stand_in})
        lrs, name = [], type(config.scheduler).__name__
        try:
            with warnings.catch_warnings():
                # "scheduler.step() before optimizer.step()": the stand-in never steps
                warnings.simplefilter("ignore")
                for _ in range(
                    (steps if config.interval == "step" else epochs) // config.frequency
                ):
                    twin.step()
                    lrs.append(stand_in.param_groups[0]["lr"])
        # e.g. OneCycleLR refuses to step past its total_steps
        except Exception as exc:  # noqa: BLE001
            lines.append(f"{name}: lr {optimizer.param_groups[0]['lr']:.3g} now; stepping it "
                         f"further raises {type(exc).__name__}: {exc}")
            continue
        if lrs:
            lines.append(f"{name}: lr {optimizer.param_groups[0]['lr']:.3g} now, {lrs[-1]:.3g} at "
                         f"the end of this run (lowest {min(lrs):.3g}, highest {max(lrs):.3g} over "
                         f"its {len(lrs)} more steps)")
    return lines


def step_scheduler(config: SchedulerConfig, metrics: Mapping[str, float],
                   task_step: Callable[[Any, Any], None] | None = None) -> None:
    """Step one scheduler; ReduceLROnPlateau gets its monitored value from ``metrics``.
    ``task_step``: the task's ``lr_scheduler_step(scheduler, metric)`` (Lightning's override),
    called instead of ``scheduler.step``."""
    if not config.on_plateau:
        (task_step or plain_scheduler_step)(config.scheduler, None)
        return
    value = metrics.get(config.monitor)
    if value is None and not config.strict:
        if not config.warned:
            config.warned = True
            warnings.warn(f"ReduceLROnPlateau monitors {config.monitor!r}, which is not logged, "
                          "and its scheduler dict says 'strict': False: its steps are skipped "
                          "until it is. HINT: log the key, or fix 'monitor' in "
                          "configure_optimizers.", UserWarning, stacklevel=2)
        return
    if value is None:
        raise MisconfigurationError(
            f"ReduceLROnPlateau monitors {config.monitor!r}, which has not been logged.",
            f"set 'monitor' to one of {sorted(metrics) or 'the logged keys'} in "
            "configure_optimizers, or add 'strict': False to its scheduler dict to skip its steps "
            "while the key is missing.")
    (task_step or plain_scheduler_step)(config.scheduler, value)


def plain_scheduler_step(scheduler: Any, metric: Any) -> None:
    """``scheduler.step()``, or ``scheduler.step(metric)`` for a monitored one: what Lightning's
    default ``lr_scheduler_step`` does."""
    if metric is None:
        scheduler.step()
    else:
        scheduler.step(metric)


def gradient_clipper(optimizer: torch.optim.Optimizer, value: float | None,
                     algorithm: str) -> Callable[[], Any] | None:
    """A call that clips the optimizer's gradients in place (``"norm"``: their global norm;
    ``"value"``: each element), or None without clipping. Built once per fit: the parameter list is
    not rebuilt per step."""
    if value is None:
        return None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    clip = (
        torch.nn.utils.clip_grad_norm_ if algorithm == "norm" else torch.nn.utils.clip_grad_value_
    )
    return functools.partial(clip, params, value)


def check_optimizer_state(
    optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], path: str
) -> None:
    """``saved`` (an optimizer's state dict) fits ``optimizer``: the same parameter groups, of the
    same sizes."""
    have = [len(group["params"]) for group in optimizer.param_groups]
    had = [len(group["params"]) for group in saved.get("param_groups", [])]
    if have != had:
        raise CheckpointError(f"The optimizer state in {path} does not fit this optimizer "
                              f"(parameters per group: {had} in the checkpoint, {have} now).",
                              "resume with the optimizer of the original run (same parameter "
                              "groups).")
