"""One pass's logged values, without a host-device sync per call: ``LogBook`` (the training epoch,
or one validation/test pass) and its series, per key the step value and the epoch reduction with the
options of its first ``self.log`` (log_options.py). Values stay tensors in a pending list, folded
into a running (weighted) total only at the logging interval and at epoch end; logbuffer.py converts
them."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..errors import MisconfigurationError
from .options import LogOptions, check_same, log_options

LOSS = " loss"  # the key of the loop's own loss series (no name given to self.log can become it)
# after a name logged from an epoch-level hook: its own series, as Lightning keys each
EPOCH_HOOK = " (epoch hook)"
# value by the hook that logged it (a key logged per step in training_step and again in
# on_train_epoch_end is two) a book saved before self.log had options: name and name_epoch
LEGACY = LogOptions(on_step=True, on_epoch=True)


def stack_scalars(values: list[Any], device: torch.device) -> torch.Tensor:
    """One float32 vector on ``device`` from scalars (tensors of shape () or (1,), any dtype;
    numbers).

    One ``stack``, no host-device sync; values that already are float32 scalars on ``device`` go in
    as they are (``as_tensor`` and ``reshape`` cost two dispatches each, per value, per log).
    """
    f32 = torch.float32
    return torch.stack(
        [
            v
            if type(v) is torch.Tensor and v.dtype is f32 and v.dim() == 0 and v.device == device
            else torch.as_tensor(v, dtype=f32, device=device).reshape(())
            for v in values
        ]
    )


def _shown(value: Any, limit: int = 80) -> str:
    """``value`` as Lightning's messages show it (``str``), cut to ``limit`` characters."""
    text = str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def unloggable(name: str, value: Any) -> MisconfigurationError:
    """The error for a value ``self.log`` cannot record (None, a string, a dict, a list...):
    taskfit's words, then Lightning's (its ValueError's text: people search for it)."""
    hint = ("log `float(x)`, a 0-d tensor or a torchmetrics Metric (computed and reset once per "
            "pass).")
    kind = type(value).__name__
    if isinstance(value, dict) and any(isinstance(v, dict) for v in value.values()):
        return MisconfigurationError(f"self.log({name!r}, ...) got a {kind}; expected a scalar "
                                     f"tensor or a number. `self.log({name}, {_shown(value)})` "
                                     "was called, but nested dictionaries cannot be logged.",
                                     hint)
    return MisconfigurationError(f"self.log({name!r}, ...) got a {kind}; expected a scalar tensor "
                                 f"or a number. `self.log({name}, {_shown(value)})` was called, "
                                 f"but `{kind}` values cannot be logged.", hint)


