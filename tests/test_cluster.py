"""What a cluster does around a run, for real: signals to whole process groups with DataLoader
workers, a launcher killed by the out-of-memory killer, slow steps under a scheduler's grace period,
restarts by torchrun, SLURM tasks and requeues (a stand-in ``scontrol``), and the ``taskfit``
command's errors before any work."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from taskfit import Trainer
from tasks import RecordPeriod, RegressionTask, SignalAt, SlowSteps

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for key in (
        "TASKFIT_SEED",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        env.pop(key, None)
    for key in [k for k in env if k.startswith("SLURM_")]:
        env.pop(key)
    return dict(env, **extra)


# ---- a signal to the whole process group, with DataLoader workers --------------------------------
def _group_signal(tmp_path: Path, repetitions: int, mode: str, parallel: int = 1) -> list[dict]:
    script = str(TESTS / "group_signal_script.py")
    command = [sys.executable, script, str(tmp_path), str(repetitions), mode, str(parallel)]
    result = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_sigterm_to_the_group_never_kills_a_worker_20_times(tmp_path):
    """20 runs (a race is tested by repetition): half of them signalled by a new worker from the
    very moment one used to die of it (torch's handler installed, worker_init_fn not yet run), half
    at a random moment around the start of an epoch's workers. Every run saves and exits 143; no
    worker dies, nothing hangs."""
    runs = _group_signal(tmp_path, 20, "mixed")
    failed = [
        r for r in runs if r["code"] != 143 or r["hung"] or not r["checkpoint"] or r["worker_died"]
    ]
    assert not failed, failed[:3]
    assert {r["mode"] for r in runs} == {"window", "random"}


def test_a_worker_killed_with_the_group_signal_never_hangs_the_run_20_times(tmp_path):
    """Issue 47, row 7 (20 trials, 4 at a time): the out-of-memory killer takes a worker while the
    group gets SIGTERM. The run ends (the DataLoader's error, or the preemption's save), it never
    waits for the surviving worker, which ignores SIGTERM. Before: torch's SIGCHLD handler raised
    inside multiprocessing.Queue.put with the queue's lock taken, and the iterator's __del__
    deadlocked (about 1 run in 40, 2 of 3 in a CI rehearsal); now the handler only counts the
    signal and the loader's own check raises the death at the next batch."""
    runs = _group_signal(tmp_path, 20, "kill_worker", parallel=4)
    assert not [r for r in runs if r["hung"]], runs
    assert all(r["code"] in (1, 143) for r in runs), runs


# ---- ddp: the ranks agree on a signal within a step or two, without a blocking collective per step
def test_ddp_ranks_agree_on_a_signal_within_two_steps_of_slow_steps(tmp_path):
    """log_every_n_steps=50 and steps of 0.5 s: the blocking agreement at the log interval would
    come 25 s after the signal. Each step starts an all-reduce of the flags and reads the previous
    step's: saved within 2 steps."""
    trainer = Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        log_every_n_steps=50,
        callbacks=[SlowSteps(0.5), SignalAt(step=2, pid=os.getpid(), signum=signal.SIGTERM)],
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
        **QUIET,
    )
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


def test_ddp_with_fast_steps_exchanges_flags_less_often_and_still_agrees(tmp_path):
    """Steps of a millisecond or two: after the first log interval the ranks exchange their flags
    every `period` steps (about 50 ms of steps), and a signal is still agreed within two periods."""
    trainer = Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=3,
        log_every_n_steps=50,
        callbacks=[
            RecordPeriod(str(tmp_path), 79),
            SignalAt(step=80, pid=os.getpid(), signum=signal.SIGTERM),
        ],
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
        **QUIET,
    )
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as info:
            trainer.fit(RegressionTask(n=2 * 8 * 60))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert info.value.code == 143
    period = int((tmp_path / "period").read_text())
    (last,) = tmp_path.rglob("last.ckpt")
    saved = torch.load(last, weights_only=True)["loop"]["state"]["global_step"]
    assert period > 1 and 80 < saved <= 80 + 2 * period + 1, (period, saved)


