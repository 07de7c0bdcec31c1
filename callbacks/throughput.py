"""ThroughputMonitor: samples/s, time per batch, the share of it spent waiting for data, epoch time,
peak memory.

No per-batch hook: the Trainer times the DataLoader itself (``trainer.state.data_wait_s``, a
``perf_counter`` around each ``next(batch)``, creating the iterator included), and this callback
reads the clock only when the Trainer logs (every ``log_every_n_steps``) and at epoch ends. The time
of a window is the wall time of its batches and of the loop around them, less validation run inside
the epoch; never a device sync. On a GPU the host runs ahead of the device, but the Trainer syncs
once per ``log_every_n_steps``, so the time of a window is the true wall time, and a data-bound loop
shows up as data wait.
"""
from __future__ import annotations

from time import perf_counter
from typing import Any, TextIO

from ..arguments import arguments_checked
from ..callback import Callback
from ..console import echo
from ..errors import MisconfigurationError
from .lr_monitor import MONITORS

# vitals/samples_per_sec...; the whole fit's: vitals/fit/...
PERF, FIT = f"{MONITORS}/", f"{MONITORS}/fit/"
_COUNTED = ("remove it: taskfit counts samples from the training DataLoader's batch_size "
            "(all ranks together).")
_LIGHTNING_ONLY = {"batch_size_fn": _COUNTED, "length_fn": _COUNTED,
                   "window_size": "remove it: each point covers the steps since the previous "
                                  "log_every_n_steps.",
                   "available_flops": "remove it: taskfit logs samples/s, time per batch and data "
                                      "wait, not MFU.",
                   "separator": "remove it: the keys are vitals/<name> (docs/logging.md).",
                   "world_size": "remove it: the world size comes from the Trainer's strategy."}


