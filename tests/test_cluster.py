"""What a cluster does around a run, for real: signals to whole process groups with DataLoader workers, a
launcher killed by the out-of-memory killer, slow steps under a scheduler's grace period, restarts by torchrun,
SLURM tasks and requeues (a stand-in ``scontrol``), and the ``taskfit`` command's errors before any work."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tasks import RegressionTask, SignalAt, SlowSteps
from taskfit import Trainer

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for key in ("TASKFIT_SEED", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    for key in [k for k in env if k.startswith("SLURM_")]:
        env.pop(key)
    return env


# ---- a signal to the whole process group, with DataLoader workers -------------------------------------------
def _group_signal(tmp_path: Path, repetitions: int, mode: str) -> list[dict]:
    result = subprocess.run([sys.executable, str(TESTS / "group_signal_script.py"), str(tmp_path), str(repetitions),
                             mode], env=_env(), capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_sigterm_to_the_group_never_kills_a_worker_20_times(tmp_path):
    """20 runs (a race is tested by repetition): half of them signalled by a new worker from the very moment one
    used to die of it (torch's handler installed, worker_init_fn not yet run), half at a random moment around
    the start of an epoch's workers. Every run saves and exits 143; no worker dies, nothing hangs."""
    runs = _group_signal(tmp_path, 20, "mixed")
    failed = [r for r in runs if r["code"] != 143 or r["hung"] or not r["checkpoint"] or r["worker_died"]]
    assert not failed, failed[:3]
    assert {r["mode"] for r in runs} == {"window", "random"}


def test_a_worker_killed_with_the_group_signal_never_hangs_the_run(tmp_path):
    """The out-of-memory killer takes a worker while the group gets SIGTERM: the run ends (the DataLoader's
    error), it does not wait for the surviving worker, which ignores SIGTERM."""
    runs = _group_signal(tmp_path, 3, "kill_worker")
    assert not [r for r in runs if r["hung"]], runs
    assert all(r["code"] in (1, 143) for r in runs), runs


# ---- ddp: the ranks agree on a signal within a step or two, without a blocking collective per step ----------
def test_ddp_ranks_agree_on_a_signal_within_two_steps_of_slow_steps(tmp_path):
    """log_every_n_steps=50 and steps of 0.5 s: the blocking agreement at the log interval would come 25 s after
    the signal. Each step starts an all-reduce of the flags and reads the previous step's: saved within 2 steps."""
    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=1, log_every_n_steps=50,
                      callbacks=[SlowSteps(0.5), SignalAt(step=2, pid=os.getpid(), signum=signal.SIGTERM)],
                      default_root_dir=str(tmp_path), num_sanity_val_steps=0, **QUIET)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as info:
            trainer.fit(RegressionTask(n=2 * 8 * 60))  # 60 steps per epoch
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert info.value.code == 143
    (last,) = tmp_path.rglob("last.ckpt")
    state = torch.load(last, weights_only=True)["loop"]["state"]
    assert 2 < state["global_step"] <= 4, state  # the signal came after step 2


# ---- the self-launching parent of ddp/fsdp killed: its workers stop at once -------------------------------------
LAUNCHER_KILLED = """
import os, signal, sys, time
from tasks import RegressionTask
from taskfit import Trainer
from taskfit.callbacks import Callback, ModelCheckpoint


class Trace(Callback):  # every rank: its pid once, then each step it finishes; rank 0 kills the launcher at step 3
    def __init__(self, out, launcher):
        self.out, self.launcher = out, launcher

    def on_fit_start(self, trainer, task):
        with open(os.path.join(self.out, f"pid{{trainer.strategy.rank}}"), "w") as fh:
            fh.write(str(os.getpid()))

    def on_train_batch_start(self, trainer, task, batch, batch_idx):
        time.sleep(0.3)

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        with open(os.path.join(self.out, "steps"), "a") as fh:
            fh.write(f"{{trainer.strategy.rank}} {{trainer.state.global_step}}\\n")
        if trainer.strategy.rank == 0 and trainer.state.global_step == 3:
            os.kill(self.launcher, signal.SIGKILL)  # the out-of-memory killer picks the launcher


if __name__ == "__main__":
    Trainer(max_epochs=4, strategy={strategy!r}, devices=2, accelerator="cpu", default_root_dir={root!r},
            logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            callbacks=[ModelCheckpoint(every_n_train_steps=1, save_top_k=-1), Trace({out!r}, os.getpid())]).fit(
        RegressionTask(n=64))
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_workers_stop_at_once_when_their_launcher_is_killed(tmp_path, strategy):
    """3/3 workers used to train on to the end and write checkpoints; now they stop within the step they were in
    and write nothing more. 16 steps of 0.3 s would follow the kill at step 3."""
    script = tmp_path / "train.py"
    script.write_text(LAUNCHER_KILLED.format(strategy=strategy, root=str(tmp_path / "runs"), out=str(tmp_path)))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in (0, 1)]
    import time

    deadline = time.monotonic() + 60  # only catches workers that never stop
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "a worker outlived its launcher"
    steps = [tuple(map(int, line.split())) for line in (tmp_path / "steps").read_text().splitlines()]
    assert max(step for _, step in steps) <= 4, steps  # no rank trained on (each step is >= 0.3 s)
    saved = [torch.load(p / "checkpoint.pt" if p.is_dir() else p, weights_only=True)["loop"]["state"]["global_step"]
             for p in (tmp_path / "runs").rglob("*.ckpt")]
    assert saved and max(saved) <= 3, saved  # nothing written after the kill
