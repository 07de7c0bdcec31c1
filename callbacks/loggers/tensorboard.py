"""TensorBoardLogger: every value the Trainer publishes becomes a TensorBoard scalar;
hyperparameters go to HParams.

Cost per training step: nothing. The Trainer converts logged tensors to floats once per
``log_every_n_steps`` (its one host-device sync) and calls ``on_log``; this callback collects the
values of one step (the loss, the learning rate and the throughput arrive in separate calls) into
one event, and hands the events to ``SummaryWriter`` in one batch every ``SEND_SECS``, then flushes.
Each event handed over wakes the writer's thread, which takes the GIL from the training loop to
checksum it in pure Python: one wake-up per log interval cost a tiny model's epoch 4-6%
(docs/performance.md); one batch every 5 s costs nothing measurable. Only rank 0 creates a writer;
other ranks write no file at all.

The tags are the published keys (docs/logging.md lists them), with one exception: a test pass's
``test/*`` values are written as ``~test/*``. TensorBoard's Scalars and Time Series tabs open the
first two groups by name and collapse the rest; ``test`` sorts before ``train`` and ``val``, and its
one point per run would take the place of the curves. ``~`` sorts after every letter, as the best
values' ``~best/`` do. A resumed fit continues its run directory and hides the steps it redoes
(``SummaryWriter(purge_step=...)``).
"""
from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ...arguments import arguments_checked
from ...data.loaders import batch_to_device
from ...errors import MisconfigurationError
from ...logs.outputs import check_writable, hparams_dict, write_hparams_yaml
from .logger import Logger
from ...module import TaskModule, graph_tracing
from .tensorboard_hparams import (
    BEST,
    config_text,
    experiment,
    loggable,
    metric_order,
    session_end,
    session_start,
)

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

# The collected events go to the writer, which writes and flushes them, when the last batch is this
# old (seconds), checked at each log call and epoch end; and always when the writer closes (fit's
# end, an error, a preemption).
SEND_SECS = 5.0
# A metric whose last name part contains one of these is better when lower (used when no callback
# says).
_LOWER_IS_BETTER = ("loss", "err", "mse", "mae", "perplexity", "ppl", "time")
# a test pass's keys, and their tags: after every letter, as ~best/ sorts
TEST, TEST_TAG = "test/", "~test/"
# Lightning's TensorBoardLogger arguments (and SummaryWriter's, which it passes on) that this one
# does not take.
_LIGHTNING_ONLY = {
    "purge_step": (
        "remove it: a fit resumed from a checkpoint purges the steps it redoes by itself."),
    "comment": 'remove it: the run\'s folder is save_dir/name/version (pass version="my-run" to '
    "name it).",
}


def tag(key: str) -> str:
    """The TensorBoard tag of a published key: the key itself; ``test/x`` is ``~test/x`` (module
    docstring)."""
    return TEST_TAG + key[len(TEST):] if key.startswith(TEST) else key


def guess_mode(key: str) -> str:
    """``"min"`` for loss/error-like keys (``val/loss``, ``val/mae``), ``"max"`` otherwise
    (``val/acc``)."""
    name = key.rsplit("/", 1)[-1].lower()
    return "min" if any(word in name for word in _LOWER_IS_BETTER) else "max"


