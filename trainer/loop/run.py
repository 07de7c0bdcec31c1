"""One run of an entry point: the :class:`Run` object, everything that exists for one
``fit``/``validate``/``test``/ ``predict`` inside the launched process, declared in one place.
lifecycle.py builds it; the loop (trainer.py) and its helper modules (evaluation, checkpointing,
steps) take the run, not the Trainer: what they need of the Trainer's configuration is
``run.config`` (trainer_config.py's frozen TrainerConfig)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from ..callback import Callback
from ..checkpoint.files import CheckpointWriter
from ..datamodule import DataSource
from ..logs.buffer import LogBuffer
from ..module import TaskModule
from ..optim import Schedulers
from ..state import TrainerState
from ..strategies.base import Strategy
from ..trainer_config import TrainerConfig
from .cadence import ValidationSchedule
from .hooks import Hook
from ..precision import Precision
from .preemption import Preemption


@dataclasses.dataclass(eq=False)
class Run:
    """Everything that exists for one run of an entry point, declared here and built by
    :func:`running` (and :func:`setup_fit` for fit). The Trainer keeps its configuration and its
    current (or last) run; callbacks read the run's parts through the Trainer's read-only properties
    (``trainer.model``, ``trainer.optimizer``...)."""

    # The Trainer, handed to every hook as its first argument (and set as ``task.trainer``);
    # nothing below the Trainer reads it (tests/test_layers.py): the configuration is ``config``.
    trainer: object
    config: TrainerConfig  # the Trainer's configuration as this run started (frozen)
    fn: str  # "fit", "validate", "test" or "predict"
    task: TaskModule
    data: DataSource
    strategy: Strategy
    callbacks: list[Callback]
    state: TrainerState
    checkpoint_writer: CheckpointWriter  # the Trainer's: background checkpoint files outlive a run
    # hook name -> the callables that define it, in Lightning's order (hooks.py)
    hooks: dict[str, list[Hook]]
    # chosen by the first logger with a directory (rank 0), or a resumed run's
    log_dir: str | None = None
    log_dir_restored: bool = False  # log_dir is the resumed run's (set_log_dir)
    # validate/test(verbose=): the results table is printed (callbacks/progress.py)
    verbose: bool = True
    precision: Precision | None = None
    logs: LogBuffer | None = None
    # what the loop calls: the task wrapped by the strategy (and torch.compile)
    model: nn.Module | None = None
    # configure_metrics by stage
    metrics: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    data_seed: int = 0  # the data order: rank 0's seed on every rank
    preemption: Preemption | None = None
    # The checkpoint manager (loop/checkpointer.py): every save and the resume lookup go through it
    checkpointer: Any = None
    # read once from the strategy (and a true precision, which converts): asked every batch
    moves_batches: bool = True
    # the strategy's batch_to_device, after a true precision's conversion (precision.batch_mover)
    batch_to_device: Callable[[Any], Any] | None = None
    predict_dataloader: Any = None
    # ---- fit only (setup_fit) ----
    # the task's training_step steps its optimizers (automatic_optimization = False)
    manual: bool = False
    optimizers: list[torch.optim.Optimizer] = dataclasses.field(default_factory=list)
    # the first (the only one with automatic optimization)
    optimizer: torch.optim.Optimizer | None = None
    manual_optimizers: list[Any] = dataclasses.field(default_factory=list)  # steps.ManualOptimizer
    schedulers: Schedulers | None = None
    train_dataloader: Any = None
    num_train_batches: float = 0
    val_loader: Any = None
    # of each validation loader
    num_val_batches: list[float] = dataclasses.field(default_factory=list)
    val_schedule: ValidationSchedule | None = None
    # the epoch the loaders were (re)built for (reload_dataloaders_every_n_epochs: not again)
    loaders_epoch: int = 0
    batches: Any = None  # the epoch's training batches being iterated (loaders.epoch_batches)
    # The step's callables, chosen once per fit (setup_fit): the plain call when no hook is defined
    # steps.training_step (forward and loss) under autocast
    training_step: Callable[[Any, int], Any] | None = None
    # optimizer.zero_grad (or the task's), with_hooks around it if any
    zero_grad: Callable[..., None] | None = None
    # Tensor.backward (precision.backward with a GradScaler) or the task's backward, with_hooks
    # around it if any:
    backward: Callable[..., None] | None = None
    # optimizer.step; precision.step with a GradScaler (False: skipped)
    optimizer_step: Callable[[], Any] | None = None
    # optim.gradient_clipper (None without clipping), or the task's
    clip_gradients: Callable[[], None] | None = None
    # the task's optimizer_step, else None
    task_optimizer_step: Callable[[torch.Tensor], bool] | None = None
    before_step_work: bool = False  # a GradScaler to unscale or on_before_optimizer_step hooks
    loss_checked: bool = False  # the first loss was checked (check_loss)

    def call_hooks(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on every callback (and task, data module) that defines it, in Lightning's
        order."""
        for fn in self.hooks[hook]:
            fn(self.trainer, self.task, *args)

    def publish(self, metrics: dict[str, float]) -> None:
        """Floats into ``state.metrics`` and every ``on_log`` (without ``self.log(...,
        logger=False)`` values)."""
        if metrics:
            self.state.metrics.update(self.logs.callback_view(metrics))
            logged = self.logs.logger_view(metrics)
            if logged:
                self.call_hooks("on_log", logged)

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Before every optimizer step (also a manual ``opt.step()``): unscaled gradients, then the
        hooks."""
        self.precision.unscale(optimizer)
        for fn in self.hooks["on_before_optimizer_step"]:
            fn(self.trainer, self.task, optimizer)

    def rewrite_hooks(self, rewrite: Callable[[str, list[Hook]], list[Hook]]) -> None:
        """Each hook's list replaced by ``rewrite(name, list)``, from now on (SimpleProfiler times
        every hook)."""
        for name, fns in self.hooks.items():
            self.hooks[name] = rewrite(name, fns)

    def set_log_dir(self, log_dir: str) -> None:
        """A resumed fit continues the run directory its checkpoint recorded (a logger's
        on_load_checkpoint; without one, the checkpoint manager: the checkpoint's run directory)."""
        self.log_dir = log_dir
        self.log_dir_restored = True


