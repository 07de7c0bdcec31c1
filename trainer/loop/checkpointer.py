"""The run's checkpoint manager: the one place that decides when a checkpoint is written, under
which name, what is removed, and which file ``ckpt_path="last"`` resumes.

The loop reaches it at each point where a save may be due (a step, a validation, an epoch end, a
preemption signal, an exception, the end of fit); a ``ModelCheckpoint`` is its configuration and its
ranking (the Lightning surface: arguments, ``best_model_path``, ``best_k_models``, ``state_dict``),
and each of its ``on_*`` hooks hands the event here. The manager writes through
:func:`save_checkpoint` itself: no save goes back through the Trainer or the callback.
docs/concepts.md, "Who saves"."""

from __future__ import annotations

import collections
import dataclasses
import difflib
import os
import time
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

from ..checkpoint.files import LAST, atomic_copy, load_checkpoint, remove_files, write_probe
from ..checkpoint.folder_lock import FolderHeld, hold, release
from ..checkpoint.lookup import folder_candidates, last_candidates, warn_skipped
from ..checkpoint.sharded import checkpoint_exists
from ..console import echo, user_stacklevel
from ..errors import CheckpointError, MisconfigurationError, NonFiniteLossError
from .checkpointing import load_first, no_training_state, save_checkpoint
from .run import Run

# Always monitor candidates, as in Lightning: the loop's counters, logged or not
LOOP_KEYS = ("epoch", "step")


class CheckpointPolicy(Protocol):
    """What the manager reads of a ``ModelCheckpoint``: its arguments, names and ranking."""

    dirpath: str | None
    dirpath_arg: str | None
    monitor: str | None
    save_top_k: int
    save_last: bool
    verbose: bool
    save_weights_only: bool
    save_on_exception: bool
    every_n_train_steps: int | None
    train_time_interval: float | None
    every_n_epochs: int
    save_on_train_epoch_end: bool | None
    min_epoch_interval: float
    last_model_path: str
    best_model_path: str

    def resolve_dirpath(self, log_dir: str) -> str: ...

    def start_ranking(self) -> None: ...

    def ranked_scores(self) -> dict[str, float]: ...

    def is_ranked(self, path: str) -> bool: ...

    def qualifies(self, score: float) -> bool: ...

    def rank(self, path: str, score: float) -> list[str]: ...

    def bookkeeping(self) -> tuple[Any, ...]: ...

    def restore_bookkeeping(self, before: tuple[Any, ...]) -> None: ...

    def forget_missing(self, evicted: dict[str, float]) -> None: ...

    def name_ranked(self, values: Any) -> str: ...

    def name_last(self, values: Any) -> str: ...

    def exception_path(self, values: Any) -> str: ...


@dataclasses.dataclass
class _Schedule:
    """One policy's counters in one fit (global steps of the last batch seen, of the last full save,
    of the last ``last.ckpt`` written, of a step save waiting for its validation...)."""

    last_step: int = -1
    saved_step: int = -1
    last_written: int = -1
    awaiting: int = -1
    last_time: float = 0.0
    epoch_saves: int = 0
    skipped: int = 0
    skipped_since_save: bool = False
    pending: bool = False
    validated: bool = False
    warned_unscored: bool = False
    prepared_step: int = -1
    fit_last: str = ""
    fitting: bool = False
    monitor_step: int = -1
    evicted: dict[str, float] = dataclasses.field(default_factory=dict)


def _unwritable(folder: str) -> str | None:
    """Why a checkpoint could not be written in ``folder`` (created if missing), or None: a probe
    file is written, fsynced and removed."""
    try:
        write_probe(folder)
    except OSError as exc:
        return _why(exc)
    return None


def _why(exc: OSError) -> str:
    return f"{exc.strerror or exc} ({type(exc).__name__}, errno {exc.errno})"


