"""The logging buffer: where ``self.log`` and the loop's losses go, without a host-device sync per call.

``LogBook`` keeps one stage's values as tensors in a pending list, folded into a running (weighted) total only
at the logging interval and at epoch end. ``LogBuffer`` is what the Trainer holds: the training book of the
current epoch (the loop appends each step's loss to :attr:`LogBuffer.losses`), the book ``self.log`` writes to
now, and the conversion to Python floats, once per interval, in one ``tolist()`` (the CPU-GPU sync point).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import torch

from .errors import MisconfigurationError, NonFiniteLossError

if TYPE_CHECKING:
    from .precision import Precision
    from .state import TrainerState
    from .strategies import Strategy


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

    Each value has a weight, the samples of its batch, kept relative to the first value's (``unit``): then every
    full batch weighs 1, ``weights`` stays None while all of them do (no list, no multiply), and only a smaller
    batch (the epoch's last) makes the mean a weighted one.
    """

    __slots__ = ("pending", "weights", "unit", "total", "weight", "_last")

    def __init__(self) -> None:
        self.pending: list[Any] = []
        self.weights: list[float] | None = None
        self.unit: float | None = None  # the weight of the first value: the others are relative to it
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
        if weight == self.unit and self.weights is None:  # the common case: another full batch
            self.pending.append(value)
            return
        unit = self.unit
        if unit is None:
            unit = self.unit = weight
        if weight != unit and self.weights is None:
            self.weights = self.weight_list()
        self.pending.append(value)
        if self.weights is not None:
            self.weights.append(weight / unit)

    def fold(self) -> None:
        if not self.pending:
            return
        self.total, self.weight = self.peek()
        self._last = self.pending[-1]
        self.pending.clear()  # the same list: LogBuffer.losses points at it
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
        self.weight = 1.0  # the Trainer sets each batch's size here: epoch means are sample-weighted
        self.series: dict[str, _Series] = {}
        self.prog_bar: set[str] = set()
        self.metric_objects: dict[str, Any] = {}  # self.log(name, metric): computed once per pass, then reset

    def key(self, name: str) -> str:
        return name if "/" in name else f"{self.stage}/{name}"

    def log(self, name: str, value: Any, prog_bar: bool = False) -> None:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise MisconfigurationError(
                    f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; only scalars can be logged.",
                    "log a reduced value, e.g. `self.log(name, value.mean())`.")
            value = value.detach().reshape(())
        elif all(hasattr(value, a) for a in ("update", "compute", "reset")):  # a torchmetrics Metric
            self.metric_objects[self.key(name)] = value
            if prog_bar:
                self.prog_bar.add(self.key(name))
            return
        elif not isinstance(value, (int, float)):
            raise MisconfigurationError(
                f"self.log({name!r}, ...) got a {type(value).__name__}; expected a scalar tensor or a number.",
                "log `float(x)`, a 0-d tensor or a torchmetrics Metric (computed and reset once per pass).")
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
        keys = sorted(k for k, s in self.series.items() if s.pending or s.weight)  # never logged: not a 0.0
        flat: list[Any] = []
        for k in keys:  # peek, not fold: a partial epoch's end must not regroup the sums (exact resume)
            flat += list(self.series[k].peek())
        return keys, flat

    def reset(self) -> None:
        self.series.clear()
        self.metric_objects.clear()

    def compute_metrics(self, suffix: str = "") -> dict[str, Any]:
        """The torchmetrics objects logged in this book, computed (torchmetrics syncs ranks) and reset."""
        values = {}
        for key, metric in self.metric_objects.items():
            values[key + suffix] = metric.compute()
            metric.reset()
        return values

    def state_dict(self) -> dict[str, Any]:
        """Exact state (tensors kept as tensors) so that epoch means after a resume are bitwise equal."""
        return {"stage": self.stage, "prog_bar": sorted(self.prog_bar), "series": {
            k: {"pending": list(s.pending), "weights": list(s.weight_list()), "unit": s.unit,
                "total": s.total, "weight": s.weight}
            for k, s in self.series.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prog_bar = set(state["prog_bar"])
        self.series.clear()
        for key, saved in state["series"].items():
            s = self.series[key] = _Series()
            s.pending = list(saved["pending"])
            s.weights = None if all(w == 1.0 for w in saved["weights"]) else list(saved["weights"])
            s.unit = saved.get("unit")
            s.total, s.weight = saved["total"], saved["weight"]


class LogBuffer:
    """The Trainer's logging buffer for one run: the training book, the book ``self.log`` writes to, and the
    conversions (reduced over ddp ranks, turned into floats) at the log interval, validation and epoch end.

    ``fold_mark`` is the (global step, batch index) of the first loss not yet folded: it names the step of a
    NaN/Inf loss found at the next check. Everything a resume needs is in :meth:`state_dict`.
    """

    def __init__(self, strategy: Strategy, nonfinite_loss: str, precision: Precision,
                 accumulate_grad_batches: int) -> None:
        self.strategy, self.accumulate = strategy, accumulate_grad_batches
        # With 16-mixed the GradScaler already skips steps whose gradients overflow: that is not an error.
        self.raise_nonfinite = nonfinite_loss == "raise" and precision.scaler is None
        self.train = LogBook("train")
        self.current = self.train
        self.new_epoch(0)

    def new_epoch(self, global_step: int) -> None:
        """An empty training book; :attr:`losses` is its loss series' pending list (the loop appends to it)."""
        self.train.reset()
        self._use_loss_series(self.train.series_for("train/loss"))
        self._checked = 0  # how many of them check_pending found finite
        self.fold_mark = (global_step, 0)

    def _use_loss_series(self, series: _Series) -> None:
        self._loss = series
        self.losses: list[Any] = series.pending  # this epoch's losses since the last log (read, not written)
        # add_loss(loss, samples): a step's detached loss, weighted by its batch's size, kept (not converted). The
        # series' own method, bound here once per epoch: the loop's one call per step for its loss.
        self.add_loss: Callable[[Any, float], None] = series.add

    @property
    def last_loss(self) -> Any:
        """The most recent training loss (a device tensor; None before this epoch's first step), for a progress bar
        that reads it when it redraws: converting it is a sync, a few times a second, never per step."""
        return self._loss.last

    def enter(self, stage: str) -> LogBook:
        """Make ``stage``'s book the one ``self.log`` writes to: the training book, or a new one per evaluation."""
        self.current = self.train if stage == "train" else LogBook(stage)
        return self.current

    # ---- training: the log interval and the epoch's end ---------------------------------------------------
    def interval(self, state: TrainerState) -> dict[str, float]:
        """The latest value of every training key, as floats; raises if a loss since the last check is NaN/Inf."""
        pending = list(self.losses)  # fold empties it; kept to name a bad step
        self.train.fold()  # one stack and sum per logged key: the loss total now includes every pending loss...
        last = self.train.last_values()
        floats = stack_scalars([*last.values(), self._loss.total], self.strategy.device).tolist()  # the sync
        if self.raise_nonfinite and not math.isfinite(floats[-1]):  # ...so it is finite iff each loss is
            self._raise_nonfinite(pending, state.epoch)
        self.fold_mark = (state.global_step, state.batch_idx + 1)  # where the next pending loss is from
        self._checked = 0  # fold emptied the list
        return dict(zip(last, floats))

    @property
    def logged_this_epoch(self) -> bool:
        """A log interval fell in this epoch (the fold mark moved past the epoch's first batch)."""
        return self.fold_mark[1] > 0

    def check_pending(self, epoch: int) -> None:
        """Raise if a loss since the last log is NaN/Inf on any rank: one sync (and under ddp one all-reduce),
        paid before a checkpoint is written, never per step."""
        if not self.raise_nonfinite or len(self.losses) == self._checked:  # nothing new since the last check (the
            return  # epoch's end, then its checkpoint): no second sync; every rank has as many losses
        mine = torch.isfinite(torch.stack(self.losses)).all() if self.losses else None
        finite = bool(mine) if mine is not None else True
        if self.strategy.world_size > 1:  # every rank must refuse the save, not only the one that saw the NaN
            flag = torch.tensor(float(finite), device=self.strategy.device)
            finite = bool(self.strategy.all_reduce(flag, op="min").item())
        if finite:
            self._checked = len(self.losses)
            return
        if mine is not None and not bool(mine):
            self._raise_nonfinite(self.losses, epoch)
        raise NonFiniteLossError(f"The training loss of another ddp rank is not finite (epoch {epoch}).",
                                 "see that rank's error; lower the learning rate or clip gradients.")

    def epoch_means(self) -> dict[str, float]:
        """The means of this epoch's training values, as ``<key>_epoch``, over all ranks."""
        return self.to_floats({**self.reduce(self.train, suffix="_epoch"), **self.train.compute_metrics("_epoch")})

    def _raise_nonfinite(self, pending: list, epoch: int) -> None:
        bad_steps = (~torch.isfinite(torch.stack(pending))).nonzero()
        if not len(bad_steps):  # finite losses whose sum overflowed: nothing to report
            return
        bad = int(bad_steps[0])
        step, batches = self.fold_mark
        raise NonFiniteLossError(
            f"The training loss is {float(pending[bad])} at epoch {epoch}, batch {batches + bad} "
            f"(global step {step + bad // self.accumulate}).",
            "lower the learning rate, clip gradients (gradient_clip_val=1.0), check the data for NaN/Inf, "
            "or pass nonfinite_loss='skip' to skip such steps (costs a sync per step). Losses are checked at "
            "every log_every_n_steps, so the run may have gone on a few steps past the bad one.")

    # ---- conversions ------------------------------------------------------------------------------------
    def reduce(self, book: LogBook, suffix: str = "") -> dict[str, Any]:
        """Sample-weighted means of everything in ``book`` over all ranks (one all-reduce, no host sync)."""
        keys, flat = book.totals()
        if not keys:
            return {}
        packed = self.strategy.all_reduce(stack_scalars(flat, self.strategy.device), op="sum")
        means = packed[0::2] / packed[1::2].clamp_min(1e-12)
        return {key + suffix: means[i] for i, key in enumerate(keys)}

    @staticmethod
    def to_floats(values: Mapping[str, Any]) -> dict[str, float]:
        """``values`` as Python floats: every tensor converted in one ``tolist()`` (a CPU-GPU sync)."""
        tensors = [v for v in values.values() if isinstance(v, torch.Tensor)]
        if not tensors:
            return {k: float(v) for k, v in values.items()}
        converted = iter(stack_scalars([t.detach() for t in tensors], tensors[0].device).tolist())
        return {k: next(converted) if isinstance(v, torch.Tensor) else float(v) for k, v in values.items()}

    # ---- resume -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The training values logged so far this epoch, exactly (tensors stay tensors), and the fold mark."""
        book = self.train.state_dict()
        for series in book["series"].values():
            pending = series["pending"]
            alike = pending and all(isinstance(v, torch.Tensor) for v in pending) \
                and len({(v.dtype, v.shape, v.device) for v in pending}) == 1
            if alike:
                # One tensor in the file instead of one per value (each costs the pickler ~20 objects); bits unchanged.
                series["pending"] = torch.stack([v.detach() for v in pending])
            else:  # logged tensors may be views of large tensors: save only their own values
                series["pending"] = [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in pending]
            if isinstance(series["total"], torch.Tensor):
                series["total"] = series["total"].detach().clone()
        return {"book": book, "fold_mark": list(self.fold_mark)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a partial epoch (its values go back to the device they were logged on), or, with no book (the
        epoch was saved complete), start the next one at ``fold_mark``."""
        if state["book"] is None:
            self.new_epoch(state["fold_mark"][0])
            return
        device = self.strategy.device
        book = state["book"]
        for series in book["series"].values():
            pending = series["pending"]
            series["pending"] = list(pending.to(device).unbind()) if isinstance(pending, torch.Tensor) else \
                [v.to(device) if isinstance(v, torch.Tensor) else v for v in pending]
            if isinstance(series["total"], torch.Tensor):
                series["total"] = series["total"].to(device)
        self.train.load_state_dict(book)
        self._use_loss_series(self.train.series_for("train/loss"))
        self._checked = 0
        self.fold_mark = tuple(state["fold_mark"])
