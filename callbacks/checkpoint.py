"""ModelCheckpoint: saves the run every N epochs/steps/seconds, keeps the top-k files and a ``last.ckpt``.

On by default (``Trainer(enable_checkpointing=False)`` turns it off). The files are complete training states
(docs/checkpointing.md): ``trainer.fit(task, ckpt_path="last")`` continues exactly where the run stopped.
"""
from __future__ import annotations

import datetime
import difflib
import math
import os
import re
import time
import warnings
from typing import Any

from ..console import echo
from ..errors import CheckpointError, MisconfigurationError
from ..serialization import atomic_copy, remove_files, write_probe
from ..sharded_checkpoint import checkpoint_exists
from .base import Callback

_FIELD = re.compile(r"\{([^{}:]+)(?::([^{}]*))?\}")


def format_filename(template: str, values: dict[str, Any]) -> str:
    """``"{epoch}-{val/acc:.3f}"`` -> ``"epoch=3-val_acc=0.912"``: each field as ``name=value``, ``/`` made safe."""
    def field(match: re.Match) -> str:
        name, spec = match.group(1).strip(), match.group(2) or ""
        return f"{safe_name(name)}={format(values[name], spec)}"

    return safe_name(_FIELD.sub(field, template), keep="=.-")


def _unwritable(folder: str) -> str | None:
    """Why a checkpoint could not be written in ``folder`` (created if missing), or None: a probe file is written,
    fsynced and removed."""
    try:
        write_probe(folder)
    except OSError as exc:
        return f"{exc.strerror or exc} ({type(exc).__name__}, errno {exc.errno})"
    return None


def safe_name(name: str, keep: str = ".-") -> str:
    return re.sub(rf"[^\w{re.escape(keep)}]", "_", name)


