"""Tools that drive a Trainer: the learning-rate range test (``lr_finder.py``, Lightning's
``Tuner.lr_find``) and the Tuner (``tuner.py``: Lightning's ``Tuner``, with the batch-size search of
``callbacks/batch_size_finder.py``)."""
from __future__ import annotations

from .lr_finder import LRFinder, lr_find
from .tuner import Tuner

__all__ = ["LRFinder", "Tuner", "lr_find"]
