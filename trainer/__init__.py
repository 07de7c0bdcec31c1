"""taskfit: a PyTorch trainer. ``from taskfit import Trainer, TaskModule, seed_everything``.

Lightning's top-level names resolve here after the guide's rename (docs/migrating-lightning.md):
``Callback``, and ``cli_lightning_logo`` (a plain stand-in, compat/lightning/names.py)."""
from __future__ import annotations

from .callback import Callback
from .compat import old_paths
from .compat.lightning.names import cli_lightning_logo
from .datamodule import DataModule
from .errors import (
    CheckpointError,
    MisconfigurationError,
    NonFiniteLossError,
    TaskfitError,
    TaskModuleError,
)
from .module import TaskModule, rank_zero_only
from .seed import seed_everything
from .state import TrainerState
from .strategies.base import Strategy
from .trainer import Trainer
from .version import __version__

old_paths.install()  # taskfit.fsdp, taskfit.tune... (the flat layout before round 4) still import

__all__ = [
    "Trainer",
    "TaskModule",
    "DataModule",
    "Callback",
    "TrainerState",
    "Strategy",
    "seed_everything",
    "rank_zero_only",
    "cli_lightning_logo",
    "TaskfitError",
    "MisconfigurationError",
    "TaskModuleError",
    "NonFiniteLossError",
    "CheckpointError",
    "__version__",
]
