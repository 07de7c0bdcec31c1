"""ModelSummary: a table of the module's layers and parameter counts, printed once at fit start."""
from __future__ import annotations

from typing import Any

from torch import nn

from ..console import echo
from .base import Callback


def summarize(module: nn.Module, max_depth: int = 1) -> str:
    """The summary table as text: one row per submodule down to ``max_depth``, then totals."""
    rows = [("", "Name", "Type", "Params", "Trainable")]
    for i, (name, child) in enumerate(
            (n, m) for n, m in module.named_modules() if n and n.count(".") < max_depth):
        params = sum(p.numel() for p in child.parameters())
        trainable = sum(p.numel() for p in child.parameters() if p.requires_grad)
        rows.append((str(i), name, type(child).__name__, f"{params:,}", f"{trainable:,}"))
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    size_mb = sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20
    lines += ["-" * len(lines[0]), f"{trainable:,} trainable params", f"{total - trainable:,} non-trainable params",
              f"{total:,} total params", f"{size_mb:.3f} MB total parameter size"]
    return "\n".join(lines)


class ModelSummary(Callback):
    """Prints :func:`summarize` of the task on rank 0 when fit starts (``enable_model_summary=False`` turns it off);
    also logged to the ``taskfit`` logger (the ``taskfit`` command's taskfit.log)."""

    def __init__(self, max_depth: int = 1) -> None:
        self.max_depth = max_depth

    def on_fit_start(self, trainer: Any, task: Any) -> None:
        if trainer.is_main:
            echo(summarize(task, self.max_depth), name="taskfit.summary")