# ---- the self-launching parent of ddp/fsdp killed: its workers stop at once ----------------------
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
            callbacks=[ModelCheckpoint(every_n_train_steps=1, save_top_k=-1), Trace({out!r}, {launcher})]).fit(
        RegressionTask(n=64))
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "torchrun"])
def test_workers_stop_at_once_when_their_launcher_is_killed(tmp_path, strategy):
    """3/3 workers used to train on to the end and write checkpoints; now they stop within the step
    they were in and write nothing more. 16 steps of 0.3 s would follow the kill at step 3. The
    launcher: the script that started ddp or fsdp workers itself, or torchrun's agent."""
    script = tmp_path / "train.py"
    launcher = "os.getppid()" if strategy == "torchrun" else "os.getpid()"
    script.write_text(
        LAUNCHER_KILLED.format(
            strategy="ddp" if strategy == "torchrun" else strategy,
            launcher=launcher,
            root=str(tmp_path / "runs"),
            out=str(tmp_path),
        )
    )
    command = (
        [sys.executable, str(script)]
        if strategy != "torchrun"
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(script),
        ]
    )
    result = subprocess.run(
        command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in (0, 1)]
    import time

    deadline = time.monotonic() + 60  # only catches workers that never stop
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "a worker outlived its launcher"
    steps = [
        tuple(map(int, line.split())) for line in (tmp_path / "steps").read_text().splitlines()
    ]
    assert max(step for _, step in steps) <= 4, steps  # no rank trained on (each step is >= 0.3 s)
    saved = [
        torch.load(p / "checkpoint.pt" if p.is_dir() else p, weights_only=True)["loop"]["state"][
            "global_step"
        ]
        for p in (tmp_path / "runs").rglob("*.ckpt")
    ]
    assert saved and max(saved) <= 3, saved  # nothing written after the kill


# ---- SLURM: srun's tasks form the ddp group; SIGUSR1 saves, requeues (a stand-in scontrol) and exi
SLURM_JOB = """
import os, signal, sys, time
import torch
from tasks import ClassifierTask
from taskfit import Trainer, seed_everything
from taskfit.callbacks import Callback


class Usr1(Callback):  # SLURM's --signal=USR1@120: every task of the job gets it (rank 0 sends both here)
    def on_fit_start(self, trainer, task):
        with open(os.path.join({out!r}, f"pid{{trainer.strategy.rank}}"), "w") as fh:
            fh.write(str(os.getpid()))

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        if trainer.strategy.rank == 0 and trainer.state.global_step == 4 and not trainer.state.resumed:
            for rank in (0, 1):
                os.kill(int(open(os.path.join({out!r}, f"pid{{rank}}")).read()), signal.SIGUSR1)


seed_everything(0)
task = ClassifierTask(batch_size=8)
trainer = Trainer(accelerator="cpu", max_epochs=3, default_root_dir={root!r}, enable_progress_bar=False,
                  enable_model_summary=False, logger=False, callbacks=[Usr1()], deterministic=True)
trainer.fit(task, ckpt_path="last")  # the job's one command: a fresh start the first time, a resume after
if trainer.is_main:
    torch.save({{"weights": task.state_dict(), "world_size": trainer.strategy.world_size,
                "strategy": trainer.strategy.name, "step": trainer.state.global_step}}, {out!r} + "/result.pt")
"""


def _srun(
    script: Path, tmp_path: Path, port: int, scontrol: Path
) -> list[subprocess.CompletedProcess]:
    """What `srun --ntasks-per-node=2 python train.py` starts: two tasks with SLURM's variables."""
    procs = []
    for rank in (0, 1):
        env = _env(
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
        env["PATH"] = f"{scontrol.parent}{os.pathsep}{env['PATH']}"
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=240)  # only catches a hang
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            proc.kill()
    return done


