"""Logger: the interface of every logger (TensorBoard, CSV, MLflow, your own), a callback with five
small methods.

The Trainer publishes values as Python floats through ``on_log`` (docs/logging.md lists them). A
logger turns the callback hooks into calls a writer understands, so a new logger only writes these
methods:

- ``setup(trainer)``: open what the writes need (a file, a run); raise MisconfigurationError when it
  cannot
- ``log_hyperparams(p)``: the run's hyperparameters, once at fit start (``trainer.hparams``,
  flattened)
- ``log_metrics(m, s)``: values of global step ``s``; called several times per step (loss, lr,
  throughput...)
- ``save()``: flush what is buffered (every epoch end, and before a checkpoint records the run)
- ``finalize(status)``: the run ended: ``"success"``, ``"failed"`` or ``"interrupted"``; write the
  rest, close

Only rank 0 writes: on other ranks none of them is called. A logger that cannot write (a bad URI, a
directory that is not writable) fails in ``on_fit_start``, on every rank, before the first training
step.

Where a run goes (logs/outputs.py's ``run_directory``, which the loop calls): a logger given
Lightning's ``save_dir``/``name``/``version`` writes into ``<save_dir>/<name>/version_<N>``; the
first such logger chooses ``trainer.log_dir`` (checkpoints go there too); without one,
``<default_root_dir>/version_<N>``. A checkpoint records each logger's run (``state_dict``), and a
fit resumed from it continues that run: the same directory, the same MLflow run.
"""
from __future__ import annotations

import os
import re
import sys
import warnings
from typing import Any

from ...callback import Callback
from ...cluster import global_rank
from ...errors import MisconfigurationError, TaskfitError
from ...logs.outputs import check_writable, next_version_dir

STATUSES = ("success", "failed", "interrupted")
PREFIX_SEPARATOR = "-"  # Lightning's: prefix="fold1" logs "fold1-train/loss"


