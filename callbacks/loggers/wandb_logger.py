"""WandbLogger: each fit is a Weights & Biases run with the hyperparameters as its config, every
published value in its history at its global step, the run's tags and name, and (when asked) the
best and last checkpoints as a model artifact.

Needs W&B: ``pip install "taskfit[wandb]"`` (the ``wandb`` package). ``offline=True`` (or
``WANDB_MODE=offline``) writes the run to local files only
(``<save_dir>/wandb/offline-run-<time>-<id>/``), which ``wandb sync`` uploads later. Rank 0 only.

As Lightning's WandbLogger does, the values of one global step are one history row that holds them
with ``trainer/global_step``, and W&B's charts use that key as their x-axis (``define_metric``);
W&B's own ``_step`` counts the rows. So a ``trainer.test`` after fit and a resumed fit log at the
Trainer's steps, never refused as "not monotonically increasing". The run is named as TensorBoard
names the run directory (``lr=0.1/version_0`` in a sweep), its config is the hyperparameters
TensorBoard's HParams tab shows, and a fit resumed from a checkpoint continues the run the
checkpoint recorded (``wandb.init(id=..., resume="allow")``); a run left open by a killed process
says so in its summary (``taskfit.killed``).

One process, one W&B run per run directory: a fit that ends well leaves its run open (as Lightning's
does), so a ``validate``/``test``/``predict`` after it, or a fit resumed in the same process, writes
into the same run and, offline, the same ``offline-run-*`` folder (W&B cannot append to a folder a
closed run left). The run is closed when a run of another directory starts, by
:meth:`WandbLogger.finish`, at an error, or when the process exits.
"""
from __future__ import annotations

import atexit
import glob
import json
import os
import time
from typing import Any

from ...arguments import arguments_checked
from ...errors import MisconfigurationError
from .logger import Logger, display_name

# the x-axis of every chart (Lightning's WandbLogger uses the same key)
STEP_KEY = "trainer/global_step"
# 255: what wandb itself records for Ctrl-C
_EXIT_CODES = {"success": 0, "failed": 1, "interrupted": 255}
# in W&B's folder of the run: "running" until the run is closed
_STATUS_FILE = "taskfit-status.json"
_LIGHTNING_ONLY = {
    "anonymous": "remove it: log in with `wandb login` (or $WANDB_API_KEY), or use offline=True.",
    "experiment": "remove it: taskfit starts (or, on a resume, continues) the run itself; pass "
                  "id=... to write into an existing run.",
    "checkpoint_name": "remove it: the checkpoints are logged as the artifact model-<run id> "
                       "(log_model=True).",
    "add_file_policy": "remove it: the checkpoints are logged once, at fit end (log_model=True).",
}
# The W&B runs that WandbLoggers of this process left open after a fit or test that ended well:
# {run id: Run}
_OPEN: dict[str, Any] = {}


def _wandb() -> Any:
    """The ``wandb`` module, or a MisconfigurationError that says what to install."""
    try:
        import wandb
    except ImportError as exc:
        raise MisconfigurationError("WandbLogger needs Weights & Biases (wandb), which is not "
                                    "installed.",
                                    "`pip install \"taskfit[wandb]\"` (or `pip install wandb`), or "
                                    "use another logger.") from exc
    return wandb