class TensorBoardLogger(Logger):
    """Writes every published value as a scalar into its run directory (x-axis:
    ``trainer.state.log_step``, the step Lightning records a value at).

    On by default (``Trainer(logger=True)``); rank 0 only. One run directory per fit:
    ``<save_dir>/<name>/version_N`` (``save_dir`` defaults to ``Trainer(default_root_dir=...)``, no
    ``name`` level unless given). A :class:`~taskfit.callbacks.Logger`: :attr:`experiment` is the
    ``SummaryWriter``.

    Args:
        save_dir: the folder of the runs (None: ``Trainer(default_root_dir=...)``,
            ``./taskfit_logs``).
        name: a folder below ``save_dir`` for this experiment's runs (None: none; Lightning's
            default is ``"lightning_logs"``).
        version: ``3`` writes ``version_3``; a string names the folder (``""``: ``save_dir/name``
            itself); None: the next free ``version_N``.
        log_graph: write the model graph once at fit start (traces
            ``task(task.example_input_array)``).
        prefix: put ``<prefix>-`` before every tag (Lightning's ``prefix``).
        sub_dir: write the event files into this folder of the run directory.
        hparam_metrics: what the HParams tab shows next to the hyperparameters. None (default):
            every ``val/*`` key, ``train/loss_epoch`` and the ``monitor`` of callbacks such as
            EarlyStopping; or a list of keys; or ``{key: "min" | "max"}``. Each metric shows its
            final value (its own tag) and its best value (the scalar ``~best/<key>``, shown as
            ``best <key>``).
        hparams: the HParams tab's hyperparameters, ``{name: value}``. None (default):
            ``trainer.hparams`` (the TaskModule's init arguments, or the Trainer's ``config=``
            flattened); the ``taskfit`` command gives the task's arguments, the keys its command
            line set and the trainer settings that change results.
        varying: the names a sweep varies. HParams lists them first and ticked, and only them: it
            ticks the first five columns it lists, so a sweep's constants would be ticked too (they
            stay in each run's config).
        tuned: names ticked first in a run that varies nothing (the ``taskfit`` command: the keys
            its command line set and the optimizer's); the other hyperparameters follow, by name.
        histogram_every_n_steps: write ``params/<name>`` and ``grads/<name>`` histograms every N
            optimizer steps (off by default: each costs a device-to-host copy of every parameter and
            gradient).
        flush_secs: ``SummaryWriter``'s: how often its thread flushes on its own. The scalars are
            handed over and flushed every ``SEND_SECS`` (5 s), at a log call or an epoch end, and
            when the writer closes: ``flush_secs`` matters for what you write through
            :attr:`experiment`.
        max_queue: ``SummaryWriter``'s queue size.
        filename_suffix: ``SummaryWriter``'s event file name suffix.
        default_hp_metric: Lightning's placeholder: ``True`` writes ``hp_metric`` = -1 when the
            hyperparameters are logged without metrics, and shows it in the HParams tab (log your
            own ``hp_metric`` to replace it). Off by default, unlike Lightning: the HParams tab
            shows each run's final and best validation metrics instead of a -1 column.
    """

    # order 900 (Logger's): after every callback that logs, so on_fit_end closes the writer last;
    # before ModelCheckpoint (1000), whose files must hold every other callback's state

    def __new__(cls, *args: Any, **kwargs: Any) -> TensorBoardLogger:
        # Gradients exist only in on_before_optimizer_step, and a callback that overrides that hook
        # costs the Trainer a call per step. Only loggers that asked for histograms get that hook.
        if cls is TensorBoardLogger and kwargs.get("histogram_every_n_steps"):
            cls = _HistogramLogger
        return super().__new__(cls)

    @arguments_checked(lightning=_LIGHTNING_ONLY, docs="docs/logging.md")
    def __init__(
        self,
        save_dir: str | None = None,
        name: str | None = None,
        version: int | str | None = None,
        log_graph: bool = False,
        *,
        prefix: str = "",
        sub_dir: str | None = None,
        hparam_metrics: Sequence[str] | Mapping[str, str] | None = None,
        hparams: Mapping[str, Any] | None = None,
        varying: Sequence[str] = (),
        tuned: Sequence[str] = (),
        histogram_every_n_steps: int | None = None,
        flush_secs: int = 120,
        max_queue: int = 10,
        filename_suffix: str = "",
        default_hp_metric: bool = False,
    ) -> None:
        self._where(save_dir, name, version, prefix)
        if not isinstance(default_hp_metric, bool):
            raise MisconfigurationError("TensorBoardLogger(default_hp_metric="
                                        f"{default_hp_metric!r}) is not valid.",
                                        "pass True (write hp_metric=-1 with the hyperparameters, "
                                        "as Lightning does) or False (taskfit's default).")
        self.default_hp_metric = default_hp_metric
        n = histogram_every_n_steps
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise MisconfigurationError(f"TensorBoardLogger(histogram_every_n_steps={n!r}) is not "
                                        "valid.",
                                        "pass a positive number of optimizer steps, or None (no "
                                        "histograms).")
        if isinstance(hparam_metrics, str):
            hparam_metrics = [hparam_metrics]
        if isinstance(hparam_metrics, Mapping):
            bad = {k: m for k, m in hparam_metrics.items() if m not in ("min", "max")}
            if bad:
                raise MisconfigurationError("TensorBoardLogger(hparam_metrics=...) has invalid "
                                            f"modes {bad}.",
                                            'give each metric "min" (lower is better) or "max".')
            modes: dict[str, str] | None = dict(hparam_metrics)
        else:
            modes = None if hparam_metrics is None else {k: guess_mode(k) for k in hparam_metrics}
        if hparams is not None and not isinstance(hparams, Mapping):
            raise MisconfigurationError(f"TensorBoardLogger(hparams={hparams!r}) is not valid.",
                                        "pass a dict {name: value} of the hyperparameters to show, "
                                        "or None (trainer.hparams).")
        for arg, keys in (("varying", varying), ("tuned", tuned)):
            if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
                raise MisconfigurationError(f"TensorBoardLogger({arg}={keys!r}) is not valid.",
                                            'pass a list of hyperparameter names, e.g. '
                                            '["task.optimizer.lr"].')
        self.hparam_metrics = modes
        self.hparams = None if hparams is None else dict(hparams)
        self.varying, self.tuned = list(varying), list(tuned)
        self.histogram_every_n_steps, self._log_graph, self.sub_dir = n, log_graph, sub_dir
        self.writer_args = {
            "flush_secs": flush_secs,
            "max_queue": max_queue,
            "filename_suffix": filename_suffix,
        }
        self._writer: SummaryWriter | None = None
        self._flushed = 0.0  # time.monotonic() of the last flush
        self._dir: str | None = None
        # a resumed fit: hide what the killed run wrote after its checkpoint
        self._purge_step: int | None = None
        self._step_values: dict[str, float] = {}  # the current step's values, not written yet
        # (values, step) of each step since the last send
        self._events: list[tuple[dict[str, float], int]] = []
        self._step = 0
        self._session_open = False  # fit wrote the HParams session start and not yet its end
        # the global step of the HParams session start (a resumed fit: its step)
        self._hparams_step = 0
        self._hparams: dict[str, Any] = {}
        self._modes: dict[str, str] = {}
        self._monitors: list[str] = []
        self._final: dict[str, float] = {}
        # keys published during validation (HParams' column order)
        self._validation_keys: set[str] = set()
        self._best: dict[str, float] = {}

    # ---- the writer ------------------------------------------------------------------------------
    @property
    def experiment(self) -> SummaryWriter | None:
        """The open ``SummaryWriter`` (rank 0, during a run), e.g. for images or text from your own
        callback; outside a run, with a ``save_dir``, one opened in :attr:`log_dir` (Lightning's use
        without a Trainer)."""
        if self._writer is None and self.open_standalone():
            self._open(self._folder(self._run_dir))
        return self._writer

    def writer(self, trainer: Any) -> SummaryWriter | None:
        """The writer of the run, opened on first use; None on ranks other than 0."""
        if not trainer.is_main or trainer.log_dir is None:
            return None
        run = self._run_dir if self._active and self._for == trainer.log_dir else trainer.log_dir
        return self._open(self._folder(run))

    def _folder(self, run: str) -> str:
        return os.path.join(run, self.sub_dir) if self.sub_dir else run

    def _open(self, folder: str) -> SummaryWriter:
        """The SummaryWriter of ``folder``: the open one, or a new one (the previous one closed)."""
        if self._writer is not None and self._dir == folder:
            return self._writer
        self._close()
        try:  # imported here, not at module import: tensorboard + protobuf take a second to load
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise MisconfigurationError(
                "TensorBoardLogger needs the `tensorboard` package, which is not installed.",
                "`pip install tensorboard`, or pass Trainer(logger=False).",
            ) from exc
        purge, self._purge_step = self._purge_step, None  # once: the resumed fit's first writer
        self._writer = SummaryWriter(log_dir=folder, purge_step=purge, **self.writer_args)
        self._dir, self._flushed = folder, time.monotonic()
        return self._writer

    def _collect(self, step: int, values: dict[str, float]) -> None:
        """Add ``values`` to the event of ``step``. One event per step holds every value (as TF1's
        merged summaries did; TensorBoard reads each scalar as if written alone); a new step, or a
        key already in it, starts the next."""
        if step != self._step or not self._step_values.keys().isdisjoint(values):
            self._end_step()
            if time.monotonic() - self._flushed >= SEND_SECS:
                self._send()
        self._step = step
        self._step_values.update(values)

    def _end_step(self) -> None:
        """The collected values of one step become one event, kept until the next :meth:`_send`."""
        if self._step_values and self._writer is not None:
            self._events.append((self._step_values, self._step))
        self._step_values = {}

    def _send(self) -> None:
        """Hand every kept event to the writer and flush (which waits while its thread writes
        them)."""
        self._end_step()
        if self._writer is not None:
            from tensorboard.compat.proto.summary_pb2 import Summary

            # the protos are built here, in one go, not at every log call
            for values, step in self._events:
                self._writer.file_writer.add_summary(
                    Summary(
                        value=[Summary.Value(tag=key, simple_value=v) for key, v in values.items()]
                    ),
                    step,
                )
            self._writer.flush()
        self._events, self._flushed = [], time.monotonic()

    def _close(self) -> None:
        if self._writer is not None:
            self._send()
            self._writer.close()  # closes the event file
            self._writer = None

    # ---- the Logger interface --------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        check_writable(self.log_dir, "TensorBoardLogger")
        self._hparams_step = trainer.state.log_step
        # events of steps after the checkpoint's were written by the killed run: hidden
        if self.resuming:
            self._purge_step = trainer.state.log_step + 1
        self.writer(trainer)

    def log_hyperparams(
        self, params: dict[str, Any] | Any = None, metrics: Any = None, step: int | None = None
    ) -> None:
        """HParams' session start: :attr:`hparams` if given, else ``params`` (a dict, an
        ``argparse.Namespace`` or None; numbers, strings, bools; anything else as text).
        ``metrics`` (Lightning's initial values: a dict, or one number for ``hp_metric``) are
        logged at ``step`` (default 0); without them, ``default_hp_metric=True`` logs
        ``hp_metric`` = -1. Outside a run, with a ``save_dir``, a run is opened."""
        if self.experiment is None:
            return
        params = hparams_dict(params)
        write_hparams_yaml(self._run_dir, params)  # Lightning's file beside the event files
        if metrics is None and self.default_hp_metric:
            metrics = {"hp_metric": -1}
        elif metrics is not None and not isinstance(metrics, Mapping):
            metrics = {"hp_metric": metrics}
        if metrics:
            self.log_metrics(dict(metrics), self._hparams_step if step is None else step)
            # its columns in the HParams tab (the fit's final values, or these)
            self._final.update({tag(k): float(v) for k, v in metrics.items()})
        self._hparams = loggable(self.hparams if self.hparams is not None else params)
        self._writer.file_writer.add_summary(session_start(self._hparams), self._hparams_step)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Values of ``step`` into its event (outside a run too: Lightning's ``step=None`` is the
        last step)."""
        if self.experiment is None:  # (the open writer, or one opened outside a run)
            return
        self._collect(
            self._step if step is None else step,
            {tag(key): float(value) for key, value in metrics.items()},
        )

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """Lightning's call: the graph of ``model`` traced on ``input_array`` (default: its
        ``example_input_array``) into the Graphs tab; a warning when there is no input to trace
        with."""
        example = (
            input_array if input_array is not None else getattr(model, "example_input_array", None)
        )
        # Lightning's warnings (no graph, and why)
        if example is None:
            warnings.warn("Could not log computational graph to TensorBoard: The "
                          "`model.example_input_array` attribute is not set or `input_array` was "
                          "not given. HINT: give input_array, or set model.example_input_array.",
                          UserWarning, stacklevel=2)
            return
        if not isinstance(example, (torch.Tensor, tuple)):
            warnings.warn("Could not log computational graph to TensorBoard: The `input_array` or "
                          f"`model.example_input_array` has type {type(example)} which can't be "
                          "traced by TensorBoard. HINT: make it a tensor, or a tuple of the "
                          "positional arguments of the model's `forward()`.",
                          UserWarning, stacklevel=2)
            return
        if self.experiment is not None:
            device = next((p.device for p in model.parameters()), None)
            _write_graph(
                self.experiment,
                model,
                example if device is None else batch_to_device(example, device),
            )

    def save(self) -> None:
        """End the pending step's event; send the events when the last send is ``SEND_SECS`` old
        (epoch ends)."""
        self._end_step()
        # epochs of a second or two: not every one waits
        if time.monotonic() - self._flushed >= SEND_SECS:
            self._send()

    def finalize(self, status: str = "success") -> None:
        self._close()

    def state_dict(self) -> dict[str, Any]:
        """The run, for a resumed fit (Logger's); what the checkpoint covers is handed to the writer
        first: a resumed fit continues the event file's curves from there (and hides what came
        after)."""
        if self._active:
            self._send()
        return super().state_dict()

    # ---- hooks -----------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, task: Any) -> None:
        example = getattr(task, "example_input_array", None) if self._log_graph else None
        if self._log_graph and example is None:  # checked on every rank, so that all of them stop
            raise MisconfigurationError(
                "TensorBoardLogger(log_graph=True) needs "
                f"{type(task).__name__}.example_input_array.",
                "set `self.example_input_array = torch.zeros(1, ...)` (one input batch, as forward "
                "takes it) in your TaskModule's __init__, or pass log_graph=False.")
        self._final, self._best, self._validation_keys = {}, {}, set()
        self._modes = {
            k: m
            for k, m in (
                (getattr(cb, "monitor", None), getattr(cb, "mode", None))
                for cb in trainer.callbacks
            )
            if isinstance(k, str) and m in ("min", "max")
        }
        self._monitors = list(self._modes)
        if self.default_hp_metric:
            # Lightning's placeholder column; a logged hp_metric replaces its -1
            self._modes.setdefault("hp_metric", "max")
        if self.hparam_metrics is not None:
            self._modes.update(self.hparam_metrics)
        super().on_fit_start(trainer, task)  # rank 0: the writer and the HParams session start
        self._session_open = True
        # the whole config, in the TEXT tab
        if trainer.config is not None and self._writer is not None:
            self._writer.add_text("config", config_text(trainer.config), self._hparams_step)
        if example is not None and self._writer is not None:
            _write_graph(self._writer, task, trainer.strategy.batch_to_device(example))

    def on_log(self, trainer: Any, task: Any, metrics: dict[str, float]) -> None:
        super().on_log(trainer, task, metrics)  # rank 0: collected into the step's event
        if trainer.state.fn == "fit" and self._writer is not None:
            validating = trainer.state.stage == "val"
            for key, value in metrics.items():
                if self._tracked(key, validating):
                    self._final[key] = value
                    if validating:
                        self._validation_keys.add(key)
                    if math.isfinite(value):
                        best = self._best.get(key)
                        better = min if self._mode(key) == "min" else max
                        self._best[key] = value if best is None else better(best, value)

    def on_validation_end(self, trainer: Any, task: Any) -> None:
        super().on_validation_end(trainer, task)
        if trainer.state.fn == "validate":  # also a writer that only summary_writer() opened
            self._close()

    def on_test_end(self, trainer: Any, task: Any) -> None:
        super().on_test_end(trainer, task)
        self._close()

    def on_fit_end(self, trainer: Any, task: Any) -> None:
        self._end_session(trainer, task, "STATUS_SUCCESS")
        super().on_fit_end(trainer, task)

    def on_exception(self, trainer: Any, task: Any, exception: BaseException) -> None:
        # an error fails the run; Ctrl-C or a preemption exit may be resumed later
        if self._session_open:
            self._end_session(trainer, task, "STATUS_FAILURE" if isinstance(exception, Exception)
                              else "STATUS_UNKNOWN")
        super().on_exception(trainer, task, exception)
        self._close()

    # ---- hyperparameters -------------------------------------------------------------------------
    def _tracked(self, key: str, validating: bool) -> bool:
        """An HParams metric: the ones given, else every validation value (named as logged), the
        training epoch loss and what a callback monitors."""
        if self.hparam_metrics is not None:
            return key in self.hparam_metrics
        return (
            validating or key.startswith("val/") or key == "train/loss_epoch" or key in self._modes
        )

    def _mode(self, key: str) -> str:
        return self._modes.get(key) or guess_mode(key)

    def _end_session(self, trainer: Any, task: Any, status: str) -> None:
        """Write ``~best/<key>``, the experiment (hparam and metric columns) and the session end,
        then close."""
        self._session_open = False
        writer = self.writer(trainer)
        if writer is None:
            return
        step = trainer.state.log_step
        self._collect(step, {f"{BEST}{key}": value for key, value in self._best.items()})
        self._send()
        names = (
            metric_order(self._final, self._monitors, self._validation_keys)
            if self.hparam_metrics is None
            else [key for key in self.hparam_metrics if key in self._final]
        )  # the order the user gave
        metrics = [
            column for key in names for column in ((key, key), (f"{BEST}{key}", f"best {key}"))
        ]
        # columns for a trainer.test that may follow, in this run
        if _defines(task, "test_dataloader"):
            metrics += [
                (tag(f"{TEST}{key[4:]}"), f"{TEST}{key[4:]}")
                for key in names
                if key.startswith("val/")
            ]
        writer.file_writer.add_summary(
            experiment(self._hparams, metrics, self.varying, self.tuned), step
        )
        writer.file_writer.add_summary(session_end(status), step)
        self._close()


class _HistogramLogger(TensorBoardLogger):
    """TensorBoardLogger with ``histogram_every_n_steps``: adds the gradient hook (see
    ``__new__``)."""

    def on_before_optimizer_step(self, trainer: Any, task: Any, optimizer: Any) -> None:
        # steps done: parameters after `step` steps, gradients taken there
        step = trainer.state.global_step
        if step % self.histogram_every_n_steps:
            return
        writer = self.writer(trainer)
        if writer is None:
            return
        # a device-to-host copy per tensor, every N steps only
        for name, param in task.named_parameters():
            writer.add_histogram(f"params/{name}", param.detach(), step)
            if param.grad is not None:
                writer.add_histogram(f"grads/{name}", param.grad.detach(), step)


def summary_writer(trainer: Any) -> SummaryWriter | None:
    """The ``SummaryWriter`` of ``trainer``'s TensorBoardLogger for your own callbacks; None on
    other ranks or when the Trainer has no logger (``logger=False``). Write at
    ``trainer.state.log_step`` (the loggers' step)."""
    for callback in trainer.callbacks:
        if isinstance(callback, TensorBoardLogger):
            return callback.writer(trainer)
    return None


def _defines(task: Any, method: str) -> bool:
    return getattr(type(task), method, None) is not getattr(TaskModule, method)


def _write_graph(writer: SummaryWriter, task: Any, inputs: Any) -> None:
    """Trace the model once on ``inputs`` (on its device; RNG state and train/eval mode are
    restored: the run is unchanged)."""
    device = next((p.device for p in task.parameters()), torch.device("cpu"))
    training = task.training
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        warnings.catch_warnings(),
    ):
        # add_graph traces with jit
        warnings.filterwarnings("ignore", "`torch.jit.trace", DeprecationWarning)
        task.eval()
        with graph_tracing():
            writer.add_graph(task, inputs)
    task.train(training)
