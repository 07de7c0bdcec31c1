"""The logging buffer: where ``self.log`` and the loop's losses go, without a host-device sync per call.

``LogBook`` keeps one stage's values as tensors in a pending list, folded into a running (weighted) total only
at the logging interval and at epoch end. ``LogBuffer`` is what the Trainer holds: the training book of the
current epoch (the loop appends each step's loss to :attr:`LogBuffer.losses`), the book ``self.log`` writes to
now, and the conversion to Python floats, once per interval, in one ``tolist()`` (the CPU-GPU sync point).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import torch

from .errors import MisconfigurationError, NonFiniteLossError
from .log_options import LogOptions, check_same, log_options

if TYPE_CHECKING:
    from .precision import Precision
    from .state import TrainerState
    from .strategies import Strategy


LOSS = " loss"  # the key of the loop's own loss series (no name given to self.log can become it)
LEGACY = LogOptions(on_step=True, on_epoch=True)  # a book saved before self.log had options: name and name_epoch


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
    batch (the epoch's last) makes the mean a weighted one. ``reduce_fx`` "sum" adds the values (weight 1 each),
    "max"/"min" keep the running extreme.
    """

    __slots__ = ("pending", "weights", "unit", "total", "weight", "_last", "options", "step_name", "epoch_name",
                 "builtin", "hidden")

    def __init__(self, options: LogOptions = LEGACY, key: str = "", builtin: tuple[str | None, str | None] | None = None
                 ) -> None:
        self.pending: list[Any] = []
        self.weights: list[float] | None = None
        self.unit: float | None = None  # the weight of the first value: the others are relative to it
        self.total: Any = 0.0 if options.reduce_fx in ("mean", "sum") else None
        self.weight = 0.0
        self._last: Any = None
        self.options = options
        self.step_name, self.epoch_name = builtin if builtin is not None else options.names(key)
        self.builtin, self.hidden = builtin is not None, False  # the loop's own loss; hidden: a user's key took it

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
        weights, fx = self.weights, self.options.reduce_fx
        if isinstance(self.pending[0], torch.Tensor):
            try:  # one stack (and a cast, a reshape where needed) per interval, not a .float() per value
                values = torch.stack(self.pending)
                if values.dtype is not torch.float32 or values.dim() != 1:  # a loss may be (1,), or float16
                    values = values.float().reshape(-1)
            except RuntimeError:  # values of different shapes, e.g. () and (1,)
                values = torch.stack([v.float().reshape(()) for v in self.pending])
            if fx in ("max", "min"):
                extreme = values.max() if fx == "max" else values.min()
                total = extreme if self.total is None else (torch.maximum if fx == "max" else torch.minimum)(
                    torch.as_tensor(self.total, device=extreme.device), extreme)
            elif weights is None:  # training: unweighted, no weights tensor to build
                total = self.total + values.sum()
            else:
                total = self.total + (values * torch.tensor(weights, dtype=values.dtype, device=values.device)).sum()
        else:
            floats = [float(v) for v in self.pending]
            if fx in ("max", "min"):
                pick = max if fx == "max" else min
                total = pick(floats) if self.total is None else pick(float(self.total), pick(floats))
            else:
                total = self.total + sum(v * w for v, w in zip(floats, self.weight_list()))
        return total, self.weight + (len(self.pending) if weights is None else sum(weights))


class _StepSeries:
    """A key logged per step only: its latest value, nothing accumulated."""

    __slots__ = ("_last", "options", "step_name", "epoch_name", "builtin", "hidden", "pending")

    def __init__(self, options: LogOptions, key: str) -> None:
        self._last: Any = None
        self.options, self.builtin, self.hidden, self.pending = options, False, False, ()
        self.step_name, self.epoch_name = options.names(key)

    @property
    def last(self) -> Any:
        return self._last

    def add(self, value: Any, weight: float = 1.0) -> None:
        self._last = value

    def fold(self) -> None:
        pass


