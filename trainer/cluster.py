"""Who started this process, and where its peers are: torchrun, or SLURM's ``srun``. Also SLURM's
requeue.

* **torchrun** (and any launcher that sets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``): the ranks
  come from those variables, the rendezvous from ``MASTER_ADDR``/``MASTER_PORT`` (``env://``). It
  wins over SLURM, so ``srun torchrun ...`` (one task per node) works as it does without SLURM.
* **SLURM** (``srun python train.py`` with ``--ntasks-per-node=N``, as Lightning's
  ``SLURMEnvironment`` reads it): rank ``SLURM_PROCID``, local rank ``SLURM_LOCALID``, world size
  ``SLURM_NTASKS``; the rendezvous on the first node of ``SLURM_NODELIST`` at ``MASTER_PORT``, else
  port ``15000 +`` the job id's last four digits (every task computes the same one). A job named
  ``bash`` or ``interactive`` (``srun --pty bash``, ``salloc``) is not treated as one: processes
  started by hand there launch themselves. One task is one process (a ddp run with ``devices=N``
  then starts its workers itself).

Under torchrun, :func:`watch_parent` ends a worker whose agent is gone (SIGKILLed by the
out-of-memory killer, a lost node): its workers would otherwise train on as orphans next to the
restarted job. ``requeue_job`` runs ``scontrol requeue <job id>``: a ``Trainer(requeue=True)`` (the
default under SLURM) does that on rank 0 after the checkpoint a SIGUSR1 asked for (``sbatch
--signal=USR1@120``): preemption.py.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

_INTERACTIVE = ("bash", "interactive")
_WATCHED: list[int] = []  # the parent this process watches (one watch per process)
_SIGNALLED: list[int] = []  # preemption signals this process received
# how long an orphan with a preemption signal may take to save (SLURM's USR1@120)
ORPHAN_GRACE_S = 120.0


@dataclasses.dataclass(frozen=True)
class ClusterEnvironment:
    """The process's place in a run its launcher started: ``launcher`` is "torchrun" or "slurm"."""

    launcher: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    # None: torchrun's MASTER_ADDR/MASTER_PORT (init_method="env://")
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def init_method(self) -> str:
        """How ``init_process_group`` finds the other ranks."""
        return (
            "env://" if self.master_addr is None else f"tcp://{self.master_addr}:{self.master_port}"
        )


def slurm_managed(env: Mapping[str, str] = os.environ) -> bool:
    """This process is a task of a SLURM job step (``srun``), not an interactive session's shell."""
    return (
        "SLURM_NTASKS" in env
        and "SLURM_PROCID" in env
        and env.get("SLURM_JOB_NAME") not in _INTERACTIVE
    )


