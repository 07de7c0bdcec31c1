"""Driver of the staggered SLURM signal test (tests/test_cluster.py): a 2-task job in the shape
``srun --ntasks=2 python train.py`` gives it, many times.

    python tests/slurm_signal_script.py ROOT REPETITIONS

torch is imported once; each repetition forks the job's two tasks as the launcher does: each
task its own process, in a process group of its own, with SLURM's variables of its rank (they
form the ddp group themselves), which ends as a Python program ends: through the interpreter's
finalization (not ``os._exit``: that skipped the moment a late signal killed a task). When rank
0 trains its fourth step, the driver signals task 0's group with SIGUSR1, then task 1's
0.27-0.48 s later (SLURM delivers ``--signal=USR1@120`` per task, not at one instant). Each
repetition gets ``DEADLINE`` s (a hang, not a slow machine). Prints one JSON line: each
repetition's two exit statuses, whether it hung, whether ``last.ckpt`` is there, the ``scontrol
requeue`` calls (a stand-in on PATH records them) and the stagger.
"""
from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)

from taskfit import Trainer, seed_everything  # noqa: E402
from taskfit.callbacks import Callback  # noqa: E402
from taskfit.strategies.spawn import free_port  # noqa: E402
from tasks import RegressionTask  # noqa: E402

DEADLINE = 120.0


class Training(Callback):
    """Steps of 20 ms more; rank 0 says when its fourth step ends (the scheduler signals then)."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        time.sleep(0.02)
        if trainer.strategy.rank == 0 and trainer.state.global_step == 4:
            open(self.flag, "w").close()


def _task(folder: str, rank: int, port: int) -> None:
    """One task of the job: SLURM's variables, then the job's one command."""
    os.environ.update(SLURM_JOB_ID="4242", SLURM_JOB_NAME="train", SLURM_NTASKS="2",
                      SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_NODEID="0",
                      SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODELIST="localhost",
                      MASTER_PORT=str(port), SCONTROL_CALLS=os.path.join(folder, "scontrol_calls"))
    seed_everything(0)
    trainer = Trainer(accelerator="cpu", max_epochs=50,
                      default_root_dir=os.path.join(folder, "runs"), enable_progress_bar=False,
                      enable_model_summary=False, logger=False, num_sanity_val_steps=0,
                      callbacks=[Training(os.path.join(folder, "training"))])
    trainer.fit(RegressionTask(n=64), ckpt_path="last")


def _fork_task(folder: str, rank: int, port: int) -> int:
    """Fork task ``rank``: in a process group of its own, its output in ``task<rank>.txt``. The
    child never returns here: the job's SystemExit (or its end) unwinds it out of this script, and
    its interpreter exits as the job's would, finalization included."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    os.setpgrp()
    log = os.path.join(folder, f"task{rank}.txt")
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    _task(folder, rank, port)
    sys.exit(0)


def _wait(pids: list[int], deadline: float) -> tuple[bool, list[int]]:
    """(hung, exit statuses) of the tasks ``pids``; killed at ``deadline``."""
    statuses: dict[int, int] = {}
    while len(statuses) < len(pids):
        for pid in pids:
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = status
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    hung = len(statuses) < len(pids)
    for pid in pids:
        try:  # a task that hung, and anything a task left in its group
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if pid not in statuses:
            statuses[pid] = os.waitpid(pid, 0)[1]
    return hung, [os.waitstatus_to_exitcode(statuses[pid]) for pid in pids]


def _run(folder: str) -> dict:
    os.makedirs(folder)
    port, started = free_port(), time.monotonic()
    pids = [_fork_task(folder, rank, port) for rank in (0, 1)]
    flag, stagger = os.path.join(folder, "training"), random.uniform(0.27, 0.48)
    while not os.path.exists(flag) and time.monotonic() < started + DEADLINE:
        # (a task ended before it trained: its status says why; looked at, not reaped)
        if any(os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) for pid in pids):
            break
        time.sleep(0.005)
    for i, pid in enumerate(pids):
        if i:
            time.sleep(stagger)
        try:  # the task's process group, as slurmstepd signals a task
            os.killpg(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    hung, codes = _wait(pids, started + DEADLINE)
    calls = os.path.join(folder, "scontrol_calls")
    last = [d for d, _, files in os.walk(folder) if "last.ckpt" in files]
    tails = []
    for rank in (0, 1):
        with open(os.path.join(folder, f"task{rank}.txt"), errors="replace") as fh:
            tails.append(fh.read()[-400:])
    return {"codes": codes, "hung": hung, "checkpoint": bool(last), "stagger": round(stagger, 3),
            "requeues": open(calls).read().splitlines() if os.path.exists(calls) else [],
            "seconds": round(time.monotonic() - started, 1), "tails": tails}


def main() -> None:
    root, repetitions = sys.argv[1], int(sys.argv[2])
    scontrol = os.path.join(root, "bin", "scontrol")
    os.makedirs(os.path.dirname(scontrol))
    with open(scontrol, "w") as fh:
        fh.write('#!/bin/sh\necho "$@" >> "$SCONTROL_CALLS"\n')
    os.chmod(scontrol, 0o755)
    os.environ["PATH"] = f"{os.path.dirname(scontrol)}{os.pathsep}{os.environ['PATH']}"
    runs = [_run(os.path.join(root, f"run{i}")) for i in range(repetitions)]
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
