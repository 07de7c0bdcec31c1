"""ModelCheckpoint: saves the run every N epochs/steps/seconds, keeps the top-k files and a ``last.ckpt``.

On by default (``Trainer(enable_checkpointing=False)`` turns it off). The files are complete training states
(docs/checkpointing.md): ``trainer.fit(task, ckpt_path="last")`` continues exactly where the run stopped. Lightning's
arguments mean what they mean there; where taskfit differs, docs/migrating-lightning.md says so.
"""
from __future__ import annotations

import collections
import datetime
import difflib
import os
import time
import warnings
from typing import Any, Literal

import torch

from ...arguments import arguments_checked
from ...callback import Callback
from ...checkpoint.files import atomic_copy, remove_files, write_probe
from ...checkpoint.sharded import checkpoint_exists
from ...console import echo
from ...errors import CheckpointError, MisconfigurationError
from ...loop.checkpointing import save_checkpoint
from .policy import Ranking, check_arguments, format_filename, seconds, versioned

__all__ = ["ModelCheckpoint", "format_filename"]

LOOP_KEYS = ("epoch", "step")  # always monitor candidates, as in Lightning: the loop's counters, logged or not


def _unwritable(folder: str) -> str | None:
    """Why a checkpoint could not be written in ``folder`` (created if missing), or None: a probe file is written,
    fsynced and removed."""
    try:
        write_probe(folder)
    except OSError as exc:
        return f"{exc.strerror or exc} ({type(exc).__name__}, errno {exc.errno})"
    return None


