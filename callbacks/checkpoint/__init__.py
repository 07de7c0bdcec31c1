"""ModelCheckpoint (``model_checkpoint.py``) and its rules that need no Trainer (``policy.py``)."""
from __future__ import annotations

from .model_checkpoint import ModelCheckpoint
from .policy import format_filename

__all__ = ["ModelCheckpoint", "format_filename"]