def _unwritable_error(folder: str, problem: str) -> CheckpointError:
    return CheckpointError(
        f"Checkpoints cannot be written to {folder}: {problem}.",
        "make the folder writable (permissions, a read-only or full file system), or pass "
        "ModelCheckpoint(dirpath=...) / Trainer(default_root_dir=...) elsewhere.",
    )


class Checkpointer:
    """One run's checkpoint manager (``run.checkpointer``). ``policies``: the ``ModelCheckpoint``
    callbacks, first the one the Trainer names its checkpoint callback."""

    def __init__(self, run: Run, policies: list[CheckpointPolicy]) -> None:
        self.run = run
        self.policies = list(policies)
        self._schedules: dict[int, _Schedule] = {}
        # The folders this run asked for (every rank) and holds (rank 0): one live run per folder
        self._claimed: list[str] = []
        self._held: list[str] = []
        # The checkpoint this fit resumed: never removed by its rotation (as in Lightning)
        self._resumed: str = ""

    # ---- writing ---------------------------------------------------------------------------------
    def save(
        self, path: str | os.PathLike, background: bool = False, weights_only: bool = False
    ) -> str:
        """Write the run's state to ``path`` (the Trainer's ``save_checkpoint`` and every policy
        save come here): never from a state whose recent losses are not finite. Returns the
        absolute path."""
        run = self.run
        if run.optimizer is None:
            raise no_training_state(path)
        path = os.path.abspath(os.fspath(path))
        self._check_losses(path)
        return save_checkpoint(run, path, background, weights_only)

    def _check_losses(self, path: str) -> None:
        """No checkpoint from a state whose losses since the last check were NaN/Inf: it would
        rotate good files out."""
        try:
            self.run.logs.check_pending(self.run.state.epoch)
        except NonFiniteLossError as exc:
            cb = self.policies[0] if self.policies else None
            paths = (cb.last_model_path, cb.best_model_path) if cb else ()
            good = [p for p in paths if p and checkpoint_exists(p)]
            raise NonFiniteLossError(
                f"{exc.what} Nothing was saved to {path}; the last good checkpoint is "
                f"{good[0] if good else 'none yet'}.",
                f"resume from it with fit(ckpt_path={good[0]!r}) after the fix: {exc.hint}"
                if good
                else exc.hint,
            ) from None

    def _write(self, policy: CheckpointPolicy, path: str, background: bool) -> None:
        self.save(path, background, weights_only=policy.save_weights_only)

    # ---- the resume lookup -----------------------------------------------------------------------
    def resolve(
        self, ckpt_path: Any, fresh: bool = False
    ) -> tuple[list[str], list[tuple[str, str]]]:
        """The checkpoints ``ckpt_path`` may load, best first, and ``(path, why)`` of those already
        skipped. A path or "best" is one file; "last" is the ``last.ckpt`` this Trainer wrote, else
        the one found under the run directories, followed by the other checkpoints of its folder
        (newest first) and of older versions: a missing, unreadable or damaged ``last.ckpt`` falls
        back to the newest intact one (:func:`load_first`). ``fresh``: "last" finding nothing is a
        warning (fit starts fresh), not an error."""
        if ckpt_path not in ("last", "best"):
            if not isinstance(ckpt_path, (str, os.PathLike)):
                raise CheckpointError(
                    f"ckpt_path={ckpt_path!r} is not a path.",
                    'pass "last", "best" or the path of a .ckpt file.',
                )
            return [os.path.abspath(os.path.expanduser(os.fspath(ckpt_path)))], []
        candidates, skipped, looked = self._last_candidates()
        if ckpt_path == "last":
            return self._resolve_last(candidates, skipped, looked, fresh)
        return [self._best(candidates, skipped)], []

    def _last_candidates(self) -> tuple[list[str], list[tuple[str, str]], list[str]]:
        """Every checkpoint "last" may resume, best first; those skipped; the roots looked in."""
        cb = self.policies[0] if self.policies else None
        # Written by this Trainer
        if cb is not None and cb.last_model_path and checkpoint_exists(cb.last_model_path):
            last = os.path.abspath(cb.last_model_path)
            others = [p for p in folder_candidates(os.path.dirname(last)) if p != last]
            return [last] + others, [], []
        looked: list[str] = []
        candidates: list[str] = []
        skipped: list[tuple[str, str]] = []
        roots = [cb.dirpath_arg] if cb is not None and cb.dirpath_arg else []
        for root in roots + [os.path.dirname(self.run.log_dir)]:
            looked.append(root)
            candidates, skipped = last_candidates(root)
            if candidates:
                break
        return candidates, skipped, looked

    def _resolve_last(
        self, candidates: list[str], skipped: list[tuple[str, str]], looked: list[str], fresh: bool
    ) -> tuple[list[str], list[tuple[str, str]]]:
        where = f"looked for {LAST} in {' and '.join(looked)} and its version_*/checkpoints folders"
        if not candidates and fresh:
            if self.run.strategy.is_main:
                # A last.ckpt that is not one (an empty folder...); then the line that called fit
                warn_skipped(skipped, None, stacklevel=user_stacklevel())
                warnings.warn(
                    f'fit(ckpt_path="last"): there is no checkpoint to resume yet ({where}), so '
                    "this fit starts fresh. HINT: expected on a job's first start; otherwise check "
                    "default_root_dir (or ModelCheckpoint(dirpath=...)) is the folder of the run "
                    "to resume.",
                    UserWarning,
                    stacklevel=user_stacklevel(),
                )
            return [], skipped
        if not candidates:
            raise CheckpointError(
                f'ckpt_path="last" but no checkpoint has been saved yet ({where}).',
                "pass the path of a .ckpt file, or set Trainer(default_root_dir=...) to the "
                "folder of the run whose checkpoint to evaluate.",
            )
        return candidates, skipped

    def _best(self, candidates: list[str], skipped: list[tuple[str, str]]) -> str:
        cb = self.policies[0] if self.policies else None
        best = cb.best_model_path if cb is not None and cb.best_model_path else None
        # The newest run's bookkeeping names its best file
        if best is None and candidates:
            _, ckpt = load_first(
                self.run, "last", candidates, list(skipped), load_checkpoint, warn=False
            )
            states = ckpt.get("callbacks", {})
            best = next(
                (
                    s.get("best_model_path")
                    for s in states.values()
                    if isinstance(s, Mapping) and s.get("best_model_path")
                ),
                None,
            )
        if not best or not checkpoint_exists(best):
            raise CheckpointError(
                f'ckpt_path="best" but no best checkpoint is known (last: '
                f"{candidates[0] if candidates else None}, best: {best}).",
                "train first with a ModelCheckpoint that saves top-k files (save_top_k >= 1, "
                'monitor="val/loss" to rank them), or pass the path of a .ckpt file.',
            )
        return best

    # ---- one live run per folder -----------------------------------------------------------------
    def hold_folders(self) -> None:
        """Before a fit reads the checkpoint to resume: hold the folders given as ``dirpath`` (a
        live run that holds one is refused here, before its files are read). fast_dev_run writes
        nothing: no folder."""
        if self.run.config.fast_dev_run:
            return
        for policy in self.policies:
            if policy.dirpath_arg is not None:
                self._hold(policy.dirpath_arg)

    def _hold(self, folder: str) -> None:
        """Hold ``folder`` for this run, on rank 0; every rank raises when another live process
        holds it."""
        # Asked on every rank alike (the answer is collective)
        if folder in self._claimed:
            return
        self._claimed.append(folder)
        strategy = self.run.strategy
        # (holder, None): another live run; (None, why): the folder or its lock cannot be written
        problem: tuple[str | None, str | None] | None = None
        if strategy.is_main:
            try:
                hold(folder)
                self._held.append(folder)
            except FolderHeld as exc:
                problem = (exc.describe(), None)
            except OSError as exc:
                problem = (None, _why(exc))
        problem = strategy.broadcast(problem) if strategy.world_size > 1 else problem
        if problem and problem[1]:
            raise _unwritable_error(folder, problem[1])
        if problem:
            raise CheckpointError(
                f"Checkpoints cannot be written to {folder}: another live run holds it "
                f"({problem[0]}). Two runs writing one folder overwrite each other's last.ckpt and "
                "top-k files, and a resume would continue the other run's weights.",
                "give each run its own folder (ModelCheckpoint(dirpath=...), one per trial of a "
                "sweep), or end the other run first; the lock of a run that has ended is taken "
                "over by itself.",
            )

    def release(self) -> None:
        """The run ended (any way): let go of the folders it held."""
        while self._held:
            release(self._held.pop())

    def resumed_from(self, path: str) -> None:
        """A resumed fit whose run directory no logger restored continues in the run directory of
        the checkpoint it resumed (``<root>/version_N/checkpoints/<file>``, under this fit's root),
        not in a new ``version_N``: its files are ranked and rotated with the earlier ones
        (Lightning with ``logger=False``: one folder). A checkpoint of another root starts a run
        directory of this one, as before."""
        run = self.run
        self._resumed = os.path.abspath(path)
        folder = os.path.dirname(self._resumed)
        run_dir = os.path.dirname(folder)
        # With a dirpath of its own, a policy's files do not depend on the run directory
        derived = not self.policies or any(p.dirpath_arg is None for p in self.policies)
        same_root = os.path.dirname(run_dir) == os.path.dirname(os.path.abspath(run.log_dir))
        if derived and same_root and not run.log_dir_restored and \
                os.path.basename(folder) == "checkpoints":
            run.set_log_dir(run_dir)

    # ---- the loop's events -----------------------------------------------------------------------
    def _of(self, policy: CheckpointPolicy) -> _Schedule:
        schedule = self._schedules.get(id(policy))
        if schedule is None:
            schedule = self._schedules[id(policy)] = _Schedule(last_time=time.monotonic())
        return schedule

    def fit_start(self, policy: CheckpointPolicy) -> None:
        """The policy's folder, checked writable before the first step; its ranking kept on a
        resume."""
        run, strategy = self.run, self.run.strategy
        folder = policy.resolve_dirpath(run.log_dir)
        if policy.save_weights_only and strategy.sharded_checkpoints:
            raise MisconfigurationError(
                "ModelCheckpoint(save_weights_only=True) cannot write sharded (fsdp) checkpoints.",
                "save full checkpoints under fsdp and write one weights file afterwards: python -m "
                "taskfit.consolidate <checkpoint> <file> (TaskModule.load_from_checkpoint reads "
                "it).",
            )
        # fast_dev_run writes nothing, not even the folder (Lightning's)
        if not run.config.fast_dev_run:
            problem = strategy.broadcast(_unwritable(folder) if strategy.is_main else None)
            # Before the first step, on every rank: not after an epoch of training
            if problem:
                raise _unwritable_error(folder, problem)
            self._hold(folder)
        if not run.state.resumed:
            policy.start_ranking()
        step = run.state.global_step
        monitor_step = self._of(policy).monitor_step
        self._schedules[id(policy)] = _Schedule(
            last_step=step,
            saved_step=step,
            last_written=step,
            last_time=time.monotonic(),
            fitting=True,
            monitor_step=monitor_step,
        )

    def step_end(self, policy: CheckpointPolicy, batch_idx: int) -> None:
        """After a training batch: a step or time save when one is due."""
        run, sched = self.run, self._of(policy)
        run.checkpoint_writer.check()
        step = run.state.global_step
        # No optimizer step in this batch (accumulation): nothing new to save
        if step == sched.last_step:
            return
        sched.last_step = step
        every = policy.every_n_train_steps
        due = every is not None and step % every == 0
        if policy.train_time_interval is not None and not due:
            due = self._time_due(policy, sched, step)
        if not due or step == sched.saved_step or run.config.fast_dev_run:
            return
        if (
            policy.monitor not in (None, *LOOP_KEYS)
            and sched.monitor_step != step
            and self._validates_now(batch_idx)
        ):
            # This step's validation brings its score
            sched.pending, sched.awaiting = True, step
            sched.last_time = time.monotonic()
        else:
            self.save_now(policy)

    def logged(self, policy: CheckpointPolicy, metrics: dict[str, float]) -> None:
        """The step whose state produced a score: a file is ranked by its own score."""
        self.run.checkpoint_writer.check()
        if policy.monitor in metrics:
            self._of(policy).monitor_step = self.run.state.global_step

    def validation_end(self, policy: CheckpointPolicy) -> None:
        run = self.run
        if run.state.fn != "fit":
            return
        run.checkpoint_writer.check()
        self._of(policy).validated = True
        self._save_pending(policy)
        if not self._saves_at_epoch_end(policy) and self._epoch_due(policy):
            self._epoch_save(policy)

    def epoch_end(self, policy: CheckpointPolicy) -> None:
        # A partial epoch (max_steps, a stop, a signal) is saved at fit end or by the preemption
        # save
        if not self.run.state.epoch_done:
            return
        self.run.checkpoint_writer.check()
        self._check_monitor(policy)
        self._save_pending(policy)
        if self._saves_at_epoch_end(policy) and self._epoch_due(policy):
            self._epoch_save(policy)

    def fit_end(self, policy: CheckpointPolicy) -> None:
        # (still fitting: an error in a later on_fit_end saves, as in Lightning)
        run, sched = self.run, self._of(policy)
        step = run.state.global_step
        if step != sched.saved_step and not run.config.fast_dev_run:
            # The ranked file too: best_model_path must be the final state
            if sched.skipped_since_save:
                self.save_now(policy)
            # Training ended between two saves
            elif policy.save_last and step != sched.last_written:
                self._write_last(policy)
        if sched.skipped and run.strategy.is_main:
            final = (
                os.path.basename(policy.last_model_path) if policy.save_last else "the ranked file"
            )
            echo(
                f"ModelCheckpoint: {sched.skipped} of {sched.epoch_saves} epoch-end saves skipped "
                f"(epochs shorter than min_epoch_interval={policy.min_epoch_interval} s); the "
                f"final state is in {final}. ModelCheckpoint(min_epoch_interval=0) saves every "
                "epoch, as Lightning does.",
                name="taskfit.checkpoint",
            )

    def exception(self, policy: CheckpointPolicy, exception: BaseException) -> None:
        """A save that failed in the background (a full disk): the policy forgets the files that are
        not on disk, so that its bookkeeping and the folder agree. Then ``save_on_exception``'s
        file."""
        run, sched = self.run, self._of(policy)
        if run.strategy.is_main:
            policy.forget_missing(sched.evicted)
        fitting, sched.fitting = sched.fitting, False
        st = run.state
        if not (
            policy.save_on_exception
            and fitting
            and st.fn == "fit"
            and not run.config.fast_dev_run
            and st.stage != "sanity"
            and st.global_step not in (sched.saved_step, sched.prepared_step)
        ):
            # As Lightning: nothing to add when this step's state is already saved
            return
        if run.strategy.world_size > 1:
            # A save is collective: the other ranks may not be in this hook
            warnings.warn(
                f"ModelCheckpoint(save_on_exception=True) saved nothing for this "
                f"{type(exception).__name__}: under ddp a save needs every rank. HINT: the saves "
                f"before the error are in {policy.dirpath}; save more often (every_n_train_steps) "
                "to lose less.",
                stacklevel=3,
            )
            return
        self._exception_save(policy, exception)

    def preempt(self) -> str:
        """A preemption signal at a step boundary: the state to the ``last`` checkpoint (the first
        policy's name for it, else ``<log_dir>/checkpoints/last.ckpt``), written now. Returns its
        path."""
        policy = self.policies[0] if self.policies else None
        if policy is not None:
            path = self._name_last(policy)
        else:
            path = os.path.join(self.run.log_dir, "checkpoints", LAST)
        return self.save(path)

    # ---- when ------------------------------------------------------------------------------------
    def _time_due(self, policy: CheckpointPolicy, sched: _Schedule, step: int) -> bool:
        strategy, interval = self.run.strategy, policy.train_time_interval
        # Ranks must agree: decide on rank 0, only where ranks sync anyway
        if strategy.world_size > 1:
            if step % self.run.config.log_every_n_steps:
                return False
            return bool(strategy.broadcast(time.monotonic() - sched.last_time >= interval))
        return time.monotonic() - sched.last_time >= interval

    def _validates_now(self, batch_idx: int) -> bool:
        """A validation runs right after this batch, at this step (Lightning defers a step save to
        it)."""
        run, st = self.run, self.run.state
        schedule = run.val_schedule
        return (
            bool(run.num_val_batches)
            and schedule.in_epoch(st.epoch)
            and schedule.due(st.epoch, batch_idx)
        )

    def _save_pending(self, policy: CheckpointPolicy) -> None:
        """A step/time save that had no score of its own: rank this state if its score is here now.
        """
        sched, step = self._of(policy), self.run.state.global_step
        if sched.pending and sched.monitor_step == step and step != sched.saved_step:
            self.save_now(policy)
        # The validation of its step did not log the monitor either
        elif sched.awaiting == step:
            self._unscored(policy)
        sched.awaiting = -1

    def _saves_at_epoch_end(self, policy: CheckpointPolicy) -> bool:
        """Lightning's rule for where epoch saves happen (see ``save_on_train_epoch_end``)."""
        if policy.save_on_train_epoch_end is not None:
            return policy.save_on_train_epoch_end
        config = self.run.config
        if config.check_val_every_n_epoch != 1:
            return False
        return not self.run.num_val_batches or config.val_check_interval == 1.0

    def _epoch_due(self, policy: CheckpointPolicy) -> bool:
        st, every = self.run.state, policy.every_n_epochs
        return (
            every >= 1
            and (st.epoch + 1) % every == 0
            and st.global_step != self._of(policy).saved_step
            and not self.run.config.fast_dev_run
        )

    def _epoch_save(self, policy: CheckpointPolicy) -> None:
        """An epoch save, skipped when it is too soon after the last one and would only replace the
        newest file (a monitored save never is: a new best must be on disk). Under ddp rank 0
        decides."""
        sched, strategy = self._of(policy), self.run.strategy
        sched.epoch_saves += 1
        if policy.monitor is None and policy.save_top_k in (0, 1) and policy.min_epoch_interval > 0:
            soon = time.monotonic() - sched.last_time < policy.min_epoch_interval
            if strategy.world_size > 1:
                soon = bool(strategy.broadcast(soon))
            if soon:
                sched.skipped += 1
                sched.skipped_since_save = True
                return
        self.save_now(policy)

    def _check_monitor(self, policy: CheckpointPolicy) -> None:
        """At the end of a completed epoch after a validation (or without validation data), the
        monitored key must have been logged. Else one error, before saving."""
        metrics, monitor = self.run.state.metrics, policy.monitor
        if (
            monitor in (None, *LOOP_KEYS)
            or monitor in metrics
            or (self.run.num_val_batches and not self._of(policy).validated)
        ):
            return
        logged = sorted(metrics)
        close = difflib.get_close_matches(monitor, logged, n=1, cutoff=0.5)
        raise MisconfigurationError(
            f"ModelCheckpoint(monitor={monitor!r}) is not a logged key; logged: {logged}.",
            (f"did you mean {close[0]!r}? " if close else "")
            + "use one of the logged keys (validation metrics are named val/<name>), log it with "
            "self.log, or pass monitor=None to keep the newest files.",
        )

    # ---- what ------------------------------------------------------------------------------------
    def candidates(self) -> dict[str, Any]:
        """Lightning's monitor candidates: the logged values, ``epoch`` and ``step`` (as logged,
        else the loop's; between two epochs, at the end of fit, the epoch it completed)."""
        st, metrics = self.run.state, self.run.state.metrics
        return {
            **metrics,
            "epoch": int(metrics.get("epoch", st.checkpoint_epoch)),
            "step": int(metrics.get("step", st.global_step)),
        }

    def _score(self, policy: CheckpointPolicy) -> float | None:
        """This state's score: its global step without a monitor, ``epoch``/``step`` always, a
        logged key when it was logged at this step (else None: the state has no score of its own).
        """
        st, monitor = self.run.state, policy.monitor
        if monitor is None:
            return float(st.global_step)
        if monitor in LOOP_KEYS:
            return float(self.candidates()[monitor])
        if monitor in st.metrics and self._of(policy).monitor_step == st.global_step:
            return st.metrics[monitor]
        return None

    def _unscored(self, policy: CheckpointPolicy) -> None:
        """This state has no score of its own (e.g. a step save between validations): last.ckpt
        only, and the next state that has one is ranked (Lightning would rank this one by an earlier
        state's score)."""
        st, sched = self.run.state, self._of(policy)
        sched.pending = True
        if not sched.warned_unscored:
            what = (
                "was logged at an earlier step"
                if policy.monitor in st.metrics
                else "has not been logged yet"
            )
            warnings.warn(
                f"ModelCheckpoint(monitor={policy.monitor!r}) {what}, so the state of step "
                f"{st.global_step} has no score of its own: only last.ckpt is written for it, and "
                "the next state whose score is logged (after a validation or at an epoch end) is "
                "ranked instead. HINT: save when validation has run (every_n_epochs), or validate "
                "at the steps you save (val_check_interval).",
                stacklevel=4,
            )
            sched.warned_unscored = True
        if st.global_step != sched.last_written:
            self._write_last(policy)

    def _say(self, policy: CheckpointPolicy, message: str) -> None:
        """``verbose``: Lightning's line for a monitored save."""
        if policy.verbose and policy.monitor is not None and self.run.strategy.is_main:
            st = self.run.state
            echo(
                f"Epoch {st.epoch:d}, global step {st.global_step:d}: {message}",
                name="taskfit.checkpoint",
            )

    def _name_last(self, policy: CheckpointPolicy) -> str:
        """The policy's ``last`` file for this state, recorded as its ``last_model_path`` before
        writing."""
        path = policy.name_last(collections.defaultdict(int, self.candidates()))
        self._of(policy).prepared_step = self.run.state.global_step
        return path

    def _written_last(self, policy: CheckpointPolicy) -> None:
        """After a last-file write was queued: the previous one this fit wrote goes once it is in
        place, when the name changed (a ``CHECKPOINT_NAME_LAST`` with fields, e.g.
        ``"last-{epoch}"``), as in Lightning."""
        sched = self._of(policy)
        old, sched.fit_last = sched.fit_last, policy.last_model_path
        if (
            old
            and old not in (sched.fit_last, self._resumed)
            and not policy.is_ranked(old)
            and self.run.strategy.is_main
        ):
            self.run.checkpoint_writer.submit(remove_files, [old])

    def _write_last(self, policy: CheckpointPolicy) -> None:
        if policy.save_last:
            self._write(policy, self._name_last(policy), background=True)
            self._of(policy).last_written = self.run.state.global_step
            self._written_last(policy)

    def save_now(self, policy: CheckpointPolicy) -> None:
        """Save now: a ranked file if it makes the top k, and ``last.ckpt``; then delete what fell
        out of the top k. Serialised now; the fsync, rename, ``last.ckpt`` copy and removals follow
        in that order on the checkpoint writer's thread, so the loop does not wait for the disk. A
        save that fails leaves the policy's bookkeeping as it was."""
        before = policy.bookkeeping()
        try:
            self._save(policy)
        except BaseException:
            # Nothing of this save is on disk: the bookkeeping must not name its files
            policy.restore_bookkeeping(before)
            raise
        self._of(policy).last_time = time.monotonic()

    def _save(self, policy: CheckpointPolicy) -> None:
        run, sched = self.run, self._of(policy)
        score = self._score(policy)
        if score is None:
            self._unscored(policy)
            return
        path, evicted, scores = self._rank(policy, score)
        last = self._name_last(policy) if policy.save_last else None
        writer, is_main = run.checkpoint_writer, run.strategy.is_main
        if path is not None:
            # Holds the bookkeeping above, which counts this file
            self._write(policy, path, background=True)
            if last and is_main:
                # A copy: one damage never hits both
                writer.submit(atomic_copy, path, last)
        elif last:
            self._write(policy, last, background=True)
        if last:
            self._written_last(policy)
        # As Lightning's: only files of this folder, never the checkpoint this fit resumed from
        evicted = [
            old
            for old in evicted
            if os.path.dirname(old) == policy.dirpath
            and old not in (path, policy.last_model_path, self._resumed)
        ]
        # Until their removal has run (after the new file is in place), evicted files and their
        # scores are kept in mind: if that write fails, the removal is skipped and the exception
        # ranks them again.
        sched.evicted = {p: s for p, s in sched.evicted.items() if checkpoint_exists(p)}
        sched.evicted.update((old, scores[old]) for old in evicted)
        if is_main and evicted:
            # Old files go only once their replacement is in
            writer.submit(remove_files, evicted)
        step = run.state.global_step
        sched.saved_step = step
        sched.skipped_since_save = sched.pending = False
        sched.last_written = step if last else sched.last_written

    def _rank(self, policy: CheckpointPolicy,
              score: float) -> tuple[str | None, list[str], dict[str, float]]:
        """The ranked file this state goes to (None: not in the top k), the files it pushes out, and
        the scores before."""
        scores = policy.ranked_scores()
        if policy.save_top_k == 0:
            return None, [], scores
        if not policy.qualifies(score):
            self._say(policy, f"{policy.monitor!r} was not in top {policy.save_top_k}")
            return None, [], scores
        path = policy.name_ranked(self.candidates())
        evicted = policy.rank(path, score)
        top = len(scores) + 1 if policy.save_top_k == -1 else policy.save_top_k
        best = policy.ranked_scores()[policy.best_model_path]
        self._say(
            policy,
            f"{policy.monitor!r} reached {score:0.5f} (best {best:0.5f}), saving model to "
            f"{path!r} as top {top}",
        )
        return path, evicted, scores

    def _exception_save(self, policy: CheckpointPolicy, exception: BaseException) -> None:
        """Lightning's ``save_on_exception``: the state as it is, to ``filename`` (unranked; a
        missing key is 0, no version counter) and to ``last.ckpt``. A save that fails is a warning:
        the error to report is ``exception``."""
        path = policy.exception_path(collections.defaultdict(int, self.candidates()))
        try:
            self._write(policy, path, background=False)
            if policy.save_last:
                atomic_copy(path, self._name_last(policy))
        # The exception already propagating is the one to report
        except Exception as exc:  # noqa: BLE001
            warnings.warn(
                f"ModelCheckpoint(save_on_exception=True) could not save to {path}: {exc!r}.",
                stacklevel=4,
            )
            return
        echo(
            f"An {type(exception).__name__} was raised with message: {exception}, saved checkpoint "
            f"to {path}",
            name="taskfit.checkpoint",
        )