class ModelCheckpoint(Callback):
    """Save checkpoints during fit; keep the ``save_top_k`` best by ``monitor`` and a ``last.ckpt``.

    Lightning's arguments in Lightning's order, with its meanings (docs/checkpointing.md has the table and says where
    taskfit differs):

    Args:
        dirpath: folder of the files (default: ``<trainer.log_dir>/checkpoints``).
        filename: name template (None: ``"{epoch}-{step}"``); ``"{epoch:03d}-{val/acc:.2f}"`` gives
            ``epoch=003-val_acc=0.91``.
        monitor: logged key that ranks the files (e.g. ``"val/loss"``; ``"epoch"`` and ``"step"`` are always
            available); None keeps the newest.
        verbose: print each monitored save, as Lightning logs it.
        save_last: keep ``last.ckpt``, the newest state (``"link"``: the same; None/False: none).
        save_top_k: how many ranked files to keep (-1: all, 0: none).
        save_on_exception: when fit raises, save the state it stopped in to a file named by ``filename``, and
            ``last.ckpt`` (single-process runs; a preemption signal saves ``last.ckpt`` at a step boundary anyway).
        save_weights_only: files hold the weights only (inference; a resume needs a full checkpoint).
        mode: ``"min"`` or ``"max"``: which values of ``monitor`` are better.
        auto_insert_metric_name: write ``name=`` before each field of ``filename``.
        every_n_train_steps: save every N optimizer steps.
        train_time_interval: save when this long (seconds or a ``timedelta``) has passed since the last save.
        every_n_epochs: save every N-th epoch; None: every epoch unless a step or time trigger is given.
        save_on_train_epoch_end: where epoch saves happen (None: as Lightning decides).
        enable_version_counter: a name taken by another file gets ``-v1``, ``-v2``... (False: overwrite).
        min_epoch_interval: (taskfit) seconds since the last save below which an unmonitored top-1 epoch save
            is skipped (0: every epoch).

    After fit: ``best_model_path``, ``best_model_score``, ``best_k_models`` (monitored runs only, as Lightning),
    ``last_model_path``; :meth:`to_yaml` writes ``best_k_models``. Every rank runs this callback (a save gathers RNG
    states); only rank 0 touches files. A subclass may change Lightning's name parts below.
    """

    CHECKPOINT_JOIN_CHAR = "-"  # before a version: epoch=0-v1.ckpt
    CHECKPOINT_EQUALS_CHAR = "="  # after an inserted name: epoch=0
    CHECKPOINT_NAME_LAST = "last"  # a template too: "{epoch}-last"
    FILE_EXTENSION = ".ckpt"
    STARTING_VERSION = 1

    monitors_epoch_values = True  # ranks by what the epoch logged (hooks.hook_table)
    order = 1000  # last of the defaults: a checkpoint must hold every other callback's state after this hook

    @arguments_checked(docs="docs/checkpointing.md")
    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str | None = "{epoch}-{step}",
                 monitor: str | None = None, verbose: bool = False, save_last: bool | Literal["link"] | None = True,
                 save_top_k: int = 1, save_on_exception: bool = False, save_weights_only: bool = False,
                 mode: str = "min", auto_insert_metric_name: bool = True, every_n_train_steps: int | None = None,
                 train_time_interval: float | datetime.timedelta | None = None, every_n_epochs: int | None = None,
                 save_on_train_epoch_end: bool | None = None, enable_version_counter: bool = True, *,
                 min_epoch_interval: float | datetime.timedelta = 1.0) -> None:
        stem = check_arguments(mode, save_top_k, {"every_n_train_steps": every_n_train_steps, "every_n_epochs":
                               every_n_epochs}, save_last, filename)
        self.train_time_interval = seconds("train_time_interval", train_time_interval, "save at every step",
                                            allow_none=True)
        self.min_epoch_interval = seconds("min_epoch_interval", min_epoch_interval,
                                           "save every epoch, as Lightning does")
        if every_n_train_steps is None and every_n_epochs is None and train_time_interval is None:
            every_n_epochs = 1  # Lightning: no trigger given means every epoch; a step or time trigger replaces it
        self.dirpath_arg = os.path.abspath(os.path.expanduser(os.fspath(dirpath))) if dirpath is not None else None
        self.dirpath: str | None = self.dirpath_arg
        self.filename, self.monitor, self.mode, self.save_top_k = stem, monitor, mode, save_top_k
        self.verbose, self.save_last, self.save_weights_only = bool(verbose), bool(save_last), bool(save_weights_only)
        self.save_on_exception = bool(save_on_exception)
        self.auto_insert_metric_name, self.enable_version_counter = auto_insert_metric_name, enable_version_counter
        self.every_n_train_steps, self._every_n_epochs = every_n_train_steps or None, every_n_epochs or 0
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self._ranking = Ranking(mode, by_recency=monitor is None, k=save_top_k)
        self.best_model_path, self.last_model_path = "", ""
        self.current_score: torch.Tensor | None = None  # the score of the latest ranked save (monitored runs)
        self._score_set, self._set_score = False, None  # best_model_score as assigned, until the next ranked save
        self._evicted: dict[str, float] = {}  # files out of the top k whose removal may not have run yet
        self._monitor_step = -1  # the global step at which the monitored key was last logged
        self._new_fit(-1)

    def _new_fit(self, step: int) -> None:
        """One fit's bookkeeping: global steps of the last batch seen, full save and last.ckpt written."""
        self._last_step = self._saved_step = self._last_written = step
        self._awaiting, self._last_time = -1, time.monotonic()  # _awaiting: a step save waiting for its validation
        self._epoch_saves = self._skipped = 0  # due epoch saves and those skipped (in memory only)
        self._skipped_since_save = self._pending = self._validated = self._warned_unscored = False
        self._prepared_step, self._fit_last, self._fitting = -1, "", False  # last.ckpt named at / written by this fit

    # ---- what Lightning's ModelCheckpoint exposes ---------------------------------------------------------
    @property
    def every_n_epochs(self) -> int:
        """The resolved epoch trigger (0: never by epoch)."""
        return self._every_n_epochs

    @property
    def best_k_models(self) -> dict[str, torch.Tensor]:
        """``{path: score}`` of the ranked files; empty without a monitor (the files are then the newest)."""
        return {p: torch.tensor(s) for p, s in self._ranking.kept.items()} if self.monitor is not None else {}

    @property
    def best_model_score(self) -> torch.Tensor | None:
        """The score of ``best_model_path`` (None without a monitor), or what was assigned since the last ranked save
        (Lightning code sets it, e.g. when it restores a callback by hand)."""
        if self._score_set:
            return self._set_score
        if self.monitor is None or self.best_model_path not in self._ranking.kept:
            return None
        return torch.tensor(self._ranking.kept[self.best_model_path])

    @best_model_score.setter
    def best_model_score(self, value: torch.Tensor | float | None) -> None:
        self._score_set, self._set_score = True, None if value is None else torch.as_tensor(value)

    @property
    def kth_best_model_path(self) -> str:
        """The worst of the ranked files ("" without a monitor)."""
        return self._ranking.worst() if self.monitor is not None else ""

    @property
    def kth_value(self) -> torch.Tensor:
        worst = self.kth_best_model_path
        return torch.tensor(self._ranking.kept[worst] if worst else float("inf" if self.mode == "min" else "-inf"))

    # ---- hooks ----------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, task: Any) -> None:
        self.dirpath = self.dirpath_arg or os.path.join(trainer.log_dir, "checkpoints")
        if self.save_weights_only and trainer.strategy.sharded_checkpoints:
            raise MisconfigurationError(
                "ModelCheckpoint(save_weights_only=True) cannot write sharded (fsdp) checkpoints.",
                "save full checkpoints under fsdp and write one weights file afterwards: python -m taskfit.consolidate "
                "<checkpoint> <file> (TaskModule.load_from_checkpoint reads it).")
        problem = trainer.strategy.broadcast(_unwritable(self.dirpath) if trainer.is_main else None)
        if problem:  # before the first step, on every rank: not after an epoch of training
            raise CheckpointError(f"Checkpoints cannot be written to {self.dirpath}: {problem}.",
                                  "make the folder writable (permissions, a read-only or full file system), or "
                                  "pass ModelCheckpoint(dirpath=...) / Trainer(default_root_dir=...) elsewhere.")
        if not trainer.state.resumed:  # a fresh run ranks its own files (a resume restored them)
            self._ranking.kept, self.best_model_path, self.current_score = {}, "", None
            self._score_set = False
        self._new_fit(trainer.state.global_step)  # a resume: the resumed step
        self._fitting = True

    def needs_batch_hooks(self, trainer: Any) -> bool:
        return self.every_n_train_steps is not None or self.train_time_interval is not None

    def on_train_batch_end(self, trainer: Any, task: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        trainer.checkpoint_writer.check()  # a background write that failed is raised at the next step
        step = trainer.state.global_step
        if step == self._last_step:  # no optimizer step in this batch (accumulation): nothing new to save
            return
        self._last_step = step
        due = self.every_n_train_steps is not None and step % self.every_n_train_steps == 0
        if self.train_time_interval is not None and not due:
            due = self._time_due(trainer, step)
        if due and step != self._saved_step and not trainer.fast_dev_run:
            if self.monitor not in (None, *LOOP_KEYS) and self._monitor_step != step and \
                    self._validates_now(trainer, batch_idx):
                self._pending, self._awaiting = True, step  # this step's validation brings its score
                self._last_time = time.monotonic()
            else:
                self.save(trainer)

    def on_log(self, trainer: Any, task: Any, metrics: dict[str, float]) -> None:
        trainer.checkpoint_writer.check()  # a failed background write: raised here, at the next log interval
        if self.monitor in metrics:  # the step whose state produced the score: a file is ranked by its own score
            self._monitor_step = trainer.state.global_step

    def on_validation_end(self, trainer: Any, task: Any) -> None:
        if trainer.state.fn != "fit":
            return
        trainer.checkpoint_writer.check()
        self._validated = True
        self._save_pending(trainer)
        if not self._saves_at_epoch_end(trainer) and self._epoch_due(trainer):
            self._epoch_save(trainer)

    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        # A partial epoch (max_steps, a stop, a signal) is saved by on_fit_end or the preemption handler.
        if not trainer.state.epoch_done:
            return
        trainer.checkpoint_writer.check()
        self._check_monitor(trainer)
        self._save_pending(trainer)
        if self._saves_at_epoch_end(trainer) and self._epoch_due(trainer):
            self._epoch_save(trainer)

    def _validates_now(self, trainer: Any, batch_idx: int) -> bool:
        """A validation runs right after this batch, at this step (Lightning defers a step save to it)."""
        schedule, st = trainer.val_schedule, trainer.state
        return bool(trainer.num_val_batches) and schedule.in_epoch(st.epoch) and schedule.due(st.epoch, batch_idx)

    def _save_pending(self, trainer: Any) -> None:
        """A step/time save that had no score of its own: rank this state if its score is here now."""
        step = trainer.state.global_step
        if self._pending and self._monitor_step == step and step != self._saved_step:
            self.save(trainer)
        elif self._awaiting == step:  # the validation of its step did not log the monitor either
            self._unscored(trainer)
        self._awaiting = -1

    def _saves_at_epoch_end(self, trainer: Any) -> bool:
        """Lightning's rule for where epoch saves happen (see ``save_on_train_epoch_end``)."""
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        if trainer.check_val_every_n_epoch != 1:
            return False
        return not trainer.num_val_batches or trainer.val_check_interval == 1.0

    def _epoch_due(self, trainer: Any) -> bool:
        st = trainer.state
        return self._every_n_epochs >= 1 and (st.epoch + 1) % self._every_n_epochs == 0 \
            and st.global_step != self._saved_step and not trainer.fast_dev_run

    def _epoch_save(self, trainer: Any) -> None:
        """An epoch save, skipped when it is too soon after the last one and would only replace the newest file
        (a monitored save never is: a new best must be on disk). Under ddp rank 0 decides: a save is collective."""
        self._epoch_saves += 1
        if self.monitor is None and self.save_top_k in (0, 1) and self.min_epoch_interval > 0:
            soon = time.monotonic() - self._last_time < self.min_epoch_interval
            if trainer.strategy.world_size > 1:
                soon = bool(trainer.strategy.broadcast(soon))
            if soon:
                self._skipped += 1
                self._skipped_since_save = True
                return
        self.save(trainer)

    def _check_monitor(self, trainer: Any) -> None:
        """At the end of a completed epoch after a validation (or without validation data), the monitored key must
        have been logged: anything a validation or an epoch logs has been by then. Else one error, before saving."""
        if self.monitor in (None, *LOOP_KEYS) or self.monitor in trainer.state.metrics or (
                trainer.num_val_batches and not self._validated):
            return
        logged = sorted(trainer.state.metrics)
        close = difflib.get_close_matches(self.monitor, logged, n=1, cutoff=0.5)
        raise MisconfigurationError(
            f"ModelCheckpoint(monitor={self.monitor!r}) is not a logged key; logged: {logged}.",
            (f"did you mean {close[0]!r}? " if close else "") + "use one of the logged keys (validation metrics "
            "are named val/<name>), log it with self.log, or pass monitor=None to keep the newest files.")

    def on_exception(self, trainer: Any, task: Any, exception: BaseException) -> None:
        """A save that failed in the background (a full disk): forget the files that are not on disk, so that
        ``best_k_models``, ``best_model_path`` and the folder agree (the previous best is still there). Then
        ``save_on_exception``'s file."""
        if trainer.is_main:
            kept = {**self._evicted, **self._ranking.kept}  # a file whose removal was skipped is still ranked
            self._ranking.kept = {p: s for p, s in kept.items() if checkpoint_exists(p)}
            self.best_model_path, self._score_set = self._ranking.best(), False
            if self.last_model_path and not checkpoint_exists(self.last_model_path):
                self.last_model_path = ""
        fitting, self._fitting = self._fitting, False
        st = trainer.state
        if not (self.save_on_exception and fitting and st.fn == "fit" and not trainer.fast_dev_run
                and st.stage != "sanity" and st.global_step not in (self._saved_step, self._prepared_step)):
            return  # as Lightning: nothing to add when this step's state is already saved
        if trainer.strategy.world_size > 1:  # a save is collective: the other ranks may not be in this hook
            warnings.warn(f"ModelCheckpoint(save_on_exception=True) saved nothing for this {type(exception).__name__}: "
                          "under ddp a save needs every rank. HINT: the saves before the error are in "
                          f"{self.dirpath}; save more often (every_n_train_steps) to lose less.", stacklevel=2)
            return
        self._exception_save(trainer, exception)

    def _exception_save(self, trainer: Any, exception: BaseException) -> None:
        """Lightning's ``save_on_exception``: the state as it is, to ``filename`` (unranked; a missing key is 0, no
        version counter) and to ``last.ckpt``. A save that fails is a warning: the error to report is ``exception``."""
        name = self._format(self.filename, collections.defaultdict(int, self._candidates(trainer)))
        path = os.path.join(self._folder(trainer), name + self.FILE_EXTENSION)
        try:
            self._write(trainer, path, background=False)
            if self.save_last:
                atomic_copy(path, self.prepare_last(trainer))
        except Exception as exc:  # noqa: BLE001 - the exception already propagating is the one to report
            warnings.warn(f"ModelCheckpoint(save_on_exception=True) could not save to {path}: {exc!r}.", stacklevel=3)
            return
        echo(f"An {type(exception).__name__} was raised with message: {exception}, saved checkpoint to {path}",
             name="taskfit.checkpoint")

    def on_fit_end(self, trainer: Any, task: Any) -> None:
        self._fitting = False
        step = trainer.state.global_step
        if step != self._saved_step and not trainer.fast_dev_run:
            if self._skipped_since_save:  # the ranked file too: best_model_path must be the final state
                self.save(trainer)
            elif self.save_last and step != self._last_written:  # training ended between two saves
                self._write_last(trainer)
        if self._skipped and trainer.is_main:
            echo(f"ModelCheckpoint: {self._skipped} of {self._epoch_saves} epoch-end saves skipped (epochs shorter "
                 f"than min_epoch_interval={self.min_epoch_interval} s); the final state is in "
                 f"{os.path.basename(self.last_model_path) if self.save_last else 'the ranked file'}. "
                 "ModelCheckpoint(min_epoch_interval=0) saves every epoch, as Lightning does.",
                 name="taskfit.checkpoint")

    def _time_due(self, trainer: Any, step: int) -> bool:
        if trainer.strategy.world_size > 1:  # ranks must agree: decide on rank 0, only where ranks sync anyway
            if step % trainer.log_every_n_steps:
                return False
            return bool(trainer.strategy.broadcast(time.monotonic() - self._last_time >= self.train_time_interval))
        return time.monotonic() - self._last_time >= self.train_time_interval

    # ---- saving -------------------------------------------------------------------------------------------
    def prepare_last(self, trainer: Any) -> str:
        """The ``last.ckpt`` path, recorded as :attr:`last_model_path` before the file is written. As Lightning's: a
        checkpoint named ``last.ckpt`` there that this callback did not write (a fresh fit in a used folder) is kept,
        and this run's is ``last-v1.ckpt``; a resumed fit restored :attr:`last_model_path` and overwrites its own."""
        name = self._format(self.CHECKPOINT_NAME_LAST, collections.defaultdict(int, self._candidates(trainer)))
        own = self.last_model_path
        self.last_model_path = self._versioned(self._folder(trainer), name,
                                               lambda p: p == own or not checkpoint_exists(p))
        self._prepared_step = trainer.state.global_step
        return self.last_model_path

    def _written_last(self, trainer: Any) -> None:
        """After a last-file write was queued: the previous one this fit wrote goes once it is in place, when the
        name changed (a ``CHECKPOINT_NAME_LAST`` with fields, e.g. ``"last-{epoch}"``), as in Lightning."""
        old, self._fit_last = self._fit_last, self.last_model_path
        if old and old != self._fit_last and old not in self._ranking.kept and trainer.is_main:
            trainer.checkpoint_writer.submit(remove_files, [old])

    def _write(self, trainer: Any, path: str, background: bool) -> None:
        if self.save_weights_only:
            save_checkpoint(trainer.run, path, background, weights_only=True)
        else:
            trainer.save_checkpoint(path, background=background)

    def _write_last(self, trainer: Any) -> None:
        if self.save_last:
            self._write(trainer, self.prepare_last(trainer), background=True)
            self._last_written = trainer.state.global_step
            self._written_last(trainer)

    def save(self, trainer: Any) -> None:
        """Save now: a ranked file if it makes the top k, and ``last.ckpt``; then delete what fell out of the top k.
        Serialised now; the fsync, rename, ``last.ckpt`` copy and removals follow in that order on
        ``trainer.checkpoint_writer``'s thread, so the loop does not wait for the disk."""
        before = (dict(self._ranking.kept), self.best_model_path, self.current_score, self.last_model_path,
                  self._score_set)
        try:
            self._save(trainer)
        except BaseException:  # nothing of this save is on disk: the bookkeeping must not name its files
            self._ranking.kept, self.best_model_path, self.current_score, self.last_model_path, self._score_set = \
                before
            raise
        self._last_time = time.monotonic()

    def _save(self, trainer: Any) -> None:
        st = trainer.state
        score = self._score(trainer)
        if score is None:
            self._unscored(trainer)
            return
        path, evicted, scores = None, [], dict(self._ranking.kept)
        if self.save_top_k != 0 and self._ranking.qualifies(score):
            path = self._new_path(trainer)
            evicted = self._ranking.admit(path, score)
            self.best_model_path, self._score_set = self._ranking.best(), False
            self.current_score = torch.tensor(score) if self.monitor is not None else None
            top = len(scores) + 1 if self.save_top_k == -1 else self.save_top_k
            best = self._ranking.kept[self.best_model_path]
            self._say(trainer, f"{self.monitor!r} reached {score:0.5f} (best {best:0.5f}), saving model to {path!r} "
                               f"as top {top}")
        elif self.save_top_k != 0:
            self._say(trainer, f"{self.monitor!r} was not in top {self.save_top_k}")
        last = self.prepare_last(trainer) if self.save_last else None
        if path is not None:
            self._write(trainer, path, background=True)  # holds the bookkeeping above, which counts this file
            if last and trainer.is_main:
                trainer.checkpoint_writer.submit(atomic_copy, path, last)  # a copy: one damage never hits both
        elif last:
            self._write(trainer, last, background=True)
        if last:
            self._written_last(trainer)
        evicted = [old for old in evicted if os.path.dirname(old) == self.dirpath
                   and old not in (path, self.last_model_path)]
        # Until their removal has run (after the new file is in place), evicted files and their scores are kept
        # in mind: if that write fails, the removal is skipped and on_exception ranks them again.
        self._evicted = {p: s for p, s in self._evicted.items() if checkpoint_exists(p)}
        self._evicted.update((old, scores[old]) for old in evicted)
        if trainer.is_main and evicted:
            trainer.checkpoint_writer.submit(remove_files, evicted)  # old files go only once their replacement is in
        self._saved_step, self._skipped_since_save, self._pending = st.global_step, False, False
        self._last_written = st.global_step if last else self._last_written

    def _candidates(self, trainer: Any) -> dict[str, Any]:
        """Lightning's monitor candidates: the logged values, ``epoch`` and ``step`` (as logged, else the loop's;
        between two epochs, at the end of fit, the epoch it completed)."""
        st, metrics = trainer.state, trainer.state.metrics
        return {**metrics, "epoch": int(metrics.get("epoch", st.checkpoint_epoch)),
                "step": int(metrics.get("step", st.global_step))}

    def _score(self, trainer: Any) -> float | None:
        """This state's score: its global step without a monitor, ``epoch``/``step`` always, a logged key when it
        was logged at this step (else None: the state has no score of its own)."""
        st = trainer.state
        if self.monitor is None:
            return float(st.global_step)
        if self.monitor in LOOP_KEYS:
            return float(self._candidates(trainer)[self.monitor])
        return st.metrics[self.monitor] if self.monitor in st.metrics and self._monitor_step == st.global_step else None

    def _unscored(self, trainer: Any) -> None:
        """This state has no score of its own (e.g. a step save between validations): last.ckpt only, and the
        next state that has one is ranked (Lightning would rank this one by the score of an earlier state)."""
        st = trainer.state
        self._pending = True
        if not self._warned_unscored:
            what = "was logged at an earlier step" if self.monitor in st.metrics else "has not been logged yet"
            warnings.warn(f"ModelCheckpoint(monitor={self.monitor!r}) {what}, so the state of step "
                          f"{st.global_step} has no score of its own: only last.ckpt is written for it, and the "
                          "next state whose score is logged (after a validation or at an epoch end) is ranked "
                          "instead. HINT: save when validation has run (every_n_epochs), or validate at the steps "
                          "you save (val_check_interval).", stacklevel=3)
            self._warned_unscored = True
        if st.global_step != self._last_written:
            self._write_last(trainer)

    def _say(self, trainer: Any, message: str) -> None:
        """``verbose``: Lightning's line for a monitored save."""
        if self.verbose and self.monitor is not None and trainer.is_main:
            st = trainer.state
            echo(f"Epoch {st.epoch:d}, global step {st.global_step:d}: {message}", name="taskfit.checkpoint")

    def _new_path(self, trainer: Any) -> str:
        values = self._candidates(trainer)
        try:
            name = self._format(self.filename, values)
        except KeyError as exc:
            raise MisconfigurationError(
                f"ModelCheckpoint(filename={self.filename!r}) uses {exc.args[0]!r}, which is not logged; "
                f"available: {sorted(values)}.",
                "use {epoch}, {step} or a logged key (e.g. {val/loss:.4f}) in the filename.") from None
        # A name may be reused for the file this save replaces (Lightning: the k-th best it evicts; without a
        # monitor the previous newest); any other file keeps its name and the new one gets -v1, -v2...
        replaceable = {self._ranking.would_evict(), self.best_model_path if self.monitor is None else ""} - {""}
        return self._versioned(self.dirpath, name, lambda p: p in replaceable or not (
            os.path.exists(p) or p in self._ranking.kept))

    def _folder(self, trainer: Any) -> str:
        return self.dirpath or os.path.join(trainer.log_dir, "checkpoints")

    def _format(self, template: str, values: Any) -> str:
        """A file name (without the extension) from ``template``, with this callback's name parts."""
        return format_filename(template, values, self.auto_insert_metric_name, self.CHECKPOINT_EQUALS_CHAR)

    def _versioned(self, folder: str, name: str, free: Any) -> str:
        """``folder/name`` + extension, or its first free ``-v1``, ``-v2``... (``enable_version_counter``)."""
        return versioned(folder, name, free, self.enable_version_counter, self.FILE_EXTENSION,
                         self.CHECKPOINT_JOIN_CHAR, self.STARTING_VERSION)

    def to_yaml(self, filepath: str | os.PathLike | None = None) -> None:
        """Write :attr:`best_k_models` as YAML ``{path: score}`` to ``filepath`` (default:
        ``<dirpath>/best_k_models.yaml``), as Lightning's ``to_yaml``."""
        import yaml

        if filepath is None:
            if self.dirpath is None:
                raise MisconfigurationError(
                    "ModelCheckpoint.to_yaml() has no file to write to: no filepath was given and dirpath is not "
                    "known before fit.", "pass the file, to_yaml(\"best_k_models.yaml\"), or call it after "
                    "trainer.fit (or give ModelCheckpoint(dirpath=...)).")
            filepath = os.path.join(self.dirpath, "best_k_models.yaml")
        with open(filepath, "w", encoding="utf-8") as fp:
            yaml.dump({path: score.item() for path, score in self.best_k_models.items()}, fp)

    # ---- state in the checkpoint -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        score = self.best_model_score
        return {"monitor": self.monitor, "mode": self.mode, "best_k_models": dict(self._ranking.kept),
                "best_model_path": self.best_model_path, "best_model_score": None if score is None else float(score),
                "last_model_path": self.last_model_path, "dirpath": self.dirpath}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("monitor") != self.monitor or state.get("mode") != self.mode:
            warnings.warn(f"The checkpoint's ModelCheckpoint ranked files by {state.get('monitor')!r} "
                          f"({state.get('mode')}); this one by {self.monitor!r} ({self.mode}): its top-k list starts "
                          "empty. HINT: keep monitor/mode when resuming to continue the same ranking.", stacklevel=2)
            self.last_model_path = state.get("last_model_path", "")
            return
        self._ranking.kept = {str(k): float(v) for k, v in state.get("best_k_models", {}).items()}
        self.best_model_path, self._score_set = state.get("best_model_path", ""), False
        self.last_model_path = state.get("last_model_path", "")
