"""ModelCheckpoint: when to save (every N epochs/steps/seconds), the top-k files and a
``last.ckpt``.

The configuration and ranking of the run's checkpoint manager (loop/checkpointer.py), which decides
and writes every save; its hooks hand each event to it.

On by default (``Trainer(enable_checkpointing=False)`` turns it off). The files are complete
training states (docs/checkpointing.md): ``trainer.fit(task, ckpt_path="last")`` continues exactly
where the run stopped. Lightning's arguments mean what they mean there; where taskfit differs,
docs/migrating-lightning.md says so.

Annotations are evaluated (no ``from __future__ import annotations``): tools that read the
signature, as jsonargparse and Lightning's CLI do, get types, not strings.
"""
import datetime
import math
import os
import warnings
from typing import Any, Literal

import torch

from ...arguments import arguments_checked
from ...callback import Callback
from ...checkpoint.sharded import checkpoint_exists
from ...errors import MisconfigurationError
from .policy import (Ranking, check_arguments, format_filename, local_folder, seconds,
                     versioned)

__all__ = ["ModelCheckpoint", "format_filename"]


class ModelCheckpoint(Callback):
    """Save checkpoints during fit; keep the ``save_top_k`` best by ``monitor`` and a ``last.ckpt``.

    Lightning's arguments in Lightning's order, with its meanings (docs/checkpointing.md has the
    table and says where taskfit differs):

    Args:
        dirpath: folder of the files (default: ``<trainer.log_dir>/checkpoints``).
        filename: name template (None: ``"{epoch}-{step}"``); ``"{epoch:03d}-{val/acc:.2f}"`` gives
            ``epoch=003-val_acc=0.91``.
        monitor: logged key that ranks the files (e.g. ``"val/loss"``; ``"epoch"`` and ``"step"``
            are always available); None keeps the newest.
        verbose: print each monitored save, as Lightning logs it.
        save_last: keep ``last.ckpt``, the newest state (``"link"``: the same; None/False: none).
        save_top_k: how many ranked files to keep (-1: all, 0: none).
        save_on_exception: when fit raises, save the state it stopped in to a file named by
            ``filename``, and ``last.ckpt`` (single-process runs; a preemption signal saves
            ``last.ckpt`` at a step boundary anyway).
        save_weights_only: files hold the weights only (inference; a resume needs a full
            checkpoint).
        mode: ``"min"`` or ``"max"``: which values of ``monitor`` are better.
        auto_insert_metric_name: write ``name=`` before each field of ``filename``.
        every_n_train_steps: save every N optimizer steps.
        train_time_interval: save when this long (seconds or a ``timedelta``) has passed since the
            last save.
        every_n_epochs: save every N-th epoch; None: every epoch unless a step or time trigger is
            given.
        save_on_train_epoch_end: where epoch saves happen (None: as Lightning decides).
        enable_version_counter: a name taken by another file gets ``-v1``, ``-v2``... (False:
            overwrite).
        min_epoch_interval: (taskfit) seconds since the last save below which an unmonitored top-1
            epoch save is skipped (0: every epoch).

    After fit: ``best_model_path``, ``best_model_score``, ``best_k_models`` (monitored runs only, as
    Lightning), ``last_model_path``; :meth:`to_yaml` writes ``best_k_models``. Every rank runs this
    callback (a save gathers RNG states); only rank 0 touches files. A subclass may change
    Lightning's name parts below. """

    CHECKPOINT_JOIN_CHAR = "-"  # before a version: epoch=0-v1.ckpt
    CHECKPOINT_EQUALS_CHAR = "="  # after an inserted name: epoch=0
    CHECKPOINT_NAME_LAST = "last"  # a template too: "{epoch}-last"
    FILE_EXTENSION = ".ckpt"
    STARTING_VERSION = 1

    monitors_epoch_values = True  # ranks by what the epoch logged (hooks.hook_table)
    # last of the defaults: a checkpoint must hold every other callback's state after this hook
    order = 1000

    @arguments_checked(docs="docs/checkpointing.md")
    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        filename: str | None = "{epoch}-{step}",
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | Literal["link"] | None = True,
        save_top_k: int = 1,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: float | datetime.timedelta | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
        *,
        min_epoch_interval: float | datetime.timedelta = 1.0,
    ) -> None:
        stem = check_arguments(
            mode,
            save_top_k,
            {"every_n_train_steps": every_n_train_steps, "every_n_epochs": every_n_epochs},
            save_last,
            filename,
        )
        # As given: Lightning's state_key shows it (a timedelta or None)
        self._train_time_interval_arg = train_time_interval
        self.train_time_interval = seconds(
            "train_time_interval", train_time_interval, "save at every step", allow_none=True
        )
        self.min_epoch_interval = seconds("min_epoch_interval", min_epoch_interval,
                                           "save every epoch, as Lightning does")
        if every_n_train_steps is None and every_n_epochs is None and train_time_interval is None:
            # Lightning: no trigger given means every epoch; a step or time trigger replaces it
            every_n_epochs = 1
        self.dirpath_arg = local_folder(dirpath) if dirpath is not None else None
        self.dirpath: str | None = self.dirpath_arg
        self.filename, self.monitor, self.mode, self.save_top_k = stem, monitor, mode, save_top_k
        self.verbose, self.save_last, self.save_weights_only = (
            bool(verbose),
            bool(save_last),
            bool(save_weights_only),
        )
        self.save_on_exception = bool(save_on_exception)
        self.auto_insert_metric_name, self.enable_version_counter = (
            auto_insert_metric_name,
            enable_version_counter,
        )
        self.every_n_train_steps, self._every_n_epochs = (
            every_n_train_steps or None,
            every_n_epochs or 0,
        )
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self._ranking = Ranking(mode, by_recency=monitor is None, k=save_top_k)
        self.best_model_path, self.last_model_path = "", ""
        # the score of the latest ranked save (monitored runs)
        self.current_score: torch.Tensor | None = None
        # best_model_score, kth_best_model_path, kth_value as assigned (Lightning code sets them,
        # e.g. to restore a callback by hand): read back until the next ranked save
        self._assigned: dict[str, Any] = {}

    # ---- what Lightning's ModelCheckpoint exposes ------------------------------------------------
    @property
    def state_key(self) -> str:
        """Lightning's key of this callback's state in a checkpoint (so that a Lightning ``.ckpt``'s
        state restores, and two ModelCheckpoints of one Trainer keep theirs apart):
        ``ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min', 'every_n_train_steps': 0,
        'every_n_epochs': 1, 'train_time_interval': None}``."""
        key = {
            "monitor": self.monitor,
            "mode": self.mode,
            "every_n_train_steps": self.every_n_train_steps or 0,
            "every_n_epochs": self._every_n_epochs,
            "train_time_interval": self._train_time_interval_arg,
        }
        return f"{type(self).__qualname__}{key!r}"

    @property
    def every_n_epochs(self) -> int:
        """The resolved epoch trigger (0: never by epoch)."""
        return self._every_n_epochs

    @property
    def best_k_models(self) -> dict[str, torch.Tensor]:
        """``{path: score}`` of the ranked files; empty without a monitor (the files are then the
        newest)."""
        return (
            {p: torch.tensor(s) for p, s in self._ranking.kept.items()}
            if self.monitor is not None
            else {}
        )

    @best_k_models.setter
    def best_k_models(self, value: dict[str, Any]) -> None:
        # Lightning's is a plain dict that its users assign: the ranking itself (scores as floats)
        self._ranking.kept = {str(p): _score(v) for p, v in value.items()}

    @property
    def best_model_score(self) -> torch.Tensor | None:
        """The score of ``best_model_path`` (None without a monitor), or what was assigned since the
        last ranked save (Lightning code sets it, e.g. when it restores a callback by hand)."""
        if "best_model_score" in self._assigned:
            return self._assigned["best_model_score"]
        if self.monitor is None or self.best_model_path not in self._ranking.kept:
            return None
        return torch.tensor(self._ranking.kept[self.best_model_path])

    @best_model_score.setter
    def best_model_score(self, value: torch.Tensor | float | None) -> None:
        self._assigned["best_model_score"] = None if value is None else torch.as_tensor(value)

    @property
    def kth_best_model_path(self) -> str:
        """The worst of the ranked files ("" without a monitor), or what was assigned."""
        if "kth_best_model_path" in self._assigned:
            return self._assigned["kth_best_model_path"]
        return self._ranking.worst() if self.monitor is not None else ""

    @kth_best_model_path.setter
    def kth_best_model_path(self, value: str) -> None:
        self._assigned["kth_best_model_path"] = value

    @property
    def kth_value(self) -> torch.Tensor:
        """The score of :attr:`kth_best_model_path` (``inf``/``-inf`` for none), or what was
        assigned."""
        if "kth_value" in self._assigned:
            return self._assigned["kth_value"]
        worst = self.kth_best_model_path
        return torch.tensor(
            self._ranking.kept[worst] if worst in self._ranking.kept
            else float("inf" if self.mode == "min" else "-inf")
        )

    @kth_value.setter
    def kth_value(self, value: torch.Tensor | float) -> None:
        self._assigned["kth_value"] = torch.as_tensor(value)

    # ---- hooks: each hands its event to the run's checkpoint manager (loop/checkpointer.py) ------
    def on_fit_start(self, trainer: Any, task: Any) -> None:
        trainer.checkpointer.fit_start(self)

    def needs_batch_hooks(self, trainer: Any) -> bool:
        return self.every_n_train_steps is not None or self.train_time_interval is not None

    def on_train_batch_end(
        self, trainer: Any, task: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        trainer.checkpointer.step_end(self, batch_idx)

    def on_log(self, trainer: Any, task: Any, metrics: dict[str, float]) -> None:
        trainer.checkpointer.logged(self, metrics)

    def on_validation_end(self, trainer: Any, task: Any) -> None:
        trainer.checkpointer.validation_end(self)

    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        trainer.checkpointer.epoch_end(self)

    def on_exception(self, trainer: Any, task: Any, exception: BaseException) -> None:
        trainer.checkpointer.exception(self, exception)

    def on_fit_end(self, trainer: Any, task: Any) -> None:
        trainer.checkpointer.fit_end(self)

    # ---- the manager's questions: the folder, names and ranking ---------------------------------
    def resolve_dirpath(self, log_dir: str) -> str:
        """The folder of this fit's files: ``dirpath``, else ``<log_dir>/checkpoints``."""
        self.dirpath = self.dirpath_arg or os.path.join(log_dir, "checkpoints")
        return self.dirpath

    def start_ranking(self) -> None:
        """A fresh fit ranks its own files (a resume restored them)."""
        self._ranking.kept, self.best_model_path, self.current_score = {}, "", None
        self._assigned = {}

    def ranked_scores(self) -> dict[str, float]:
        """``{path: score}`` of the ranked files (a copy)."""
        return dict(self._ranking.kept)

    def is_ranked(self, path: str) -> bool:
        return path in self._ranking.kept

    def qualifies(self, score: float) -> bool:
        """``score`` enters the top k."""
        return self._ranking.qualifies(score)

    def rank(self, path: str, score: float) -> list[str]:
        """Rank ``path`` with ``score``; returns the files that fell out of the top k."""
        # As Lightning: a NaN score is kept as the worst value of its mode (inf for "min")
        if math.isnan(score):
            score = math.inf if self.mode == "min" else -math.inf
        evicted = self._ranking.admit(path, score)
        self.best_model_path, self._assigned = self._ranking.best(), {}
        self.current_score = torch.tensor(score) if self.monitor is not None else None
        return evicted

    def bookkeeping(self) -> tuple[Any, ...]:
        """What a save changes here, to put back if it fails (:meth:`restore_bookkeeping`)."""
        return (dict(self._ranking.kept), self.best_model_path, self.current_score,
                self.last_model_path, dict(self._assigned))

    def restore_bookkeeping(self, before: tuple[Any, ...]) -> None:
        self._ranking.kept, self.best_model_path, self.current_score, self.last_model_path, \
            self._assigned = before

    def forget_missing(self, evicted: dict[str, float]) -> None:
        """After a failed background save: rank only the files on disk (``evicted``: files pushed
        out whose removal may not have run), so that the bookkeeping and the folder agree."""
        kept = {**evicted, **self._ranking.kept}
        self._ranking.kept = {p: s for p, s in kept.items() if checkpoint_exists(p)}
        self.best_model_path, self._assigned = self._ranking.best(), {}
        if self.last_model_path and not checkpoint_exists(self.last_model_path):
            self.last_model_path = ""

    def name_ranked(self, values: Any) -> str:
        """The path of a ranked file for this state (``values``: Lightning's monitor candidates)."""
        try:
            name = self._format(self.filename, values)
        except KeyError as exc:
            raise MisconfigurationError(
                f"ModelCheckpoint(filename={self.filename!r}) uses {exc.args[0]!r}, which is not "
                f"logged; available: {sorted(values)}.",
                "use {epoch}, {step} or a logged key (e.g. {val/loss:.4f}) in the filename.",
            ) from None
        # A name may be reused for the file this save replaces (Lightning: the k-th best it evicts;
        # without a monitor the previous newest); any other file keeps its name and the new one gets
        # -v1, -v2...
        replaceable = {
            self._ranking.would_evict(),
            self.best_model_path if self.monitor is None else "",
        } - {""}
        return self._versioned(self.dirpath, name, lambda p: p in replaceable or not (
            os.path.exists(p) or p in self._ranking.kept))

    def name_last(self, values: Any) -> str:
        """The ``last.ckpt`` path, recorded as :attr:`last_model_path` before the file is written.
        As Lightning's: a checkpoint named ``last.ckpt`` there that this callback did not write (a
        fresh fit in a used folder) is kept, and this run's is ``last-v1.ckpt``; a resumed fit
        restored :attr:`last_model_path` and overwrites its own."""
        name = self._format(self.CHECKPOINT_NAME_LAST, values)
        own = self.last_model_path
        self.last_model_path = self._versioned(
            self.dirpath, name, lambda p: p == own or not checkpoint_exists(p))
        return self.last_model_path

    def exception_path(self, values: Any) -> str:
        """``save_on_exception``'s file: ``filename`` formatted (no version counter)."""
        return os.path.join(self.dirpath, self._format(self.filename, values) + self.FILE_EXTENSION)

    def _format(self, template: str, values: Any) -> str:
        """A file name (without the extension) from ``template``, with this callback's name
        parts."""
        return format_filename(
            template, values, self.auto_insert_metric_name, self.CHECKPOINT_EQUALS_CHAR
        )

    def _versioned(self, folder: str, name: str, free: Any) -> str:
        """``folder/name`` + extension, or its first free ``-v1``, ``-v2``...
        (``enable_version_counter``)."""
        return versioned(folder, name, free, self.enable_version_counter, self.FILE_EXTENSION,
                         self.CHECKPOINT_JOIN_CHAR, self.STARTING_VERSION)

    def to_yaml(self, filepath: str | os.PathLike | None = None) -> None:
        """Write :attr:`best_k_models` as YAML ``{path: score}`` to ``filepath`` (default:
        ``<dirpath>/best_k_models.yaml``), as Lightning's ``to_yaml``."""
        import yaml

        if filepath is None:
            if self.dirpath is None:
                raise MisconfigurationError(
                    "ModelCheckpoint.to_yaml() has no file to write to: no filepath was given and "
                    "dirpath is not known before "
                    "fit.", "pass the file, to_yaml(\"best_k_models.yaml\"), or call it after "
                    "trainer.fit (or give ModelCheckpoint(dirpath=...)).")
            filepath = os.path.join(self.dirpath, "best_k_models.yaml")
        with open(filepath, "w", encoding="utf-8") as fp:
            yaml.dump({path: score.item() for path, score in self.best_k_models.items()}, fp)

    # ---- state in the checkpoint -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Lightning's keys (scores as floats: a checkpoint holds plain values) and ``mode``."""
        score, current, kth = self.best_model_score, self.current_score, self.kth_value
        return {
            "monitor": self.monitor,
            "mode": self.mode,
            "best_k_models": dict(self._ranking.kept),
            "best_model_path": self.best_model_path,
            "best_model_score": None if score is None else float(score),
            "current_score": None if current is None else float(current),
            "kth_best_model_path": self.kth_best_model_path,
            "kth_value": float(kth),
            "last_model_path": self.last_model_path,
            "dirpath": self.dirpath,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The ranking of a taskfit or Lightning checkpoint (its scores may be tensors). As in
        Lightning, a checkpoint of another ``dirpath`` gives back only ``best_model_path``."""
        mode = state.get("mode", self.mode)
        if state.get("monitor") != self.monitor or mode != self.mode:
            warnings.warn("The checkpoint's ModelCheckpoint ranked files by "
                          f"{state.get('monitor')!r} ({mode}); this one by "
                          f"{self.monitor!r} ({self.mode}): its top-k list starts empty. HINT: "
                          "keep monitor/mode when resuming to continue the same "
                          "ranking.", stacklevel=2)
            self.last_model_path = state.get("last_model_path", "")
            return
        saved_dir = state.get("dirpath")
        if self.dirpath_arg is not None and saved_dir and \
                os.path.abspath(saved_dir) != self.dirpath_arg:
            # Lightning's phrase, then why and what to do
            warnings.warn(
                f"The dirpath has changed from {saved_dir!r} to {self.dirpath_arg!r}, therefore "
                "`best_model_score`, `kth_best_model_path`, `kth_value`, `last_model_path` and "
                "`best_k_models` won't be reloaded. Only `best_model_path` will be reloaded. "
                "HINT: pass the checkpoint's folder as ModelCheckpoint(dirpath=...) to continue "
                "its ranking; files in another folder are never rotated.", stacklevel=2)
            self.best_model_path = state.get("best_model_path", "")
            return
        self.best_k_models = state.get("best_k_models", {})
        self.best_model_path, self._assigned = state.get("best_model_path", ""), {}
        self.last_model_path = state.get("last_model_path", "")
        current = state.get("current_score")
        self.current_score = None if current is None else torch.tensor(_score(current))

    def on_load_checkpoint(self, trainer: Any, task: Any, checkpoint: dict[str, Any]) -> None:
        """A taskfit checkpoint written before the key was Lightning's: its state, older key."""
        states = checkpoint.get("callbacks", {})
        if self.state_key not in states and type(self).__qualname__ in states:
            self.load_state_dict(states[type(self).__qualname__])


def _score(value: Any) -> float:
    """A score as a float (Lightning's are 0-dim tensors)."""
    return float(value.item() if isinstance(value, torch.Tensor) else value)
