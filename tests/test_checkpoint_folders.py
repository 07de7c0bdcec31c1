"""Checkpoint folders across runs (issue 47, rows 1 and 2): a resumed fit continues in the folder of
the run it resumes, and two live runs given the same folder never write the same file nor resume
each other's weights.

Row 1 runs in this process; row 2 starts two real processes on one folder, again and again (a race).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys

import pytest
from taskfit import CheckpointError
from taskfit.callbacks import ModelCheckpoint
from taskfit.checkpoint.folder_lock import FolderHeld, hold, lock_path, release
from tasks import checkpointing_trainer as _trainer
from tasks import seeded_task as _task

HERE = os.path.dirname(os.path.abspath(__file__))


def _files(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".ckpt"))


# ---- row 1: a resume continues in its run's folder -----------------------------------------------
def test_a_resume_without_a_logger_continues_in_the_folder_it_resumes(tmp_path):
    _trainer(tmp_path, max_epochs=2).fit(_task())
    folder = tmp_path / "version_0" / "checkpoints"
    assert _files(folder) == ["epoch=1-step=16.ckpt", "last.ckpt"]
    trainer = _trainer(tmp_path, max_epochs=4)
    trainer.fit(_task(), ckpt_path="last")
    # No second run directory: save_top_k=1 held across the resume (the epoch=1 file was rotated
    # out)
    assert sorted(os.listdir(tmp_path)) == ["version_0"]
    assert _files(folder) == ["epoch=3-step=32.ckpt", "last.ckpt"]
    assert trainer.log_dir == str(tmp_path / "version_0")
    assert trainer.checkpoint_callback.best_model_path == str(folder / "epoch=3-step=32.ckpt")


def test_resumed_saves_rotate_the_top_k_of_the_earlier_fits(tmp_path):
    ranked = dict(monitor="step", mode="max", save_top_k=2)
    _trainer(tmp_path, max_epochs=2, callbacks=[ModelCheckpoint(**ranked)]).fit(_task())
    for epochs in (3, 4):
        cb = ModelCheckpoint(**ranked)
        _trainer(tmp_path, max_epochs=epochs, callbacks=[cb]).fit(_task(), ckpt_path="last")
    folder = tmp_path / "version_0" / "checkpoints"
    assert _files(folder) == ["epoch=2-step=24.ckpt", "epoch=3-step=32.ckpt", "last.ckpt"]
    assert sorted(os.path.basename(p) for p in cb.best_k_models) == _files(folder)[:2]


def test_a_fresh_fit_without_a_logger_still_starts_a_new_version(tmp_path):
    _trainer(tmp_path, max_epochs=1).fit(_task())
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(_task())
    assert trainer.log_dir == str(tmp_path / "version_1")
    assert re.fullmatch(
        r"epoch=0-step=\d+\.ckpt", _files(tmp_path / "version_0" / "checkpoints")[0]
    )


# ---- row 2: two live runs on one folder ----------------------------------------------------------
TRIALS = 20


def test_two_runs_started_on_one_folder_never_share_a_file_nor_resume_each_other(tmp_path):
    """20 trials of two real processes released at the same instant on one
    ModelCheckpoint(dirpath=...), then a third with ckpt_path="last" while one of them trains:
    exactly one trains there, every other is refused before its first step by one CheckpointError
    naming the live process (pid), and nothing is resumed from it."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TASKFIT_SEED", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "shared_folder_script.py"), str(tmp_path), str(TRIALS)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "trials.jsonl") as fh:
        trials = [json.loads(line) for line in fh]
    assert len(trials) == TRIALS
    for n, runs in enumerate(trials):
        assert not [r for r in runs.values() if r["status"] == "crashed"], runs
        trained = [r for name, r in runs.items() if name != "resume" and r["status"] == "trained"]
        assert len(trained) == 1, (n, runs)
        owner = trained[0]
        others = [r for r in runs.values() if r is not owner]
        for other in others:
            assert other["status"] == "refused", (n, runs)
            assert f"another live run holds it (pid {owner['pid']} on host " in other["message"], (
                other
            )
            assert "HINT: give each run its own folder" in other["message"]
        folder = tmp_path / f"trial{n}" / "ckpts"
        assert sorted(str(folder / f) for f in _files(folder)) == owner["files"]


HOLDER = """
import os, sys, time
from taskfit.checkpoint.folder_lock import hold
hold(sys.argv[1])
if sys.argv[2] == "worker" and os.fork() == 0:
    time.sleep(60)  # a DataLoader worker forked after the lock was taken, outliving its parent
    os._exit(0)
print("held", flush=True)
time.sleep(60)
"""


def _holder(folder, worker: bool = False) -> subprocess.Popen:
    argv = [sys.executable, "-c", HOLDER, str(folder), "worker" if worker else "-"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_live_holder_is_named_and_a_dead_ones_lock_is_taken_over(tmp_path):
    folder = tmp_path / "ckpts"
    for worker in (False, True):
        proc = _holder(folder, worker)
        with pytest.raises(FolderHeld) as info:
            hold(str(folder))
        assert info.value.describe().startswith(f"pid {proc.pid} on host ")
        # SIGKILL, as the out-of-memory killer; a forked worker may outlive it for a while
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        hold(str(folder))
        # (read by another process: a second descriptor closed here would drop this process's lock)
        cat = subprocess.run(["cat", lock_path(str(folder))], capture_output=True, text=True)
        recorded = cat.stdout
        assert json.loads(recorded)["pid"] == os.getpid()
        release(str(folder))
        assert not os.path.exists(lock_path(str(folder)))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_fit_on_a_held_folder_is_refused_before_its_first_step(tmp_path):
    proc = _holder(tmp_path / "ckpts")
    try:
        cb = ModelCheckpoint(dirpath=tmp_path / "ckpts")
        trainer = _trainer(tmp_path, max_epochs=1, callbacks=[cb])
        held = rf"another live run holds it \(pid {proc.pid} on host "
        with pytest.raises(CheckpointError, match=held):
            trainer.fit(_task(), ckpt_path="last")
        assert trainer.state.global_step == 0 and not os.listdir(tmp_path / "ckpts")
    finally:
        proc.kill()
        proc.wait()
    trainer.fit(_task())
    assert _files(tmp_path / "ckpts") == ["epoch=0-step=8.ckpt", "last.ckpt"]


def test_ddp_ranks_agree_on_a_folder_given_as_dirpath(tmp_path):
    """2 gloo processes, a dirpath held before the resume lookup and again at fit start: rank 0 holds it, every
    rank answers the same collective question, and the resumed fit continues the folder's files."""
    from taskfit import Trainer

    def fit(epochs, ckpt_path=None):
        cb = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="step", mode="max", save_top_k=2)
        trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=epochs, seed=0,
                          logger=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=str(tmp_path), callbacks=[cb])
        trainer.fit(_task(), ckpt_path=ckpt_path)
        return cb

    fit(1)
    cb = fit(2, "last")
    # 4 batches per rank and epoch; the two newest ranked files kept across the resume
    assert _files(tmp_path / "ckpts") == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    assert not os.path.exists(lock_path(str(tmp_path / "ckpts")))
