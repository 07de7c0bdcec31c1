"""Checkpoint files, without a run: atomic files and the background writer (``files.py``,
``staging.py``), checksums (``integrity.py``), finding and reading one (``lookup.py``), sharded
directories (``dirs.py``, ``sharded.py``, ``sharded_index.py``, ``consolidate.py``) and RNG states
(``rng.py``). What a run's checkpoint holds and how a run is restored from it:
loop/checkpointing.py. docs/checkpointing.md."""
from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {"load_checkpoint": ".files", "FORMAT_VERSION": ".files", "last_checkpoint": ".lookup"}
__all__ = list(_PUBLIC)


# what the flat module taskfit.checkpoint offered, loaded on first use
def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    raise AttributeError(f"module 'taskfit.checkpoint' has no attribute {name!r}")
