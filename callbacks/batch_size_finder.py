"""BatchSizeFinder: the largest batch size that runs without running out of memory (Lightning's
``BatchSizeFinder`` callback and ``Tuner.scale_batch_size``).

At ``on_fit_start`` (``on_validation_start``, ``on_test_start``, ``on_predict_start`` of those entry
points) the finder tries batch sizes, each in a short trial run of the same entry point on the same
task (``steps_per_trial`` batches, with the Trainer's strategy, precision, accumulation and
clipping: ``trainer.trial_trainer``), growing the size by doubling until a trial runs out of memory
(``"power"``), then, in ``"binsearch"`` mode, bisecting between the last size that ran and the first
that did not. The size is the attribute the task's (or data module's) ``*_dataloader()`` reads
(``batch_arg_name``, also in their ``hparams``). After the search the task's weights, the run's
optimizers and schedulers, the modules' train/eval flags and every RNG are as they were, the found
size is set on the attribute, and the run's loaders are built again with it
(``trainer.reload_dataloaders()``). docs/tuning.md has the details.
"""
from __future__ import annotations

import copy
import gc
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import IterableDataset

from ..callback import Callback, StopRun
from ..checkpoint.rng import rng_state, set_rng_state
from ..console import echo
from ..errors import MisconfigurationError

MODES = ("power", "binsearch")
METHODS = ("fit", "validate", "test", "predict")
_SEED_ENV = "TASKFIT_SEED"
# the loader a trial of each entry point reads, by Trainer property (Lightning's names)
_LOADERS = {"fit": "train_dataloader", "validate": "val_dataloaders", "test": "test_dataloaders",
            "predict": "predict_dataloaders"}
DISTRIBUTED_HINT = ("search in one process (devices=1), then run the distributed fit with the size "
                    "found (a per-process batch size).")
# the DataSource method of the loader each entry point's search sizes
_METHODS = {"fit": "train_dataloader", "validate": "val_dataloader", "test": "test_dataloader",
            "predict": "predict_dataloader"}
_PREFIX = {"fit": "train", "validate": "val", "test": "test", "predict": "predict"}
# messages that mean "out of memory" (CUDA, the CPU allocator; cuDNN's when memory is short)
_OOM_TEXTS = ("out of memory", "can't allocate memory", "CUDNN_STATUS_NOT_SUPPORTED")


def is_oom_error(exception: BaseException) -> bool:
    """``exception`` says the device (or the host) ran out of memory: torch's
    ``OutOfMemoryError``, or a RuntimeError whose message says so ("CUDA out of memory", "CUDA
    error: out of memory", the CPU allocator's "can't allocate memory"), as Lightning's."""
    oom_class = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError")
    if isinstance(exception, oom_class):
        return True
    if not isinstance(exception, RuntimeError) or not exception.args:
        return False
    message = str(exception.args[0])
    return any(text in message for text in _OOM_TEXTS)


def free_memory() -> None:
    """What a failed trial left: Python's garbage and the CUDA allocator's cached blocks."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def search(
    trial: Callable[[int], bool],
    *,
    mode: str,
    init_val: int,
    max_trials: int,
    max_val: int,
    margin: float,
    data_length: int | None,
    say: Callable[[str], None],
) -> int:
    """The batch size the finder settles on: ``trial(size)`` runs a trial and returns False when it
    ran out of memory. ``"power"`` doubles from ``init_val`` until a trial fails, then takes the
    last size that ran; ``"binsearch"`` then bisects between the two and keeps ``margin`` (a
    fraction) below the result. At most ``max_trials`` trials succeed; no size passes ``max_val``
    or grows past the dataset's length (``data_length``: larger ones hold the same data)."""
    size = max(1, min(init_val, max_val))
    if max_trials <= 0:
        return size
    if mode == "power":
        return _power(trial, size, max_trials, max_val, data_length, say)
    found = _binsearch(trial, size, max_trials, max_val, data_length, say)
    reduced = max(1, int(found * (1 - margin)))
    if reduced != found:
        say(f"Applying margin of {margin:.1%}, reducing batch size from {found} to {reduced}")
    return reduced


