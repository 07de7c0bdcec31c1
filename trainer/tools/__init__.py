"""Tools that drive a Trainer: the learning-rate range test (``lr_finder.py``, Lightning's
``Tuner.lr_find``)."""
from __future__ import annotations

from .lr_finder import LRFinder, lr_find

__all__ = ["LRFinder", "lr_find"]
