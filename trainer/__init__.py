"""taskfit: a PyTorch trainer. ``from taskfit import Trainer, TaskModule, seed_everything``."""
from __future__ import annotations

from .errors import CheckpointError, MisconfigurationError, NonFiniteLossError, TaskfitError, TaskModuleError
from .module import TaskModule
from .seed import seed_everything
from .state import TrainerState
from .strategies import Strategy
from .trainer import Trainer
from .version import __version__

__all__ = ["Trainer", "TaskModule", "TrainerState", "Strategy", "seed_everything", "TaskfitError",
           "MisconfigurationError", "TaskModuleError", "NonFiniteLossError", "CheckpointError", "__version__"]
