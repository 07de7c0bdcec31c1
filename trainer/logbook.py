"""LogBook: where ``self.log`` and the Trainer's own losses go, without a host-device sync per call.

Values are kept as tensors in a pending list and folded into a running (weighted) total only at the
logging interval and at epoch end; conversion to Python floats happens once per interval, in one
``tolist()`` (the single CPU-GPU sync point of logging).
"""
from __future__ import annotations

from typing import Any

import torch


def stack_scalars(values: list[Any], device: torch.device) -> torch.Tensor:
    """One float32 vector on ``device`` from scalars (tensors of shape () or (1,), any dtype; numbers).

    One ``stack``, no host-device sync; values that already are float32 scalars on ``device`` go in as they are
    (``as_tensor`` and ``reshape`` cost two dispatches each, per value, per log).
    """
    f32 = torch.float32
    return torch.stack([v if type(v) is torch.Tensor and v.dtype is f32 and v.dim() == 0 and v.device == device
                        else torch.as_tensor(v, dtype=f32, device=device).reshape(()) for v in values])


class _Series:
    """One logged key: the values since the last fold (tensors stay tensors) and the folded running total.

    ``weights`` is None while every weight is 1 (training): then the Trainer appends its losses to ``pending``
    directly, no call per step, and the count of values is the weight.
    """

    __slots__ = ("pending", "weights", "total", "weight", "_last")

    def __init__(self) -> None:
        self.pending: list[Any] = []
        self.weights: list[float] | None = None
        self.total: Any = 0.0
        self.weight = 0.0
        self._last: Any = None

    @property
    def last(self) -> Any:
        """The most recent value (None before the first)."""
        return self.pending[-1] if self.pending else self._last

    def weight_list(self) -> list[float]:
        """The weight of each pending value (a new list of ones while they are all 1)."""
        return [1.0] * len(self.pending) if self.weights is None else self.weights

    def add(self, value: Any, weight: float = 1.0) -> None:
        if weight != 1.0 and self.weights is None:
            self.weights = self.weight_list()
        self.pending.append(value)
        if self.weights is not None:
            self.weights.append(weight)

    def fold(self) -> None:
        if not self.pending:
            return
        self.total, self.weight = self.peek()
        self._last = self.pending[-1]
        self.pending.clear()  # the same list: the Trainer holds it
        self.weights = None

    def peek(self) -> tuple[Any, float]:
        """``(total, weight)`` as :meth:`fold` would leave them, without folding (the book is left unchanged)."""
        if not self.pending:
            return self.total, self.weight
        weights = self.weights
        if isinstance(self.pending[0], torch.Tensor):
            try:  # one stack (and a cast, a reshape where needed) per interval, not a .float() per value
                values = torch.stack(self.pending)
                if values.dtype is not torch.float32 or values.dim() != 1:  # a loss may be (1,), or float16
                    values = values.float().reshape(-1)
            except RuntimeError:  # values of different shapes, e.g. () and (1,)
                values = torch.stack([v.float().reshape(()) for v in self.pending])
            if weights is None:  # training: unweighted, no weights tensor to build
                total = self.total + values.sum()
            else:
                total = self.total + (values * torch.tensor(weights, dtype=values.dtype, device=values.device)).sum()
        else:
            total = self.total + sum(float(v) * w for v, w in zip(self.pending, self.weight_list()))
        return total, self.weight + (len(self.pending) if weights is None else sum(weights))


class LogBook:
    """Per-stage accumulation of logged values: ``last`` for step logging, weighted mean per epoch."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.weight = 1.0  # the Trainer sets the batch size here during evaluation (sample-weighted means)
        self.series: dict[str, _Series] = {}
        self.prog_bar: set[str] = set()

    def key(self, name: str) -> str:
        return name if "/" in name else f"{self.stage}/{name}"

    def log(self, name: str, value: Any, prog_bar: bool = False) -> None:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                from .errors import MisconfigurationError

                raise MisconfigurationError(
                    f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; only scalars can be logged.",
                    "log a reduced value, e.g. `self.log(name, value.mean())`.")
            value = value.detach().reshape(())
        elif not isinstance(value, (int, float)):
            from .errors import MisconfigurationError

            raise MisconfigurationError(
                f"self.log({name!r}, ...) got a {type(value).__name__}; expected a scalar tensor or a number.",
                "log `float(x)` or a 0-d tensor.")
        key = self.key(name)
        self.add(key, value)
        if prog_bar:
            self.prog_bar.add(key)

    def series_for(self, key: str) -> _Series:
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = _Series()
        return series

    def add(self, key: str, value: Any) -> None:
        self.series_for(key).add(value, self.weight)

    def fold(self) -> None:
        for series in self.series.values():
            series.fold()

    def last_values(self) -> dict[str, Any]:
        """The most recent value of each key (still tensors)."""
        return {k: s.last for k, s in self.series.items() if s.last is not None}

    def totals(self) -> tuple[list[str], list[Any]]:
        """Keys (sorted, identical on every rank) and their flattened ``[total, weight]`` pairs."""
        keys = sorted(self.series)
        flat: list[Any] = []
        for k in keys:  # peek, not fold: a partial epoch's end must not regroup the sums (exact resume)
            flat += list(self.series[k].peek())
        return keys, flat

    def reset(self) -> None:
        self.series.clear()

    def state_dict(self) -> dict[str, Any]:
        """Exact state (tensors kept as tensors) so that epoch means after a resume are bitwise equal."""
        return {"stage": self.stage, "prog_bar": sorted(self.prog_bar), "series": {
            k: {"pending": list(s.pending), "weights": list(s.weight_list()),
                "total": s.total, "weight": s.weight}
            for k, s in self.series.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prog_bar = set(state["prog_bar"])
        self.series.clear()
        for key, saved in state["series"].items():
            s = self.series[key] = _Series()
            s.pending = list(saved["pending"])
            s.weights = None if all(w == 1.0 for w in saved["weights"]) else list(saved["weights"])
            s.total, s.weight = saved["total"], saved["weight"]
