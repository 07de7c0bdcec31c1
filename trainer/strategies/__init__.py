"""Device strategies: where the module and the data live (docs/strategies.md).

``base.py`` is the interface the loop talks to (and one device, DataParallel); ``ddp.py``,
``spawn.py`` (ddp's self-launch) and ``fsdp.py`` the distributed ones; ``registry.py`` builds one
from ``Trainer(strategy=...)``; ``model_memory.py`` activation checkpointing and meta-device init.
DDP and FSDP load on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

from .base import DataParallelStrategy, Strategy, normalize_state_dict, unwrap

# torch.distributed's heavier modules, on first use
_LAZY = {"DDPStrategy": ".ddp", "FSDPStrategy": ".fsdp"}
__all__ = ["Strategy", "DataParallelStrategy", "DDPStrategy", "FSDPStrategy",
           "normalize_state_dict", "unwrap"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'taskfit.strategies' has no attribute {name!r}")
