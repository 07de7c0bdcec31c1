"""The logging buffer: where ``self.log`` and the loop's losses go, without a host-device sync per
call.

``LogBuffer`` is what the Trainer holds: the training book of the current epoch (logbook.py; the
loop appends each step's loss to :attr:`LogBuffer.losses`), the book ``self.log`` writes to now, the
conversion to Python floats, once per interval, in one ``tolist()`` (the CPU-GPU sync point), the
epoch values reduced over ranks, and what each consumer gets: callbacks (``callback_view``), loggers
(``logger_view``), the progress bar (``prog_bar``).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..errors import NonFiniteLossError
from .book import LogBook, Series, stack_scalars
from .options import LogOptions

# taskfit's own measurements (throughput, learning rates...): callbacks publish them
VITALS = "vitals/"

if TYPE_CHECKING:
    from ..state import TrainerState
    from ..strategies.base import Strategy


class LogBuffer:
    """The Trainer's logging buffer for one run: the training book, the book ``self.log`` writes to,
    and the conversions (reduced over ddp ranks, turned into floats) at the log interval, validation
    and epoch end.

    ``fold_mark`` is the (global step, batch index) of the first loss not yet folded: it names the
    step of a NaN/Inf loss found at the next check. Everything a resume needs is in
    :meth:`state_dict`.
    """

    def __init__(self, strategy: Strategy, nonfinite_loss: str, scales_loss: bool,
                 accumulate_grad_batches: int, exact: bool = False) -> None:
        self.strategy, self.accumulate = strategy, accumulate_grad_batches
        # A task with its own training_step (a Lightning program): once it logs training values,
        # the views hold its keys only, as Lightning's (no train/loss, val/loss nor vitals/* beside
        # them; loggers keep vitals/*)
        self.exact = exact
        # the task logged a training value with self.log (this run)
        self.logged_training = False
        # With a GradScaler (16-mixed) overflowing steps are skipped by it: not an error.
        self.raise_nonfinite = nonfinite_loss == "raise" and not scales_loss
        self.prog_bar: set[str] = set()  # published names logged with prog_bar=True (any stage)
        # published names logged with logger=False: callbacks only
        self.not_logged: set[str] = set()
        # "<key>_step"/"<key>_epoch" -> "<key>": callback_metrics has the latest
        self.aliases: dict[str, str] = {}
        # the last evaluation pass's on_step names (not in its result)
        self.eval_step_names: set[str] = set()
        # the last evaluation pass's names -> the loader each was logged in (LogBook.loaders)
        self.eval_loaders: dict[str, int | None] = {}
        # every evaluation pass's on_step names: not in Lightning's callback_metrics
        self.eval_step_seen: set[str] = set()
        self.train = LogBook("train", self)
        self.current = self.train
        self.new_epoch(0)

    def register(
        self,
        options: LogOptions,
        step_name: str | None,
        epoch_name: str | None,
        names: set[str],
        stage: str = "train",
    ) -> None:
        """A logged key's published names: on the bar, kept from the loggers, aliased (books call it
        once per key)."""
        self.logged_training = self.logged_training or stage == "train"
        if options.prog_bar:
            self.prog_bar |= names
        if not options.logger:
            self.not_logged |= names
        if step_name is not None and epoch_name is not None and step_name != epoch_name:
            self.aliases[step_name] = self.aliases[epoch_name] = step_name[:-len("_step")]

    def new_epoch(self, global_step: int) -> None:
        """An empty training book; :attr:`losses` is its loss series' pending list (the loop appends
        to it)."""
        self.train.reset()
        self._use_loss_series(self.train.builtin_loss("train/loss", "train/loss_epoch"))
        self._checked = 0  # how many of them check_pending found finite
        self.fold_mark = (global_step, 0)

    def _use_loss_series(self, series: Series) -> None:
        self._loss = series
        # this epoch's losses since the last log (read, not written)
        self.losses: list[Any] = series.pending
        # add_loss(loss, samples): a step's detached loss, weighted by its batch's size, kept (not
        # converted). The series' own method, bound here once per epoch: the loop's one call per
        # step for its loss.
        self.add_loss: Callable[[Any, float], None] = series.add

    def enter(self, stage: str) -> LogBook:
        """Make ``stage``'s book the one ``self.log`` writes to: the training book, or a new one per
        evaluation."""
        self.current = self.train if stage == "train" else LogBook(stage, self)
        return self.current

    @property
    def last_loss(self) -> Any:
        """The most recent training loss (a device tensor: reading it is a sync), or None before the
        first and while the task logs its own values instead (the progress bar then shows those
        only)."""
        return None if self._loss.hidden else self._loss.last

    @property
    def own_values_only(self) -> bool:
        """The task writes its own training_step and logged training values: the views hold its keys
        only."""
        return self.exact and self.logged_training

    # ---- what is published where: callbacks (state.metrics), loggers (on_log), the progress bar --
    def callback_view(self, values: dict[str, float]) -> dict[str, float]:
        """``values`` plus Lightning's plain ``<key>`` for a key logged both per step and per epoch
        (the latest); taskfit's ``vitals/*`` only while the task does not log values of its own
        (then they go to loggers only)."""
        if self.own_values_only:
            values = {k: v for k, v in values.items() if not k.startswith(VITALS)}
        if not self.aliases:
            return values
        # the epoch value wins
        named = sorted((k.endswith("_epoch"), k) for k in values if k in self.aliases)
        return {**values, **{self.aliases[k]: values[k] for _, k in named}}

    def lightning_views(self, values: dict[str, float]) -> tuple[dict[str, float],
                                                                  dict[str, float]]:
        """Lightning's ``callback_metrics`` and ``logged_metrics`` of the published ``values``
        (``state.metrics``): the task's keys only once it logs its own training values (no
        ``vitals/*``, also those published before its first self.log), and no evaluation step
        value among the callback metrics (Lightning keeps them from the loggers only)."""
        if self.own_values_only:
            values = {k: v for k, v in values.items() if not k.startswith(VITALS)}
        logged = self.logger_view(values)
        if self.eval_step_seen:
            values = {k: v for k, v in values.items() if k not in self.eval_step_seen}
        return values, logged

    def logger_view(self, values: dict[str, float]) -> dict[str, float]:
        """``values`` without those logged with ``logger=False`` (and without the plain aliases of
        callback_view)."""
        if not self.not_logged and not self.aliases:
            return values
        hidden = self.not_logged | set(self.aliases.values())
        return {k: v for k, v in values.items() if k not in hidden}

    def monitored(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """``metrics`` with this step's training values over them (tensors, as logged): what a
        step-interval ReduceLROnPlateau reads between log intervals too (its ``step`` then converts
        one value: a sync)."""
        step = self.train.step_values()
        return {
            **metrics,
            **step,
            **{self.aliases[k]: v for k, v in step.items() if k in self.aliases},
        }

    # ---- training: the log interval and the epoch's end ------------------------------------------
    def interval(self, state: TrainerState) -> dict[str, float]:
        """The latest value of every training key, as floats; raises if a loss since the last check
        is NaN/Inf."""
        pending = list(self.losses)  # fold empties it; kept to name a bad step
        # one stack and sum per logged key: the loss total now includes every pending loss...
        self.train.fold()
        last = self.train.step_values()
        # the sync
        floats = stack_scalars([*last.values(), self._loss.total], self.strategy.device).tolist()
        # ...so it is finite iff each loss is
        if self.raise_nonfinite and not math.isfinite(floats[-1]):
            self._raise_nonfinite(pending, state.epoch)
        # where the next pending loss is from
        self.fold_mark = (state.global_step, state.batch_idx + 1)
        self._checked = 0  # fold emptied the list
        return dict(zip(last, floats))

    @property
    def step_logged(self) -> bool:
        """A training loss or a per-step value was logged this epoch (what a log interval would
        publish)."""
        return bool(self.losses) or any(
            s.step_name is not None and s.last is not None and not s.builtin
            for s in self.train.series.values()
        )

    @property
    def logged_this_epoch(self) -> bool:
        """A log interval fell in this epoch (the fold mark moved past the epoch's first batch)."""
        return self.fold_mark[1] > 0

    def check_pending(self, epoch: int) -> None:
        """Raise if a loss since the last log is NaN/Inf on any rank: one sync (and under ddp one
        all-reduce), paid before a checkpoint is written, never per step."""
        # nothing new since the last check (the
        if not self.raise_nonfinite or len(self.losses) == self._checked:
            # epoch's end, then its checkpoint): no second sync; every rank has as many losses
            return
        mine = torch.isfinite(torch.stack(self.losses)).all() if self.losses else None
        finite = bool(mine) if mine is not None else True
        # every rank must refuse the save, not only the one that saw the NaN
        if self.strategy.world_size > 1:
            flag = torch.tensor(float(finite), device=self.strategy.device)
            finite = bool(self.strategy.all_reduce(flag, op="min").item())
        if finite:
            self._checked = len(self.losses)
            return
        if mine is not None and not bool(mine):
            self._raise_nonfinite(self.losses, epoch)
        raise NonFiniteLossError(
            f"The training loss of another ddp rank is not finite (epoch {epoch}).",
            "see that rank's error; lower the learning rate or clip gradients.",
        )

    def epoch_values(self, book: LogBook) -> dict[str, float]:
        """The epoch values of ``book`` (the training epoch's, or a validation/test pass's): its
        keys reduced over all ranks, its torchmetrics computed (not reset: the epoch-end hooks may
        read them), as floats. What is logged after this (in those hooks) comes from
        :meth:`late_values`."""
        values = self.to_floats({**self.reduce(book), **book.compute_metrics()})
        book.late = set()
        return values

    def late_values(self, book: LogBook) -> dict[str, float]:
        """The epoch values of the keys logged in the epoch-end hooks since :meth:`epoch_values` (or
        the last call)."""
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
            "lower the learning rate, clip gradients (gradient_clip_val=1.0), check the data for "
            "NaN/Inf, or pass nonfinite_loss='skip' to skip such steps (costs a sync per step). "
            "Losses are checked at every log_every_n_steps, so the run may have gone on a few "
            "steps past the bad one.")

    # ---- conversions -----------------------------------------------------------------------------
    def reduce(self, book: LogBook, keys: Any = None) -> dict[str, Any]:
        """Each epoch-reduced key of ``book`` (all, or ``keys``) over all ranks, by its epoch name:
        "mean" (weighted by batch size) and "sum" in one all-reduce, "max" and "min" in one each; no
        host sync."""
        items = book.reducible(keys)
        out: dict[str, Any] = {}
        for group in (("mean", "sum"), ("max",), ("min",)):
            chosen = [s for _, s in items if s.options.reduce_fx in group]
            # rank_zero_only keys are not reduced (other ranks may not log them)
            for local in (False, True):
                part = [s for s in chosen if s.options.rank_zero_only is local]
                if not part:
                    continue
                device = self.strategy.device
                if group[0] == "mean":
                    packed = stack_scalars([x for s in part for x in s.peek()], device)
                    packed = packed if local else self.strategy.all_reduce(packed, op="sum")
                    means = packed[0::2] / packed[1::2].clamp_min(1e-12)
                    out.update(
                        {
                            s.epoch_name: packed[2 * i]
                            if s.options.reduce_fx == "sum"
                            else means[i]
                            for i, s in enumerate(part)
                        }
                    )
                else:
                    extremes = stack_scalars([s.peek()[0] for s in part], device)
                    extremes = (
                        extremes if local else self.strategy.all_reduce(extremes, op=group[0])
                    )
                    out.update({s.epoch_name: extremes[i] for i, s in enumerate(part)})
        return out

    @staticmethod
    def to_floats(values: Mapping[str, Any]) -> dict[str, float]:
        """``values`` as Python floats: every tensor converted in one ``tolist()`` (a CPU-GPU
        sync)."""
        tensors = [v for v in values.values() if isinstance(v, torch.Tensor)]
        if not tensors:
            return {k: float(v) for k, v in values.items()}
        converted = iter(stack_scalars([t.detach() for t in tensors], tensors[0].device).tolist())
        return {
            k: next(converted) if isinstance(v, torch.Tensor) else float(v)
            for k, v in values.items()
        }

    # ---- resume ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The training values logged so far this epoch, exactly (tensors stay tensors), and the
        fold mark."""
        book = self.train.state_dict()
        for series in book["series"].values():
            pending = series["pending"]
            alike = pending and all(isinstance(v, torch.Tensor) for v in pending) \
                and len({(v.dtype, v.shape, v.device) for v in pending}) == 1
            if alike:
                # One tensor in the file instead of one per value (each costs the pickler ~20
                # objects); bits unchanged.
                series["pending"] = torch.stack([v.detach() for v in pending])
            else:  # logged tensors may be views of large tensors: save only their own values
                series["pending"] = [
                    v.detach().clone() if isinstance(v, torch.Tensor) else v for v in pending
                ]
            if isinstance(series["total"], torch.Tensor):
                series["total"] = series["total"].detach().clone()
        return {"book": book, "fold_mark": list(self.fold_mark)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a partial epoch (its values go back to the device they were logged on), or, with
        no book (the epoch was saved complete), start the next one at ``fold_mark``."""
        if state["book"] is None:
            self.new_epoch(state["fold_mark"][0])
            return
        device = self.strategy.device
        book = state["book"]
        for series in book["series"].values():
            pending = series["pending"]
            series["pending"] = (
                list(pending.to(device).unbind())
                if isinstance(pending, torch.Tensor)
                else [v.to(device) if isinstance(v, torch.Tensor) else v for v in pending]
            )
            if isinstance(series["total"], torch.Tensor):
                series["total"] = series["total"].to(device)
        self.train.load_state_dict(book)
        self._use_loss_series(self.train.builtin_loss("train/loss", "train/loss_epoch"))
        self._checked = 0
        self.fold_mark = tuple(state["fold_mark"])
