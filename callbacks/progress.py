"""ProgressBar: a tqdm bar on a terminal; one plain line per epoch when stdout is a file or a CI
log. Either way the epoch's line also goes to the ``taskfit`` logger (the ``taskfit`` command's
taskfit.log), the bar itself does not.

What the bar costs: one ``tqdm.update()`` per batch. Its values (the loss, the ``prog_bar`` values,
the validation metrics) are read only when tqdm redraws, at most ``REFRESH_S`` apart: the current
loss is the training step's kept tensor (``trainer.logs.last_loss``), converted then, so the bar
shows it from the first steps with one host-device sync per redraw, never one per step. The values
keep the order they first appeared in.
"""
from __future__ import annotations

import functools
import sys
import time
from typing import Any, Callable, TextIO

from ..arguments import arguments_checked
from ..callback import Callback
from ..console import echo, results_table

REFRESH_S = 0.25  # the bar and its values redraw at most this often (tqdm's mininterval)
EVAL_DELAY_S = 2.0  # a validation, test or predict pass shows a bar once it has run this long
_TITLES = {"validate": "Validation", "test": "Test", "predict": "Predict"}
_LIGHTNING_ONLY = {
    "refresh_rate": "remove it: the bar redraws at most 4 times a second whatever the step rate "
                    "(turn it off with Trainer(enable_progress_bar=False)).",
    "process_position": "remove it: taskfit draws one bar at a time, on rank 0.",
}


