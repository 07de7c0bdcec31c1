"""Preemption: a signal (SIGTERM, SIGUSR1...) becomes a flag; the loop saves at the next step
boundary and exits.

The handler only records the signal. The loop asks :attr:`Preemption.requested` between epochs and
:meth:`Preemption.should_break` after each optimizer step. Under ddp every rank must stop at the
same step, and a scheduler's grace period (30 s) must not wait for a log interval of slow steps:
every ``period`` optimizer steps each rank starts an all-reduce of its flags without waiting for it
(gloo threads do the work) and reads the result of the previous one, finished by then, so the ranks
agree on a signal one or two exchanges after it arrives, with no collective that waits. The period
is 1 step unless steps are shorter than ``EXCHANGE_S`` (an exchange costs ~70 us of the training
thread): then as many steps as take that long, agreed by every rank at each blocking agreement
(:meth:`Preemption.agree`: the log interval, validation, the epoch end). One process pays nothing of
this.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..cluster import detect, note_signal, slurm_job_id
from ..console import echo
from ..errors import MisconfigurationError

if TYPE_CHECKING:
    from ..state import TrainerState
    from ..strategies.base import Strategy


def normalize_signals(names: Any) -> tuple[str, ...]:
    """``preempt_signals`` as full names: one name or several, ``"TERM"`` or ``"SIGTERM"``; () turns
    preemption off. Anything else is one error at construction: a signal that does nothing must not
    pass silently."""
    if isinstance(names, str):
        names = (names,)
    valid = sorted(
        s.name for s in signal.Signals if s.name.startswith("SIG") and not s.name.startswith("SIG_")
    )
    out = []
    for name in names if isinstance(names, (list, tuple)) else [names]:
        full = name.upper() if isinstance(name, str) else name
        full = full if not isinstance(full, str) or full.startswith("SIG") else "SIG" + full
        if full not in valid or full in ("SIGKILL", "SIGSTOP"):
            raise MisconfigurationError(
                f"Trainer(preempt_signals={names!r}): {name!r} is not a signal taskfit can catch.",
                'name signals like "SIGTERM" or "TERM" (one, or a list: ["SIGTERM", "SIGUSR1"]); '
                'SIGKILL and '
                "SIGSTOP cannot be caught. Pass () to turn preemption checkpoints off.")
        out.append(full)
    return tuple(out)


# ddp: the flag exchange runs at least every this many seconds of steps (or every step)
EXCHANGE_S = 0.05
MAX_PERIOD = 1000


def requeue_setting(requeue: Any, signals: Sequence[str]) -> bool:
    """``Trainer(requeue=...)``: whether a SIGUSR1 also requeues the SLURM job (``scontrol
    requeue``) after its checkpoint. None: yes in a SLURM batch job (as Lightning's
    SLURMEnvironment(auto_requeue=True)), else no."""
    if requeue is not None and not isinstance(requeue, bool):
        raise MisconfigurationError(f"Trainer(requeue={requeue!r}) is not valid.",
                                    "pass True (requeue the SLURM job on SIGUSR1), False, or None "
                                    "(True under SLURM).")
    in_slurm = slurm_job_id() is not None
    if requeue and "SIGUSR1" not in signals:
        raise MisconfigurationError(
            "Trainer(requeue=True) requeues the SLURM job when SIGUSR1 arrives, but "
            f"preempt_signals={signals!r} leaves SIGUSR1 "
            "alone.",
            'add "SIGUSR1" to preempt_signals (sbatch --signal=USR1@120 sends it), or pass '
            "requeue=False.",
        )
    if requeue and not in_slurm:
        warnings.warn("Trainer(requeue=True) outside a SLURM job (no SLURM_JOB_ID): a SIGUSR1 "
                      "saves and exits, and there is no job to requeue. HINT: it takes effect in a "
                      "job started by sbatch; requeue=None turns it on there by "
                      "itself.", UserWarning, stacklevel=4)
    return bool(requeue if requeue is not None else in_slurm and "SIGUSR1" in signals)


class _AfterFit:
    """The handler of the preemption signals after a fit under a launcher (torchrun, SLURM, ddp's
    own workers), until the process exits. A scheduler signals every rank, but not at the same
    instant: a rank that learned of the signal from its peers has saved and is on its way out when
    its own signal lands, 0.3-0.5 s later (or a second one comes). Restoring the default handler
    there killed it by the signal (status -10, not 138). So: while the process exits from a
    preemption, the signals are ignored (SIG_IGN: :meth:`Preemption.uninstall`; the status is
    decided and the checkpoint written); this handler serves after a fit that ended otherwise: the
    first signal ends the process with SystemExit(128 + signal) (nothing is left to save), the next
    ones are recorded. SIGINT keeps its handler after a normal end."""

    def __init__(self) -> None:
        self.exit_code: int | None = None  # the status of the preemption exit in progress
        self.stopping = False

    def __call__(self, signum: int, frame: Any) -> None:
        # a launcher that dies now does not stop this process first (cluster.orphaned)
        note_signal(signum)
        if self.exit_code is not None or self.stopping:
            return
        self.stopping = True
        try:
            os.write(2, f"taskfit: {signal.Signals(signum).name} received after the fit ended; "
                        f"exiting with status {128 + signum}.\n".encode())
        except OSError:
            pass
        raise SystemExit(128 + signum)


AFTER_FIT = _AfterFit()


def under_launcher() -> bool:
    """This process is one of a launcher's (torchrun, srun, ddp's own workers), or a SLURM job's
    single task."""
    return detect() is not None or slurm_job_id() is not None


class Preemption:
    """The preemption signals of one run: handlers installed for fit, restored by :meth:`uninstall`
    (under a launcher replaced by :data:`AFTER_FIT` instead, until the process exits)."""

    def __init__(self, names: Sequence[str], strategy: Strategy, install: bool) -> None:
        self.strategy = strategy
        # the signal received on this rank (or, under ddp, agreed from another)
        self.signum: int | None = None
        self.agreed = False  # ddp: every rank knows of a signal, so all of them save together
        self.stop_agreed = False  # ddp: every rank knows of a stop (should_stop or a signal)
        self._previous: dict[int, Any] = {}
        # ddp: [should_stop, signal number], all-reduced in place every `period` steps
        self._flags = torch.zeros(2)
        # ... and that all-reduce (in flight while _pending, until the next exchange reads it)
        self._work: Any = None
        self._pending = False
        self._held = [0.0, 0.0]  # what the buffer holds (the last reduced flags)
        # ddp: optimizer steps between exchanges; steps since the last one
        self.period, self._steps = 1, 0
        # ddp: time and global step at the last blocking agreement
        self._clock: tuple[float, int] | None = None
        # set by loop/checkpointing.py's preempt just before it exits the process
        self.exit_code: int | None = None
        if install and threading.current_thread() is threading.main_thread():
            for name in names:
                signum = getattr(signal, name, None)
                if signum is not None:
                    self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.signum is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: abort at once, as Python would have
        self.signum = signum  # only a flag: the loop saves and exits at the next step boundary
        # a launcher that dies now does not stop this process before it has saved
        note_signal(signum)
        if signum == signal.SIGINT and self.strategy.is_main:
            echo("\ntaskfit: Ctrl-C: finishing this step, then saving a checkpoint and exiting "
                 "(Ctrl-C again to abort at "
                 "once).", stream=sys.stderr, level=logging.WARNING, name="taskfit.preemption")

    def uninstall(self) -> None:
        """The handlers before the run come back; under a launcher :data:`AFTER_FIT` takes their
        place instead: a preemption signal that lands late (after this rank saved on its peers'
        word) or twice never kills the process by its default action, and every rank exits with the
        documented status."""
        keep = bool(self._previous) and under_launcher()
        if keep:
            AFTER_FIT.exit_code, AFTER_FIT.stopping = self.exit_code, False
        if keep and self.exit_code is not None and self.signum is not None:
            # the exit is decided: a launcher that dies now must not stop it (cluster.orphaned)
            note_signal(self.signum)
        for signum, handler in self._previous.items():
            if keep and self.exit_code is not None:
                # a preemption exit in progress: a late signal is ignored by the kernel, to the
                # process's last instruction. A Python handler is not enough: the interpreter's
                # finalization sets it back to the default action, and a scheduler's per-task
                # signal 0.3-0.5 s after a peer's killed the rank there (-10, not 138)
                handler = signal.SIG_IGN
            elif keep and signum != signal.SIGINT:
                handler = AFTER_FIT
            signal.signal(signum, handler)
        self._previous = {}

    @property
    def requested(self) -> bool:
        """A signal arrived (under ddp: one that every rank has agreed on)."""
        return self.agreed if self.strategy.world_size > 1 else self.signum is not None

    def should_break(self, state: TrainerState) -> bool:
        """Leave the epoch after this optimizer step: a stop or a signal (under ddp: agreed by every
        rank)."""
        if self.strategy.world_size > 1:
            self._steps += 1
            if self._steps >= self.period:
                self._steps = 0
                self._exchange(state)
            return self.stop_agreed
        return state.should_stop or self.signum is not None

    def _exchange(self, state: TrainerState) -> None:
        """ddp, every ``period`` optimizer steps: take the flags every rank had at the last exchange
        (that all-reduce has had ``period`` steps to finish: ``wait`` returns at once) and start the
        all-reduce of now's."""
        self._collect(state)
        mine = [float(state.should_stop), float(self.signum or 0)]
        # written only when it differs: no tensor write on a step where nothing happened
        if mine != self._held:
            self._flags.copy_(torch.tensor(mine))
        self._work, self._pending = self.strategy.exchange_flags(self._flags), True

    def _collect(self, state: TrainerState) -> None:
        """The exchange in flight, if any: wait for it (every rank has started it) and take in its
        result. The finished work stays referenced here until the next one: released by gloo's
        thread instead, it would need the GIL to free its Python tensor, and at interpreter exit
        that thread aborts the process."""
        if self._pending:
            self._work.wait()
            self._pending, self._held = False, self._flags.tolist()
            self._absorb(state, *self._held)

    def _absorb(self, state: TrainerState, stop: float, signalled: float) -> None:
        """Some rank wanted to stop, or got a signal: now every rank knows it (each reads the same
        reduced flags; of several signals, the highest number: SIGTERM over SIGUSR1 over SIGINT)."""
        state.should_stop = state.should_stop or bool(stop)
        if signalled:
            self.signum = max(self.signum or 0, int(signalled))
        self.agreed = self.agreed or bool(signalled)
        self.stop_agreed = self.stop_agreed or bool(stop or signalled)

    def agree(self, state: TrainerState) -> None:
        """Under ddp, make every rank agree on ``should_stop`` and a signal (one tiny all-reduce),
        and on the exchange period: the smallest that any rank proposes from its own step time since
        the last agreement. Every rank calls it at the same points (the log interval, validation,
        each epoch's start)."""
        if self.strategy.world_size == 1:
            return
        self._collect(state)  # nothing stays in flight past an agreement (fit's last one included)
        now, steps = time.perf_counter(), state.global_step
        # the first: after a resume too
        (then, before), self._clock = self._clock or (now, steps), (now, steps)
        proposal = self.period if steps <= before else \
            max(1, min(MAX_PERIOD, int(EXCHANGE_S * (steps - before) / max(now - then, 1e-9))))
        flags = torch.tensor([float(state.should_stop), float(self.signum or 0), -float(proposal)],
                             device=self.strategy.device)
        stop, signalled, period = self.strategy.all_reduce(flags, op="max").tolist()
        self._absorb(state, stop, signalled)
        self.period, self._steps = int(-period), 0  # every rank, at the same step
