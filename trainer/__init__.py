"""taskfit: a PyTorch trainer. ``from taskfit import Trainer, TaskModule, seed_everything``."""
from __future__ import annotations

from .datamodule import DataModule
from .errors import CheckpointError, MisconfigurationError, NonFiniteLossError, TaskfitError, TaskModuleError
from .module import TaskModule, rank_zero_only
from .seed import seed_everything
from .state import TrainerState
from .strategies import Strategy
from .trainer import Trainer
from .version import __version__

__all__ = ["Trainer", "TaskModule", "DataModule", "TrainerState", "Strategy", "seed_everything", "rank_zero_only",
           "TaskfitError", "MisconfigurationError", "TaskModuleError", "NonFiniteLossError", "CheckpointError",
           "__version__"]
