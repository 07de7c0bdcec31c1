"""ProgressBar: a tqdm bar on a terminal; one plain line per epoch when stdout is a file or a CI log. Either way the
epoch's line also goes to the ``taskfit`` logger (the ``taskfit`` command's taskfit.log), the bar itself does not."""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from ..console import echo
from .base import Callback


class ProgressBar(Callback):
    """Shows epoch, step, it/s, the loss and the ``prog_bar`` metrics. Rank 0 only.

    Args:
        stream: where to write (default ``sys.stdout``). A non-terminal stream gets one line per epoch.
        leave: keep each epoch's bar on screen.
    """

    order = 100  # after the callbacks that produce metrics

    def __init__(self, stream: TextIO | None = None, leave: bool = True) -> None:
        self.stream, self.leave = stream, leave
        self._bar: Any = None
        self._logged: dict[str, float] = {}  # the latest value of each key logged this epoch
        self._interactive = False
        self._start = 0.0

    def _out(self) -> TextIO:
        return self.stream or sys.stdout

    def on_fit_start(self, trainer: Any, task: Any) -> None:
        out = self._out()
        self._interactive = trainer.is_main and hasattr(out, "isatty") and out.isatty()

    def needs_batch_hooks(self, trainer: Any) -> bool:
        return self._interactive  # a log file gets one line per epoch: nothing to do per batch

    def on_train_epoch_start(self, trainer: Any, task: Any) -> None:
        self._logged = {}
        self._start = time.perf_counter()
        if self._interactive:
            from tqdm.auto import tqdm

            total = trainer.num_train_batches
            self._bar = tqdm(total=None if total == float("inf") else total, initial=trainer.state.batches_done,
                             desc=self._desc(trainer), file=self._out(), leave=self.leave, dynamic_ncols=True)

    def on_train_batch_end(self, trainer: Any, task: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._bar is not None:
            self._bar.update()

    def on_log(self, trainer: Any, task: Any, metrics: dict[str, float]) -> None:
        self._logged.update(metrics)  # formatted only where shown: at tqdm's refresh, or in the epoch's line
        if self._bar is not None:  # tqdm refreshes the postfix at its own rate, not every step
            self._bar.set_postfix(self._postfix(trainer), refresh=False)

    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        if not trainer.is_main:
            return
        bar, self._bar = self._bar, None
        if bar is not None:  # the bar stays on the terminal; the log gets the epoch's line
            bar.set_postfix(self._postfix(trainer))
            bar.close()
        from tqdm import tqdm

        done = trainer.state.batch_idx + 1
        total = trainer.num_train_batches
        postfix = ", ".join(f"{k}={v}" for k, v in self._postfix(trainer).items())
        line = tqdm.format_meter(done, None if total == float("inf") else total, time.perf_counter() - self._start,
                                 prefix=self._desc(trainer), postfix=postfix or None)
        echo(line, stream=self._out(), name="taskfit.progress", terminal=bar is None)

    def _postfix(self, trainer: Any) -> dict[str, str]:
        """The step and the ``prog_bar`` values logged this epoch (validation's included), formatted."""
        # the losses, the values logged with prog_bar=True, and the validation metrics
        metrics = {f"val/{name}" for name in trainer.metrics.get("val", {})}
        shown = {"train/loss", "val/loss"} | trainer.logs.train.prog_bar | metrics
        values = {key.replace("train/", ""): f"{value:.4g}" for key, value in self._logged.items() if key in shown}
        return {"step": str(trainer.state.global_step), **values} if self._logged else values

    def on_exception(self, trainer: Any, task: Any, exception: BaseException) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _desc(self, trainer: Any) -> str:
        last = trainer.max_epochs
        return f"Epoch {trainer.state.epoch}" + (f"/{last - 1}" if last is not None else "")