def _grown(size: int, max_val: int, data_length: int | None, say: Callable[[str], None]
           ) -> int | None:
    """The next size after ``size`` ran (twice it, at most ``max_val``), or None: no larger size
    is worth a trial."""
    if data_length is not None and size >= data_length:
        say(f"The batch size {size} is greater or equal than the length of your dataset: "
            f"{data_length}.")
        return None
    if size >= max_val:
        say(f"Reached the maximum batch size limit of {max_val}. Stopping search.")
        return None
    return min(size * 2, max_val)


def _power(trial: Callable[[int], bool], size: int, max_trials: int, max_val: int,
           data_length: int | None, say: Callable[[str], None]) -> int:
    grew = False  # a larger size was tried after one that ran: its failure ends the search
    for i in range(max_trials):
        if trial(size):
            bigger = None if i + 1 >= max_trials else _grown(size, max_val, data_length, say)
            if bigger is None:
                return size
            say(f"Batch size {size} succeeded, trying batch size {bigger}")
            size, grew = bigger, True
        else:
            if size == 1:
                return _nothing_fits()
            say(f"Batch size {size} failed, trying batch size {size // 2}")
            size //= 2
            if grew:
                return size
    return size


def _binsearch(trial: Callable[[int], bool], size: int, max_trials: int, max_val: int,
               data_length: int | None, say: Callable[[str], None]) -> int:
    low, high, successes = 1, None, 0  # high: the smallest size that failed
    while True:
        if trial(size):
            successes += 1
            low = size
            if successes >= max_trials:
                return size
            if high is None:
                nxt = _grown(size, max_val, data_length, say)
            else:
                nxt = None if high - low <= 1 else (high + low) // 2
            if nxt is None:
                return size
            say(f"Batch size {size} succeeded, trying batch size {nxt}")
        else:
            if size == 1:
                return _nothing_fits()
            high = size
            nxt = (high + low) // 2
            say(f"Batch size {size} failed, trying batch size {nxt}")
            if high - low <= 1:
                return nxt
        size = nxt


def _nothing_fits() -> int:
    raise MisconfigurationError(
        "BatchSizeFinder: even batch size 1 ran out of memory.",
        "the model does not fit this device at any batch size: use a smaller model, a lower "
        "precision (precision='bf16-mixed'), activation checkpointing, or a sharded strategy.")


