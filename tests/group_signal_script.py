"""Driver of the group-signal tests (tests/test_cluster.py): SIGTERM to a whole process group with DataLoader
workers, many times, each time at another moment of the workers' lives.

    python tests/group_signal_script.py ROOT REPETITIONS [MODE [PARALLEL]]

torch is imported once; every repetition is a forked child in a process group of its own (a real process group,
a real ``killpg``), training with ``num_workers=2``, whose workers are restarted every epoch. MODE:

* ``random`` (default): a timer in the trainer process signals the group at a random moment around the start of
  the next epoch's workers;
* ``window``: a new worker signals its own group right after torch has installed its signal handlers and before
  ``worker_init_fn`` runs: the moment a worker used to die of the signal;
* ``mixed``: the two in turn;
* ``kill_worker``: a worker is SIGKILLed (the out-of-memory killer) at the same time as the group SIGTERM.

``PARALLEL`` repetitions (default 1) run at the same time: a run killed by a worker's death
spends most of its time waiting for the DataLoader's own check (5 s without a batch), which
costs no CPU.

Each repetition gets ``DEADLINE`` s (a hang, not a slow machine: a run takes about a second). Prints one JSON
line: the exit status of every repetition, which of them hung (killed at the deadline), which left a
``last.ckpt``, which printed a DataLoader worker's death, and how long each ran (reported, never asserted).
"""
from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)

from resume_script import start_child  # noqa: E402
from taskfit import Trainer  # noqa: E402
from taskfit.callbacks import Callback  # noqa: E402
from tasks import RegressionTask  # noqa: E402
from torch.utils.data._utils import signal_handling  # noqa: E402

DEADLINE = 90.0
_install_handlers = signal_handling._set_worker_signal_handlers


def _signal_from_the_window(*args, **kwargs):
    """In a new worker: torch's handlers are in place, ``worker_init_fn`` has not run yet. Signal the group."""
    _install_handlers(*args, **kwargs)
    if os.environ.get("SIGNAL_FROM_WORKER") == "1":
        os.environ["SIGNAL_FROM_WORKER"] = "0"  # this process only (a fork of the trainer: its own copy)
        os.killpg(os.getpgrp(), signal.SIGTERM)


class Preempt(Callback):
    def __init__(self, mode: str) -> None:
        self.mode = mode

    def on_train_epoch_end(self, trainer, task):
        if trainer.state.epoch != 1:
            return
        if self.mode == "window":  # the next epoch's first worker sends it
            os.environ["SIGNAL_FROM_WORKER"] = "1"
        elif self.mode == "kill_worker":
            threading.Timer(random.uniform(0, 0.05), self._kill_worker).start()
        else:
            threading.Timer(random.uniform(0, 0.08), os.killpg, (os.getpgrp(), signal.SIGTERM)).start()

    @staticmethod
    def _kill_worker():
        children = _children(os.getpid())
        if children:
            try:  # an epoch's workers may have just exited between the scan and the kill: the group is still signalled
                os.kill(children[0], signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.killpg(os.getpgrp(), signal.SIGTERM)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _child(root: str, mode: str) -> None:
    signal_handling._set_worker_signal_handlers = _signal_from_the_window
    trainer = Trainer(max_epochs=40, default_root_dir=root, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Preempt(mode)])
    trainer.fit(RegressionTask(n=64, batch_size=8, num_workers=2))


def _start(root: str, mode: str) -> tuple[int, float]:
    os.makedirs(root, exist_ok=True)
    log = os.path.join(root, "output.txt")
    pid = start_child(lambda: (random.seed(os.getpid()), _child(root, mode)), log)  # its own process group
    return pid, time.monotonic()


def _poll(pid: int, started: float) -> tuple[bool, int] | None:
    """(hung, status) of a finished (or, past its deadline, killed) repetition; None while it
    runs."""
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        return False, status
    if time.monotonic() > started + DEADLINE:
        os.killpg(pid, signal.SIGKILL)
        return True, os.waitpid(pid, 0)[1]
    return None


def _finish(root: str, pid: int, started: float, hung: bool, status: int) -> dict:
    log = os.path.join(root, "output.txt")
    try:
        os.killpg(pid, signal.SIGKILL)  # any worker left behind in that group
    except ProcessLookupError:
        pass
    with open(log, errors="replace") as fh:
        output = fh.read()
    last = os.path.join(root, "version_0", "checkpoints", "last.ckpt")
    return {"code": os.waitstatus_to_exitcode(status), "hung": hung, "checkpoint": os.path.isfile(last),
            "worker_died": "DataLoader worker" in output, "seconds": round(time.monotonic() - started, 1),
            "tail": output[-600:]}


def main() -> None:
    root, repetitions = sys.argv[1], int(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "random"
    parallel = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    runs: list[dict | None] = [None] * repetitions
    # repetition: (pid, started, mode)
    running: dict[int, tuple[int, float, str]] = {}
    todo = list(range(repetitions))
    while todo or running:
        while todo and len(running) < parallel:
            i = todo.pop(0)
            this = mode if mode != "mixed" else ("window", "random")[i % 2]
            running[i] = (*_start(os.path.join(root, f"run{i}"), this), this)
        for i, (pid, started, this) in list(running.items()):
            ended = _poll(pid, started)
            if ended is not None:
                del running[i]
                folder = os.path.join(root, f"run{i}")
                runs[i] = dict(_finish(folder, pid, started, *ended), mode=this)
        time.sleep(0.05)
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