class ThroughputMonitor(Callback):
    """Logs ``vitals/*`` at every ``log_every_n_steps`` and epoch end; prints a summary at fit end
    (rank 0).

    Added by default with the logger (``Trainer(logger=True)``). Samples are counted from the
    training DataLoader's ``batch_size`` (all ranks together); ``summary`` holds the end-of-fit
    numbers.

    Args:
        data_wait_warning: share of the time (0-1) spent waiting for data above which the summary
            says the DataLoader is the bottleneck and suggests ``num_workers``/``pin_memory``...
        min_data_wait_s: ...provided the fit waited at least this long in total (in a run of a few
            seconds, fixed costs dominate and more workers would not help).
        verbose: print the summary at fit end.
        stream: where to print (default ``sys.stdout``).
    """

    # at epoch end before ModelCheckpoint (1000): saving a checkpoint is not training time
    order = 500

    @arguments_checked(lightning=_LIGHTNING_ONLY, docs="docs/logging.md")
    def __init__(
        self,
        data_wait_warning: float = 0.3,
        min_data_wait_s: float = 1.0,
        verbose: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        if isinstance(data_wait_warning, bool) or not isinstance(data_wait_warning, (int, float)) \
                or not 0 <= data_wait_warning <= 1:
            raise MisconfigurationError(
                f"ThroughputMonitor(data_wait_warning={data_wait_warning!r}) is not valid.",
                "pass a share of the step time between 0 and 1, e.g. 0.3 (30%).",
            )
        self.data_wait_warning, self.min_data_wait_s = (
            float(data_wait_warning),
            float(min_data_wait_s),
        )
        self.verbose, self.stream = verbose, stream
        self.summary: dict[str, float] = {}

    # ---- per fit ---------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, task: Any) -> None:
        loader = trainer.train_dataloader
        self._loader_settings = (
            getattr(loader, "num_workers", None),
            getattr(loader, "pin_memory", None),
        )
        bs = getattr(loader, "batch_size", None)
        # 0: unknown (custom batch sampler): no samples/s
        self._batch_size = bs if isinstance(bs, int) else 0
        # the epoch's last, smaller batch (drop_last=False)
        self._partial_idx, self._partial = -1, 0
        try:
            per_rank = len(loader.sampler)
        except (AttributeError, TypeError):
            per_rank = None
        if (
            self._batch_size
            and per_rank
            and per_rank % self._batch_size
            and not getattr(loader, "drop_last", True)
        ):
            self._partial_idx, self._partial = (
                per_rank // self._batch_size,
                per_rank % self._batch_size,
            )
        self._world = trainer.strategy.world_size
        self._cuda = trainer.strategy.device if trainer.strategy.device.type == "cuda" else None
        if self._cuda is not None:
            import torch

            torch.cuda.reset_peak_memory_stats(self._cuda)
        # Since the last log: wall time, data wait, validation inside the epoch (s), batches, and
        # samples short of batches * batch_size (the partial batches).
        self._elapsed = self._wait = self._val = 0.0
        self._batches = self._short = 0
        # elapsed, data wait, validation inside the epoch, samples, batches
        self._total = [0.0, 0.0, 0.0, 0, 0]
        self._epochs, self._in_epoch, self._whole_epoch, self.summary = 0, False, True, {}
        self._mark(trainer)
        self._t_val = self._t_epoch = self._t_mark

    def _mark(self, trainer: Any) -> None:
        """Start the next window here: the clock, the Trainer's data wait and its batches done so
        far."""
        st = trainer.state
        self._t_mark, self._wait_mark, self._batches_mark = (
            perf_counter(),
            st.data_wait_s,
            st.batches_done,
        )

    def _take(self, trainer: Any, batches_done: int) -> None:
        """Add what happened since the mark to the window, and move the mark here."""
        now, wait = perf_counter(), trainer.state.data_wait_s
        self._elapsed += now - self._t_mark
        self._wait += wait - self._wait_mark
        self._batches += batches_done - self._batches_mark
        self._t_mark, self._wait_mark, self._batches_mark = now, wait, batches_done

    def on_train_epoch_start(self, trainer: Any, task: Any) -> None:
        # between epochs (the checkpoint after on_train_epoch_end...) is not training time
        self._mark(trainer)
        self._t_epoch, self._in_epoch = self._t_mark, True
        self._whole_epoch = trainer.state.batches_done == 0  # not an epoch resumed in its middle

    def on_validation_start(self, trainer: Any, task: Any) -> None:
        self._t_val = perf_counter()

    def on_validation_end(self, trainer: Any, task: Any) -> None:
        # Validation inside the epoch (val_check_interval) is not training time.
        if trainer.state.fn == "fit" and self._in_epoch:
            self._val += perf_counter() - self._t_val

    def on_log_interval(self, trainer: Any, task: Any) -> None:
        # called from inside the step of batch ``batch_idx``
        self._take(trainer, trainer.state.batch_idx + 1)
        values = self._rates(self._fold())
        if values:
            trainer.log_metrics(values)

    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        st = trainer.state
        self._take(trainer, st.batches_done)
        self._epochs += 1
        self._in_epoch = False
        if st.batch_idx == self._partial_idx:  # the epoch ended with its smaller last batch
            self._short += self._batch_size - self._partial
        if self._whole_epoch:  # a resumed epoch's time would be that of its rest only: not logged
            trainer.log_metrics({f"{PERF}epoch_time_s": perf_counter() - self._t_epoch})

    def on_fit_end(self, trainer: Any, task: Any) -> None:
        self._fold()
        values = self._rates(self._total)
        self.summary = {key[len(PERF):]: value for key, value in values.items()}
        self.summary.update(
            samples=self._total[3] * self._world,
            batches=self._total[4],
            epochs=self._epochs,
            train_time_s=self._total[0] - self._total[2],
            data_wait_s=self._total[1],
        )
        if values:
            trainer.log_metrics({FIT + key[len(PERF):]: value for key, value in values.items()})
        if self.verbose and trainer.is_main:
            echo(self.report(), stream=self.stream, name="taskfit.throughput")

    # ---- numbers ---------------------------------------------------------------------------------
    def _fold(self) -> list:
        """The counts since the last log, added to the totals and reset."""
        window = [
            self._elapsed,
            self._wait,
            self._val,
            self._batches * self._batch_size - self._short,
            self._batches,
        ]
        self._elapsed = self._wait = self._val = 0.0
        self._batches = self._short = 0
        for i, value in enumerate(window):
            self._total[i] += value
        return window

    def _rates(self, counts: list) -> dict[str, float]:
        elapsed, wait, val, samples, batches = counts
        elapsed -= val
        if batches == 0 or elapsed <= 0:
            return {}
        values = {
            f"{PERF}step_time_ms": 1000.0 * elapsed / batches,
            f"{PERF}data_wait_pct": 100.0 * wait / elapsed,
        }
        if samples:
            values[f"{PERF}samples_per_sec"] = samples * self._world / elapsed
        if self._cuda is not None:
            import torch

            # no device sync
            values[f"{PERF}peak_memory_gib"] = torch.cuda.max_memory_allocated(self._cuda) / 2**30
        return values

    def report(self) -> str:
        """The end-of-fit summary as text (and advice when the DataLoader is the bottleneck)."""
        s = self.summary
        if "step_time_ms" not in s:
            return "Throughput: no training batch was run."
        parts = [
            f"{s['samples_per_sec']:,.0f} samples/s" if "samples_per_sec" in s else None,
            f"{s['step_time_ms']:.3g} ms/batch",
            f"data wait {s['data_wait_pct']:.0f}% of each batch",
            f"{s['batches']:,} batches ({s['samples']:,} samples) in {s['train_time_s']:.3g} s",
            f"peak CUDA memory {s['peak_memory_gib']:.2f} GiB" if "peak_memory_gib" in s else None,
        ]
        text = "Throughput: " + " | ".join(p for p in parts if p)
        if (
            s["data_wait_pct"] > 100 * self.data_wait_warning
            and s["data_wait_s"] >= self.min_data_wait_s
        ):
            workers, pin = self._loader_settings
            text += (f"\nThroughput: the DataLoader is the bottleneck: {s['data_wait_pct']:.0f}% "
                     f"of each batch was spent waiting for data (num_workers={workers}, "
                     f"pin_memory={pin}).\n  HINT: raise DataLoader(num_workers=...) (e.g. to the "
                     "number of CPU cores), pass pin_memory=True when training on a GPU, or make "
                     "__getitem__/collate_fn cheaper (pre-process once, not per batch).")
        return text