class Series:
    """One logged key: the values since the last fold (tensors stay tensors) and the folded running
    total.

    Each value has a weight, the samples of its batch, kept relative to the first value's
    (``unit``): then every full batch weighs 1, ``weights`` stays None while all of them do (no
    list, no multiply), and only a smaller batch (the epoch's last) makes the mean a weighted one.
    ``reduce_fx`` "sum" adds the values (weight 1 each), "max"/"min" keep the running extreme.
    """

    __slots__ = (
        "pending",
        "weights",
        "unit",
        "total",
        "weight",
        "_last",
        "options",
        "step_name",
        "epoch_name",
        "builtin",
        "hidden",
    )

    def __init__(
        self,
        options: LogOptions = LEGACY,
        key: str = "",
        builtin: tuple[str | None, str | None] | None = None,
        suffix: str = "",
    ) -> None:
        self.pending: list[Any] = []
        self.weights: list[float] | None = None
        # the weight of the first value: the others are relative to it
        self.unit: float | None = None
        self.total: Any = 0.0 if options.reduce_fx in ("mean", "sum") else None
        self.weight = 0.0
        self._last: Any = None
        self.options = options
        self.step_name, self.epoch_name = (
            builtin if builtin is not None else options.names(key, suffix)
        )
        # the loop's own loss; hidden: a user's key took it
        self.builtin, self.hidden = builtin is not None, False

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
        """``(total, weight)`` as :meth:`fold` would leave them, without folding (the book is left
        unchanged)."""
        if not self.pending:
            return self.total, self.weight
        weights, fx = self.weights, self.options.reduce_fx
        if isinstance(self.pending[0], torch.Tensor):
            # one stack (and a cast, a reshape where needed) per interval, not a .float() per value
            try:
                values = torch.stack(self.pending)
                # a loss may be (1,), or float16
                if values.dtype is not torch.float32 or values.dim() != 1:
                    values = values.float().reshape(-1)
            except RuntimeError:  # values of different shapes, e.g. () and (1,)
                values = torch.stack([v.float().reshape(()) for v in self.pending])
            if fx in ("max", "min"):
                extreme = values.max() if fx == "max" else values.min()
                total = (
                    extreme
                    if self.total is None
                    else (torch.maximum if fx == "max" else torch.minimum)(
                        torch.as_tensor(self.total, device=extreme.device), extreme
                    )
                )
            elif weights is None:  # training: unweighted, no weights tensor to build
                total = self.total + values.sum()
            else:
                total = (
                    self.total
                    + (
                        values * torch.tensor(weights, dtype=values.dtype, device=values.device)
                    ).sum()
                )
        else:
            floats = [float(v) for v in self.pending]
            if fx in ("max", "min"):
                pick = max if fx == "max" else min
                total = (
                    pick(floats) if self.total is None else pick(float(self.total), pick(floats))
                )
            else:
                total = self.total + sum(v * w for v, w in zip(floats, self.weight_list()))
        return total, self.weight + (len(self.pending) if weights is None else sum(weights))


class StepSeries:
    """A key logged per step only: its latest value, nothing accumulated."""

    __slots__ = ("_last", "options", "step_name", "epoch_name", "builtin", "hidden", "pending")

    def __init__(self, options: LogOptions, key: str, suffix: str = "") -> None:
        self._last: Any = None
        self.options, self.builtin, self.hidden, self.pending = options, False, False, ()
        self.step_name, self.epoch_name = options.names(key, suffix)

    @property
    def last(self) -> Any:
        return self._last

    def add(self, value: Any, weight: float = 1.0) -> None:
        self._last = value

    def fold(self) -> None:
        pass


