"""Checkpoints: what one holds and how a run is restored from it (``run_state.py``), atomic files and the background
writer (``files.py``, ``staging.py``), sharded directories (``dirs.py``, ``sharded.py``, ``sharded_index.py``,
``consolidate.py``) and RNG states (``rng.py``). docs/checkpointing.md."""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["load_checkpoint", "last_checkpoint", "save_checkpoint"]


def __getattr__(name: str) -> Any:  # the old module taskfit.checkpoint's public functions, loaded on first use
    if name in __all__:
        return getattr(importlib.import_module(".run_state", __name__), name)
    raise AttributeError(f"module 'taskfit.checkpoint' has no attribute {name!r}")
