"""The TaskModule's ``configure_metrics``: one copy of each torchmetrics object per evaluation
stage, on the device, and a metric's computed value as logged keys."""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import TaskModuleError


def build_metrics(task: Any, device: torch.device) -> dict[str, dict[str, Any]]:
    """``{"val": {name: metric}, "test": {...}}`` from ``task.configure_metrics()`` (empty when it
    returns None)."""
    raw = task.configure_metrics()
    if not raw:
        return {}
    items = dict(raw.items()) if hasattr(raw, "items") else None
    if items is None or not all(
        all(hasattr(m, a) for a in ("update", "compute", "reset")) for m in items.values()
    ):
        raise TaskModuleError(f"configure_metrics returned {type(raw).__name__}.",
                              "return a dict {name: torchmetrics.Metric}, e.g. `{'acc': "
                              "torchmetrics.Accuracy(task='multiclass', num_classes=10)}`.")
    return {
        stage: {name: copy.deepcopy(m).to(device) for name, m in items.items()}
        for stage in ("val", "test")
    }


def metric_values(name: str, value: Any) -> dict[str, Any]:
    """A computed metric as logged keys: a dict becomes ``name/key``, a vector ``name_i``, a scalar
    ``name``."""
    if isinstance(value, Mapping):
        return {f"{name}/{k}": v for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() > 1:
        return {f"{name}_{i}": v for i, v in enumerate(value.flatten())}
    return {name: value}