class LogBook:
    """One pass's logged values (the training epoch, or one validation/test pass): per key its step value and its
    epoch reduction, with the options of its first ``self.log`` (log_options.py)."""

    def __init__(self, stage: str, buffer: LogBuffer | None = None) -> None:
        self.stage, self.buffer = stage, buffer
        self.weight = 1.0  # the Trainer sets each batch's size here: epoch means are sample-weighted
        self.series: dict[str, Any] = {}  # key -> _Series / _StepSeries
        self.prog_bar: set[str] = set()  # published names shown on the progress bar
        self.metric_objects: dict[str, tuple[Any, str | None]] = {}  # key -> (Metric, epoch name): computed per pass
        self.epoch_level = False  # an epoch-level hook is running: self.log defaults to on_epoch (Lightning)
        self.late: set[str] | None = None  # keys logged after the pass's values were computed (its epoch-end hooks)

    def key(self, name: str) -> str:
        return name if "/" in name else f"{self.stage}/{name}"

    def log(self, name: str, value: Any, **options: Any) -> None:
        """``self.log(name, value, ...)``: checked, then kept as a tensor (no sync) under its options."""
        key = self.key(name)
        batch_size = options.pop("batch_size", None)
        opts = log_options(key, self.stage, self.epoch_level or self.late is not None, **options)
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise MisconfigurationError(
                    f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; only scalars can be logged.",
                    "log a reduced value, e.g. `self.log(name, value.mean())`.")
            value = value.detach().reshape(())
        elif all(hasattr(value, a) for a in ("update", "compute", "reset")):  # a torchmetrics Metric
            step_name, epoch_name = opts.names(key)
            if key not in self.metric_objects:
                self._register(opts, step_name, epoch_name)
            self.metric_objects[key] = (value, epoch_name)  # computed (torchmetrics syncs ranks) once per pass
            batch_value = getattr(value, "_forward_cache", None)  # the batch's value, as Lightning logs per step
            if step_name is not None and isinstance(batch_value, torch.Tensor) and batch_value.numel() == 1:
                series = self.series.get(key)
                if series is None:
                    series = self.series[key] = _StepSeries(opts, key)
                    series.epoch_name = None  # the epoch value is the metric's compute()
                series.add(batch_value.detach().reshape(()))
            if self.late is not None:
                self.late.add(key)
            return
        elif not isinstance(value, (int, float)):
            raise MisconfigurationError(
                f"self.log({name!r}, ...) got a {type(value).__name__}; expected a scalar tensor or a number.",
                "log `float(x)`, a 0-d tensor or a torchmetrics Metric (computed and reset once per pass).")
        self.add(key, value, opts, batch_size)

    def add(self, key: str, value: Any, options: LogOptions, batch_size: int | None = None) -> None:
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = _Series(options, key) if options.on_epoch else _StepSeries(options, key)
            self._register(options, series.step_name, series.epoch_name)
        elif series.options is not options:
            check_same(key, series.options, options)
        series.add(value, 1.0 if options.reduce_fx == "sum" else self.weight if batch_size is None else batch_size)
        if self.late is not None:
            self.late.add(key)

    def _register(self, options: LogOptions, step_name: str | None, epoch_name: str | None) -> None:
        """A new key: its names claim a built-in one (the loss: never mixed), the bar, the loggers, the alias."""
        names = {step_name, epoch_name} - {None}
        builtin = self.series.get(LOSS)
        if builtin is not None and names & {builtin.step_name, builtin.epoch_name}:
            builtin.hidden = True  # the user's self.log of the loss key replaces the built-in one (all its names)
        if options.prog_bar:
            self.prog_bar |= names
        if self.buffer is not None:
            self.buffer.register(options, step_name, epoch_name, names)

    def builtin_loss(self, step_name: str | None, epoch_name: str) -> _Series:
        """The loop's own loss series (``train/loss``, ``train/loss_epoch``; ``val/loss``): a user's self.log of
        one of its names hides it."""
        series = self.series.get(LOSS)
        if series is None:
            series = self.series[LOSS] = _Series(LogOptions(True, True), builtin=(step_name, epoch_name))
            series.hidden = any(name in (step_name, epoch_name) for s in self.series.values() if not s.builtin
                                for name in (s.step_name, s.epoch_name))
        return series

    def fold(self) -> None:
        for series in self.series.values():
            series.fold()

    def step_values(self) -> dict[str, Any]:
        """The most recent value of each key logged per step, by its published name (still tensors)."""
        return {s.step_name: s.last for s in self.series.values()
                if s.step_name is not None and not s.hidden and s.last is not None}

    def reducible(self, keys: Any = None) -> list[tuple[str, _Series]]:
        """``(key, series)`` of the epoch-reduced keys (all, or those in ``keys``), sorted: the same on every rank."""
        return sorted((k, s) for k, s in self.series.items() if s.epoch_name is not None and not s.hidden
                      and (s.pending or s.weight) and (keys is None or k in keys))

    def reset(self) -> None:
        self.series.clear()
        self.metric_objects.clear()
        self.late = None

    def compute_metrics(self, keys: Any = None) -> dict[str, Any]:
        """The torchmetrics objects logged per epoch in this book (all, or those in ``keys``), computed (torchmetrics
        syncs ranks); reset by :meth:`reset_metrics`, after the epoch-end hooks read them."""
        return {epoch_name: metric.compute() for key, (metric, epoch_name) in self.metric_objects.items()
                if epoch_name is not None and (keys is None or key in keys)}

    def reset_metrics(self) -> None:
        for metric, _ in self.metric_objects.values():
            metric.reset()

    def state_dict(self) -> dict[str, Any]:
        """Exact state (tensors kept as tensors) so that epoch means after a resume are bitwise equal."""
        return {"stage": self.stage, "prog_bar": sorted(self.prog_bar), "series": {
            k: {"pending": list(s.pending), "weights": list(s.weight_list()), "unit": s.unit,
                "total": s.total, "weight": s.weight, "options": dataclasses.asdict(s.options),
                "names": [s.step_name, s.epoch_name], "hidden": s.hidden}
            for k, s in self.series.items() if isinstance(s, _Series)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prog_bar = set(state["prog_bar"])
        self.series.clear()
        for key, saved in state["series"].items():
            if "options" in saved:
                options, names = LogOptions(**saved["options"]), tuple(saved["names"])
            else:  # saved before self.log had options: the loss, and "key" + "key_epoch" for the others
                options, names = LEGACY, ("train/loss", "train/loss_epoch") if key == "train/loss" else (
                    key, f"{key}_epoch")
                key = LOSS if key == "train/loss" else key
            s = self.series[key] = _Series(options, key, builtin=names)
            s.builtin, s.hidden = key == LOSS, bool(saved.get("hidden", False))
            s.pending = list(saved["pending"])
            s.weights = None if all(w == 1.0 for w in saved["weights"]) else list(saved["weights"])
            s.unit = saved.get("unit")
            s.total, s.weight = saved["total"], saved["weight"]
            if self.buffer is not None and not s.builtin:
                self.buffer.register(options, s.step_name, s.epoch_name, {s.step_name, s.epoch_name} - {None})


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
        self.prog_bar: set[str] = set()  # published names logged with prog_bar=True (any stage)
        self.not_logged: set[str] = set()  # published names logged with logger=False: callbacks only
        self.aliases: dict[str, str] = {}  # "<key>_step"/"<key>_epoch" -> "<key>": callback_metrics has the latest
        self.eval_step_names: set[str] = set()  # the last evaluation pass's on_step names (not in its result)
        self.train = LogBook("train", self)
        self.current = self.train
        self.new_epoch(0)

    def register(self, options: LogOptions, step_name: str | None, epoch_name: str | None, names: set[str]) -> None:
        """A logged key's published names: on the bar, kept from the loggers, aliased (books call it once per key)."""
        if options.prog_bar:
            self.prog_bar |= names
        if not options.logger:
            self.not_logged |= names
        if step_name is not None and epoch_name is not None and step_name != epoch_name:
            self.aliases[step_name] = self.aliases[epoch_name] = step_name[:-len("_step")]

    def new_epoch(self, global_step: int) -> None:
        """An empty training book; :attr:`losses` is its loss series' pending list (the loop appends to it)."""
        self.train.reset()
        self._use_loss_series(self.train.builtin_loss("train/loss", "train/loss_epoch"))
        self._checked = 0  # how many of them check_pending found finite
        self.fold_mark = (global_step, 0)

    def _use_loss_series(self, series: _Series) -> None:
        self._loss = series
        self.losses: list[Any] = series.pending  # this epoch's losses since the last log (read, not written)
        # add_loss(loss, samples): a step's detached loss, weighted by its batch's size, kept (not converted). The
        # series' own method, bound here once per epoch: the loop's one call per step for its loss.
        self.add_loss: Callable[[Any, float], None] = series.add

    def enter(self, stage: str) -> LogBook:
        """Make ``stage``'s book the one ``self.log`` writes to: the training book, or a new one per evaluation."""
        self.current = self.train if stage == "train" else LogBook(stage, self)
        return self.current

    @property
    def last_loss(self) -> Any:
        """The most recent training loss (a device tensor: reading it is a sync), or None before the first."""
        return self._loss.last

    # ---- what is published where: callbacks (state.metrics), loggers (on_log), the progress bar ---------------
    def callback_view(self, values: dict[str, float]) -> dict[str, float]:
        """``values`` plus Lightning's plain ``<key>`` for a key logged both per step and per epoch (the latest)."""
        if not self.aliases:
            return values
        named = sorted((k.endswith("_epoch"), k) for k in values if k in self.aliases)  # the epoch value wins
        return {**values, **{self.aliases[k]: values[k] for _, k in named}}

    def logger_view(self, values: dict[str, float]) -> dict[str, float]:
        """``values`` without those logged with ``logger=False`` (and without the plain aliases of callback_view)."""
        if not self.not_logged and not self.aliases:
            return values
        hidden = self.not_logged | set(self.aliases.values())
        return {k: v for k, v in values.items() if k not in hidden}

    def monitored(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """``metrics`` with this step's training values over them (tensors, as logged): what a step-interval
        ReduceLROnPlateau reads between log intervals too (its ``step`` then converts one value: a sync)."""
        step = self.train.step_values()
        return {**metrics, **step, **{self.aliases[k]: v for k, v in step.items() if k in self.aliases}}

    # ---- training: the log interval and the epoch's end ---------------------------------------------------
    def interval(self, state: TrainerState) -> dict[str, float]:
        """The latest value of every training key, as floats; raises if a loss since the last check is NaN/Inf."""
        pending = list(self.losses)  # fold empties it; kept to name a bad step
        self.train.fold()  # one stack and sum per logged key: the loss total now includes every pending loss...
        last = self.train.step_values()
        floats = stack_scalars([*last.values(), self._loss.total], self.strategy.device).tolist()  # the sync
        if self.raise_nonfinite and not math.isfinite(floats[-1]):  # ...so it is finite iff each loss is
            self._raise_nonfinite(pending, state.epoch)
        self.fold_mark = (state.global_step, state.batch_idx + 1)  # where the next pending loss is from
        self._checked = 0  # fold emptied the list
        return dict(zip(last, floats))

    @property
    def step_logged(self) -> bool:
        """A training loss or a per-step value was logged this epoch (what a log interval would publish)."""
        return bool(self.losses) or any(s.step_name is not None and s.last is not None and not s.builtin
                                         for s in self.train.series.values())

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

    def epoch_values(self, book: LogBook) -> dict[str, float]:
        """The epoch values of ``book`` (the training epoch's, or a validation/test pass's): its keys reduced over
        all ranks, its torchmetrics computed (not reset: the epoch-end hooks may read them), as floats. What is
        logged after this (in those hooks) comes from :meth:`late_values`."""
        values = self.to_floats({**self.reduce(book), **book.compute_metrics()})
        book.late = set()
        return values

    def late_values(self, book: LogBook) -> dict[str, float]:
        """The epoch values of the keys logged in the epoch-end hooks since :meth:`epoch_values` (or the last call)."""
        if not book.late:
            return {}
        keys, book.late = book.late, set()
        return self.to_floats({**self.reduce(book, keys), **book.compute_metrics(keys)})

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
    def reduce(self, book: LogBook, keys: Any = None) -> dict[str, Any]:
        """Each epoch-reduced key of ``book`` (all, or ``keys``) over all ranks, by its epoch name: "mean" (weighted
        by batch size) and "sum" in one all-reduce, "max" and "min" in one each; no host sync."""
        items = book.reducible(keys)
        out: dict[str, Any] = {}
        for group in (("mean", "sum"), ("max",), ("min",)):
            chosen = [s for _, s in items if s.options.reduce_fx in group]
            for local in (False, True):  # rank_zero_only keys are not reduced (other ranks may not log them)
                part = [s for s in chosen if s.options.rank_zero_only is local]
                if not part:
                    continue
                device = self.strategy.device
                if group[0] == "mean":
                    packed = stack_scalars([x for s in part for x in s.peek()], device)
                    packed = packed if local else self.strategy.all_reduce(packed, op="sum")
                    means = packed[0::2] / packed[1::2].clamp_min(1e-12)
                    out.update({s.epoch_name: packed[2 * i] if s.options.reduce_fx == "sum" else means[i]
                                for i, s in enumerate(part)})
                else:
                    extremes = stack_scalars([s.peek()[0] for s in part], device)
                    extremes = extremes if local else self.strategy.all_reduce(extremes, op=group[0])
                    out.update({s.epoch_name: extremes[i] for i, s in enumerate(part)})
        return out

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
        self._use_loss_series(self.train.builtin_loss("train/loss", "train/loss_epoch"))
        self._checked = 0
        self.fold_mark = tuple(state["fold_mark"])