def test_slurm_tasks_form_the_group_and_sigusr1_saves_requeues_and_resumes(tmp_path):
    from taskfit.strategies.spawn import free_port
    from test_ddp import _assert_same_weights, _single_reference

    calls = tmp_path / "scontrol_calls"
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    scontrol.chmod(0o755)
    script = tmp_path / "train.py"
    script.write_text(SLURM_JOB.format(root=str(tmp_path / "runs"), out=str(tmp_path)))

    # preempted at step 4: saved, requeued, exit 138
    first = _srun(script, tmp_path, free_port(), scontrol)
    assert [p.returncode for p in first] == [128 + signal.SIGUSR1] * 2, (
        first[0].stderr[-3000:] + first[1].stderr[-3000:]
    )
    assert calls.read_text() == "requeue 4242\n"  # once, by rank 0, after the checkpoint
    assert (
        "requeued SLURM job 4242 (scontrol requeue 4242)" in first[0].stderr
        and "SIGUSR1" not in first[1].stderr
    )
    (last,) = (tmp_path / "runs").rglob("last.ckpt")
    assert 4 <= torch.load(last, weights_only=True)["loop"]["state"]["global_step"] <= 6

    # the requeued job: the same command resumes
    second = _srun(script, tmp_path, free_port(), scontrol)
    assert [p.returncode for p in second] == [0, 0], (
        second[0].stderr[-3000:] + second[1].stderr[-3000:]
    )
    assert "Resumed from" in second[0].stdout and calls.read_text() == "requeue 4242\n"
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert (result["world_size"], result["strategy"], result["step"]) == (2, "ddp", 3 * 6)
    # 1 x batch 16
    reference, _, _ = _single_reference(3, tmp_path / "reference", enable_checkpointing=False)
    _assert_same_weights(result["weights"], reference.state_dict())


def test_a_staggered_per_task_slurm_signal_ends_every_task_with_138_6_times(tmp_path):
    """Issue 47, row 6 (6 trials; the code before failed 4 of 4): a real 2-task job's shape. Each
    task its own process in a process group of its own, ending through the interpreter's
    finalization; SLURM signals each task, rank 1's SIGUSR1 0.27-0.48 s after rank 0's. The test
    above sends both at once, from rank 0, while both still train: rank 1 then learns of it first
    hand. Here rank 1 learns of it from rank 0, saves with it and is exiting when its own signal
    lands: before, in the interpreter's finalization (which sets Python's handlers back to the
    default action), it died of it (-10 in 4 of 4). Every task ends with 138, one checkpoint, one
    `scontrol requeue`."""
    script = str(TESTS / "slurm_signal_script.py")
    result = subprocess.run([sys.executable, script, str(tmp_path), "6"], env=_env(),
                            capture_output=True, text=True, timeout=3000)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(result.stdout.splitlines()[-1])
    wrong = [r for r in runs if r["codes"] != [138, 138] or r["hung"] or not r["checkpoint"]
             or r["requeues"] != ["requeue 4242"]]
    assert not wrong, wrong[:3]
    assert len(runs) == 6 and all(0.27 <= r["stagger"] <= 0.48 for r in runs)


# ---- torchrun --max-restarts: the same command resumes after a rank is killed, bitwise -----------
RESTARTED = """
import os, signal, sys
import torch
from tasks import RegressionTask
from taskfit import Trainer, seed_everything
from taskfit.callbacks import Callback, ModelCheckpoint


class KillOnce(Callback):  # the out-of-memory killer takes rank 1 mid-epoch, on torchrun's first attempt only
    def on_train_batch_start(self, trainer, task, batch, batch_idx):
        if os.environ.get("KILL") == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" \\
                and trainer.strategy.rank == 1 and trainer.state.global_step == 5:
            os.kill(os.getpid(), signal.SIGKILL)


seed_everything(0)
task = RegressionTask(n=64, shuffle=True, dropout=0.1)
trainer = Trainer(accelerator="cpu", max_epochs=3, deterministic=True, default_root_dir=sys.argv[1],
                  enable_progress_bar=False, enable_model_summary=False, logger=False,
                  callbacks=[ModelCheckpoint(every_n_train_steps=1), KillOnce()])
trainer.fit(task, ckpt_path="last")  # every attempt runs this same line
if trainer.is_main:
    torch.save({"weights": task.state_dict(), "resumed": trainer.state.resumed,
                "attempt": os.environ["TORCHELASTIC_RESTART_COUNT"]}, sys.argv[1] + "/result.pt")
"""


