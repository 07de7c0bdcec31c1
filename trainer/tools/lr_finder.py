"""The taskfit command's ``mode=lr_find``, and ``from taskfit.tools import lr_find, LRFinder``: the
learning-rate range test itself is callbacks/lr_finder.py's (the ``LearningRateFinder`` callback
runs it during a fit)."""
from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from ..callbacks.lr_finder import LRFinder, RangeTest, lr_find
from ..console import echo

__all__ = ["LRFinder", "RangeTest", "lr_find", "lr_find_command"]


# ---- the taskfit command's mode=lr_find ----------------------------------------------------------
def lr_find_command(
    trainer: Any, task: Any, config: Mapping[str, Any], run_dir: str
) -> dict[str, Any]:
    """``taskfit mode=lr_find``: the range test with the ``lr_find.*`` settings; prints the
    suggestion and the override that uses it. Returns what the sweep summary shows."""
    settings = dict(config.get("lr_find") or {})
    started = time.perf_counter()
    finder = lr_find(trainer, task, output_dir=os.path.join(run_dir, "lr_find"), **settings)
    lr = finder.suggestion() if finder is not None else None
    key = "task.optimizer.lr" if isinstance(config["task"].get("optimizer"), Mapping) and \
        "lr" in config["task"]["optimizer"] else "task.lr" if "lr" in config["task"] else None
    if trainer.is_main and finder is not None:
        points = len(finder.results["lr"])
        use = (
            f"taskfit {key}={lr:.3g}"
            if key and lr
            else "set the optimizer's lr to it in your task's config"
        )
        echo(
            "\n".join(
                [
                    f"taskfit: lr_find in {time.perf_counter() - started:.1f} s "
                    f"({points} steps from "
                    f"{finder.lr_min:g} to "
                    f"{finder.results['lr'][-1]:.3g}"
                    f"{', stopped: the loss diverged' if finder.stopped_early else ''})",
                    f"  run directory:   {run_dir}",
                    "  curve:           "
                    f"{finder.png_path or os.path.join(finder.output_dir, 'lr_find.json')}"
                    "  (tensorboard "
                    f"--logdir {run_dir}: Images tab)",
                    f"  suggestion:      lr={lr:.3g}"
                    if lr
                    else "  suggestion:      none (too few points: raise lr_find.num_training)",
                    *([f"  use it:          {use}"] if lr else []),
                ]
            ),
            name="taskfit.cli",
        )
    return {
        "run_dir": run_dir,
        "run_mode": "lr_find",
        "suggestion": lr,
        "override": f"{key}={lr:.3g}" if key and lr else None,
        "metrics": {"lr_find/suggestion": lr} if lr else {},
        "score": lr,
        "monitor": "lr_find/suggestion",
        "mode": "min",
        "kind": "final",
        "log_dir": finder.output_dir if finder else None,
        "test": None,
        "best_checkpoint": None,
        "loggers": [],
    }