class WandbLogger(Logger):
    """Logs each fit as a Weights & Biases run (rank 0).

    Args:
        name: the run's display name (None: the run directory as TensorBoard names it, e.g.
            ``lr=0.1/version_0``).
        save_dir: the folder W&B writes its ``wandb/`` folder into (None: the run directory,
            ``trainer.log_dir``).
        version: the run id (Lightning's name for ``id``): continue that run, or start one with that
            id.
        offline: write the run to local files only (``wandb sync <folder>`` uploads it later).
            False: W&B's mode (``$WANDB_MODE``, else online).
        dir: the same as ``save_dir`` (Lightning's alias; ``save_dir`` wins).
        id: the same as ``version``.
        project: the W&B project (None: ``$WANDB_PROJECT``, else ``"taskfit"``).
        log_model: at fit end, log ModelCheckpoint's best and last files as the artifact
            ``model-<run id>`` (type ``model``, aliases ``best`` and ``latest``).
        prefix: put ``<prefix>-`` before every metric name.
        tags: tags of the run.
        config: more entries of the run's config, beside the hyperparameters.
        entity: the W&B user or team (None: your default entity).
        group: W&B's run group (e.g. a sweep's name), passed to ``wandb.init``.
        notes: a description of the run, passed to ``wandb.init``.
        job_type: W&B's job type (e.g. ``"train"``), passed to ``wandb.init``.
    """

    # after ModelCheckpoint (1000): at fit end its last file is saved before the upload
    order = 1100

    @arguments_checked(lightning=_LIGHTNING_ONLY, docs="docs/logging.md")
    def __init__(
        self,
        name: str | None = None,
        save_dir: str | None = None,
        version: str | None = None,
        offline: bool = False,
        dir: str | None = None,
        id: str | None = None,
        *,
        project: str | None = None,
        log_model: bool = False,
        prefix: str = "",
        tags: list[str] | None = None,
        config: dict[str, Any] | None = None,
        entity: str | None = None,
        group: str | None = None,
        notes: str | None = None,
        job_type: str | None = None,
    ) -> None:
        _wandb()  # a missing package is an error here, not at fit start
        if log_model not in (True, False):
            raise MisconfigurationError(f"WandbLogger(log_model={log_model!r}) is not supported.",
                                        "pass True (the best and last checkpoints, logged as an "
                                        "artifact at fit end) "
                                        'or False; Lightning\'s "all" (every checkpoint as it is '
                                        'saved) is not '
                                        "supported.")
        self._where(save_dir if save_dir is not None else dir, None, None, prefix)
        self.run_name, self.offline, self.log_model = name, bool(offline), log_model
        self.project = project or os.environ.get("WANDB_PROJECT") or "taskfit"
        self.tags, self.config = list(tags or []), dict(config or {})
        self.init_args = {"entity": entity, "group": group, "notes": notes, "job_type": job_type}
        # the config (None: trainer.hparams; the taskfit command: HParams')
        self.hparams: dict[str, Any] | None = None
        self._id: str | None = version or id
        self._run: Any = None
        # W&B's local folder of the run (…/wandb/offline-run-<time>-<id>)
        self._folder: str | None = None
        self._row: dict[str, float] = {}  # the current step's values, not logged yet
        self._row_step = 0
        # a resumed online run: the last global step it holds (not sent again)
        self._sent_until = -1

    @property
    def experiment(self) -> Any:
        """The ``wandb`` Run (rank 0, once a run started): ``logger.experiment.log({...})`` for
        anything else."""
        return self._run

    @property
    def run_id(self) -> str | None:
        """The W&B run id of the current (or last) run."""
        return self._id

    @property
    def version(self) -> str | None:
        """The run id (Lightning's ``version``)."""
        return self._id

    @property
    def name(self) -> str | None:
        """The run's display name."""
        return self._run.name if self._run is not None else self.run_name

    @property
    def log_dir(self) -> str | None:
        """W&B's local folder of the run (``<save_dir>/wandb/offline-run-<time>-<id>`` offline);
        None before one."""
        return self._folder

    @property
    def has_directory(self) -> bool:
        # its runs live in W&B's folder (or server): the run directory is another logger's
        return False

    @property
    def save_dir(self) -> str | None:
        """The folder holding W&B's ``wandb/`` folder: ``save_dir`` as given, else the run
        directory."""
        if self._save_dir is not None:
            return os.path.abspath(self._save_dir)
        return self._run_dir

    def run_state(self) -> dict[str, Any]:
        return {"run_id": self._id, "project": self.project, "wandb_folder": self._folder}

    # ---- the Logger interface --------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        recorded = self._recorded if self.resuming else None
        run_id = (recorded or {}).get("run_id") or self._id
        run = _OPEN.get(run_id) if run_id else None
        # a new start, unless this process's run is still open (the user's wandb.finish() closes it)
        if run is None or _wandb().run is not run:
            _finish_open()  # the run a fit before left open (W&B writes one run at a time)
            folder = (recorded or {}).get("wandb_folder")
            killed = recorded is not None and _status(folder) == "running"
            run = self._init(trainer, recorded, run_id)
            self._sent_until = -1
        else:  # this process's run, still open: the same run and, offline, the same folder
            killed = False
        self._run, self._id, self._row = run, run.id, {}
        self._folder = os.path.dirname(os.path.abspath(run.dir))
        _OPEN[run.id] = run
        if recorded is not None:
            self._resumed(trainer.state.log_step, killed)
        _write_status(self._folder, "running")

    def _init(self, trainer: Any, recorded: dict[str, Any] | None, run_id: str | None) -> Any:
        """``wandb.init``: a new run, or run ``run_id`` continued; its charts' x-axis set."""
        wandb = _wandb()
        folder = self.save_dir or os.path.abspath(os.path.join(os.getcwd(), "taskfit_logs"))
        try:
            os.makedirs(folder, exist_ok=True)
            run = wandb.init(
                project=(recorded or {}).get("project") or self.project,
                name=self.run_name or display_name(trainer, self._run_dir),
                dir=folder,
                id=run_id,
                resume="allow" if run_id else None,
                tags=self.tags or None,
                config=self.config or None,
                mode="offline" if self.offline else None,
                **{k: v for k, v in self.init_args.items() if v is not None},
            )
        except Exception as exc:  # noqa: BLE001 - any failure of W&B: one explained error
            reason = " ".join(str(exc).split())[:500]
            raise MisconfigurationError(
                f"WandbLogger cannot start a run in {folder}: {type(exc).__name__}: {reason}",
                "log in (`wandb login` or $WANDB_API_KEY), or run offline: "
                "WandbLogger(offline=True) or WANDB_MODE=offline (`wandb sync` uploads the run "
                "later); check that save_dir is writable.") from exc
        run.define_metric(STEP_KEY)
        run.define_metric("*", step_metric=STEP_KEY, step_sync=True)
        # registered after W&B's own exit hook, so it runs before it: the exit code is ours
        atexit.unregister(_finish_open)
        atexit.register(_finish_open)
        return run

    def _resumed(self, step: int, killed: bool) -> None:
        """A resumed fit: note where, and whether the previous process died with the run open
        (SIGKILL, out of memory). An online run W&B resumed knows its last global step: those steps
        are not sent again."""
        summary = self._run.summary
        last = summary.get(STEP_KEY)
        if isinstance(last, (int, float)):
            self._sent_until = int(last)
        if killed:
            summary["taskfit.killed"] = ("the process died without closing the run; found "
                                         f"{time.strftime('%Y-%m-%d %H:%M:%S')} by a resume at "
                                         f"step {step}")
        resumes = summary.get("taskfit.resumed_at") or ""
        summary["taskfit.resumed_at"] = f"{resumes},{step}".strip(",")

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """The run's config: the ``hparams`` the taskfit command chose, else ``params`` (numbers,
        strings, bools, null; anything else as text), beside ``config``."""
        chosen = self.hparams if self.hparams is not None else params
        plain = {str(k): v if v is None or isinstance(v, (bool, int, float, str)) else str(v)
                 for k, v in chosen.items()}
        self._run.config.update(plain, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if step <= self._sent_until:
            # a resumed online run holds this step already (the same values: an exact resume)
            return
        if self._row and (step != self._row_step or not self._row.keys().isdisjoint(metrics)):
            # a new step, or a key again at the same step (a validate after fit): a new row
            self._send()
        self._row_step = step
        self._row.update(metrics)

    def _send(self) -> None:
        if self._row and self._run is not None:
            self._run.log({**self._row, STEP_KEY: self._row_step})
        self._row = {}

    def save(self) -> None:
        self._send()

    def finalize(self, status: str) -> None:
        """A fit or test that ended well leaves the run open for what follows in this process (a
        test after fit writes into it); an error or an interruption closes it with its exit code."""
        self._send()
        _write_status(self._folder, status)
        if status != "success":
            self.finish(status)

    def finish(self, status: str = "success") -> None:
        """Close the W&B run now (else a run of another directory, or the process's exit, closes
        it): offline, its folder is then complete for ``wandb sync``."""
        run = _OPEN.pop(self._id or "", None)
        if run is not None:
            run.finish(exit_code=_EXIT_CODES.get(status, 1))

    def sync_lines(self) -> list[str]:
        """Where the run is and how to see it: its URL online; offline, its folder(s) and the
        ``wandb sync`` command (a fit resumed in another process wrote a folder of its own, same
        id)."""
        if self._run is None or self._folder is None:
            return []
        if not self._run.offline:
            return [f"run {self._id}: {self._run.url}"]
        folders = sorted(glob.glob(os.path.join(glob.escape(os.path.dirname(self._folder)),
                                                f"offline-run-*-{self._id}")))
        shown = self._folder if len(folders) <= 1 else os.path.join(os.path.dirname(self._folder),
                                                                    f"offline-run-*-{self._id}")
        return [f"run {self._id} (offline): {shown}", f"sync it: wandb sync {shown}"]

    def on_fit_end(self, trainer: Any, task: Any) -> None:
        if self._active and self.log_model:
            self._log_checkpoints(trainer)
        super().on_fit_end(trainer, task)

    def _log_checkpoints(self, trainer: Any) -> None:
        """ModelCheckpoint's best and last files, as versions of the artifact ``model-<run id>``."""
        callback = trainer.checkpoint_callback
        if callback is None:
            return
        trainer.checkpoint_writer.wait()  # the files written on the background thread are in place
        wandb = _wandb()
        best, last = callback.best_model_path, callback.last_model_path
        # a file: its aliases (last.ckpt may be a link to the best file: one)
        files: dict[str, list[str]] = {}
        for alias, path in (("best", best), ("latest", last)):
            if path and os.path.isfile(path):
                same = next((f for f in files if os.path.samefile(f, path)), path)
                files.setdefault(same, []).append(alias)
        for path, aliases in files.items():
            artifact = wandb.Artifact(
                f"model-{self._id}",
                type="model",
                metadata={
                    "global_step": trainer.state.global_step,
                    "monitor": getattr(callback, "monitor", None),
                    "score": _number(getattr(callback, "best_model_score", None))
                    if "best" in aliases
                    else None,
                },
            )
            artifact.add_file(path, name=os.path.basename(path))
            self._run.log_artifact(artifact, aliases=aliases)


def _finish_open() -> None:
    """Close the runs WandbLoggers left open (a run of another directory starts, the process
    exits)."""
    while _OPEN:
        _, run = _OPEN.popitem()
        run.finish(exit_code=0)


def _number(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def _status(folder: str | None) -> str | None:
    """What :func:`_write_status` left in W&B's folder of a run (None: nothing readable)."""
    try:
        with open(os.path.join(folder or "", _STATUS_FILE), encoding="utf-8") as fh:
            return json.load(fh).get("status")
    except (OSError, ValueError, AttributeError):
        return None


def _write_status(folder: str | None, status: str) -> None:
    """``running`` while the run is open, then how it ended: a resume that finds ``running`` knows
    the process that wrote it died without closing the run."""
    if folder and os.path.isdir(folder):
        try:
            with open(os.path.join(folder, _STATUS_FILE), "w", encoding="utf-8") as fh:
                json.dump({"status": status, "time": time.time()}, fh)
        except OSError:
            pass  # informative only