def test_torchrun_restarts_after_a_rank_is_killed_and_ends_bitwise_equal(tmp_path):
    """`srun torchrun --max-restarts=1 ...` (SLURM's variables of one task per node are set:
    torchrun's win). Each attempt's process group has keys of its own in torchrun's store (without,
    3 of 4 restarts failed or hung)."""
    script = tmp_path / "train.py"
    script.write_text(RESTARTED)
    slurm = dict(SLURM_JOB_ID="77", SLURM_JOB_NAME="train", SLURM_NTASKS="1", SLURM_PROCID="0",
                 SLURM_LOCALID="0", SLURM_NODELIST="localhost")
    runs = {}
    # restarts raced: twice
    for name, kill in (("uninterrupted", "0"), ("killed", "1"), ("killed again", "1")):
        root = tmp_path / name
        root.mkdir()
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                "--max-restarts=1",
                str(script),
                str(root),
            ],
            cwd=tmp_path,
            env=_env(KILL=kill, **slurm),
            capture_output=True,
            text=True,
            timeout=280,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        # rank 0, first attempt
        assert result.stderr.count("there is no checkpoint to resume yet") == 1
        runs[name] = torch.load(root / "result.pt", weights_only=True)
    # "last": a fresh start
    assert runs["uninterrupted"]["attempt"] == "0" and not runs["uninterrupted"]["resumed"]
    expected = runs["uninterrupted"]["weights"]
    for killed in (runs["killed"], runs["killed again"]):
        assert killed["attempt"] == "1" and killed["resumed"]  # restarted, and continued
        assert all(torch.equal(killed["weights"][k], v) for k, v in expected.items())


# ---- "last": a fresh start when there is nothing yet; the newest complete checkpoint when last.ckp
def test_ckpt_path_last_with_nothing_to_resume_starts_fresh_with_one_warning(tmp_path, recwarn):
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), num_sanity_val_steps=1, **QUIET)
    trainer.fit(RegressionTask(val_n=8), ckpt_path="last")
    fresh = [str(w.message) for w in recwarn if "no checkpoint to resume yet" in str(w.message)]
    assert len(fresh) == 1 and "so this fit starts fresh" in fresh[0], [
        str(w.message) for w in recwarn
    ]
    assert trainer.state.global_step == 8 and not trainer.state.resumed
    again = Trainer(max_epochs=2, default_root_dir=str(tmp_path), **QUIET)
    # the same line, now with something to resume
    again.fit(RegressionTask(val_n=8), ckpt_path="last")
    assert again.state.resumed and again.state.global_step == 16


def test_the_fresh_start_warning_names_the_line_that_called_fit(tmp_path):
    """However many of taskfit's frames lie between (the strategy's launch, the loop), the warning
    names the user's line, which Python prints under it; not one of taskfit's lines, nor its
    caller's caller."""
    import inspect
    import warnings

    def fit(trainer):
        trainer.fit(RegressionTask(), ckpt_path="last")  # the line the warning names
        return inspect.currentframe().f_lineno - 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = fit(Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET))
    (fresh,) = [w for w in caught if "no checkpoint to resume yet" in str(w.message)]
    assert (fresh.filename, fresh.lineno) == (__file__, line)