class Logger(Callback):
    """Base class of loggers: subclasses implement :meth:`log_metrics` and, as needed,
    :meth:`setup`, :meth:`log_hyperparams`, :meth:`save`, :meth:`finalize` and :attr:`experiment`;
    the hooks do the rest.

    A run is one directory (:attr:`log_dir`): one per ``fit``; a ``validate``/``test`` after it
    writes into the same run (``setup`` is called again first), one on its own starts a run of its
    own.
    """

    order = 900  # after the callbacks that log (lower orders); before ModelCheckpoint (1000)
    # a Logger's setup(trainer) is its own API, not the hook
    not_hooks = frozenset({"setup", "teardown"})
    # Lightning's arguments (None: Trainer(default_root_dir=...) and no name level)
    _save_dir: str | None = None
    _name: str | None = None
    _version: int | str | None = None
    prefix = ""
    _run_dir: str | None = None  # the directory this logger writes its run into (rank 0)
    _for: str | None = None  # the trainer.log_dir of the run it writes (rank 0)
    _active = False  # set up and not finalized
    # the run a checkpoint recorded, which this resumed fit continues
    _recorded: dict[str, Any] | None = None
    # this run continues one a checkpoint recorded (set at fit start; setup reads it)
    resuming = False

    def _where(
        self,
        save_dir: str | os.PathLike | None,
        name: str | None,
        version: int | str | None,
        prefix: str,
    ) -> None:
        """Check and keep Lightning's directory arguments (subclasses' ``__init__`` call it)."""
        cls = type(self).__name__
        if save_dir is not None and not isinstance(save_dir, (str, os.PathLike)):
            raise MisconfigurationError(f"{cls}(save_dir={save_dir!r}) is not a folder path.",
                                        f'pass a folder, e.g. {cls}("logs"), or None '
                                        '(Trainer(default_root_dir=...)).')
        if save_dir is not None and self.has_directory and re.match(r"[A-Za-z][\w+.-]+://",
                                                                     os.fspath(save_dir)):
            raise MisconfigurationError(f"{cls}(save_dir={save_dir!r}) is a URL: taskfit's {cls} "
                                        "writes to a local folder (Lightning's remote file systems "
                                        "through fsspec are not supported).",
                                        'pass a local folder (save_dir="logs") and copy it to the '
                                        "remote storage after the run, or mount that storage.")
        if name is not None and (not isinstance(name, str) or os.path.isabs(name)):
            raise MisconfigurationError(f"{cls}(name={name!r}) is not valid.",
                                        'pass a folder name below save_dir, e.g. name="exp", or '
                                        'None.')
        if version is not None and (isinstance(version, bool) or not isinstance(version, (int, str))
                                    or (isinstance(version, int) and version < 0)):
            raise MisconfigurationError(f"{cls}(version={version!r}) is not valid.",
                                        'pass a number (version_3), a folder name ("run-a"; "" '
                                        'writes into '
                                        "save_dir/name itself), or None (the next free version_N).")
        if not isinstance(prefix, str):
            raise MisconfigurationError(f"{cls}(prefix={prefix!r}) is not valid.",
                                        'pass a string; prefix="fold1" logs fold1-train/loss... '
                                        '("" for none).')
        # "~/logs" and "$SCRATCH/logs" as Lightning's loggers expand them (not a folder named "~")
        self._save_dir = (os.path.expandvars(os.path.expanduser(os.fspath(save_dir)))
                          if save_dir is not None else None)
        self._name, self._version, self.prefix = name or None, version, prefix

    # ---- what a logger writes: override these ----------------------------------------------------
    def setup(self, trainer: Any) -> None:
        """Open what :meth:`log_metrics` needs (rank 0, when a run starts writing, and again when a
        finalized run writes more). Raise :class:`~taskfit.MisconfigurationError` if it cannot
        write: at fit start every rank stops before training. :attr:`log_dir` is the run's
        directory; :attr:`resuming` says whether it continues a run a checkpoint recorded (at
        ``trainer.state.log_step``)."""

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """The run's hyperparameters, flattened (``{"task.optimizer.lr": 0.01, ...}``), once at fit
        start."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Values published at global step ``step``. One step arrives in several calls (the loss,
        the learning rate and the throughput separately): merge or buffer them as the format
        needs."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement log_metrics(metrics, step)"
        )

    def save(self) -> None:
        """Write out what is buffered (called at every epoch end and before a checkpoint records the
        run)."""

    def finalize(self, status: str) -> None:
        """The run ended with ``status`` (``"success"``, ``"failed"``, ``"interrupted"``): write the
        rest, close."""

    def run_state(self) -> dict[str, Any]:
        """What a resumed fit needs to continue this logger's run, beyond its directory (MLflow: the
        run id)."""
        return {}

    @property
    def experiment(self) -> Any:
        """The underlying writer (SummaryWriter, MlflowClient...), for what the interface does not
        cover."""
        return None

    @property
    def log_dir(self) -> str | None:
        """The directory this logger writes its run into: during and after a run, or, with a
        ``save_dir`` given, the one its first write outside a run would open (Lightning's); else
        None (and on ranks other than 0)."""
        if self._run_dir is None and self._save_dir is not None and self.has_directory:
            return self.directory(None)
        return self._run_dir

    def open_standalone(self) -> bool:
        """Lightning's loggers also work without a Trainer (``CSVLogger("logs").log_metrics({"a":
        1.0})``): a write outside a run opens one in :attr:`log_dir`. Returns whether this logger
        writes outside a run now (not on ranks other than 0 during a run, nor without a
        ``save_dir``)."""
        if self._active or self._run_dir is not None:
            return self._run_dir is not None and self._for is None  # a standalone run already open
        if self._save_dir is None or not self.has_directory or global_rank() != 0:
            return False
        self._run_dir = self.directory(None)
        check_writable(self._run_dir, type(self).__name__)
        return True

    @property
    def save_dir(self) -> str | None:
        """The folder that holds the runs: ``save_dir`` as given, else ``log_dir``'s parent."""
        if self._save_dir is not None:
            return os.path.abspath(self._save_dir)
        return os.path.dirname(self._run_dir) if self._run_dir else None

    @property
    def name(self) -> str | None:
        """The ``name`` folder below ``save_dir`` (None: none)."""
        return self._name

    @property
    def root_dir(self) -> str | None:
        """``<save_dir>/<name>``: the folder of this logger's versions (Lightning's
        ``root_dir``)."""
        save_dir = self.save_dir
        return os.path.join(save_dir, self._name) if save_dir and self._name else save_dir

    @property
    def version(self) -> int | str | None:
        """The run's version: as given, else the number of the ``version_N`` folder it writes (None
        before)."""
        if self._version is not None:
            return self._version
        match = re.fullmatch(r"version_(\d+)", os.path.basename(self.log_dir or ""))
        return int(match.group(1)) if match else None

    @property
    def has_directory(self) -> bool:
        """Writes files into a run directory (TensorBoard, CSV): may choose ``trainer.log_dir``."""
        return True

    @property
    def chooses_directory(self) -> bool:
        """Was given ``save_dir``, ``name`` or ``version``: its run goes where they say."""
        return self.has_directory and (self._save_dir, self._name, self._version) != (
            None,
            None,
            None,
        )

    def directory(self, default_root_dir: str | None) -> str:
        """Where a new run of this logger goes: ``<save_dir or
        default_root_dir>/<name>/<version>``; the run opened outside a Trainer (``experiment``
        or ``log_metrics`` before fit), if any: the fit continues it, as Lightning's does."""
        if self._run_dir is not None and self._for is None:
            return self._run_dir
        root = os.path.abspath(
            self._save_dir or default_root_dir or os.path.join(os.getcwd(), "taskfit_logs")
        )
        if self._name:
            root = os.path.join(root, self._name)
        if self._version is None:
            return next_version_dir(root)
        return os.path.normpath(os.path.join(root, self._version if isinstance(self._version, str)
                                             else f"version_{self._version}"))

    # ---- the hooks that call them ----------------------------------------------------------------
    def on_fit_start(self, trainer: Any, task: Any) -> None:
        if not trainer.state.resumed:  # (a resumed fit's run was chosen in on_load_checkpoint)
            self._recorded, self.resuming = None, False
        problem: BaseException | None = None
        if trainer.is_main:
            try:
                self._start(trainer)
                self.log_hyperparams(dict(trainer.hparams))
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                problem = exc
        # under ddp the other ranks stop too
        shared = trainer.strategy.broadcast(_portable(problem))
        if problem is not None:
            raise problem
        if shared is not None:
            raise shared

    def on_log(self, trainer: Any, task: Any, metrics: dict[str, float]) -> None:
        if not trainer.is_main or trainer.log_dir is None:
            return
        # a validate/test on its own, or after fit
        if not self._active or self._for != trainer.log_dir:
            self._start(trainer)
        if self.prefix:  # at the log interval, not per step
            metrics = {
                f"{self.prefix}{PREFIX_SEPARATOR}{key}": value for key, value in metrics.items()
            }
        # Lightning's step for the value (state.py)
        self.log_metrics(metrics=metrics, step=trainer.state.log_step)

    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        if self._active:
            self.save()

    def on_validation_end(self, trainer: Any, task: Any) -> None:
        # a Trainer.validate on its own: its values are all there
        if trainer.state.fn == "validate":
            self._finish("success")

    def on_test_end(self, trainer: Any, task: Any) -> None:
        self._finish("success")

    def on_fit_end(self, trainer: Any, task: Any) -> None:
        self._finish("success")

    def on_exception(self, trainer: Any, task: Any, exception: BaseException) -> None:
        # an error fails the run; Ctrl-C or a preemption exit (resumable later) interrupts it
        try:
            self._finish("failed" if isinstance(exception, Exception) else "interrupted")
        # the error on its way matters more; other callbacks still run
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"{type(self).__name__} could not close its run after "
                          f"{type(exception).__name__}: {type(exc).__name__}: "
                          f"{exc}", RuntimeWarning, stacklevel=2)

    # ---- resume: the run a checkpoint recorded ---------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The run this logger writes (its directory, and e.g. MLflow's run id), so that a resumed
        fit continues it. A checkpoint asks for it as it records the run: what is buffered is
        written out first (:meth:`save`)."""
        if self._run_dir is None:  # no run yet (and on ranks other than 0)
            return {}
        # (the fit-end checkpoint comes after the run was closed: it still names it)
        if self._active:
            self.save()
        return {"log_dir": self._run_dir, "trainer_log_dir": self._for, **self.run_state()}

    def on_load_checkpoint(self, trainer: Any, task: Any, checkpoint: dict[str, Any]) -> None:
        """A fit resumed from ``checkpoint`` continues the run it recorded: ``trainer.log_dir`` is
        that run's directory again (before any ``on_fit_start``), and the logger's own run goes on
        (:meth:`setup` sees :attr:`resuming`). Rank 0 decides (the directory must still exist there)
        and every rank follows."""
        recorded = (checkpoint.get("callbacks") or {}).get(self.state_key) or {}
        self._recorded, self.resuming = None, False
        if not recorded.get("log_dir"):
            return
        if not trainer.strategy.broadcast(trainer.is_main and os.path.isdir(recorded["log_dir"])):
            if trainer.is_main:
                warnings.warn(f"{type(self).__name__}: the run this checkpoint was logged to "
                              f"({recorded['log_dir']}) is gone; the resumed fit starts a new one "
                              f"in {trainer.log_dir}.", RuntimeWarning, stacklevel=2)
            return
        if recorded.get("trainer_log_dir"):  # every logger recorded the same one
            trainer.run.set_log_dir(recorded["trainer_log_dir"])
        self._recorded, self.resuming = dict(recorded), True

    # ---- runs ------------------------------------------------------------------------------------
    def _start(self, trainer: Any) -> None:
        if self._active and self._for != trainer.log_dir:
            self._finish("success")
        recorded = self._recorded if self.resuming else None
        if recorded is not None:
            self._run_dir = recorded["log_dir"]
        elif self.chooses_directory and self is not _first_directory_logger(trainer):
            # its own, as Lightning's loggers do
            self._run_dir = self.directory(trainer.default_root_dir)
        else:
            self._run_dir = trainer.log_dir
        self._for = trainer.log_dir
        self.setup(trainer)
        self._active = True
        # a validate/test after this fit starts writing without resuming anything
        self.resuming = False

    def _finish(self, status: str) -> None:
        if self._active:
            self._active = False
            self.finalize(status)


class DummyLogger(Logger):
    """``trainer.logger`` under ``fast_dev_run`` (Lightning's): it takes every call and writes
    nothing, so that a task's ``self.logger.experiment.add_image(...)`` runs unchanged in a quick
    check."""

    @property
    def has_directory(self) -> bool:
        return False

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Nothing is written."""

    @property
    def experiment(self) -> Any:
        return _Anything()


class _Anything:
    """Every attribute is a function that does nothing (``experiment.add_image(...)``,
    ``experiment.log(...)``)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


# stateless: one for every fast_dev_run (trainer.logger may be read every step)
DUMMY_LOGGER = DummyLogger()


def _first_directory_logger(trainer: Any) -> Logger | None:
    return next((lg for lg in trainer.loggers if lg.has_directory), None)


def _portable(problem: BaseException | None) -> BaseException | None:
    """What the other ranks raise for rank 0's ``problem``: taskfit's errors as they are, others as
    text."""
    if problem is None or isinstance(problem, TaskfitError):
        return problem
    return RuntimeError(f"rank 0's logger failed at fit start: {type(problem).__name__}: {problem}")


def display_name(trainer: Any, log_dir: str | None) -> str:
    """A run's name in MLflow and W&B: the run directory as TensorBoard names it when opened as
    docs/logging.md says: below a ``taskfit -m`` sweep's folder (``lr=0.1/version_0``), below a
    ``taskfit`` run's ``runs/`` folder (``<time>/version_0``), else below the folder of the runs
    (``version_3``, ``exp/version_3``)."""
    if not log_dir:
        return "taskfit"
    base = os.path.dirname(log_dir)
    # only a taskfit command (or a Hydra app) imported it A run of the taskfit command carries its
    # config; Hydra's global config may be another app's, or outlive one
    hydra = sys.modules.get("hydra.core.hydra_config")
    if (
        getattr(trainer, "config", None) is not None
        and hydra is not None
        and hydra.HydraConfig.initialized()
    ):
        from hydra.types import RunMode

        cfg = hydra.HydraConfig.get()
        base = (
            str(cfg.sweep.dir)
            if cfg.mode == RunMode.MULTIRUN
            else os.path.dirname(cfg.runtime.output_dir)
        )
    else:
        first = next((lg for lg in trainer.loggers if lg.has_directory and lg.save_dir), None)
        base = first.save_dir if first is not None else (trainer.default_root_dir or base)
    name = os.path.relpath(log_dir, os.path.abspath(base))
    return os.path.basename(log_dir) if name.startswith("..") else name
