"""taskfit's module paths before the subpackages (round 4), still importable: ``from taskfit.fsdp
import FSDPStrategy`` gives ``taskfit.strategies.fsdp``'s module itself (the same object, so a
monkeypatch reaches it).

An import of an old name is answered by :class:`OldPaths`, a finder on ``sys.meta_path`` that
``taskfit/__init__`` installs; nothing is imported before it is asked for. New code uses the new
paths (docs/concepts.md).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

MOVED = {  # old name: new name
    "taskfit.averaging": "taskfit.callbacks.averaging",
    "taskfit.callbacks.base": "taskfit.callback",
    "taskfit.callbacks.checkpoint_policy": "taskfit.callbacks.checkpoint.policy",
    "taskfit.callbacks.csv_logger": "taskfit.callbacks.loggers.csv_logger",
    "taskfit.callbacks.hparams": "taskfit.callbacks.loggers.tensorboard_hparams",
    "taskfit.callbacks.lightning_hooks": "taskfit.loop.hooks",
    "taskfit.callbacks.logger": "taskfit.callbacks.loggers.logger",
    "taskfit.callbacks.mlflow_logger": "taskfit.callbacks.loggers.mlflow_logger",
    "taskfit.callbacks.tensorboard": "taskfit.callbacks.loggers.tensorboard",
    "taskfit.checkpoint_dirs": "taskfit.checkpoint.dirs",
    "taskfit.checks": "taskfit.loop.checks",
    "taskfit.config": "taskfit.cli.config",
    "taskfit.config_errors": "taskfit.cli.config_errors",
    "taskfit.config_schemas": "taskfit.cli.schemas",
    "taskfit.ddp": "taskfit.strategies.ddp",
    "taskfit.ddp_spawn": "taskfit.strategies.spawn",
    "taskfit.evaluation": "taskfit.loop.evaluation",
    "taskfit.figures": "taskfit.logs.figures",
    "taskfit.fsdp": "taskfit.strategies.fsdp",
    "taskfit.lightning_arguments": "taskfit.compat.lightning.trainer_arguments",
    "taskfit.loader_workers": "taskfit.data.workers",
    "taskfit.log_options": "taskfit.logs.options",
    "taskfit.logbook": "taskfit.logs.book",
    "taskfit.logbuffer": "taskfit.logs.buffer",
    "taskfit.loop.precision": "taskfit.precision",
    "taskfit.metrics": "taskfit.logs.metrics",
    "taskfit.model_memory": "taskfit.strategies.model_memory",
    "taskfit.modes": "taskfit.cli.modes",
    "taskfit.preemption": "taskfit.loop.preemption",
    "taskfit.profiler": "taskfit.profilers.simple",
    "taskfit.profiling": "taskfit.profilers.choice",
    "taskfit.rng": "taskfit.checkpoint.rng",
    "taskfit.schedule": "taskfit.loop.cadence",
    "taskfit.serialization": "taskfit.checkpoint.files",
    "taskfit.session": "taskfit.loop.run",
    "taskfit.sharded_checkpoint": "taskfit.checkpoint.sharded",
    "taskfit.sharded_index": "taskfit.checkpoint.sharded_index",
    "taskfit.staging": "taskfit.checkpoint.staging",
    "taskfit.steps": "taskfit.loop.steps",
    "taskfit.strategy_registry": "taskfit.strategies.registry",
    "taskfit.sweep": "taskfit.cli.sweep",
    "taskfit.torch_profiler": "taskfit.profilers.pytorch",
    "taskfit.tune": "taskfit.tools.lr_finder",
}


class OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name and loads it as the module at its new name."""

    def find_spec(
        self, name: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        # the import system set the old name's spec
        module.__spec__ = importlib.util.find_spec(module.__name__)


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (after the standard finders: a real module always
    wins)."""
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(OldPaths())
