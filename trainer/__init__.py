"""taskfit: a PyTorch trainer. ``from taskfit import Trainer, TaskModule, seed_everything``."""
from __future__ import annotations

from .compat import old_paths
from .datamodule import DataModule
from .errors import CheckpointError, MisconfigurationError, NonFiniteLossError, TaskfitError, TaskModuleError
from .module import TaskModule, rank_zero_only
from .seed import seed_everything
from .state import TrainerState
from .strategies.base import Strategy
from .trainer import Trainer
from .version import __version__

old_paths.install()  # taskfit.fsdp, taskfit.tune... (the flat layout before round 4) still import

__all__ = ["Trainer", "TaskModule", "DataModule", "TrainerState", "Strategy", "seed_everything", "rank_zero_only",
           "TaskfitError", "MisconfigurationError", "TaskModuleError", "NonFiniteLossError", "CheckpointError",
           "__version__"]
