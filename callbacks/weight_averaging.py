"""Weight averaging: ``EMAWeightAveraging`` (exponential moving average) and
``StochasticWeightAveraging`` (SWA), with Lightning's names, on one base class ``WeightAveraging``
(``should_update`` decides when to blend in).

The average lives beside the model (trainer/averaging.py: one copy of the weights, a shard of it per
rank under fsdp). It is swapped into the model for every validation pass in fit, so ``val/*``,
EarlyStopping and ModelCheckpoint's ranking see the averaged model, and swapped back before anything
saves. At the end of fit the task keeps the average (as Lightning's callbacks leave it), so
``trainer.test(task)``, ``trainer.predict(task)`` and the final ``last.ckpt`` use it. Checkpoints
hold what is not in the model at the time of the save, so a resumed run continues bit for bit.
docs/tuning.md, "Weight averaging", has the costs measured.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from ..arguments import arguments_checked
from ..callback import Callback
from ..console import echo
from ..errors import MisconfigurationError
from ..strategies.base import unwrap
from .averaging import AveragedWeights, AvgFn, MultiAvgFn


class WeightAveraging(Callback):
    """Keeps a running average of the model's weights, updated after every optimizer step for which
    :meth:`should_update` says yes; the average is used for validation and is what the task holds
    after fit.

    Without ``avg_fn``/``multi_avg_fn`` it is the equal average of every update (SWA's), as
    ``torch.optim.swa_utils.AveragedModel``. Subclass and override :meth:`should_update` for another
    schedule.

    Args:
        device: where the average is kept (None: beside the weights; ``"cpu"`` saves accelerator
            memory and costs a device-to-host copy of the weights per update).
        use_buffers: average the floating-point buffers too (BatchNorm's running statistics); False
            validates with the model's current buffers.
        avg_fn: ``fn(averaged, current, num_averaged) -> tensor``, per tensor
            (``torch.optim.swa_utils``'s).
        multi_avg_fn: ``fn(averaged_list, current_list, num_averaged)``, in place (e.g.
            ``get_ema_multi_avg_fn``).
        save_average: checkpoints hold the average as the model's weights (``module``; Lightning's
            layout, so that ``ckpt_path="best"`` and ``load_from_checkpoint`` give the averaged
            model) and the training weights in this callback's state; False: the other way round.
    """

    order = 800  # before ModelCheckpoint (1000): validation's swap is undone before it saves

    @arguments_checked(docs="docs/tuning.md")
    def __init__(self, device: torch.device | str | None = None, use_buffers: bool = True,
                 avg_fn: AvgFn | None = None, multi_avg_fn: MultiAvgFn | None = None,
                 save_average: bool = True) -> None:
        if avg_fn is not None and multi_avg_fn is not None:
            raise MisconfigurationError(f"{type(self).__name__}(avg_fn=..., multi_avg_fn=...) got "
                                        "both.",
                                        "pass one averaging function: avg_fn (per tensor) or "
                                        "multi_avg_fn (lists).")
        for name, fn in (("avg_fn", avg_fn), ("multi_avg_fn", multi_avg_fn)):
            if fn is not None and not callable(fn):
                raise MisconfigurationError(
                    f"{type(self).__name__}({name}={fn!r}) is not callable.",
                    "pass a function, e.g. torch.optim.swa_utils.get_ema_multi_avg_fn(0.999).",
                )
        self.device, self.use_buffers, self.avg_fn, self.multi_avg_fn = (
            device,
            use_buffers,
            avg_fn,
            multi_avg_fn,
        )
        self.save_average = save_average
        self.weights: AveragedWeights | None = None  # built at fit start
        # global step / epoch of the last update
        self.latest_update_step, self.latest_update_epoch = 0, -1
        # a checkpoint's state, applied once the model is restored
        self._pending: dict[str, Any] | None = None
        # the state at the end of fit (no collective needed after it)
        self._final: dict[str, Any] | None = None
        self._validating = False
        self._sharded = False

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Called after each optimizer step (``step_idx``: its 0-based index) and each completed
        epoch (``epoch_idx``): True blends the current weights into the average. Default: after
        every step."""
        return step_idx is not None

    def update_weight(self) -> float | None:
        """The share of the current weights in the next update (None: the equal average, or
        ``avg_fn``)."""
        return None

    # ---- fit -------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, task: Any) -> None:
        others = [
            type(cb).__name__
            for cb in trainer.callbacks
            if isinstance(cb, WeightAveraging) and cb is not self
        ]
        if others:
            raise MisconfigurationError(
                f"Trainer(callbacks=[...]) has {type(self).__name__} and {', '.join(others)}: two "
                "weight averages would both swap themselves into the model for validation.",
                "keep one weight-averaging callback per Trainer (EMA or SWA).")
        self._final, self._validating = None, False
        self._sharded = trainer.strategy.sharded_checkpoints
        self.weights = AveragedWeights(unwrap(trainer.model), self.use_buffers, self.device)
        pending, self._pending = self._pending, None
        # the module holds the checkpoint's weights by now
        if pending is not None and trainer.state.resumed:
            self.weights.load(pending)
        elif not trainer.state.resumed:
            self.latest_update_step, self.latest_update_epoch = 0, -1

    def on_train_batch_end(
        self, trainer: Any, task: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._after_step(trainer)

    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        if trainer.state.epoch_done:
            self._after_epoch(trainer)

    def _after_step(self, trainer: Any) -> None:
        step = trainer.state.global_step
        if step > self.latest_update_step and self.should_update(step_idx=step - 1):
            self._update()
            self.latest_update_step = step

    def _after_epoch(self, trainer: Any) -> None:
        epoch = trainer.state.epoch
        if epoch > self.latest_update_epoch and self.should_update(epoch_idx=epoch):
            self._update()
            self.latest_update_epoch = epoch

    def _update(self) -> None:
        self.weights.update(self.update_weight(), self.avg_fn, self.multi_avg_fn)

    def on_validation_start(self, trainer: Any, task: Any) -> None:
        if trainer.state.fn != "fit" or self.weights is None:
            return
        # Validation runs inside the batch, before on_train_batch_end (and the epoch's last one
        # before on_train_epoch_end): fold in the update due at this point first, as Lightning's
        # order has it.
        self._after_step(trainer)
        if trainer.state.batches_done >= trainer.num_train_batches:
            self._after_epoch(trainer)
        if self.weights.average is not None:
            self._validating = True
            self.weights.swap()

    def on_validation_end(self, trainer: Any, task: Any) -> None:
        if self._validating:
            self._validating = False
            self._restore_training_weights(trainer)

    def on_exception(self, trainer: Any, task: Any, exception: BaseException) -> None:
        if self._validating:  # interrupted inside validation: the task keeps its own weights
            self._validating = False
            self._restore_training_weights(trainer)

    def _restore_training_weights(self, trainer: Any) -> None:
        self._release(trainer)
        self.weights.swap()

    def _release(self, trainer: Any) -> None:
        """Under fsdp, free what evaluation gathered (the shards are what is swapped: nothing may go
        stale)."""
        if self._sharded:
            from ..strategies.fsdp import release

            release(unwrap(trainer.model))

    def on_fit_end(self, trainer: Any, task: Any) -> None:
        """The task keeps the average (Lightning's behaviour); checkpoints saved from now on hold
        the training weights in this callback's state, so that a resumed run continues with them."""
        if self.weights is None or self.weights.average is None:
            return
        self._release(trainer)
        self.weights.swap()
        self._final = self.state_dict()  # under fsdp: gathered now, on every rank
        if trainer.is_main:
            echo(f"{type(self).__name__}: the task now holds the average of {self.weights.count} "
                 "updates (validation used it too); its training weights are in the checkpoints' "
                 "callback state.",
                 name="taskfit.weight_averaging")

    # ---- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self._final is not None:
            return self._final
        # not fitted in this process (ddp's parent: what rank 0 ended with)
        if self.weights is None:
            return dict(self._pending or {})
        return {
            "latest_update_step": self.latest_update_step,
            "latest_update_epoch": self.latest_update_epoch,
            **self.weights.state(gather=self._sharded),
        }

    def on_save_checkpoint(self, trainer: Any, task: Any, checkpoint: dict[str, Any]) -> None:
        """With ``save_average``: the file's ``module`` part gets the average and this callback's
        state the training weights (``swapped``), the layout the model has after fit; a resume swaps
        them back."""
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if (
            not self.save_average
            or not state
            or state.get("weights") is None
            or state.get("swapped")
        ):
            return
        module = checkpoint["module"]
        checkpoint["callbacks"] = {**checkpoint["callbacks"], self.state_key: {
            **state, "swapped": True, "weights": self.weights.exchange(module)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.latest_update_step = int(state.get("latest_update_step", 0))
        self.latest_update_epoch = int(state.get("latest_update_epoch", -1))
        self._pending = dict(state) if "count" in state else None


class EMAWeightAveraging(WeightAveraging):
    """Exponential moving average of the weights: ``avg = decay * avg + (1 - decay) * w`` every
    ``update_every_n_steps`` optimizer steps, from ``update_starting_at_step`` and
    ``update_starting_at_epoch``.

    Args:
        device: as for :class:`WeightAveraging`.
        use_buffers: as for :class:`WeightAveraging`.
        decay: the share of the average kept at each update (0.999: an average over ~1000 updates).
        update_every_n_steps: update after every n-th optimizer step.
        update_starting_at_step: the first optimizer step (0-based) to update after (None: 0).
        update_starting_at_epoch: the first epoch (0-based) whose steps update (None: 0).
        warmup_steps: the decay rises linearly from 0 to ``decay`` over this many updates (0:
            ``decay`` from the second update on), so that an early average is not dominated by the
            initial weights.
        save_average: as for :class:`WeightAveraging`.
    """

    @arguments_checked(docs="docs/tuning.md")
    def __init__(
        self,
        device: torch.device | str | None = None,
        use_buffers: bool = True,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
        warmup_steps: int = 0,
        save_average: bool = True,
    ) -> None:
        super().__init__(device=device, use_buffers=use_buffers, save_average=save_average)
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay <= 1:
            raise MisconfigurationError(f"EMAWeightAveraging(decay={decay!r}) is not valid.",
                                        "pass the share of the average kept per update, in [0, 1], "
                                        "e.g. 0.999.")
        for name, value, low in (
            ("update_every_n_steps", update_every_n_steps, 1),
            ("warmup_steps", warmup_steps, 0),
            ("update_starting_at_step", update_starting_at_step, 0),
            ("update_starting_at_epoch", update_starting_at_epoch, 0),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < low
            ):
                raise MisconfigurationError(f"EMAWeightAveraging({name}={value!r}) is not valid.",
                                            f"pass an integer >= {low} (the starting step and "
                                            "epoch may be None).")
        self.decay, self.update_every_n_steps, self.warmup_steps = (
            float(decay),
            update_every_n_steps,
            warmup_steps,
        )
        self.update_starting_at_step, self.update_starting_at_epoch = (
            update_starting_at_step,
            update_starting_at_epoch,
        )
        self._epoch = 0

    def on_train_epoch_start(self, trainer: Any, task: Any) -> None:
        self._epoch = trainer.state.epoch

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """After steps ``update_starting_at_step``, then every ``update_every_n_steps``-th, in
        epochs from ``update_starting_at_epoch`` on; never at an epoch end."""
        if step_idx is None:
            return False
        start = self.update_starting_at_step or 0
        return step_idx >= start and (step_idx - start) % self.update_every_n_steps == 0 \
            and self._epoch >= (self.update_starting_at_epoch or 0)

    def update_weight(self) -> float:
        count = self.weights.count if self.weights is not None else 0
        decay = (
            self.decay * min(1.0, count / self.warmup_steps) if self.warmup_steps else self.decay
        )
        return 1.0 - decay


class StochasticWeightAveraging(WeightAveraging):
    """SWA (Izmailov et al., 2018), as ``torch.optim.swa_utils`` runs it: from epoch
    ``swa_epoch_start`` the learning rate anneals to ``swa_lrs`` (``SWALR``, per epoch; the task's
    own schedulers pause) and the weights at the end of every epoch enter an equal average.

    Args:
        swa_lrs: the SWA learning rate, for every parameter group (a float) or per group (a list).
        swa_epoch_start: the epoch SWA starts in: an int counts from 1 (Lightning's), a float in (0,
            1] is that fraction of ``max_epochs``.
        annealing_epochs: epochs over which the learning rate moves to ``swa_lrs``.
        annealing_strategy: ``"cos"`` or ``"linear"``.
        avg_fn: as for :class:`WeightAveraging` (None: the equal average).
        device: as for :class:`WeightAveraging`.
        use_buffers: as for :class:`WeightAveraging`; the BatchNorm statistics are averaged with the
            weights (``AveragedModel(use_buffers=True)``) rather than recomputed by an extra epoch
            as Lightning does.
        save_average: as for :class:`WeightAveraging`.
    """

    @arguments_checked(docs="docs/tuning.md")
    def __init__(
        self,
        swa_lrs: float | list[float],
        swa_epoch_start: int | float = 0.8,
        annealing_epochs: int = 10,
        annealing_strategy: str = "cos",
        avg_fn: AvgFn | None = None,
        device: torch.device | str | None = None,
        use_buffers: bool = True,
        save_average: bool = True,
    ) -> None:
        super().__init__(
            device=device, use_buffers=use_buffers, avg_fn=avg_fn, save_average=save_average
        )
        lrs = swa_lrs if isinstance(swa_lrs, (list, tuple)) else [swa_lrs]
        if not lrs or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 for v in lrs
        ):
            raise MisconfigurationError(
                f"StochasticWeightAveraging(swa_lrs={swa_lrs!r}) is not valid (Lightning's words: "
                "The `swa_lrs` should a positive float, or a list of positive floats).",
                                        "pass a positive learning rate, or a list of them (one per "
                                        "parameter group).")
        start_ok = (
            isinstance(swa_epoch_start, int)
            and not isinstance(swa_epoch_start, bool)
            and swa_epoch_start >= 1
        ) or (isinstance(swa_epoch_start, float) and 0 < swa_epoch_start <= 1)
        if not start_ok:
            raise MisconfigurationError(
                f"StochasticWeightAveraging(swa_epoch_start={swa_epoch_start!r}) is not valid "
                "(`swa_epoch_start` should be a >0 integer or a float between 0 and 1).",
                                        "pass an epoch number >= 1 or a fraction of max_epochs in "
                                        "(0, 1].")
        if annealing_strategy not in ("cos", "linear"):
            raise MisconfigurationError(
                f"StochasticWeightAveraging(annealing_strategy={annealing_strategy!r}) is not "
                "valid.",
                'use "cos" or "linear".')
        if (
            isinstance(annealing_epochs, bool)
            or not isinstance(annealing_epochs, int)
            or annealing_epochs < 0
        ):
            raise MisconfigurationError(
                f"StochasticWeightAveraging(annealing_epochs={annealing_epochs!r}) is not valid.",
                "pass a number of epochs >= 0.")
        self.swa_lrs, self.swa_epoch_start = swa_lrs, swa_epoch_start
        self.annealing_epochs, self.annealing_strategy = annealing_epochs, annealing_strategy
        self.swa_start = 0  # 0-based epoch, set at fit start
        self.scheduler: Any = None
        self._scheduler_state: dict[str, Any] | None = None

    def on_fit_start(self, trainer: Any, task: Any) -> None:
        if len(trainer.optimizers) != 1:
            raise MisconfigurationError(
                "StochasticWeightAveraging anneals the learning rate of one optimizer; this fit "
                "has "
                f"{len(trainer.optimizers)}.",
                "use it with one optimizer, or EMAWeightAveraging (no lr schedule).",
            )
        start = self.swa_epoch_start
        if isinstance(start, float):
            if trainer.max_epochs in (None, -1):
                # Lightning's words for -1: "SWA with `swa_epoch_start` as a float is not
                # supported when `max_epochs=-1`"
                raise MisconfigurationError(
                    f"StochasticWeightAveraging(swa_epoch_start={start}) is a fraction of "
                    "max_epochs, but "
                    f"Trainer(max_epochs={trainer.max_epochs}): SWA with `swa_epoch_start` as a "
                    "float is not supported without an epoch limit.",
                    "set Trainer(max_epochs=...) or give swa_epoch_start as an epoch "
                    "number (>= 1).",
                )
            start = max(1, int(trainer.max_epochs * start))  # Lightning's rounding
        self.swa_start = start - 1
        lrs = self.swa_lrs if isinstance(self.swa_lrs, (list, tuple)) else [self.swa_lrs]
        groups = len(trainer.optimizer.param_groups)
        if len(lrs) not in (1, groups):
            raise MisconfigurationError(f"StochasticWeightAveraging(swa_lrs={self.swa_lrs!r}) has "
                                        f"{len(lrs)} values for {groups} parameter "
                                        "groups.", "pass one float, or one per group.")
        if not trainer.state.resumed:
            self.scheduler, self._scheduler_state = None, None
        super().on_fit_start(trainer, task)

    def needs_batch_hooks(self, trainer: Any) -> bool:
        return False  # epoch-end updates only

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return epoch_idx is not None and epoch_idx >= self.swa_start

    def on_train_epoch_start(self, trainer: Any, task: Any) -> None:
        if trainer.state.epoch < self.swa_start:
            return
        if self.scheduler is None or self.scheduler.optimizer is not trainer.optimizer:
            from torch.optim.swa_utils import SWALR

            self.scheduler = SWALR(
                trainer.optimizer,
                swa_lr=self.swa_lrs,
                anneal_epochs=self.annealing_epochs,
                anneal_strategy=self.annealing_strategy,
            )
            lrs = self.swa_lrs if isinstance(self.swa_lrs, (list, tuple)) else [self.swa_lrs]
            groups = trainer.optimizer.param_groups
            for group, lr in zip(groups, lrs * len(groups)):
                group["initial_lr"] = lr  # as Lightning (and its swa_lr: SWALR's)
            if self._scheduler_state is not None:  # a resumed run: where the annealing was
                self.scheduler.load_state_dict(self._scheduler_state)
            if (
                trainer.is_main
                and trainer.state.epoch == self.swa_start
                and not trainer.state.batches_done
            ):
                self._announce(trainer)
        trainer.schedulers.pause()  # SWALR alone sets the lr from here

    def _announce(self, trainer: Any) -> None:
        """SWA starts: Lightning's line for the task's scheduler it replaces, and its warning for
        one that does not step once per epoch."""
        configs = list(trainer.schedulers.configs) if trainer.schedulers is not None else []
        for config in configs:
            if config.interval != "epoch" or config.frequency != 1:
                warnings.warn(f"SWA is currently only supported every epoch. Found the task's "
                              f"{type(config.scheduler).__name__} stepping every "
                              f"{config.frequency} {config.interval}(s): it pauses while SWALR "
                              "anneals the learning rate once per epoch. HINT: a scheduler "
                              "stepping per epoch, or EMAWeightAveraging.", UserWarning,
                              stacklevel=2)
        for config in configs:
            echo(f"Swapping scheduler `{type(config.scheduler).__name__}` for `SWALR`",
                 name="taskfit.weight_averaging")
        paused = f"; the task's {len(configs)} scheduler(s) pause" if configs else ""
        echo(f"StochasticWeightAveraging: from epoch {self.swa_start} (0-based) the learning rate "
             f"anneals to {self.swa_lrs} over {self.annealing_epochs} epoch(s){paused}; each "
             "epoch's "
             "final weights enter the average.", name="taskfit.weight_averaging")

    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        super().on_train_epoch_end(trainer, task)  # the epoch's final weights enter the average...
        if self.scheduler is not None and trainer.state.epoch_done:
            self.scheduler.step()  # ...then the lr moves on (torch.optim.swa_utils' order)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if state and self._final is None and self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._scheduler_state, self.scheduler = state.get("scheduler"), None
