"""TrainerSetup: the Trainer's arguments, setup and small helpers, so that trainer.py reads as the loop alone."""
from __future__ import annotations

import copy
import os
import re
import signal
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .checks import check_choice, check_count, check_limit, check_task, limit_batches
from .data import prepare_loader
from .errors import MisconfigurationError, TaskModuleError
from .helpers import LoopHelpers
from .logbook import LogBook
from .optim import parse_optimizers
from .precision import Precision, normalize_precision
from .seed import current_seed, seed_everything
from .serialization import CheckpointWriter
from .state import TrainerState
from .strategies import Strategy, select_strategy


class TrainerSetup(LoopHelpers):
    def __init__(
        self, *, max_epochs: int | None = None, max_steps: int | None = None, accelerator: str = "auto",
        devices: int | str | Sequence[int] = "auto", strategy: Any = "auto", precision: str | int = "32",
        accumulate_grad_batches: int = 1, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm", limit_train_batches: int | float = 1.0,
        limit_val_batches: int | float = 1.0, limit_test_batches: int | float = 1.0,
        limit_predict_batches: int | float = 1.0, val_check_interval: int | float = 1.0,
        check_val_every_n_epoch: int = 1, num_sanity_val_steps: int = 2, log_every_n_steps: int = 50,
        fast_dev_run: bool | int = False, overfit_batches: int | float = 0, deterministic: bool = False,
        callbacks: Sequence[Any] | None = None, default_root_dir: str | None = None,
        enable_progress_bar: bool = True, enable_model_summary: bool = True, enable_checkpointing: bool = True,
        logger: bool = True, nonfinite_loss: str = "raise", seed: int | None = None, compile: bool = False,
        channels_last: bool = False, preempt_signals: Sequence[str] = ("SIGTERM", "SIGUSR1"),
        preempt_exit_code: int | None = None, config: Mapping[str, Any] | None = None,
    ) -> None:
        for name, value, minimum in (("max_epochs", max_epochs, 0), ("max_steps", max_steps, 0),
                                     ("accumulate_grad_batches", accumulate_grad_batches, 1),
                                     ("check_val_every_n_epoch", check_val_every_n_epoch, 1),
                                     ("num_sanity_val_steps", num_sanity_val_steps, 0),
                                     ("log_every_n_steps", log_every_n_steps, 1), ("seed", seed, 0)):
            check_count(name, value, minimum, allow_none=name in ("max_epochs", "max_steps", "seed"))
        for name, value in (("limit_train_batches", limit_train_batches), ("limit_val_batches", limit_val_batches),
                            ("limit_test_batches", limit_test_batches), ("overfit_batches", overfit_batches),
                            ("limit_predict_batches", limit_predict_batches),
                            ("val_check_interval", val_check_interval)):
            check_limit(name, value)
        check_choice("gradient_clip_algorithm", gradient_clip_algorithm, ("norm", "value"))
        check_choice("nonfinite_loss", nonfinite_loss, ("raise", "skip"))
        if gradient_clip_val is not None and (not isinstance(gradient_clip_val, (int, float)) or gradient_clip_val <= 0):
            raise MisconfigurationError(f"Trainer(gradient_clip_val={gradient_clip_val!r}) is not valid.",
                                        "pass a positive number (e.g. 1.0), or None to turn clipping off.")
        self.precision_name = normalize_precision(precision)
        self.strategy = select_strategy(strategy, accelerator, devices)
        self.max_epochs, self.max_steps = max_epochs, max_steps
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val, self.gradient_clip_algorithm = gradient_clip_val, gradient_clip_algorithm
        self._limits = {"train": limit_train_batches, "val": limit_val_batches, "test": limit_test_batches,
                        "predict": limit_predict_batches}
        self.val_check_interval, self.check_val_every_n_epoch = val_check_interval, check_val_every_n_epoch
        self.num_sanity_val_steps, self.log_every_n_steps = num_sanity_val_steps, log_every_n_steps
        self.overfit_batches, self.deterministic, self.seed = overfit_batches, deterministic, seed
        self.default_root_dir, self.nonfinite_loss = default_root_dir, nonfinite_loss
        self.compile, self.channels_last = compile, channels_last
        self.preempt_signals, self.preempt_exit_code = tuple(preempt_signals), preempt_exit_code
        self.config = dict(config) if config is not None else None
        self.fast_dev_run = int(fast_dev_run)
        if self.fast_dev_run:  # n batches of everything, one epoch, nothing written
            n = self.fast_dev_run
            self._limits = dict.fromkeys(self._limits, n)
            self.max_epochs, self.max_steps, self.num_sanity_val_steps = 1, None, 0
            self.val_check_interval, self.log_every_n_steps = 1.0, 1
            enable_checkpointing = logger = False
        if overfit_batches:
            self._limits["train"] = self._limits["val"] = overfit_batches
        self.callbacks = self._default_callbacks(list(callbacks or []), enable_progress_bar,
                                                 enable_model_summary, enable_checkpointing, logger)
        self.state = TrainerState()
        self.log_dir: str | None = None
        self.task: Any = None
        self._signal: int | None = None
        # Finishes checkpoint files (fsync, rename) off the training thread; joined before each save and fit's end.
        self.checkpoint_writer = CheckpointWriter()

    @staticmethod
    def _default_callbacks(callbacks: list[Any], progress: bool, summary: bool, checkpointing: bool,
                           logger: bool) -> list[Any]:
        from . import callbacks as cbs

        for cb in callbacks:
            if not isinstance(cb, cbs.Callback):
                raise MisconfigurationError(f"Trainer(callbacks=[...]) got {type(cb).__name__}, not a Callback.",
                                            "subclass `taskfit.callbacks.Callback` and pass instances.")
        present = {type(cb) for cb in callbacks}
        for wanted, name in ((progress, "ProgressBar"), (summary, "ModelSummary"),
                             (checkpointing, "ModelCheckpoint"), (logger, "TensorBoardLogger"),
                             (logger, "LearningRateMonitor"), (logger, "ThroughputMonitor")):
            if wanted:
                cls = getattr(cbs, name)
                if not any(issubclass(t, cls) for t in present):
                    callbacks.append(cls())
        return sorted(callbacks, key=lambda cb: cb.order)

    # ---- properties callbacks read ---------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        """True on the process that logs, draws progress and writes files (rank 0)."""
        return self.strategy.is_main

    @property
    def hparams(self) -> dict[str, Any]:
        """The run's hyperparameters: the flattened resolved config (CLI) or the TaskModule's init arguments."""
        if self.config is not None:
            return _flatten(self.config)
        return _flatten(self.task.hparams) if self.task is not None else {}

    @property
    def prog_bar_keys(self) -> set[str]:
        return {"train/loss", "val/loss"} | self._train_book.prog_bar | {f"val/{n}" for n in self._metrics.get("val", {})}

    @property
    def train_dataloader(self) -> Any:
        """The training DataLoader as fit iterates it (re-created around taskfit's sampler); None before fit."""
        return getattr(self, "_train_loader", None)

    def log_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Publish values from a callback at the current global step: into ``state.metrics`` and every ``on_log``."""
        self._publish(self._to_floats(metrics))

    @property
    def should_stop(self) -> bool:
        """Set to True (from a callback) to end training cleanly at the next batch boundary."""
        return self.state.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self.state.should_stop = bool(value)

    @property
    def checkpoint_callback(self) -> Any:
        from .callbacks import ModelCheckpoint

        return next((cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)), None)

    # ---- run -------------------------------------------------------------------------------------
    def _check_entry(self, task: Any, stage: str) -> None:
        check_task(task, stage)
        if stage == "fit" and self.max_epochs is None and self.max_steps is None:
            raise MisconfigurationError("Neither max_epochs nor max_steps is set, so fit would never end.",
                                        "pass Trainer(max_epochs=N) or Trainer(max_steps=N).")

    def _run(self, stage: str, task: Any, ckpt_path: str | None) -> Any:
        self.strategy.setup_environment()
        if self.seed is not None:
            seed_everything(self.seed)
        was_deterministic = torch.are_deterministic_algorithms_enabled()
        if self.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self._attach(task, stage)
        try:
            if stage == "fit":
                metrics = self._fit(ckpt_path)
                self.checkpoint_writer.close()  # every checkpoint file is in place before fit returns
                return metrics
            if ckpt_path is not None:
                from .checkpoint import load_weights

                load_weights(self, ckpt_path)
            return self._predict() if stage == "predict" else self._run_eval_stage(stage)
        except BaseException as exc:
            self._close_writer_quietly()
            self._call("on_exception", exc)
            raise
        finally:
            self._detach()
            torch.use_deterministic_algorithms(was_deterministic)  # the process's setting, as it was

    def _attach(self, task: Any, stage: str) -> None:
        self.task = task
        if stage == "fit":
            self.state = TrainerState()
            self.log_dir = None
        if self.log_dir is None:
            self.log_dir = self.strategy.broadcast(self._next_version_dir() if self.is_main else None)
        self._hooks = {name: [getattr(cb, name) for cb in self.callbacks if _overrides(cb, name)]
                       for name in _hook_names()}
        self._before_step_hooks = self._hooks["on_before_optimizer_step"]  # read every step: no dict lookup
        # On the CPU the loop skips batch_to_device, unless a custom strategy overrides it (it may do more).
        self._move_batches = self.strategy.moves_batches or _overrides(self.strategy, "batch_to_device", Strategy)
        if self.channels_last:
            task.to(memory_format=torch.channels_last)
        wrapped = self.strategy.setup_module(task)
        self._wrapped = torch.compile(wrapped) if self.compile else wrapped
        self.precision = Precision(self.precision_name, self.strategy.device)
        # With 16-mixed the GradScaler already skips steps whose gradients overflow: that is not an error.
        self._raise_nonfinite_loss = self.nonfinite_loss == "raise" and self.precision.scaler is None
        self._metrics = self._build_metrics(task)
        self._train_book = LogBook("train")
        self._track_loss()
        self._enter_book("train")
        seed = current_seed() if current_seed() is not None else torch.initial_seed() % 2**31
        self.data_seed = int(self.strategy.broadcast(seed))
        self._signal, self._stop_agreed, self._signal_agreed = None, False, False
        self._previous_handlers = {}
        if stage == "fit" and sys.modules["threading"].current_thread() is sys.modules["threading"].main_thread():
            for name in self.preempt_signals:
                signum = getattr(signal, name, None)
                if signum is not None:
                    self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _detach(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}
        self.task.__dict__.pop("_logbook", None)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signal = signum  # only a flag: the loop saves and exits at the next step boundary

    def _next_version_dir(self) -> str:
        root = os.path.abspath(self.default_root_dir or os.path.join(os.getcwd(), "taskfit_logs"))
        taken = [int(m.group(1)) for d in (os.listdir(root) if os.path.isdir(root) else [])
                 if (m := re.fullmatch(r"version_(\d+)", d))]
        return os.path.join(root, f"version_{max(taken, default=-1) + 1}")

    def _build_metrics(self, task: Any) -> dict[str, dict[str, Any]]:
        raw = task.configure_metrics()
        if not raw:
            return {}
        items = dict(raw.items()) if hasattr(raw, "items") else None
        if items is None or not all(all(hasattr(m, a) for a in ("update", "compute", "reset")) for m in items.values()):
            raise TaskModuleError(f"configure_metrics returned {type(raw).__name__}.",
                                  "return a dict {name: torchmetrics.Metric}, e.g. "
                                  "`{'acc': torchmetrics.Accuracy(task='multiclass', num_classes=10)}`.")
        device = self.strategy.device
        return {stage: {name: copy.deepcopy(m).to(device) for name, m in items.items()} for stage in ("val", "test")}

    def _setup_fit(self, ckpt_path: str | None) -> None:
        task, strategy = self.task, self.strategy
        self.optimizer, self.schedulers = parse_optimizers(task.configure_optimizers())
        self._step_schedulers = [c for c in self.schedulers if c.interval == "step"]
        self._epoch_schedulers = [c for c in self.schedulers if c.interval == "epoch"]
        self._clip_params = [p for group in self.optimizer.param_groups for p in group["params"]]
        pin = strategy.device.type == "cuda"
        loader_args = dict(seed=self.data_seed, rank=strategy.rank, world_size=strategy.world_size, pin_memory=pin)
        overfit = bool(self.overfit_batches)
        self._train_loader = prepare_loader(task.train_dataloader(), train=True, shuffle=False if overfit else None,
                                            **loader_args)
        total = _length(self._train_loader)
        if total == 0:
            self._empty_train_loader()
        self.num_train_batches = limit_batches(total, self._limits["train"])
        val = prepare_loader(task.train_dataloader(), train=False, shuffle=False, **loader_args) if overfit else \
            prepare_loader(task.val_dataloader(), train=False, **loader_args)
        self.num_val_batches = 0 if val is None else limit_batches(_length(val), self._limits["val"])
        self._val_loader = val if self.num_val_batches else None
        vci, n = self.val_check_interval, self.num_train_batches
        self._val_every = (max(1, int(n * vci)) if n != float("inf") else float("inf")) \
            if isinstance(vci, float) else vci
        self._first_step, self._resumed = True, False
        # The plain step (trainer.py) once the first loss has been checked: what a hand-written loop does.
        self._plain_step = False
        self._plain_step_possible = (self.accumulate_grad_batches == 1 and not self.precision.mixed  # fp32: no scaler
                                     and self.gradient_clip_val is None and not self._before_step_hooks
                                     and self.nonfinite_loss != "skip")
        self._fold_mark = (0, 0)
        if ckpt_path is not None:
            from .checkpoint import restore

            restore(self, ckpt_path)
            self._resumed = True

    def _setup_eval(self, stage: str) -> Any:
        method = {"validate": "val_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}[stage]
        loader = getattr(self.task, method)()
        if loader is None:
            raise TaskModuleError(f"Trainer.{stage} needs data, but {type(self.task).__name__}.{method}() "
                                  "returned None.", f"define `def {method}(self): return DataLoader(...)`.")
        s = self.strategy
        return prepare_loader(loader, train=False, seed=self.data_seed, rank=s.rank, world_size=s.world_size,
                              pin_memory=s.device.type == "cuda")

    def _empty_train_loader(self) -> None:
        loader = self._train_loader
        dataset = getattr(loader, "dataset", None)
        size = len(dataset) if hasattr(dataset, "__len__") else "?"
        raise MisconfigurationError(
            f"train_dataloader() yields no batches (dataset of {size} samples, batch_size="
            f"{getattr(loader, 'batch_size', '?')}, drop_last={getattr(loader, 'drop_last', '?')}).",
            "check the dataset is not empty, and use drop_last=False or a batch_size <= the dataset size.")

    # ---- checkpoints and preemption (trainer/checkpoint.py does the work) ---------------------------
    def save_checkpoint(self, path: str, background: bool = False) -> None:
        """Write everything needed to continue this run exactly, atomically, on rank 0 (every rank calls it).

        ``background=True``: serialise now, fsync and rename on :attr:`checkpoint_writer`'s thread (the file is
        in place when the next save starts, when fit returns, or after ``trainer.checkpoint_writer.wait()``).
        """
        from .checkpoint import save_checkpoint

        save_checkpoint(self, path, background)

    def _close_writer_quietly(self) -> None:
        """Fit is failing: finish the background files, but warn about their errors rather than hide the first."""
        try:
            self.checkpoint_writer.close()
        except Exception as exc:  # noqa: BLE001 - the exception already propagating is the one to report
            warnings.warn(f"A background checkpoint write failed too: {exc!r}.", stacklevel=2)

    def _preempt(self) -> None:
        from .checkpoint import preempt

        preempt(self)


def _hook_names() -> tuple[str, ...]:
    from .callbacks.base import HOOKS

    return HOOKS


def _overrides(obj: Any, name: str, base: type | None = None) -> bool:
    """``obj``'s class defines its own ``name`` instead of ``base``'s (default: the Callback base class)."""
    if base is None:
        from .callbacks.base import Callback

        base = Callback
    return getattr(type(obj), name, None) is not getattr(base, name)


def _length(loader: Any) -> float:
    try:
        return len(loader)
    except TypeError:
        return float("inf")


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return out