class ProgressBar(Callback):
    """Shows epoch, batches, it/s, the current loss and the ``prog_bar`` and validation values. Rank
    0 only.

    After ``trainer.validate()`` or ``trainer.test()`` (on a terminal or not) it prints a table of
    the pass's results. Validation, test and predict passes longer than ``EVAL_DELAY_S`` get a bar
    of their own.

    Args:
        stream: where to write (default ``sys.stdout``). A non-terminal stream gets one line per
            epoch.
        leave: keep each epoch's bar on screen.
    """

    order = 100  # after the callbacks that produce metrics

    @arguments_checked(lightning=_LIGHTNING_ONLY, docs="docs/logging.md")
    def __init__(self, stream: TextIO | None = None, leave: bool = True) -> None:
        self.stream, self.leave = stream, leave
        self._bar: Any = None
        self._eval_bar: Any = None
        self._logged: dict[str, float] = {}  # the latest published value of each key this fit
        # the keys the bar shows, in the order they first appeared (a fixed order)
        self._order: list[str] = []
        self._pass: dict[str, float] = {}  # what a validate/test pass published (its results table)
        self._interactive = False
        self._start = 0.0
        self._total: int | None = None  # the batches of the current epoch (None: unknown)
        self._trainer: Any = None  # the Trainer of the current or last run (setup)

    def setup(self, trainer: Any, task: Any, stage: str) -> None:
        self._trainer = trainer

    @property
    def trainer(self) -> Any:
        """The Trainer this bar is attached to (Lightning's ``ProgressBar.trainer``)."""
        if self._trainer is None:
            raise TypeError(f"The progress bar `{type(self).__name__}` should be attached to a "
                            "Trainer instance (it is once a fit, validate, test or predict "
                            "starts).")
        return self._trainer

    # ---- Lightning's counts (its ProgressBar's properties), for subclasses and callbacks -------
    @property
    def total_train_batches(self) -> int | float:
        """The training batches of an epoch (``limit_train_batches`` applied); with
        ``max_epochs=-1`` no more than the steps ``max_steps`` leaves; inf without a loader
        length."""
        trainer = self.trainer
        if trainer.max_epochs == -1 and trainer.max_steps:
            return min(trainer.num_train_batches, trainer.max_steps - trainer.global_step)
        return trainer.num_train_batches

    @property
    def total_val_batches(self) -> int | float:
        """The validation batches of every loader this epoch validates with; 0 in an epoch that
        does not validate (``check_val_every_n_epoch``), as Lightning's."""
        trainer = self.trainer
        schedule = trainer.val_schedule
        if schedule is None or not schedule.in_epoch(trainer.current_epoch):
            return 0
        return sum(trainer.num_val_batches)

    def _out(self) -> TextIO:
        return self.stream or sys.stdout

    def _terminal(self, trainer: Any) -> bool:
        out = self._out()
        return trainer.is_main and hasattr(out, "isatty") and out.isatty()

    def on_fit_start(self, trainer: Any, task: Any) -> None:
        self._interactive = self._terminal(trainer)
        self._logged, self._order = {}, []

    def needs_batch_hooks(self, trainer: Any) -> bool:
        return self._interactive  # a log file gets one line per epoch: nothing to do per batch

    # ---- training --------------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: Any, task: Any) -> None:
        self._start, self._total = time.perf_counter(), _epoch_total(trainer)
        if self._interactive:
            self._bar = _bar(self, trainer, total=self._total, initial=trainer.state.batches_done,
                             desc=self._desc(trainer), leave=self.leave)

    def on_train_batch_end(
        self, trainer: Any, task: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._bar is not None:
            self._bar.update()  # redraws (and reads the values) only every REFRESH_S

    def on_log(self, trainer: Any, task: Any, metrics: dict[str, float]) -> None:
        self._logged.update(metrics)  # floats already; formatted only where shown
        if trainer.state.fn in ("validate", "test"):
            self._pass.update(metrics)

    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        if not trainer.is_main:
            return
        bar, self._bar = self._bar, None
        # the bar stays on the terminal (its last redraw reads the values); the log gets a line
        if bar is not None:
            bar.close()
        from tqdm import tqdm

        done = trainer.state.batch_idx + 1
        postfix = ", ".join(f"{k}={v}" for k, v in self.values(trainer).items())
        line = tqdm.format_meter(done, self._total, time.perf_counter() - self._start,
                                 prefix=self._desc(trainer), postfix=postfix or None)
        echo(line, stream=self._out(), name="taskfit.progress", terminal=bar is None)

    def values(self, trainer: Any) -> dict[str, str]:
        """What the bar shows now, formatted: the current loss, then the ``prog_bar`` values and the
        validation metrics in the order they first appeared. Reading the loss is a sync: called when
        the bar redraws."""
        loss = trainer.logs.last_loss if trainer.state.fn == "fit" else None
        shown = {} if loss is None else {"loss": f"{float(loss):.4g}"}
        if type(self).get_metrics is not ProgressBar.get_metrics:
            # a subclass chose what the bar shows (Lightning's override point)
            custom = self.get_metrics(trainer, trainer.task)
            return {**shown, **{k: f"{v:.4g}" if isinstance(v, float) else str(v)
                                for k, v in custom.items()}}
        wanted = _shown_keys(trainer)
        self._order += [key for key in self._logged if key in wanted and key not in self._order]
        for key in self._order:
            if key in self._logged and key != "train/loss":
                shown[key[len("train/") :] if key.startswith("train/") else key] = (
                    f"{self._logged[key]:.4g}"
                )
        return shown

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        """Lightning's ``get_metrics``: ``v_num`` (the loggers' version, a string's last 4
        characters) and ``trainer.progress_bar_metrics``. A subclass that overrides it chooses what
        the bar shows beside the loss (e.g. ``items.pop("v_num", None)``)."""
        items: dict[str, Any] = {}
        versions = list(dict.fromkeys(lg.version for lg in trainer.loggers))
        version = versions[0] if len(versions) == 1 else "_".join(map(str, versions))
        if version not in ("", None):
            items["v_num"] = version[-4:] if isinstance(version, str) else version
        items.update(trainer.progress_bar_metrics)
        return items

    # ---- validation, test, predict: a bar for long passes, a table of results --------------------
    def on_validation_start(self, trainer: Any, task: Any) -> None:
        self._start_pass(trainer, "validate" if trainer.state.fn == "validate" else "fit")

    def on_test_start(self, trainer: Any, task: Any) -> None:
        self._start_pass(trainer, "test")

    def on_predict_start(self, trainer: Any, task: Any) -> None:
        self._start_pass(trainer, "predict")

    def _start_pass(self, trainer: Any, fn: str) -> None:
        self._pass = {}
        if not self._terminal(trainer):
            return
        stage = {"fit": "val", "validate": "val", "test": "test", "predict": "predict"}[fn]
        # in fit: the batches of each validation loader
        total = getattr(trainer, f"num_{stage}_batches", None)
        total = (
            sum(total)
            if isinstance(total, list) and all(isinstance(n, int) for n in total)
            else total
        )
        self._eval_bar = _bar(
            self,
            trainer,
            total=total if isinstance(total, int) else None,
            desc=_TITLES.get(fn, "Validation"),
            leave=False,
            delay=EVAL_DELAY_S,
            values=False,
        )

    def on_validation_batch_end(
        self,
        trainer: Any,
        task: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._eval_bar is not None:
            self._eval_bar.update()

    on_test_batch_end = on_predict_batch_end = on_validation_batch_end

    def _end_pass(self, trainer: Any, title: str | None) -> None:
        bar, self._eval_bar = self._eval_bar, None
        if bar is not None:
            bar.close()
        if title is not None and trainer.is_main and self._pass and trainer.run.verbose:
            echo(results_table(title, self._pass), stream=self._out(), name="taskfit.results")

    def on_validation_end(self, trainer: Any, task: Any) -> None:
        self._end_pass(trainer, "Validation" if trainer.state.fn == "validate" else None)

    def on_test_end(self, trainer: Any, task: Any) -> None:
        self._end_pass(trainer, "Test")

    def on_predict_end(self, trainer: Any, task: Any) -> None:
        self._end_pass(trainer, None)

    def on_exception(self, trainer: Any, task: Any, exception: BaseException) -> None:
        for bar in (self._bar, self._eval_bar):
            if bar is not None:
                bar.close()
        self._bar = self._eval_bar = None

    def _desc(self, trainer: Any) -> str:
        last = trainer.max_epochs
        return f"Epoch {trainer.state.epoch}" + (f"/{last - 1}" if last not in (None, -1) else "")


def _epoch_total(trainer: Any) -> int | None:
    """The batches the current epoch runs, as Lightning's bar counts them: its batches
    (``limit_train_batches`` applied), fewer when ``max_steps`` ends the fit inside it
    (``max_steps=1``: ``1/1``, not ``1/128``); None when the loader has no length."""
    total = trainer.num_train_batches
    if trainer.max_steps is not None:
        steps_left = max(0, trainer.max_steps - trainer.state.global_step)
        batches_left = steps_left * trainer.accumulate_grad_batches
        total = min(total, trainer.state.batches_done + batches_left)
    return None if total == float("inf") else int(total)


def _shown_keys(trainer: Any) -> set[str]:
    """The published keys the bar shows: ``prog_bar`` values (any stage), the validation loss and
    metrics."""
    return (
        set(trainer.progress_bar_metrics)
        | {"val/loss"}
        | {f"val/{name}" for name in trainer.metrics.get("val", {})}
    )


def _bar(progress: ProgressBar, trainer: Any, *, values: bool = True, **kwargs: Any) -> Any:
    """A tqdm bar (``tqdm.auto``: a widget in a notebook) that, when ``values``, sets its postfix
    from ``progress.values(trainer)`` each time it redraws, and only then."""
    bar = _bar_class()(file=progress._out(), dynamic_ncols=True, mininterval=REFRESH_S, **kwargs)
    if values:
        bar.shown = functools.partial(progress.values, trainer)
        bar.refresh()  # the first draw (tqdm's own came before the line above)
    return bar


@functools.lru_cache(maxsize=None)
def _bar_class() -> type:
    """``tqdm.auto.tqdm`` whose redraw first sets the postfix from ``shown()`` (imported on first
    use)."""
    from tqdm.auto import tqdm

    class Bar(tqdm):  # type: ignore[misc, valid-type]
        shown: Callable[[], dict[str, str]] | None = None

        def display(self, *args: Any, **kwargs: Any) -> Any:
            if self.shown is not None:  # (close() sets disable before its last redraw)
                self.postfix = ", ".join(f"{k}={v}" for k, v in self.shown().items()) or None
            return super().display(*args, **kwargs)

    return Bar