class LogBook:
    """One pass's logged values (the training epoch, or one validation/test pass): per key its step
    value and its epoch reduction, with the options of its first ``self.log`` (log_options.py)."""

    def __init__(self, stage: str, buffer: Any = None) -> None:
        self.stage, self.buffer = stage, buffer
        # the Trainer sets each batch's size here: epoch means are sample-weighted
        self.weight = 1.0
        # the evaluation batch being logged (an error names it: loop/user_errors.py)
        self.batch_idx = 0
        self.dataloader_idx: int | None = None  # the loader being evaluated, when there are several
        self.series: dict[str, Any] = {}  # key -> Series / StepSeries
        self.prog_bar: set[str] = set()  # published names shown on the progress bar
        # key -> (Metric, epoch name): computed per pass
        self.metric_objects: dict[str, tuple[Any, str | None]] = {}
        # an epoch-level hook is running: self.log defaults to on_epoch (Lightning)
        self.epoch_level = False
        # keys logged after the pass's values were computed (its epoch-end hooks)
        self.late: set[str] | None = None
        # published name -> the loader it was first logged in (None: none, an epoch-end hook):
        # each loader's validate/test result holds its own keys, as Lightning's
        self.loaders: dict[str, int | None] = {}

    @property
    def suffix(self) -> str:
        """``/dataloader_idx_<i>`` while loader ``i`` of several is evaluated (Lightning's names),
        else ``""``."""
        return "" if self.dataloader_idx is None else f"/dataloader_idx_{self.dataloader_idx}"

    def log(self, name: str, value: Any, add_dataloader_idx: bool = True, **options: Any) -> None:
        """``self.log(name, value, ...)``: checked, then kept as a tensor (no sync) under its
        options. The name is published as given (Lightning's meaning): ``"val_loss"`` stays
        ``val_loss``; ``"val/acc"`` groups it."""
        epoch_hook = self.epoch_level or self.late is not None
        # the loader's suffix goes after _step/_epoch, as Lightning's names
        base, suffix = name, self.suffix if add_dataloader_idx else ""
        if add_dataloader_idx:
            if "/dataloader_idx_" in name:
                raise MisconfigurationError(
                    f"You called `self.log` with the key `{name}` but it should not contain "
                    "information about `dataloader_idx` when `add_dataloader_idx=True`.",
                    "log the plain name (the loader's suffix is added when there are several), "
                    "or pass add_dataloader_idx=False to name each loader's key yourself.")
            name += self.suffix
        key = name + EPOCH_HOOK if epoch_hook else name
        batch_size = options.pop("batch_size", None)
        opts = log_options(name, self.stage, epoch_hook, **options)
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise MisconfigurationError(
                    f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; only "
                    f"scalars can be logged. `self.log({name}, {_shown(value)})` was called, but "
                    "the tensor must have a single element.",
                    "log a reduced value, e.g. `self.log(name, value.mean())`.")
            value = value.detach().reshape(())
        # a torchmetrics Metric
        elif all(hasattr(value, a) for a in ("update", "compute", "reset")):
            step_name, epoch_name = opts.names(base, suffix)
            if key not in self.metric_objects:
                self._register(opts, step_name, epoch_name)
            # computed (torchmetrics syncs ranks) once per pass
            self.metric_objects[key] = (value, epoch_name)
            # the batch's value, as Lightning logs per step
            batch_value = getattr(value, "_forward_cache", None)
            if (
                step_name is not None
                and isinstance(batch_value, torch.Tensor)
                and batch_value.numel() == 1
            ):
                series = self.series.get(key)
                if series is None:
                    series = self.series[key] = StepSeries(opts, base, suffix)
                    series.epoch_name = None  # the epoch value is the metric's compute()
                series.add(batch_value.detach().reshape(()))
            if self.late is not None:
                self.late.add(key)
            return
        elif not isinstance(value, (int, float)):
            raise unloggable(name, value)
        self.add(key, value, opts, batch_size, base, suffix)

    def add(self, key: str, value: Any, options: LogOptions, batch_size: int | None = None,
            name: str | None = None, suffix: str = "") -> None:
        """``value`` into the series of ``key``, published as ``name`` (default: the key) with the
        loader's ``suffix``."""
        series = self.series.get(key)
        if series is None:
            name = key if name is None else name
            series = self.series[key] = (
                Series(options, name, suffix=suffix) if options.on_epoch
                else StepSeries(options, name, suffix)
            )
            self._register(options, series.step_name, series.epoch_name)
        else:
            if series.options is not options:
                check_same(name + suffix if name else key, series.options, options,
                           self.where(key))
            if self.dataloader_idx is not None and not suffix:
                # one name from several loaders (add_dataloader_idx=False): every loader's result
                for published in (series.step_name, series.epoch_name):
                    if self.loaders.get(published) not in (None, self.dataloader_idx):
                        self.loaders[published] = None
        series.add(
            value,
            1.0
            if options.reduce_fx == "sum"
            else self.weight
            if batch_size is None
            else batch_size,
        )
        if self.late is not None:
            self.late.add(key)

    def where(self, key: str) -> str:
        """The pass a key is logged in, as Lightning's messages name its hook."""
        if key.endswith(EPOCH_HOOK):
            return "an epoch-level hook"
        return {"train": "training_step", "val": "validation_step", "sanity": "validation_step",
                "test": "test_step"}.get(self.stage, self.stage)

    def _register(self, options: LogOptions, step_name: str | None, epoch_name: str | None) -> None:
        """A new key: its names claim a built-in one (the loss: never mixed), the bar, the loggers,
        the alias."""
        names = {step_name, epoch_name} - {None}
        for name in names:
            self.loaders.setdefault(name, self.dataloader_idx)
        builtin = self.series.get(LOSS + self.suffix)
        if builtin is not None and (names & {builtin.step_name, builtin.epoch_name} or self._exact):
            # the user's self.log of the loss key (or, exact, of any key) replaces the loss
            builtin.hidden = True
        if options.prog_bar:
            self.prog_bar |= names
        if self.buffer is not None:
            self.buffer.register(options, step_name, epoch_name, names, self.stage)

    @property
    def _exact(self) -> bool:
        """The task's keys only (LogBuffer.exact): a key it logs hides the built-in loss of this
        pass."""
        return self.buffer is not None and self.buffer.exact

    def builtin_loss(self, step_name: str | None, epoch_name: str) -> Series:
        """The loop's own loss series (``train/loss``, ``train/loss_epoch``; ``val/loss``, per
        loader ``val/loss/dataloader_idx_<i>``): a user's self.log of one of its names hides it."""
        key = LOSS + self.suffix
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = Series(
                LogOptions(True, True), builtin=(step_name, epoch_name)
            )
            series.hidden = any(
                name in (step_name, epoch_name) or self._exact
                for s in self.series.values()
                if not s.builtin
                for name in (s.step_name, s.epoch_name)
            ) or (self.stage == "train" and self.buffer is not None and self.buffer.own_values_only)
        return series

    def fold(self) -> None:
        for series in self.series.values():
            series.fold()

    def step_values(self) -> dict[str, Any]:
        """The most recent value of each key logged per step, by its published name (still
        tensors)."""
        return {s.step_name: s.last for s in self.series.values()
                if s.step_name is not None and not s.hidden and s.last is not None}

    def reducible(self, keys: Any = None) -> list[tuple[str, Series]]:
        """``(key, series)`` of the epoch-reduced keys (all, or those in ``keys``), sorted: the same
        on every rank."""
        return sorted(
            (k, s)
            for k, s in self.series.items()
            if s.epoch_name is not None
            and not s.hidden
            and (s.pending or s.weight)
            and (keys is None or k in keys)
        )

    def reset(self) -> None:
        self.series.clear()
        self.metric_objects.clear()
        self.loaders.clear()
        self.late = None

    def compute_metrics(self, keys: Any = None) -> dict[str, Any]:
        """The torchmetrics objects logged per epoch in this book (all, or those in ``keys``),
        computed (torchmetrics syncs ranks); reset by :meth:`reset_metrics`, after the epoch-end
        hooks read them."""
        return {
            epoch_name: metric.compute()
            for key, (metric, epoch_name) in self.metric_objects.items()
            if epoch_name is not None and (keys is None or key in keys)
        }

    def reset_metrics(self) -> None:
        for metric, _ in self.metric_objects.values():
            metric.reset()

    def state_dict(self) -> dict[str, Any]:
        """Exact state (tensors kept as tensors) so that epoch means after a resume are bitwise
        equal."""
        return {"stage": self.stage, "prog_bar": sorted(self.prog_bar), "series": {
            k: {"pending": list(s.pending), "weights": list(s.weight_list()), "unit": s.unit,
                "total": s.total, "weight": s.weight, "options": dataclasses.asdict(s.options),
                "names": [s.step_name, s.epoch_name], "hidden": s.hidden}
            for k, s in self.series.items() if isinstance(s, Series)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prog_bar = set(state["prog_bar"])
        self.series.clear()
        for key, saved in state["series"].items():
            if "options" in saved:
                options, names = LogOptions(**saved["options"]), tuple(saved["names"])
            # saved before self.log had options: the loss, and "key" + "key_epoch" for the others
            else:
                options, names = (
                    LEGACY,
                    ("train/loss", "train/loss_epoch")
                    if key == "train/loss"
                    else (key, f"{key}_epoch"),
                )
                key = LOSS if key == "train/loss" else key
            s = self.series[key] = Series(options, key, builtin=names)
            s.builtin, s.hidden = key == LOSS, bool(saved.get("hidden", False))
            s.pending = list(saved["pending"])
            s.weights = None if all(w == 1.0 for w in saved["weights"]) else list(saved["weights"])
            s.unit = saved.get("unit")
            s.total, s.weight = saved["total"], saved["weight"]
            if self.buffer is not None and not s.builtin:
                self.buffer.register(
                    options,
                    s.step_name,
                    s.epoch_name,
                    {s.step_name, s.epoch_name} - {None},
                    self.stage,
                )