def test_an_incomplete_sharded_last_is_skipped_for_the_newest_complete_checkpoint(tmp_path, capsys):
    """fsdp run 1 (6 steps, version_0), its resume (to step 18, in version_0 too: issue 47 row 1),
    then that last.ckpt loses its COMPLETE marker (a copy stopped half-way): "last" takes the
    folder's epoch=2-step=18.ckpt, not an older state (12 steps redone), and says which directory it
    skipped."""
    from fsdp_tasks import MLPTask
    from taskfit.checkpoint.sharded import MARKER
    from taskfit.strategies.fsdp import FSDPStrategy

    def fit(epochs):
        trainer = Trainer(
            strategy=FSDPStrategy("cpu", 1),
            max_epochs=epochs,
            default_root_dir=str(tmp_path),
            **QUIET,
        )
        trainer.fit(MLPTask(), ckpt_path="last")
        return trainer

    fit(1)
    fit(3)
    folder = tmp_path / "version_0" / "checkpoints"
    assert (folder / "epoch=2-step=18.ckpt" / MARKER).is_file()
    os.remove(folder / "last.ckpt" / MARKER)
    capsys.readouterr()
    with pytest.warns(UserWarning, match=rf"Skipped {folder}/last\.ckpt: incomplete \(no COMPLETE "
                                         rf"marker.*resuming from {folder}/epoch=2-step=18\.ckpt, "
                                         r"the newest complete checkpoint"):
        trainer = fit(4)
    assert (
        f"Resumed from {folder}/epoch=2-step=18.ckpt: epoch 3, batch 0, global step 18."
        in capsys.readouterr().out
    )
    # 18 + one epoch: nothing redone
    assert trainer.state.resumed and trainer.state.global_step == 24


# ---- who launched the process: torchrun wins over SLURM, SLURM's node list, requeue settings -----
def test_cluster_environment_from_torchrun_and_slurm_variables():
    from taskfit.cluster import detect, root_node, slurm_job_id

    slurm = dict(
        SLURM_NTASKS="4",
        SLURM_PROCID="3",
        SLURM_LOCALID="1",
        SLURM_NTASKS_PER_NODE="2(x2)",
        SLURM_NODELIST="gpu[017-018,020],cpu1",
        SLURM_JOB_ID="123456",
        SLURM_JOB_NAME="train",
    )
    env = detect(slurm)
    assert (env.launcher, env.rank, env.local_rank, env.world_size, env.local_world_size) == (
        "slurm",
        3,
        1,
        4,
        2,
    )
    # the first node; 15000 + the job id's last four digits
    assert env.init_method == "tcp://gpu017:18456"
    assert (
        detect(dict(slurm, MASTER_PORT="29500", MASTER_ADDR="head")).init_method
        == "tcp://head:29500"
    )
    torchrun = dict(
        slurm, SLURM_NTASKS="2", RANK="5", LOCAL_RANK="1", WORLD_SIZE="8", LOCAL_WORLD_SIZE="4"
    )
    assert (detect(torchrun).launcher, detect(torchrun).rank, detect(torchrun).init_method) == (
        "torchrun",
        5,
        "env://",
    )
    # srun --pty bash: processes start by hand
    assert detect(dict(slurm, SLURM_JOB_NAME="interactive")) is None
    # one task: one process, which may launch ddp itself
    assert detect(dict(slurm, SLURM_NTASKS="1")) is None
    assert [root_node(n) for n in ("node[7]", "a b", "host1,host2", "n[003-006,9]")] == [
        "node7",
        "a",
        "host1",
        "n003",
    ]
    assert slurm_job_id(dict(slurm, SLURM_ARRAY_JOB_ID="99", SLURM_ARRAY_TASK_ID="4")) == "99_4"
    assert slurm_job_id({}) is None


def test_requeue_settings_are_checked(monkeypatch):
    from taskfit import MisconfigurationError

    with pytest.raises(MisconfigurationError, match=r"requeue=True\) requeues the SLURM job when "
                                                    r"SIGUSR1 arrives, but "
                                                    r"preempt_signals=\('SIGTERM',\) leaves "
                                                    r"SIGUSR1 alone"):
        Trainer(requeue=True, preempt_signals="SIGTERM", **QUIET)
    with pytest.raises(MisconfigurationError, match=r"Trainer\(requeue='yes'\) is not valid"):
        Trainer(requeue="yes", **QUIET)
    with pytest.warns(UserWarning, match=r"requeue=True\) outside a SLURM job"):
        assert Trainer(requeue=True, **QUIET).requeue
    assert not Trainer(**QUIET).requeue
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert Trainer(**QUIET).requeue and not Trainer(requeue=False, **QUIET).requeue