class ModelCheckpoint(Callback):
    """Save checkpoints during fit; keep the ``save_top_k`` best by ``monitor`` and a ``last.ckpt``.

    Args:
        dirpath: folder of the files (default: ``<trainer.log_dir>/checkpoints``).
        filename: name template without ``.ckpt``: ``{epoch}``, ``{step}`` and any logged key, with an optional
            format spec, e.g. ``"{epoch}-{val/acc:.3f}"`` (written ``epoch=3-val_acc=0.912.ckpt``).
        monitor: logged key that ranks the files (e.g. ``"val/loss"``); None ranks them by recency.
        mode: ``"min"`` or ``"max"``: which values of ``monitor`` are better.
        save_top_k: how many ranked files to keep (-1: all, 0: none, only ``last.ckpt``).
        save_last: keep ``last.ckpt``, the newest state (what ``ckpt_path="last"`` resumes).
        every_n_train_steps: also save every N optimizer steps (after that step's validation, if any).
        every_n_epochs: save in every N-th epoch (None or 0: never by epoch): at its end, or after each of its
            validations when they run elsewhere (see ``save_on_train_epoch_end``).
        save_on_train_epoch_end: where the epoch saves happen, as in Lightning. None decides: at the epoch's end
            when it validates once at its end (``val_check_interval=1.0``, ``check_val_every_n_epoch=1``) or not at
            all, else after each validation (so a file is ranked by the score of the very state it holds, and an
            epoch that did not validate is never ranked).
        train_time_interval: also save when this much time (seconds or a ``timedelta``) has passed since the
            last save, checked at step boundaries (under ddp at each ``log_every_n_steps``, with one broadcast).
        min_epoch_interval: seconds (or a ``timedelta``) that must pass since the last save before an epoch save
            is written, when only the newest file is kept (``monitor=None``, ``save_top_k`` 0 or 1): very short
            epochs then do not pay a save each. A skipped state is saved at the end of fit (and by a preemption
            signal); a SIGKILL can lose up to this long plus one epoch. 0 saves every epoch, as Lightning does.

    After fit: ``best_model_path``, ``best_model_score``, ``last_model_path``, ``best_k_models`` ({path: score}).
    Every rank runs this callback (a save gathers RNG states from all ranks); only rank 0 touches files.
    """

    order = 1000  # last of the defaults: a checkpoint must hold every other callback's state after this hook

    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str = "{epoch}-{step}",
                 monitor: str | None = None, mode: str = "min", save_top_k: int = 1, save_last: bool = True,
                 every_n_train_steps: int | None = None, every_n_epochs: int | None = 1,
                 train_time_interval: float | datetime.timedelta | None = None,
                 save_on_train_epoch_end: bool | None = None,
                 min_epoch_interval: float | datetime.timedelta = 1.0) -> None:
        if mode not in ("min", "max"):
            raise MisconfigurationError(f"ModelCheckpoint(mode={mode!r}) is not valid.",
                                        'use mode="min" (lower is better, e.g. a loss) or mode="max" (e.g. accuracy).')
        if not isinstance(save_top_k, int) or save_top_k < -1:
            raise MisconfigurationError(f"ModelCheckpoint(save_top_k={save_top_k!r}) is not valid.",
                                        "use -1 (keep all), 0 (only last.ckpt) or a positive number of files.")
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise MisconfigurationError(f"ModelCheckpoint({name}={value!r}) is not valid.",
                                            "use a positive integer, or None/0 to turn this trigger off.")
        if isinstance(train_time_interval, datetime.timedelta):
            train_time_interval = train_time_interval.total_seconds()
        if train_time_interval is not None and (not isinstance(train_time_interval, (int, float))
                                                or train_time_interval <= 0):
            raise MisconfigurationError(f"ModelCheckpoint(train_time_interval={train_time_interval!r}) is not valid.",
                                        "pass a number of seconds > 0 or a datetime.timedelta.")
        if isinstance(min_epoch_interval, datetime.timedelta):
            min_epoch_interval = min_epoch_interval.total_seconds()
        if isinstance(min_epoch_interval, bool) or not isinstance(min_epoch_interval, (int, float)) \
                or not min_epoch_interval >= 0:
            raise MisconfigurationError(f"ModelCheckpoint(min_epoch_interval={min_epoch_interval!r}) is not valid.",
                                        "pass a number of seconds >= 0 (0: save every epoch, as Lightning does) or "
                                        "a datetime.timedelta.")
        stem = filename[:-5] if filename.endswith(".ckpt") else filename
        if not stem or stem == "last" or os.sep in _FIELD.sub("", stem):
            raise MisconfigurationError(f"ModelCheckpoint(filename={filename!r}) is not valid.",
                                        'give a file name template without folders and other than "last", e.g. '
                                        '"{epoch}-{step}" or "{epoch}-{val/acc:.3f}" (put folders in dirpath).')
        self.dirpath_arg = os.path.abspath(os.fspath(dirpath)) if dirpath is not None else None
        self.dirpath: str | None = self.dirpath_arg
        self.filename, self.monitor, self.mode, self.save_top_k = stem, monitor, mode, save_top_k
        self.save_last, self.every_n_train_steps = save_last, every_n_train_steps or None
        self.every_n_epochs, self.train_time_interval = every_n_epochs or None, train_time_interval
        self.best_k_models: dict[str, float] = {}
        self.best_model_path, self.best_model_score, self.last_model_path = "", None, ""
        self.save_on_train_epoch_end, self.min_epoch_interval = save_on_train_epoch_end, float(min_epoch_interval)
        self._evicted: dict[str, float] = {}  # files out of the top k whose removal may not have run yet
        self._last_step = self._saved_step = self._monitor_step = -1  # global steps of the last batch, save, score
        self._last_time = 0.0
        self._warned_missing = False
        self._epoch_saves = self._skipped = 0  # this fit's due epoch saves and those skipped (in memory only)
        self._skipped_since_save = False

    # ---- hooks ----------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, task: Any) -> None:
        self.dirpath = self.dirpath_arg or os.path.join(trainer.log_dir, "checkpoints")
        problem = trainer.strategy.broadcast(_unwritable(self.dirpath) if trainer.is_main else None)
        if problem:  # before the first step, on every rank: not after an epoch of training
            raise CheckpointError(f"Checkpoints cannot be written to {self.dirpath}: {problem}.",
                                  "make the folder writable (permissions, a read-only or full file system), or "
                                  "pass ModelCheckpoint(dirpath=...) / Trainer(default_root_dir=...) elsewhere.")
        if not trainer.state.resumed:  # a fresh run ranks its own files (a resume restored them)
            self.best_k_models, self.best_model_path, self.best_model_score = {}, "", None
        self._last_step = self._saved_step = trainer.state.global_step  # after a restore: the resumed step
        self._last_time = time.monotonic()
        self._epoch_saves = self._skipped = 0
        self._skipped_since_save = False

    def needs_batch_hooks(self, trainer: Any) -> bool:
        return self.every_n_train_steps is not None or self.train_time_interval is not None

    def on_train_batch_end(self, trainer: Any, task: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.state.global_step
        if step == self._last_step:  # no optimizer step in this batch (accumulation): nothing new to save
            return
        self._last_step = step
        due = self.every_n_train_steps is not None and step % self.every_n_train_steps == 0
        if self.train_time_interval is not None and not due:
            due = self._time_due(trainer, step)
        if due and not trainer.fast_dev_run:
            self.save(trainer)

    def on_log(self, trainer: Any, task: Any, metrics: dict[str, float]) -> None:
        if self.monitor in metrics:  # the step whose state produced the score: a file is ranked by its own score
            self._monitor_step = trainer.state.global_step

    def on_validation_end(self, trainer: Any, task: Any) -> None:
        if trainer.state.fn != "fit":
            return
        if self.monitor is not None and self.monitor.startswith("val/"):
            self._check_monitor(trainer)
        if not self._saves_at_epoch_end(trainer) and self._epoch_due(trainer):
            self._epoch_save(trainer)

    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        # A partial epoch (max_steps, a stop, a signal) is saved by on_fit_end or the preemption handler.
        if not trainer.state.epoch_done:
            return
        if self.monitor is not None and not self.monitor.startswith("val/"):
            self._check_monitor(trainer)  # training values are logged before on_train_epoch_end
        if self._saves_at_epoch_end(trainer) and self._epoch_due(trainer):
            self._epoch_save(trainer)

    def _saves_at_epoch_end(self, trainer: Any) -> bool:
        """Lightning's rule for where epoch saves happen (see ``save_on_train_epoch_end``)."""
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        if self.train_time_interval is not None or trainer.check_val_every_n_epoch != 1:
            return False
        return not trainer.num_val_batches or trainer.val_check_interval == 1.0

    def _epoch_due(self, trainer: Any) -> bool:
        st = trainer.state
        return bool(self.every_n_epochs) and (st.epoch + 1) % self.every_n_epochs == 0 \
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
        """The monitored key was logged by now (the first validation, or the first epoch's end), else one error."""
        logged = sorted(trainer.state.metrics)
        if self.monitor in logged:
            return
        close = difflib.get_close_matches(self.monitor, logged, n=1, cutoff=0.5)
        raise MisconfigurationError(
            f"ModelCheckpoint(monitor={self.monitor!r}) is not a logged key; logged: {logged}.",
            (f"did you mean {close[0]!r}? " if close else "") + "use one of the logged keys (validation metrics "
            "are named val/<name>), log it with self.log, or pass monitor=None to keep the newest files.")

    def on_exception(self, trainer: Any, task: Any, exception: BaseException) -> None:
        """A save that failed in the background (a full disk): forget the files that are not on disk, so that
        ``best_k_models``, ``best_model_path`` and the folder agree (the previous best is still there)."""
        if not trainer.is_main:
            return
        kept = {**self._evicted, **self.best_k_models}  # a file whose removal was skipped is still ranked
        self.best_k_models = {p: s for p, s in kept.items() if checkpoint_exists(p)}
        self._update_best()
        if self.last_model_path and not checkpoint_exists(self.last_model_path):
            self.last_model_path = ""

    def on_fit_end(self, trainer: Any, task: Any) -> None:
        if trainer.state.global_step != self._saved_step and not trainer.fast_dev_run:
            if self._skipped_since_save:  # the ranked file too: best_model_path must be the final state
                self.save(trainer)
            elif self.save_last:  # training ended between two saves
                trainer.save_checkpoint(self.prepare_last(trainer))
                self._saved_step = trainer.state.global_step
        if self._skipped and trainer.is_main:
            echo(f"ModelCheckpoint: {self._skipped} of {self._epoch_saves} epoch-end saves skipped (epochs shorter "
                 f"than min_epoch_interval={self.min_epoch_interval} s); the final state is in "
                 f"{'last.ckpt' if self.save_last else 'the ranked file'}. "
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
        """The ``last.ckpt`` path, recorded as :attr:`last_model_path` before the file is written."""
        self.last_model_path = os.path.join(self.dirpath or os.path.join(trainer.log_dir, "checkpoints"), "last.ckpt")
        return self.last_model_path

    def save(self, trainer: Any) -> None:
        """Save now: a ranked file if it makes the top k, and ``last.ckpt``; then delete what fell out of the top k.

        The checkpoint is serialised now; its fsync and rename, the ``last.ckpt`` link and the removals follow in
        that order on ``trainer.checkpoint_writer``'s thread, so the loop does not wait for the disk.
        """
        before = (dict(self.best_k_models), self.best_model_path, self.best_model_score, self.last_model_path)
        try:
            self._save(trainer)
        except BaseException:  # nothing of this save is on disk: the bookkeeping must not name its files
            self.best_k_models, self.best_model_path, self.best_model_score, self.last_model_path = before
            raise

    def _save(self, trainer: Any) -> None:
        score = self._score(trainer)
        path, evicted, scores = None, [], dict(self.best_k_models)
        if self.save_top_k != 0 and score is not None and self._qualifies(score):
            path = self._new_path(trainer)
            evicted = self._admit(path, score)
        if self.save_last:
            last = self.prepare_last(trainer)
        writer = trainer.checkpoint_writer
        if path is not None:
            trainer.save_checkpoint(path, background=True)  # holds the bookkeeping above, which counts this file
            if self.save_last and trainer.is_main:
                writer.submit(atomic_copy, path, last)  # a hard link: no second write
        elif self.save_last:
            trainer.save_checkpoint(last, background=True)
        evicted = [old for old in evicted if os.path.dirname(old) == self.dirpath
                   and old not in (path, self.last_model_path)]
        # Until their removal has run (after the new file is in place), evicted files and their scores are kept
        # in mind: if that write fails, the removal is skipped and on_exception ranks them again.
        self._evicted = {p: s for p, s in self._evicted.items() if checkpoint_exists(p)}
        self._evicted.update((old, scores[old]) for old in evicted)
        if trainer.is_main and evicted:
            writer.submit(remove_files, evicted)  # old files go only once their replacement is in place
        self._saved_step, self._skipped_since_save = trainer.state.global_step, False
        self._last_time = time.monotonic()

    def _score(self, trainer: Any) -> float | None:
        """The score of the state being saved, or None when this state has none (the file is then not ranked)."""
        if self.monitor is None:
            return float(trainer.state.global_step)  # ranked by recency
        metrics = trainer.state.metrics
        if self.monitor in metrics and self._monitor_step == trainer.state.global_step:
            return float(metrics[self.monitor])
        if not self._warned_missing:  # e.g. a step-triggered save between validations: only last.ckpt this time
            what = "was logged at an earlier step" if self.monitor in metrics else "has not been logged yet"
            warnings.warn(f"ModelCheckpoint(monitor={self.monitor!r}) {what}, so the state of step "
                          f"{trainer.state.global_step} has no score of its own: only last.ckpt is written for it. "
                          "HINT: save when validation has run (every_n_epochs), or validate at the steps you save "
                          "(val_check_interval).", stacklevel=2)
            self._warned_missing = True
        return None

    def _better(self, a: float, b: float) -> bool:
        if math.isnan(a):
            return False
        lower = self.mode == "min" and self.monitor is not None  # without a monitor the newest (highest step) wins
        return math.isnan(b) or (a < b if lower else a > b)

    def _qualifies(self, score: float) -> bool:
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        return self._better(score, self.best_k_models[self._worst()])

    def _worst(self) -> str:
        worst = None
        for path, score in self.best_k_models.items():
            if worst is None or self._better(self.best_k_models[worst], score):
                worst = path
        return worst

    def _admit(self, path: str, score: float) -> list[str]:
        self.best_k_models[path] = score
        evicted = []
        while self.save_top_k != -1 and len(self.best_k_models) > self.save_top_k:
            worst = self._worst()
            evicted.append(worst)
            del self.best_k_models[worst]
        self._update_best()
        return evicted

    def _update_best(self) -> None:
        best = None
        for p, s in self.best_k_models.items():
            if best is None or self._better(s, self.best_k_models[best]):
                best = p
        self.best_model_path, self.best_model_score = (best, self.best_k_models[best]) if best else ("", None)

    def _new_path(self, trainer: Any) -> str:
        st = trainer.state  # between two epochs (the end of fit): named after the epoch it completed
        epoch = st.epoch - 1 if st.epoch and not st.batches_done and not st.epoch_done else st.epoch
        values = {**st.metrics, "epoch": epoch, "step": st.global_step}
        try:
            name = format_filename(self.filename, values)
        except KeyError as exc:
            raise MisconfigurationError(
                f"ModelCheckpoint(filename={self.filename!r}) uses {exc.args[0]!r}, which is not logged; "
                f"available: {sorted(values)}.",
                "use {epoch}, {step} or a logged key (e.g. {val/loss:.4f}) in the filename.") from None
        path, version = os.path.join(self.dirpath, name + ".ckpt"), 0
        while os.path.exists(path) and path not in self.best_k_models:  # a file from another run: keep it
            version += 1
            path = os.path.join(self.dirpath, f"{name}-v{version}.ckpt")
        return path

    # ---- state in the checkpoint -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "mode": self.mode, "best_k_models": dict(self.best_k_models),
                "best_model_path": self.best_model_path, "best_model_score": self.best_model_score,
                "last_model_path": self.last_model_path, "dirpath": self.dirpath}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("monitor") != self.monitor or state.get("mode") != self.mode:
            warnings.warn(f"The checkpoint's ModelCheckpoint ranked files by {state.get('monitor')!r} "
                          f"({state.get('mode')}); this one by {self.monitor!r} ({self.mode}): its top-k list starts "
                          "empty. HINT: keep monitor/mode when resuming to continue the same ranking.", stacklevel=2)
            self.last_model_path = state.get("last_model_path", "")
            return
        self.best_k_models = {str(k): float(v) for k, v in state.get("best_k_models", {}).items()}
        self.best_model_path = state.get("best_model_path", "")
        self.best_model_score = state.get("best_model_score")
        self.last_model_path = state.get("last_model_path", "")