class BatchSizeFinder(Callback):
    """Finds the largest batch size that runs without running out of memory, before the run uses
    it (Lightning's ``BatchSizeFinder``; ``taskfit.tools.Tuner(trainer).scale_batch_size`` runs it
    alone).

    Args:
        mode: ``"power"`` (double until a trial runs out of memory) or ``"binsearch"`` (then
            bisect between the last size that ran and the first that did not).
        steps_per_trial: batches each trial runs (fit: optimizer steps; a trial also ends with
            its loader).
        init_val: the first size tried.
        max_trials: how many trials may succeed (0: none run; the result is ``init_val``).
        batch_arg_name: the attribute the loaders read: on the task, in ``task.hparams``, on the
            data module or in its ``hparams`` (each that holds it is set).
        margin: binsearch only: the result is this fraction below the largest size that ran
            (0.05: 5% left for what a real run adds, e.g. longer sequences).
        max_val: no size above this is tried.
        end_run: end the entry point after the search (what ``Tuner.scale_batch_size`` asks:
            the search is all it runs).

    After the search ``optimal_batch_size`` holds the size (None under ``fast_dev_run``).
    Override ``on_fit_start`` and call :meth:`scale_batch_size` from another hook to search
    elsewhere (e.g. ``on_train_epoch_start`` after unfreezing a backbone).
    """

    SUPPORTED_MODES = MODES
    # first among the callbacks: the others' on_fit_start see the size found (the Tuner's run ends
    # before them)
    order = -100

    def __init__(
        self,
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
        *,
        end_run: bool = False,
    ) -> None:
        mode = mode.lower() if isinstance(mode, str) else mode
        check_settings(mode, steps_per_trial, init_val, max_trials, batch_arg_name, margin,
                       max_val)
        self.mode, self.steps_per_trial, self.init_val = mode, steps_per_trial, init_val
        self.max_trials, self.batch_arg_name = max_trials, batch_arg_name
        self.margin, self.max_val, self.end_run = margin, max_val, end_run
        self.optimal_batch_size: int | None = init_val

    # ---- the checks before a run (Lightning's setup) ---------------------------------------------
    def setup(self, trainer: Any, task: Any, stage: str | None = None) -> None:
        if trainer.world_size > 1:
            raise MisconfigurationError(
                "The Batch size finder is not supported with distributed strategies: each "
                "process would search on its own.",
                DISTRIBUTED_HINT)
        data = trainer.data
        if data is None:
            return
        # the loader the search sizes (fit: the training loader; a validation loader passed to fit
        # keeps its own size)
        searched = _METHODS[stage or "fit"]
        if data.passed.get(searched) is not None:
            raise MisconfigurationError(
                f"The Batch size finder cannot be used with dataloaders passed directly to "
                f"`.{stage or 'fit'}()`: their batch size is fixed ({searched} was passed).",
                f"return the loader from {searched}() of the task or a DataModule, built with "
                f"its `{self.batch_arg_name}` attribute.")
        _warn_duplicate(task, self.batch_arg_name)

    def _holders(self, task: Any, datamodule: Any) -> list[Any]:
        """Every object and hparams dict that holds ``batch_arg_name``, or one clear error."""
        found = holders(task, datamodule, self.batch_arg_name)
        if not found:
            raise MisconfigurationError(
                f"Field {self.batch_arg_name} not found in `model`, `datamodule`, nor their "
                "`hparams` attributes: the finder has nothing to set.",
                f"give the task (or its DataModule) a `{self.batch_arg_name}` attribute that its "
                "*_dataloader() methods read, or name yours: BatchSizeFinder(batch_arg_name=...).")
        return found

    # ---- the hooks that search ------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, task: Any) -> None:
        self.scale_batch_size(trainer, task)

    def on_validation_start(self, trainer: Any, task: Any) -> None:
        if trainer.state.fn == "validate":  # not fit's validation passes
            self.scale_batch_size(trainer, task)

    def on_test_start(self, trainer: Any, task: Any) -> None:
        self.scale_batch_size(trainer, task)

    def on_predict_start(self, trainer: Any, task: Any) -> None:
        self.scale_batch_size(trainer, task)

    def scale_batch_size(self, trainer: Any, task: Any) -> None:
        """Search now, in the running entry point; set the size found on the attribute and build
        the run's loaders again with it (``optimal_batch_size`` holds it)."""
        if trainer.fast_dev_run:
            warnings.warn("Skipping batch size scaler since `fast_dev_run` is enabled. HINT: "
                          "build a Trainer without fast_dev_run to search.",
                          UserWarning, stacklevel=2)
            self.optimal_batch_size = None
        else:
            self.optimal_batch_size = _Search(self, trainer, task).run()
        if self.end_run:
            raise StopRun()