USR1_TO_THE_STEP = """
import os, signal, time
from tasks import RegressionTask
from taskfit import Trainer
from taskfit.callbacks import Callback


class Usr1ToEveryProcess(Callback):  # SLURM's --signal=USR1 under `srun torchrun`: agent and workers get it
    def on_fit_start(self, trainer, task):
        with open(os.path.join({out!r}, f"pid{{trainer.strategy.rank}}"), "w") as fh:
            fh.write(str(os.getpid()))

    def on_train_batch_start(self, trainer, task, batch, batch_idx):
        time.sleep(0.3)

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        if trainer.strategy.rank == 0 and trainer.state.global_step == 3:
            os.kill(os.getppid(), signal.SIGUSR1)  # torchrun dies of it (it does not handle SIGUSR1)
            for rank in (0, 1):
                os.kill(int(open(os.path.join({out!r}, f"pid{{rank}}")).read()), signal.SIGUSR1)


Trainer(max_epochs=4, accelerator="cpu", default_root_dir={root!r}, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Usr1ToEveryProcess()]).fit(RegressionTask(n=64))
"""


def test_a_signal_that_kills_torchrun_still_lets_its_workers_save(tmp_path):
    """The workers' watch on their agent must not cut short the checkpoint a signal asked for:
    torchrun dies of SIGUSR1, its workers got it too, and they save together before they stop."""
    script = tmp_path / "train.py"
    script.write_text(USR1_TO_THE_STEP.format(root=str(tmp_path / "runs"), out=str(tmp_path)))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(script),
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == -signal.SIGUSR1, result.stderr[-3000:]
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in (0, 1)]
    import time

    deadline = time.monotonic() + 120  # only catches workers that never stop
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)
    (last,) = (tmp_path / "runs").rglob("last.ckpt")
    assert 3 <= torch.load(last, weights_only=True)["loop"]["state"]["global_step"] <= 5


# ---- the launcher dies while a checkpoint is being written in the background: what the message say
ORPHAN_WRITE = """
import os, sys, threading, time
from taskfit.checkpoint.files import CheckpointWriter, write_file
from taskfit.cluster import orphaned

out, slow = sys.argv[1], sys.argv[2] == "writing"
writer = CheckpointWriter()
if slow:
    def write(path):  # a big checkpoint: still being written when the launcher dies
        time.sleep(0.5)
        write_file({{"weights": list(range(1000))}}, path)
    writer.submit(write, os.path.join(out, "last.ckpt"))
    time.sleep(0.1)
threading.Thread(target=orphaned, args=("the launcher", 12345)).start()  # what the watch thread calls
time.sleep(30)
"""


@pytest.mark.parametrize("writing", ["writing", "idle"])
def test_an_orphan_finishes_the_checkpoint_being_written_then_stops(tmp_path, writing):
    """Issue 39: workers said "stops now, without writing anything more" while their background
    write completed after it. With a write in flight the message says it is finished first, and it
    is: a whole file, no temporary file left; with none, the worker stops at once, as it says."""
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN_WRITE.format())
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path), writing],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    files = sorted(p.name for p in tmp_path.iterdir() if p.name != "orphan.py")
    if writing == "writing":
        assert (
            "the launcher (pid 12345) is gone; rank 0 finishes the checkpoint being written, then stops"
            in result.stderr
        )
        assert files == ["last.ckpt"]
        assert torch.load(tmp_path / "last.ckpt", weights_only=True) == {
            "weights": list(range(1000))
        }
    else:
        assert "rank 0 stops now, without writing anything more" in result.stderr and files == []
