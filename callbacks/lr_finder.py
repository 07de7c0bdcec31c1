"""The learning-rate range test: ``lr_find(trainer, task)`` (Lightning's
``Tuner(trainer).lr_find(model)``), and the :class:`LearningRateFinder` callback that runs it at the
start of a fit (or when a subclass says) and then trains with the lr it found.

A short fit of ``num_training`` optimizer steps whose learning rate rises from ``min_lr`` to
``max_lr`` (exponentially or linearly), with every setting of ``trainer`` that changes a step
(strategy, precision, accumulation, clipping, seed) and none of its callbacks. The loss of each step
(the mean over ranks) is smoothed as Lightning smooths it, and the suggestion is the lr of the
steepest descent of that curve. Afterwards the task's weights and buffers, every RNG, and any
optimizer or scheduler the task keeps between fits are put back exactly, so a fit after ``lr_find``
is bit for bit the fit without it. The curve goes to a PNG file, TensorBoard (Images and Scalars)
and a JSON file in ``<default_root_dir>/lr_find/version_N``. docs/tuning.md has the details.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..callback import Callback
from ..checkpoint.rng import rng_state, set_rng_state
from ..console import echo
from ..errors import MisconfigurationError, MissingAttributeError, NonFiniteLossError
from ..logs.outputs import next_version_dir
from .progress import REFRESH_S, ProgressBar

_SEED_ENV = "TASKFIT_SEED"


class LRFinder:
    """What :func:`lr_find` returns: ``results`` (``{"lr": [...], "loss": [...]}``, the smoothed
    losses, as Lightning's ``_LRFinder``), the raw per-step losses, :meth:`suggestion`, :meth:`plot`
    (matplotlib) and where the curve was written (``output_dir``, ``png_path``)."""

    def __init__(
        self, mode: str, lr_min: float, lr_max: float, num_training: int, results: Mapping[str, Any]
    ) -> None:
        self.mode, self.lr_min, self.lr_max, self.num_training = mode, lr_min, lr_max, num_training
        self.results = {"lr": list(results["lr"]), "loss": list(results["loss"])}
        self.raw_losses: list[float] = list(results["raw"])
        self.stopped_early: bool = bool(results["stopped_early"])
        self.output_dir: str | None = None
        self.png_path: str | None = None
        self._optimal_idx: int | None = None

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The lr where the smoothed loss falls fastest (the most negative ``torch.gradient`` of the
        loss, as Lightning's ``_LRFinder.suggestion``), leaving out the first ``skip_begin`` and
        last ``skip_end`` points; None with fewer than 2 finite points left. In exponential mode the
        gradient is taken over log10(lr), the scale the points are evenly spaced on (Lightning PR
        #21171): over lr itself, the noise between the tiny lrs at the start outweighs the real
        descent."""
        lrs = torch.tensor(self.results["lr"][skip_begin:-skip_end], dtype=torch.float64)
        if self.mode == "exponential":
            lrs = torch.log10(lrs)
        losses = torch.tensor(self.results["loss"][skip_begin:-skip_end], dtype=torch.float64)
        finite = torch.isfinite(losses)
        if int(finite.sum()) < 2:
            self._optimal_idx = None
            return None
        gradients = torch.gradient(losses[finite], spacing=[lrs[finite]])[0]
        kept = torch.arange(len(self.results["loss"]))[skip_begin:-skip_end][finite]
        self._optimal_idx = int(kept[int(torch.argmin(gradients))])
        return self.results["lr"][self._optimal_idx]

    def figure(self) -> Any:
        """The curve as a ``PIL.Image`` (smoothed loss against lr, the suggestion marked): what the
        PNG holds."""
        from ..logs.figures import line_chart

        lr = self.suggestion()
        losses = [v for v in self.results["loss"] if math.isfinite(v)]
        lowest = losses.index(min(losses)) if losses else 0
        # the divergent tail is cut a quarter above the descent
        top = max(losses[:lowest + 1], default=None)
        return line_chart(
            self.results["lr"],
            self.results["loss"],
            log_x=self.mode == "exponential",
            y_max=None if top is None else top + 0.25 * (top - losses[lowest]),
            title="learning-rate finder" + (f": suggested lr {lr:.3g}" if lr else ""),
            xlabel="learning rate" + (" (log scale)" if self.mode == "exponential" else ""),
            ylabel="loss",
            mark=self._optimal_idx,
            mark_label=f"{lr:.3g}" if lr else "",
        )

    def plot(self, suggest: bool = False, show: bool = False, ax: Any = None) -> Any:
        """Lightning's ``plot``: the curve on matplotlib axes (``ax``, or a new figure, returned).
        Needs matplotlib, which taskfit does not install; the PNG file and TensorBoard's image need
        only Pillow."""
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            raise MisconfigurationError("LRFinder.plot() draws with matplotlib, which is not "
                                        "installed.",
                                        "pip install matplotlib, or open the PNG the finder wrote "
                                        "(finder.png_path) or TensorBoard's Images tab.") from None
        fig = ax.figure if ax is not None else None
        if ax is None:
            fig, ax = plt.subplots()
        ax.plot(self.results["lr"], self.results["loss"])
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest and self.suggestion() is not None:
            ax.plot(
                self.results["lr"][self._optimal_idx],
                self.results["loss"][self._optimal_idx],
                markersize=10,
                marker="o",
                color="red",
            )
        if show:
            plt.show()
        return fig


class RangeTest(Callback):
    """The finder's only callback in its fit: sets each step's lr, records the loss (the mean over
    ranks: every rank has the same curve, so the same suggestion), stops when the smoothed loss
    exceeds ``early_stop_threshold`` times its best; keeps the optimizers' and schedulers' initial
    state to put back afterwards."""

    def __init__(self, mode: str, min_lr: float, max_lr: float, num_training: int,
                 early_stop_threshold: float | None, beta: float = 0.98,
                 stream: Any = None) -> None:
        self.mode, self.min_lr, self.max_lr, self.num_training = mode, min_lr, max_lr, num_training
        self.early_stop_threshold, self.beta = early_stop_threshold, beta
        self.stream = stream  # a terminal: the test's own bar goes there (None: no bar)
        self._bar: Any = None
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.raw: list[float] = []
        self.stopped_early = False
        self._saved: list[tuple[Any, dict[str, Any]]] = []

    def lr_at(self, i: int) -> float:
        """The lr of step ``i`` (0-based): ``min_lr`` at the first step, ``max_lr`` at step
        ``num_training - 1``."""
        r = i / max(1, self.num_training - 1)
        if self.mode == "linear":
            return self.min_lr + r * (self.max_lr - self.min_lr)
        return self.min_lr * (self.max_lr / self.min_lr) ** r

    def _set_lr(self, trainer: Any, lr: float) -> None:
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr

    def on_fit_start(self, trainer: Any, task: Any) -> None:
        if len(trainer.optimizers) != 1:
            raise MisconfigurationError(
                "lr_find varies the learning rate of one optimizer; configure_optimizers returned "
                f"{len(trainer.optimizers)}, but learning rate finder only works with single "
                "optimizer.",
                "run the finder on a task with one optimizer (Lightning's works the "
                "same way), e.g. a copy of the task whose configure_optimizers returns the one "
                "you are tuning.",
            )
        self._saved = [(o, copy.deepcopy(o.state_dict())) for o in trainer.optimizers] + [
            (c.scheduler, copy.deepcopy(c.scheduler.state_dict()))
            for c in trainer.schedulers.configs
        ]
        trainer.schedulers.pause()  # the finder alone sets the lr
        self._pending: list[torch.Tensor] = []
        self._step, self._avg, self._best = trainer.state.global_step, 0.0, math.inf
        self._set_lr(trainer, self.lr_at(0))
        if self.stream is not None and trainer.is_main:
            self._bar = _step_bar(self.stream, self.num_training)

    def on_train_batch_end(
        self, trainer: Any, task: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = (
            outputs
            if isinstance(outputs, torch.Tensor)
            else outputs.get("loss")
            if isinstance(outputs, Mapping)
            else None
        )
        # (a training_step that returned None has no loss: skipped in the group's mean)
        if isinstance(loss, torch.Tensor):
            self._pending.append(loss.detach().float())
        if trainer.state.global_step == self._step:
            return  # a micro-batch of an accumulation group: its loss joins the group's mean
        self._step = trainer.state.global_step
        i = len(self.lrs)
        self.lrs.append(self.lr_at(i))
        if not self._pending:
            # a step without a loss: a NaN point, which the suggestion leaves out (Lightning's)
            self.raw.append(math.nan)
            self.losses.append(math.nan)
            if i + 1 < self.num_training:
                self._set_lr(trainer, self.lr_at(i + 1))
            return
        mean = torch.stack([t.to(trainer.strategy.device) for t in self._pending]).mean()
        self._pending = []
        # a sync per step: a short diagnostic run
        value = float(trainer.strategy.all_reduce(mean, op="mean"))
        self.raw.append(value)
        self._avg = self.beta * self._avg + (1 - self.beta) * value
        # bias-corrected: the first point is the first loss
        smoothed = self._avg / (1 - self.beta ** (i + 1))
        self.losses.append(smoothed)
        diverged = not math.isfinite(smoothed) or (
            self.early_stop_threshold is not None
            and i > 0
            and smoothed > self.early_stop_threshold * self._best
        )
        self._best = min(self._best, smoothed)
        if self._bar is not None:  # (the value is on the host already: the bar adds no sync)
            self._bar.set_postfix_str(f"lr={self.lrs[-1]:.3g}, loss={smoothed:.4g}", refresh=False)
            self._bar.update()
        if diverged:
            self.stopped_early = trainer.state.should_stop = True
        elif i + 1 < self.num_training:
            self._set_lr(trainer, self.lr_at(i + 1))

    def on_fit_end(self, trainer: Any, task: Any) -> None:
        self.close_bar()

    def on_exception(self, trainer: Any, task: Any, exception: BaseException) -> None:
        self.close_bar()

    def close_bar(self) -> None:
        """The bar stays on the terminal, saying where the test stopped and why."""
        bar, self._bar = self._bar, None
        if bar is not None:
            if self.stopped_early:
                bar.set_description("lr_find (stopped: the loss diverged)", refresh=False)
            bar.close()

    def restore_optimizers(self) -> None:
        """Optimizers and schedulers the task keeps between fits (built once, returned by every
        configure_optimizers call) are as they were before the finder's first step."""
        for obj, state in self._saved:
            obj.load_state_dict(state)

    def results(self) -> dict[str, Any]:
        return {
            "lr": self.lrs,
            "loss": self.losses,
            "raw": self.raw,
            "stopped_early": self.stopped_early,
        }


def _step_bar(stream: Any, total: int) -> Any:
    """The range test's bar: its steps, the current lr and smoothed loss (tqdm.auto: in a notebook,
    a widget)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="lr_find", unit="step", file=stream, dynamic_ncols=True,
                mininterval=REFRESH_S)


def _range_test(inner: Any, task: Any, test: RangeTest, data: dict[str, Any]) -> dict[str, Any]:
    """The finder's fit, on every rank (a module-level function: ddp workers unpickle it by
    reference)."""
    # a spawned ddp worker joins its group: the fit then runs here, not again
    inner.strategy.setup_environment()
    try:
        inner.fit(task, **data)
    # the loss diverged to NaN/Inf past the last point the finder recorded
    except NonFiniteLossError:
        if not test.stopped_early:
            raise
    finally:
        test.restore_optimizers()
    results = test.results()
    # the curves are built from reduced losses: every rank's suggestion agrees
    if inner.strategy.world_size > 1:
        curves = inner.strategy.all_gather_object(results["loss"])
        results["ranks_agree"] = all(c == curves[0] for c in curves)
    return results


def lr_find(
    trainer: Any,
    task: Any,
    min_lr: float = 1e-8,
    max_lr: float = 1.0,
    num_training: int = 100,
    mode: str = "exponential",
    early_stop_threshold: float | None = 4.0,
    update_attr: bool = False,
    attr_name: str = "",
    output_dir: str | None = None,
    *,
    train_dataloaders: Any = None,
    val_dataloaders: Any = None,
    datamodule: Any = None,
    weights_only: bool | None = None,
) -> LRFinder | None:
    """Run a learning-rate range test on ``task`` with ``trainer``'s settings; ``task`` is left
    exactly as it was.

    Args:
        trainer: the Trainer whose strategy, precision, accumulation, clipping and seed the test
            uses.
        task: the TaskModule; its weights, buffers and the RNGs are restored afterwards.
        min_lr: the lr of the first step.
        max_lr: the lr of step ``num_training`` (the last).
        num_training: optimizer steps to take (the curve's points).
        mode: ``"exponential"`` (evenly spaced on a log scale) or ``"linear"``.
        early_stop_threshold: stop once the smoothed loss exceeds this many times its lowest value
            (None: never).
        update_attr: set the suggestion on the task: its ``lr``/``learning_rate`` attribute (or
            ``attr_name``), the entry of that name in ``task.hparams`` (Lightning's
            ``self.hparams.lr``), and the ``lr`` of its ``optimizer=`` factory, so that the next fit
            uses it.
        attr_name: the attribute to set with ``update_attr`` (default: ``lr`` or ``learning_rate``).
        output_dir: where the PNG, the TensorBoard event file and the JSON go (None:
            ``<default_root_dir>/lr_find/version_N``).
        train_dataloaders: the training data, as ``fit`` takes it (default: the task's).
        val_dataloaders: the validation data, as ``fit`` takes it (unused: the test does not
            validate).
        datamodule: a DataModule to take the data from, as ``fit`` takes it.
        weights_only: Lightning's (how its finder reloads the checkpoint it saved first); taskfit's
            keeps the task's state in memory and loads no file, so any value does the same.

    Returns:
        An :class:`LRFinder`; None under ``fast_dev_run`` (as Lightning).
    """
    _check(min_lr, max_lr, num_training, mode, early_stop_threshold)
    if trainer.fast_dev_run:
        warnings.warn("Skipping learning rate finder since `fast_dev_run` is enabled. HINT: "
                      "build a Trainer without fast_dev_run for lr_find.", UserWarning,
                      stacklevel=2)
        return None
    if update_attr:
        _lr_target(task, attr_name)  # before the work: a task without an lr to set fails now
    weights = {k: v.detach().clone() for k, v in task.state_dict().items()}
    modes, rng, seed_env = (
        [m.training for m in task.modules()],
        rng_state(),
        os.environ.get(_SEED_ENV),
    )
    test = RangeTest(mode, min_lr, max_lr, num_training, early_stop_threshold,
                     stream=_bar_stream(trainer))
    inner = _finder_trainer(trainer, test, num_training)
    started = time.perf_counter()
    try:
        data = {
            "train_dataloaders": train_dataloaders,
            "val_dataloaders": val_dataloaders,
            "datamodule": datamodule,
        }
        results = trainer.strategy.launch(_range_test, inner, task, test, data)
    finally:  # put back everything the test changed, in this process
        trainer.strategy.load_module_state_dict(task, weights)
        for module, training in zip(task.modules(), modes):
            module.training = training
        if seed_env is None:
            os.environ.pop(_SEED_ENV, None)
        else:
            os.environ[_SEED_ENV] = seed_env
        set_rng_state(rng)
    finder = LRFinder(mode, min_lr, max_lr, num_training, results)
    if not results.get("ranks_agree", True):
        raise RuntimeError("lr_find: the ranks' loss curves differ, although each is the mean over "
                           "all ranks")
    lr = finder.suggestion()
    if trainer.is_main:
        finder.output_dir = output_dir or next_version_dir(os.path.join(_root(trainer), "lr_find"))
        _write(finder, time.perf_counter() - started)
    if update_attr and lr is not None:
        _set_lr(task, attr_name, lr)
    elif update_attr and trainer.is_main:
        echo(f"lr_find: no suggestion from {len(finder.results['lr'])} point(s) (fewer than 2 "
             "finite losses after the first 10 and the last), so the task's learning rate is left "
             "as it was. HINT: raise num_training.", name="taskfit.tune")
    return finder


def _check(min_lr: Any, max_lr: Any, num_training: Any, mode: Any, threshold: Any) -> None:
    if mode not in ("exponential", "linear"):
        raise MisconfigurationError(
            f"lr_find(mode={mode!r}) is not valid.", 'use "exponential" or "linear".'
        )
    # min_lr > max_lr sweeps downwards, as Lightning's scheduler does
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (min_lr, max_lr))
    if not numbers or min_lr <= 0 or max_lr <= 0 or min_lr == max_lr:
        raise MisconfigurationError(
            f"lr_find(min_lr={min_lr!r}, max_lr={max_lr!r}) is not a range.",
            "pass two different positive learning rates, e.g. min_lr=1e-8, max_lr=1.",
        )
    # one step gives a curve of one point (no suggestion), as Lightning's
    if isinstance(num_training, bool) or not isinstance(num_training, int) or num_training < 1:
        raise MisconfigurationError(f"lr_find(num_training={num_training!r}) is not valid.",
                                    "pass the number of optimizer steps to try, an integer >= 1 "
                                    "(e.g. 100; a suggestion needs more than 11).")
    if threshold is not None and (
        isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold <= 1
    ):
        raise MisconfigurationError(f"lr_find(early_stop_threshold={threshold!r}) is not valid.",
                                    "pass a factor > 1 (e.g. 4.0: stop when the loss is 4x its "
                                    "best), or None.")


def _bar_stream(trainer: Any) -> Any:
    """Where the range test draws its bar: the terminal of ``trainer``'s progress bar (None: no bar,
    e.g. the bar is off, or its stream is a file)."""
    bar = next((cb for cb in trainer.callbacks if isinstance(cb, ProgressBar)), None)
    stream = None if bar is None else bar.stream or sys.stdout
    return stream if stream is not None and stream.isatty() else None


def _finder_trainer(trainer: Any, test: RangeTest, num_training: int) -> Any:
    """A Trainer of ``trainer``'s class with its step settings, ``test`` as its only callback (it
    draws the test's own bar, not an epoch's), nothing written, no validation."""
    train = trainer.limits["train"]
    # passed only when set: Trainer(limit_train_batches=1.0) would print Lightning's note again
    limit = {} if train == 1.0 and isinstance(train, float) else {"limit_train_batches": train}
    return type(trainer)(
        **limit,
        max_steps=num_training,
        strategy=trainer.strategy,
        precision=trainer.precision_name,
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        gradient_clip_val=trainer.gradient_clip_val,
        gradient_clip_algorithm=trainer.gradient_clip_algorithm,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=num_training + 1,
        overfit_batches=trainer.overfit_batches,
        deterministic=trainer.deterministic,
        seed=trainer.seed,
        channels_last=trainer.channels_last,
        callbacks=[test],
        default_root_dir=trainer.default_root_dir,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        preempt_signals=(),
    )


def _root(trainer: Any) -> str:
    return os.path.abspath(trainer.default_root_dir or os.path.join(os.getcwd(), "taskfit_logs"))


def _write(finder: LRFinder, seconds: float) -> None:
    """The curve as ``lr_find.png``, a TensorBoard image and scalars, and ``lr_find.json``, in
    ``output_dir``."""
    out = finder.output_dir
    os.makedirs(out, exist_ok=True)
    lr = finder.suggestion()
    with open(os.path.join(out, "lr_find.json"), "w") as fh:
        json.dump(
            {
                "suggestion": lr,
                "mode": finder.mode,
                "min_lr": finder.lr_min,
                "max_lr": finder.lr_max,
                "num_training": finder.num_training,
                "stopped_early": finder.stopped_early,
                "lr": finder.results["lr"],
                "loss": finder.results["loss"],
                "raw_loss": finder.raw_losses,
                "seconds": round(seconds, 2),
            },
            fh,
            indent=1,
        )
    try:
        image = finder.figure()
    # Pillow comes with tensorboard; without it there is no picture, the JSON still holds all
    except ImportError:
        echo("lr_find: Pillow is not installed, so no figure was drawn; the curve is in "
             f"{out}/lr_find.json. HINT: pip install pillow.", name="taskfit.tune")
        return
    finder.png_path = os.path.join(out, "lr_find.png")
    image.save(finder.png_path)
    import numpy as np
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(out)
    try:
        writer.add_image("lr_find/loss_vs_lr", np.asarray(image), 0, dataformats="HWC")
        for i, (step_lr, loss, raw) in enumerate(
            zip(finder.results["lr"], finder.results["loss"], finder.raw_losses)
        ):
            writer.add_scalar("lr_find/lr", step_lr, i)
            writer.add_scalar("lr_find/loss_smoothed", loss, i)
            writer.add_scalar("lr_find/loss", raw, i)
        writer.add_text(
            "lr_find/suggestion",
            f"suggested lr: {lr:.6g}" if lr else "no suggestion (too few points)",
        )
    finally:
        writer.close()


# ---- the suggestion into the task ----------------------------------------------------------------
def _lr_target(task: Any, attr_name: str) -> str | None:
    """The name ``update_attr`` sets, as an attribute of the task and/or an entry of its hparams
    (Lightning's ``lightning_setattr``); None: only the optimizer factory's lr. Or one clear
    error."""
    names = [attr_name] if attr_name else ["lr", "learning_rate"]
    found = next((n for n in names if hasattr(task, n) or n in task.hparams), None)
    # an AttributeError too, with Lightning's words
    if attr_name and found is None:
        raise MissingAttributeError(
            f"lr_find(attr_name={attr_name!r}): {type(task).__name__} has no such attribute: the "
            f"attribute name for the learning rate was set to {attr_name}, but could not find "
            "this as a field in `model` or `model.hparams`.",
            "name the attribute your configure_optimizers reads the learning rate from.")
    if found is None and _factory_lr(task) is None:
        raise MissingAttributeError(
            f"lr_find(update_attr=True): {type(task).__name__} has no `lr` or `learning_rate` "
            "attribute and no optimizer= factory with an lr: either `model` or `model.hparams` "
            "should have one of these fields: ('lr', 'learning_rate').",
            "set attr_name=..., or apply finder.suggestion() yourself.")
    return found


def _factory_lr(task: Any) -> float | None:
    factory = task.__dict__.get("optimizer_factory")
    return factory.keywords.get("lr") if isinstance(factory, functools.partial) else None


def _set_lr(task: Any, attr_name: str, lr: float) -> None:
    name = _lr_target(task, attr_name)
    if name is not None and hasattr(task, name):
        setattr(task, name, lr)
    # what configure_optimizers reads as self.hparams.lr
    if name is not None and name in task.hparams:
        task.hparams[name] = lr
    factory = task.__dict__.get("optimizer_factory")
    # TaskModule(optimizer=functools.partial(AdamW, lr=...)): the next fit's lr
    if _factory_lr(task) is not None:
        object.__setattr__(
            task,
            "optimizer_factory",
            functools.partial(factory.func, *factory.args, **{**factory.keywords, "lr": lr}),
        )


class LearningRateFinder(Callback):
    """Lightning's ``LearningRateFinder``: the range test of :func:`lr_find` at the start of fit,
    then the fit trains with the suggestion (``update_attr``: set on the task, as ``lr_find`` sets
    it, and in the running optimizer's parameter groups).

    The test is a fit of its own on the task (``num_training_steps`` optimizer steps, this fit's
    step settings, none of its callbacks); the task's weights, the RNGs and this fit's counters are
    as before it. To run it at other moments (fine-tuning milestones), subclass and call
    :meth:`lr_find` from another hook, e.g. ``on_train_epoch_start``. Single process: under ddp use
    :func:`lr_find` before fit. ``weights_only`` is Lightning's and does nothing here (no file is
    loaded). ``optimal_lr``: the last test's :class:`LRFinder`.
    """

    SUPPORTED_MODES = ("linear", "exponential")

    def __init__(
        self,
        min_lr: float = 1e-8,
        max_lr: float = 1,
        num_training_steps: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
        weights_only: bool | None = None,
    ) -> None:
        mode = mode.lower() if isinstance(mode, str) else mode
        _check(min_lr, max_lr, num_training_steps, mode, early_stop_threshold)
        self._min_lr, self._max_lr, self._num_training_steps = min_lr, max_lr, num_training_steps
        self._mode, self._early_stop_threshold = mode, early_stop_threshold
        self._update_attr, self._attr_name = update_attr, attr_name
        self.optimal_lr: LRFinder | None = None

    def lr_find(self, trainer: Any, task: Any) -> None:
        """Run the range test now, on the fit's data; with ``update_attr``, train on with the
        suggestion."""
        if trainer.world_size > 1:
            raise MisconfigurationError(
                "LearningRateFinder runs its range test in one process; this fit has "
                f"{trainer.world_size}.",
                "call taskfit.tools.lr_find(trainer, task, update_attr=True) before trainer.fit: "
                "it runs the test on every rank.")
        data = trainer.data
        self.optimal_lr = lr_find(
            trainer, task, self._min_lr, self._max_lr, self._num_training_steps, self._mode,
            self._early_stop_threshold, self._update_attr, self._attr_name,
            train_dataloaders=data.passed.get("train_dataloader"), datamodule=data.datamodule)
        lr = self.optimal_lr.suggestion() if self.optimal_lr is not None else None
        if self._update_attr and lr is not None:
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = lr
            echo(f"Learning rate set to {lr}", name="taskfit.tune")

    def on_fit_start(self, trainer: Any, task: Any) -> None:
        self.lr_find(trainer, task)

