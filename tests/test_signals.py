"""Preemption signals that reach a rank late, or twice (issue 39): under a launcher a rank's
handlers stay in place until the process exits, so a signal landing while it exits never kills it by
the default action; every rank exits with the documented status (128 + signal) and the SLURM job is
requeued once."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from taskfit.loop import preemption as preemption_module
from taskfit.loop.preemption import AFTER_FIT, Preemption

TESTS = Path(__file__).resolve().parent
USR1 = 128 + signal.SIGUSR1

JOB = """
import atexit, os, signal, sys, time
from tasks import RegressionTask
from taskfit import Trainer
from taskfit.callbacks import Callback

out, twice = sys.argv[1], sys.argv[2] == "twice"
rank = int(os.environ["SLURM_PROCID"])


def slow_exit():  # a rank's way out takes a while (gloo, the writer, the interpreter): a late signal lands in it
    open(os.path.join(out, f"exiting{rank}"), "w").close()
    time.sleep(1.2)


atexit.register(slow_exit)


class Usr1(Callback):  # SLURM's --signal=USR1: rank 0 gets it at step 4; rank 1 late (the test sends it)
    def on_fit_start(self, trainer, task):
        with open(os.path.join(out, f"pid{rank}"), "w") as fh:
            fh.write(str(os.getpid()))

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        if trainer.state.global_step == 4 and (rank == 0 or twice):
            os.kill(os.getpid(), signal.SIGUSR1)


Trainer(accelerator="cpu", max_epochs=20, default_root_dir=os.path.join(out, "runs"), enable_progress_bar=False,
        enable_model_summary=False, logger=False, num_sanity_val_steps=0,
        callbacks=[Usr1()]).fit(RegressionTask(n=64), ckpt_path="last")
"""


def _env(rank: int, port: int, bin_dir: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SLURM_")
        and k
        not in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TASKFIT_SEED",
        )
    }
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="train",
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_NNODES="1",
        SLURM_NODEID="0",
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank),
        SLURM_NODELIST="localhost",
        MASTER_PORT=str(port),
    )
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


def _wait_for(path: Path, procs: list[subprocess.Popen], timeout: float = 150.0) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or all(p.poll() is not None for p in procs):
            return path.exists()
        time.sleep(0.01)
    return True


def _trial(tmp: Path, twice: bool, after: str, delay: float) -> dict:
    from taskfit.strategies.spawn import free_port

    tmp.mkdir()
    calls, bin_dir = tmp / "scontrol_calls", tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    (bin_dir / "scontrol").chmod(0o755)
    script = tmp / "train.py"
    script.write_text(JOB)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp), "twice" if twice else "once"],
            cwd=tmp,
            env=_env(rank, port, bin_dir),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        exiting = _wait_for(tmp / f"exiting{after}", procs)  # rank `after` has started its way out
        time.sleep(delay)
        late = procs[1].poll() is None
        if exiting and late:
            # the late signal (a second one, on `twice` trials)
            os.kill(procs[1].pid, signal.SIGUSR1)
        if twice and procs[0].poll() is None:
            os.kill(procs[0].pid, signal.SIGUSR1)  # rank 0: a second one while it exits
        done = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            p.kill()
    lasts = list((tmp / "runs").rglob("last.ckpt"))
    return {
        "codes": [p.returncode for p in procs],
        "exiting": exiting,
        "late": late,
        "calls": calls.read_text() if calls.exists() else "",
        "lasts": len(lasts),
        "step": torch.load(lasts[0], weights_only=True)["loop"]["state"]["global_step"]
        if lasts
        else None,
        "stderr": [err[-1500:] for _, err in done],
        "twice": twice,
        "after": after,
    }


def test_a_late_or_second_sigusr1_never_kills_a_slurm_rank_6_times(tmp_path):
    """6 simulated SLURM jobs of 2 tasks (a stand-in ``scontrol``): rank 0 gets SIGUSR1 at step 4,
    rank 1 learns of it from rank 0, saves with it and exits; rank 1's own SIGUSR1 lands late: on
    even trials once rank 1 is in its way out (after its handlers used to be restored), on odd ones
    0.27-0.48 s after rank 0 started exiting (the issue's stagger). Every third trial rank 1 also
    got one with rank 0, and rank 0 gets a second one while it exits. Every trial: both ranks exit
    138, one `scontrol requeue`, one last.ckpt at step 4-6."""
    rng = random.Random(39)
    runs = []
    for trial in range(6):
        after = "1" if trial % 2 == 0 else "0"
        delay = rng.uniform(0.0, 0.3) if after == "1" else rng.uniform(0.27, 0.48)
        runs.append(
            _trial(tmp_path / f"trial{trial}", twice=trial % 3 == 0, after=after, delay=delay)
        )
    failed = [
        r
        for r in runs
        if r["codes"] != [USR1, USR1]
        or r["calls"] != "requeue 4242\n"
        or r["lasts"] != 1
        or not 4 <= r["step"] <= 6
        or not r["exiting"]
    ]
    assert not failed, failed[:2]
    # the late signal did land while rank 1 exited
    assert sum(r["late"] for r in runs if r["after"] == "1") == 3
    assert not [r for r in runs if any("Traceback" in err for err in r["stderr"])]


# ---- in one process: what a signal does after the fit, under a launcher and not ------------------
class _Strategy:
    is_main, world_size = True, 1


@pytest.fixture
def usr1_restored():
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGUSR1, before[0])
    signal.signal(signal.SIGTERM, before[1])
    AFTER_FIT.exit_code, AFTER_FIT.stopping = None, False


def test_after_a_preemption_exit_under_slurm_late_signals_are_ignored(monkeypatch, usr1_restored):
    """Ignored by the kernel (SIG_IGN), not by a Python handler: the interpreter's finalization sets
    Python handlers back to the default action, and a signal landing then killed the rank (issue
    47, row 6: tests/test_cluster.py's staggered per-task signal)."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    run = Preemption(("SIGTERM", "SIGUSR1"), _Strategy(), install=True)
    # (what loop/checkpointing.py's preempt sets before it raises SystemExit)
    run.exit_code = USR1
    run.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    # late, twice, another: nothing happens
    for signum in (signal.SIGUSR1, signal.SIGUSR1, signal.SIGTERM):
        signal.raise_signal(signum)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN


def test_after_a_normal_end_under_a_launcher_a_signal_exits_with_128_plus_it(
    monkeypatch, usr1_restored
):
    for key in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    run = Preemption(("SIGUSR1",), _Strategy(), install=True)
    run.uninstall()  # the fit ended without a signal
    with pytest.raises(SystemExit) as exit_:
        signal.raise_signal(signal.SIGUSR1)
    assert exit_.value.code == USR1
    signal.raise_signal(signal.SIGUSR1)  # a second one while that exit is under way: recorded only


def test_without_a_launcher_the_handlers_before_the_fit_come_back(monkeypatch, usr1_restored):
    for key in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    mine = lambda signum, frame: None  # noqa: E731
    signal.signal(signal.SIGUSR1, mine)
    run = Preemption(("SIGUSR1",), _Strategy(), install=True)
    run.exit_code = USR1
    run.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is mine
    assert preemption_module.under_launcher() is False
