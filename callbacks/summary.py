"""ModelSummary: a table of the module's layers and parameter counts, printed once at fit start."""
from __future__ import annotations

from typing import Any

from torch import nn

from ..arguments import arguments_checked
from ..callback import Callback
from ..console import echo
from ..errors import MisconfigurationError


def summarize(module: nn.Module, max_depth: int = 1) -> str:
    """The summary table as text: one row per submodule down to ``max_depth`` (-1: all of them),
    with Lightning's columns (name, type, parameters, train/eval mode) and taskfit's trainable
    count, then the totals."""
    rows = [("", "Name", "Type", "Params", "Trainable", "Mode")]
    modules = [(n, m) for n, m in module.named_modules() if n]
    shown = [(n, m) for n, m in modules if max_depth == -1 or n.count(".") < max_depth]
    for i, (name, child) in enumerate(shown):
        params = sum(p.numel() for p in child.parameters())
        trainable = sum(p.numel() for p in child.parameters() if p.requires_grad)
        rows.append((str(i), name, type(child).__name__, f"{params:,}", f"{trainable:,}",
                     "train" if child.training else "eval"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    size_mb = sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20
    training = sum(m.training for _, m in modules)
    lines += [
        "-" * len(lines[0]),
        f"{trainable:,} trainable params",
        f"{total - trainable:,} non-trainable params",
        f"{total:,} total params",
        f"{size_mb:.3f} MB total parameter size",
        f"{training} modules in train mode",
        f"{len(modules) - training} modules in eval mode",
    ]
    return "\n".join(lines)


class ModelSummary(Callback):
    """Prints :func:`summarize` of the task on rank 0 when fit starts
    (``enable_model_summary=False`` turns it off); also logged to the ``taskfit`` logger (the
    ``taskfit`` command's taskfit.log).

    Args:
        max_depth: how deep to list submodules, as Lightning's: 1 the task's children, -1 every
            layer, 0 no summary.
    """

    @arguments_checked(docs="docs/callbacks.md")
    def __init__(self, max_depth: int = 1) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise MisconfigurationError(f"ModelSummary(max_depth={max_depth!r}) is not valid.",
                                        "use -1 (every layer), 0 (no summary) or how many levels "
                                        "of submodules to list (1: the task's direct children).")
        self.max_depth = max_depth

    def on_fit_start(self, trainer: Any, task: Any) -> None:
        if self.max_depth and trainer.is_main:
            echo(summarize(task, self.max_depth), name="taskfit.summary")