def detect(env: Mapping[str, str] = os.environ) -> ClusterEnvironment | None:
    """The launcher of this process: torchrun's variables, else SLURM's (more than one task); None
    otherwise."""
    if all(key in env for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        world = int(env["WORLD_SIZE"])
        return ClusterEnvironment("torchrun", int(env["RANK"]), int(env["LOCAL_RANK"]), world,
                                  int(env.get("LOCAL_WORLD_SIZE", world)))
    if slurm_managed(env) and int(env["SLURM_NTASKS"]) > 1:
        world = int(env["SLURM_NTASKS"])
        per_node = re.match(
            r"\d+", env.get("SLURM_NTASKS_PER_NODE", "") or env.get("SLURM_STEP_TASKS_PER_NODE", "")
        )
        nodes = int(env.get("SLURM_NNODES", "1") or 1)
        job = env.get("SLURM_JOB_ID", "")
        port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else \
            15000 + int(job[-4:]) if job[-4:].isdigit() else 12910
        return ClusterEnvironment(
            "slurm", int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), world,
            int(per_node.group(0)) if per_node else max(1, world // nodes),
            env.get("MASTER_ADDR") or root_node(env.get("SLURM_NODELIST", "127.0.0.1")), port)
    return None


def global_rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's rank in the run its launcher started (0 when it started on its own)."""
    found = detect(env)
    return found.rank if found is not None else 0


def root_node(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[003-006,9],gpu1`` -> ``node003``; ``a b`` ->
    ``a``."""
    nodes = re.sub(r"\[(.*?)[,-].*?\]", r"\1", nodelist)  # the first of every range
    nodes = re.sub(r"\[(.*?)\]", r"\1", nodes)  # a range of one: node[7]
    return nodes.split(" ")[0].split(",")[0]


def slurm_job_id(env: Mapping[str, str] = os.environ) -> str | None:
    """The id ``scontrol requeue`` takes for this job (``<array job>_<task>`` for an array task), or
    None outside a SLURM job (or in an interactive one)."""
    if "SLURM_JOB_ID" not in env or env.get("SLURM_JOB_NAME") in _INTERACTIVE:
        return None
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env["SLURM_JOB_ID"]


def requeue_job(job_id: str) -> str:
    """``scontrol requeue <job_id>``; what happened, in a sentence (a failure is reported, never
    raised: the checkpoint is saved already and the process is about to exit)."""
    if not re.fullmatch(r"[0-9_]+", job_id):
        return f"did not requeue: {job_id!r} is not a SLURM job id"
    try:
        done = subprocess.run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`scontrol requeue {job_id}` failed ({exc}); requeue the job by hand"
    if done.returncode != 0:
        detail = " ".join((done.stderr or done.stdout).split())[:200]
        return (f"`scontrol requeue {job_id}` failed with status {done.returncode} ({detail}); "
                "requeue the job by hand")
    return f"requeued SLURM job {job_id} (scontrol requeue {job_id})"


def note_signal(signum: int) -> None:
    """A preemption signal reached this process (preemption.py): a launcher's death is then not a
    reason to stop before the checkpoint the signal asked for (torchrun dies of a SIGUSR1 that SLURM
    sends to every process)."""
    _SIGNALLED.append(signum)


def orphaned(who: str, pid: int) -> None:
    """This process's launcher ``who`` (pid ``pid``) is gone: end the process now (``os._exit``:
    nothing more is written), or, when a preemption signal came too, once the trainer has saved and
    exited by itself (at most ``ORPHAN_GRACE_S`` seconds)."""
    def say(text: str) -> None:
        try:
            os.write(
                2, f"taskfit: {who} (pid {pid}) is gone; rank {global_rank()} {text}.\n".encode()
            )
        except OSError:
            pass

    if _SIGNALLED:
        say("finishes the checkpoint its preemption signal asked for, then stops")
        time.sleep(ORPHAN_GRACE_S)  # the trainer saves and exits the process before this ends
    writing = _write_in_flight()
    if writing is None:
        say("stops now, without writing anything more")
    # cut short, it would leave its hidden temporary file behind; finished, the file is whole (a
    # rename)
    else:
        say("finishes the checkpoint being written, then stops (no other is started)")
        deadline = time.monotonic() + ORPHAN_GRACE_S
        while _write_in_flight() is writing and time.monotonic() < deadline:
            time.sleep(0.005)
    os._exit(1)


def _write_in_flight() -> Any:
    """The frame of the checkpoint write the background writer (checkpoint/files.py's
    ``CheckpointWriter``, thread ``taskfit-checkpoint...``) is running now, or None when it is idle
    (or there is none)."""
    frames = sys._current_frames()
    for thread in threading.enumerate():
        frame = frames.get(thread.ident) if thread.name.startswith("taskfit-checkpoint") else None
        while frame is not None:
            if frame.f_code.co_name == "_run" and \
                    os.path.basename(os.path.dirname(frame.f_code.co_filename)) == "checkpoint":
                return frame
            frame = frame.f_back
    return None


def restart_store(world_size: int, timeout: float) -> Any:
    """Under torchrun with its agent's store (``TORCHELASTIC_USE_AGENT_STORE``): that store, with a
    prefix per restart attempt; None elsewhere. torchrun reuses one store across ``--max-restarts``
    attempts and the process group's keys are the same in each, so a restarted rank could read the
    address of a peer of the dead attempt: with gloo, 3 of 4 restarts failed (connection refused) or
    hung. A prefix per attempt keeps each attempt's keys apart."""
    if (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        or "TORCHELASTIC_RESTART_COUNT" not in os.environ
    ):
        return None
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout),
    )
    return dist.PrefixStore(f"taskfit/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def watch_parent(who: str, interval: float = 0.25) -> None:
    """End this process within ``interval`` seconds of its parent's death (:func:`orphaned`): a
    thread compares ``os.getppid()`` with the parent it had when the watch started. Once per
    process."""
    if _WATCHED:
        return
    parent = os.getppid()
    _WATCHED.append(parent)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        orphaned(who, parent)

    threading.Thread(target=watch, name="taskfit-parent-watch", daemon=True).start()