def check_settings(mode: Any, steps_per_trial: Any, init_val: Any, max_trials: Any,
                   batch_arg_name: Any, margin: Any, max_val: Any) -> None:
    """Each setting of the finder checked before any work, one clear error for the first bad
    one."""
    if mode not in MODES:
        raise MisconfigurationError(
            f"BatchSizeFinder(mode={mode!r}): `mode` should be either of {MODES}.",
            '"power" doubles the size until it runs out of memory, "binsearch" then bisects.')
    for name, value, least in (("steps_per_trial", steps_per_trial, 1), ("init_val", init_val, 1),
                               ("max_trials", max_trials, 0), ("max_val", max_val, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise MisconfigurationError(f"BatchSizeFinder({name}={value!r}) is not valid.",
                                        f"pass an integer >= {least}.")
    if not isinstance(batch_arg_name, str) or not batch_arg_name:
        raise MisconfigurationError(f"BatchSizeFinder(batch_arg_name={batch_arg_name!r}) is not "
                                    "valid.", "name the attribute the loaders read, e.g. "
                                    '"batch_size".')
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise MisconfigurationError(
            f"BatchSizeFinder(margin={margin!r}): `margin` should be between 0 and 1.",
            "pass a fraction in [0, 1), e.g. 0.05 for 5% below the largest size that ran.")


def holders(task: Any, datamodule: Any, name: str) -> list[Any]:
    """The task and data module (each if it has the attribute ``name``) and their ``hparams``
    (each if it holds ``name`` with a value: taskfit records every ``__init__`` argument, and one
    left None holds no batch size), in that order (Lightning's ``lightning_setattr`` sets them
    all)."""
    found: list[Any] = []
    for owner in (task, datamodule):
        if owner is None:
            continue
        if getattr(owner, name, None) is not None:
            found.append(owner)
        hparams = getattr(owner, "hparams", None)
        if isinstance(hparams, Mapping) and hparams.get(name) is not None:
            found.append(hparams)
    return found


def _warn_duplicate(task: Any, name: str) -> None:
    """The task's attribute and its hparams entry disagree: both are set, say so."""
    hparams = getattr(task, "hparams", {})
    value = getattr(task, name, None)
    if value is not None and hparams.get(name) is not None and hparams[name] != value:
        warnings.warn(f"Field `model.{name}` and `model.hparams.{name}` are mutually exclusive! "
                      f"They differ here ({value} and {hparams[name]}): the finder sets both to "
                      "the size it finds. HINT: keep one of them.",
                      UserWarning, stacklevel=3)


class _Search:
    """One search, in the running entry point ``trainer.state.fn``: trials, then everything put
    back but the size found."""

    def __init__(self, finder: BatchSizeFinder, trainer: Any, task: Any) -> None:
        self.finder, self.trainer, self.task = finder, trainer, task
        self.fn = str(trainer.state.fn)
        if self.fn == "fit" and trainer.state.batches_done:
            raise MisconfigurationError(
                "BatchSizeFinder cannot search in the middle of a training epoch (after its batch "
                f"{trainer.state.batches_done - 1}, e.g. in a fit resumed there): the epoch's "
                "position belongs to the old batch size.",
                "search from on_fit_start or on_train_epoch_start; resume a mid-epoch checkpoint "
                "without BatchSizeFinder, with the batch size the first run found.")
        self.datamodule = trainer.datamodule
        # (the loaders exist now: several evaluation loaders are refused first, as Lightning's)
        self.data_length = self._data_length()
        self.holders = finder._holders(task, self.datamodule)
        self.saved: dict[str, Any] = {}
        self.collect = False  # collect garbage before the next trial

    def run(self) -> int:
        finder, trainer = self.finder, self.trainer
        initial = [_read(h, finder.batch_arg_name) for h in self.holders]
        self.saved = self._save()
        try:
            size = search(self._trial, mode=finder.mode, init_val=finder.init_val,
                          max_trials=finder.max_trials, max_val=finder.max_val,
                          margin=finder.margin if finder.mode == "binsearch" else 0.0,
                          data_length=self.data_length, say=self._say)
        except BaseException:
            for holder, value in zip(self.holders, initial):
                _write(holder, finder.batch_arg_name, value)
            raise
        finally:
            self._restore()
            free_memory()
        self._set(size)
        trainer.reload_dataloaders()
        self._say(f"Finished batch size finder, will continue with full run using batch size "
                  f"{size}" if not finder.end_run else f"Finished batch size finder: batch size "
                  f"{size} (set as `{finder.batch_arg_name}`)")
        return size

    def _data_length(self) -> int | None:
        """The length of the dataset the run's loader reads (None: unknown, e.g. an iterable);
        several evaluation loaders are refused, as Lightning's."""
        loader = getattr(self.trainer, _LOADERS[self.fn])
        if isinstance(loader, (list, tuple, Mapping)):
            raise MisconfigurationError(
                f"The Batch size finder cannot be used with multiple {_PREFIX[self.fn]} "
                f"dataloaders: {len(loader)} loaders share one batch size.",
                "search with one loader (e.g. a task whose loader method returns the largest), "
                "then set the size found for all.")
        dataset = getattr(loader, "dataset", None)
        if dataset is None or isinstance(dataset, IterableDataset):
            return None
        try:
            return len(dataset)
        except TypeError:
            return None

    def _set(self, size: int) -> None:
        for holder in self.holders:
            _write(holder, self.finder.batch_arg_name, size)

    def _say(self, message: str) -> None:
        if self.trainer.is_main:
            echo(message, name="taskfit.tune")

    # ---- one trial ----------------------------------------------------------------------------
    def _trial(self, size: int) -> bool:
        """A short run of the entry point at batch size ``size``; False: it ran out of memory.
        The task's weights and the run's optimizers and schedulers are put back after it."""
        self._set(size)
        if self.collect:
            # what the last trial left on the device (its Trainer and run hold each other: only gc
            # frees them; a collection costs ~0.1 s, so on the CPU only after a failure)
            free_memory()
        failed = False
        try:
            with warnings.catch_warnings():
                # (the outer run warned about the same task and data already)
                warnings.simplefilter("ignore", UserWarning)
                self._run(self.trainer.trial_trainer([], **self._limits()))
        except RuntimeError as exc:
            if not is_oom_error(exc):
                raise
            failed = True
        finally:
            self._restore()
        self.collect = failed or self.trainer.strategy.device.type != "cpu"
        return not failed

    def _limits(self) -> dict[str, Any]:
        steps = self.finder.steps_per_trial
        if self.fn == "fit":
            # max_epochs=1: a trial also ends with its loader
            return dict(max_steps=steps, max_epochs=1, limit_train_batches=1.0,
                        limit_val_batches=0)
        return {f"limit_{_PREFIX[self.fn]}_batches": steps}

    def _run(self, inner: Any) -> None:
        task, datamodule = self.task, self.datamodule
        if self.fn == "fit":
            inner.fit(task, datamodule=datamodule)
        elif self.fn == "predict":
            inner.predict(task, datamodule=datamodule, return_predictions=False)
        else:
            getattr(inner, self.fn)(task, datamodule=datamodule, verbose=False)

    # ---- what a trial changes, kept and put back ------------------------------------------------
    def _save(self) -> dict[str, Any]:
        """The task's weights and buffers, the run's optimizers' and schedulers' states (copies on
        the CPU: the trials measure the device's memory), the modules' train/eval flags, every
        RNG."""
        trainer, task = self.trainer, self.task
        kept = list(trainer.optimizers) + [c.scheduler for c in trainer.lr_scheduler_configs]
        return {
            "weights": {k: v.detach().to("cpu", copy=True) for k, v in task.state_dict().items()},
            "states": [(obj, _on_cpu(obj.state_dict())) for obj in kept],
            "modes": [m.training for m in task.modules()],
            "rng": rng_state(),
            "seed_env": os.environ.get(_SEED_ENV),
        }

    def _restore(self) -> None:
        trainer, task, saved = self.trainer, self.task, self.saved
        trainer.strategy.load_module_state_dict(task, saved["weights"])
        for obj, state in saved["states"]:
            obj.load_state_dict(copy.deepcopy(state))
        for module, training in zip(task.modules(), saved["modes"]):
            module.training = training
        set_rng_state(saved["rng"])
        if saved["seed_env"] is None:
            os.environ.pop(_SEED_ENV, None)
        else:
            os.environ[_SEED_ENV] = saved["seed_env"]


def _on_cpu(state: Any) -> Any:
    """``state`` (an optimizer's or scheduler's state dict) with every tensor copied to the CPU."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _on_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_on_cpu(v) for v in state)
    return copy.deepcopy(state)


def _read(holder: Any, name: str) -> Any:
    return holder[name] if isinstance(holder, Mapping) else getattr(holder, name)


def _write(holder: Any, name: str, value: Any) -> None:
    if isinstance(holder, Mapping):
        holder[name] = value
    else:
        setattr(holder, name, value)
