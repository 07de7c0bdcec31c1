"""Faults produced for real (a full or read-only file system, a NaN, a hostile pickle, bad arguments): no good
checkpoint is ever lost, and each ends in one clear error. Mounts need root; elsewhere those tests skip."""
from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from taskfit import CheckpointError, MisconfigurationError, NonFiniteLossError, Trainer
from taskfit.callbacks import Callback, ModelCheckpoint
from taskfit.checkpoint import load_checkpoint
from taskfit.checkpoint.files import FORMAT_VERSION, CheckpointWriter
from tasks import ClassifierTask, RegressionTask

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, num_sanity_val_steps=0)


class FillDisk(Callback):
    """After the first epoch's checkpoint, fill the file system it is on (what another job's logs would do)."""

    order = 2000  # after ModelCheckpoint

    def on_train_epoch_end(self, trainer, task):
        if trainer.state.epoch == 0:
            trainer.checkpoint_writer.wait()
            with open(os.path.join(trainer.checkpoint_callback.dirpath, "..", "filler"), "wb") as fh:
                try:
                    while True:
                        fh.write(b"\0" * 65536)
                        fh.flush()
                except OSError:
                    pass


def test_a_full_disk_during_a_new_best_keeps_the_previous_best(tmpfs):
    root = tmpfs(1024)
    cb = ModelCheckpoint(monitor="train/loss_epoch", save_top_k=1)  # every epoch is better than the last
    trainer = Trainer(max_epochs=3, default_root_dir=str(root), callbacks=[cb, FillDisk()], **QUIET)
    with pytest.raises(CheckpointError, match="No space left on device|could not be written"):
        trainer.fit(RegressionTask(n=64, lr=0.01))
    folder = root / "version_0" / "checkpoints"
    on_disk = {str(p) for p in folder.glob("*.ckpt") if p.name != "last.ckpt"}
    assert set(cb.best_k_models) == on_disk and cb.best_model_path in on_disk  # bookkeeping and disk agree
    best = load_checkpoint(cb.best_model_path)  # the previous best: intact, and it loads
    assert best["loop"]["state"]["epoch"] == 0 and os.path.basename(cb.best_model_path) == "epoch=0-step=8.ckpt"
    assert not list(folder.glob(".*.tmp*")) and not list(folder.glob("*.tmp"))  # no partial file left behind


class NaNAt(RegressionTask):
    def __init__(self, step: int, **kwargs):
        super().__init__(**kwargs)
        self.nan_step = step

    def loss(self, outputs, targets):
        loss = super().loss(outputs, targets)
        if self.trainer.state.global_step >= self.nan_step and torch.is_grad_enabled():
            return loss * float("nan")
        return loss


def test_a_nan_never_reaches_a_checkpoint_and_the_error_names_the_last_good_one(tmp_path):
    cb = ModelCheckpoint(every_n_train_steps=5, save_top_k=3)
    trainer = Trainer(max_epochs=4, default_root_dir=str(tmp_path), callbacks=[cb], **QUIET)  # log every 50
    with pytest.raises(NonFiniteLossError, match=r"(?s)The training loss is nan at epoch 1, batch 4 \(global step "
                                                 r"12\)\. Nothing was saved to .*; the last good checkpoint is "
                                                 r".*last\.ckpt"):
        trainer.fit(NaNAt(12, n=64, lr=0.01))
    files = sorted((tmp_path / "version_0" / "checkpoints").glob("*.ckpt"))
    assert files, "the good checkpoints are still there"
    for path in files:
        ckpt = load_checkpoint(str(path))
        assert ckpt["loop"]["state"]["global_step"] <= 12
        assert all(torch.isfinite(v).all() for v in ckpt["module"].values()), path.name
    assert load_checkpoint(str(tmp_path / "version_0" / "checkpoints" / "last.ckpt"))["loop"]["state"][
        "global_step"] == 10


def test_a_read_only_checkpoint_folder_fails_before_the_first_step(tmpfs):
    root = tmpfs(64, read_only=True)
    steps = []

    class Count(Callback):
        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
            steps.append(batch_idx)

    with pytest.raises(CheckpointError, match=r"(?s)Checkpoints cannot be written to .*Read-only file system.*"
                                              r"HINT: make the folder writable"):
        Trainer(max_epochs=1, callbacks=[ModelCheckpoint(dirpath=str(root / "ckpts")), Count()], **QUIET).fit(
            RegressionTask())
    assert steps == []


def test_a_checkpoint_of_a_newer_format_is_refused_by_every_loading_path(tmp_path):
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(RegressionTask())
    path = trainer.checkpoint_callback.last_model_path
    ckpt = torch.load(path, weights_only=True)
    ckpt["format_version"] = FORMAT_VERSION + 1
    newer = str(tmp_path / "newer.ckpt")
    torch.save(ckpt, newer)
    message = rf"has checkpoint format version {FORMAT_VERSION + 1} .*upgrade taskfit"
    for load in (lambda: Trainer(max_epochs=2, **QUIET).fit(RegressionTask(), ckpt_path=newer),
                 lambda: RegressionTask.load_from_checkpoint(newer),
                 lambda: Trainer(**QUIET).validate(RegressionTask(val_n=8), ckpt_path=newer)):
        with pytest.raises(CheckpointError, match=f"(?s){message}"):
            load()


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_pickle_that_would_call_os_system_is_refused_and_named(tmp_path):
    path = tmp_path / "hostile.ckpt"
    with open(path, "wb") as fh:
        pickle.dump({"weight": RunsCode()}, fh)
    torch.save({"weight": RunsCode()}, path)
    with pytest.raises(CheckpointError, match=r"it needs to import and call `posix\.system`.*Nothing in it was "
                                              r"executed"):
        RegressionTask.load_from_checkpoint(str(path))
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


@pytest.mark.parametrize("settings, message", [
    (dict(callbacks=object()), r"Trainer\(callbacks=\.\.\.\) got object, not a list of callbacks"),
    (dict(default_root_dir=123), r"Trainer\(default_root_dir=123\) is not valid: expected a folder path"),
    (dict(preempt_signals=("SIGFOO",)), r"'SIGFOO' is not a signal taskfit can catch"),
    (dict(preempt_signals="KILL"), r"'KILL' is not a signal taskfit can catch"),
])
def test_bad_arguments_are_one_error_naming_the_argument(settings, message):
    with pytest.raises(MisconfigurationError, match=message):
        Trainer(**settings)


@pytest.mark.parametrize("given", ["SIGTERM", "TERM", ("term",), ["SIGUSR1", "TERM"]])
def test_preempt_signals_accept_one_name_and_the_short_form(given):
    assert "SIGTERM" in Trainer(preempt_signals=given, **QUIET).preempt_signals


def test_a_single_callback_is_accepted():
    cb = ModelCheckpoint()
    assert cb in Trainer(callbacks=cb, **QUIET).callbacks


def test_best_model_score_is_finite_after_the_full_disk_row():  # the bookkeeping holds no stale NaN either
    cb = ModelCheckpoint(monitor="val/acc", mode="max", save_top_k=2)
    trainer = Trainer(max_epochs=2, callbacks=[cb], **QUIET)
    trainer.fit(ClassifierTask())
    assert all(math.isfinite(s) for s in cb.best_k_models.values())


CTRL_C = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from tasks import RegressionTask
from taskfit import Trainer
from taskfit.callbacks import Callback


class CtrlC(Callback):
    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        if trainer.state.global_step == 5:
            for _ in range({presses}):
                os.kill(os.getpid(), signal.SIGINT)


Trainer(max_epochs=3, default_root_dir={root!r}, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[CtrlC()]).fit(RegressionTask(n=256))
"""


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_saves_and_exits_130_and_a_second_one_aborts(tmp_path, presses):
    script = tmp_path / "train.py"
    script.write_text(CTRL_C.format(tests=os.path.dirname(__file__), root=str(tmp_path / "runs"), presses=presses))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    last = tmp_path / "runs" / "version_0" / "checkpoints" / "last.ckpt"
    assert "Ctrl-C: finishing this step, then saving a checkpoint" in result.stderr
    if presses == 1:
        assert result.returncode == 130, result.stderr[-3000:]
        assert "SIGINT received; saved a checkpoint" in result.stderr
        assert load_checkpoint(str(last))["loop"]["state"]["global_step"] == 5
    else:
        assert result.returncode != 130 and "KeyboardInterrupt" in result.stderr
        assert not last.exists()  # aborted at once: nothing saved at step 5


RANK_KILLED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from tasks import RegressionTask
from taskfit import Trainer
from taskfit.callbacks import Callback


class OutOfMemory(Callback):  # what the kernel's out-of-memory killer does to one rank
    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        if trainer.strategy.rank == 1 and trainer.state.global_step == 3:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    Trainer(max_epochs=2, strategy="ddp", devices=2, accelerator="cpu", default_root_dir={root!r}, logger=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            callbacks=[OutOfMemory()]).fit(RegressionTask(n=128))
"""


def test_a_ddp_rank_killed_by_sigkill_is_named_as_the_cause(tmp_path):
    """The survivor's collectives fail at once (not after the 600 s process-group timeout: the 240 s deadline
    only catches that hang, whatever the machine's load)."""
    script = tmp_path / "train.py"
    script.write_text(RANK_KILLED.format(tests=os.path.dirname(__file__), root=str(tmp_path / "runs")))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 1
    assert "ddp rank 1 of 2 was killed by SIGKILL" in result.stderr, result.stderr[-3000:]
    assert "raised on ddp rank 0" not in result.stderr  # the survivor is not blamed


class PositionLoader:
    """A loader that keeps its own position, as torchdata's StatefulDataLoader does (taskfit uses it as it is)."""

    def __init__(self, batches):
        self.batches, self.position = batches, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        while self.position < len(self.batches):
            self.position += 1
            yield self.batches[self.position - 1]
        self.position = 0  # the next epoch starts over

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class Stateful(RegressionTask):
    def train_dataloader(self):
        x, y = self.data.tensors
        return PositionLoader([(x[i:i + 8], y[i:i + 8]) for i in range(0, 64, 8)])


def test_a_stateful_loader_is_saved_and_continues_mid_epoch(tmp_path):
    quiet = dict(QUIET, default_root_dir=str(tmp_path))
    torch.manual_seed(0)
    whole = Stateful()
    Trainer(max_steps=11, enable_checkpointing=False, **QUIET).fit(whole)  # 8 batches per epoch: ends mid-epoch 1
    torch.manual_seed(0)
    first = Stateful()
    Trainer(max_steps=5, **quiet).fit(first)  # stops mid-epoch 0: the loader is at batch 5
    assert load_checkpoint(str(tmp_path / "version_0" / "checkpoints" / "last.ckpt"))["data"]["loader"] == \
        {"position": 5}
    resumed = Stateful()
    Trainer(max_steps=11, **quiet).fit(resumed, ckpt_path="last")
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))


def test_checkpoint_writer_keeps_order_and_reraises_the_first_error():
    done = []

    def slow(x):
        time.sleep(0.05)
        done.append(x)

    def fail():
        raise ValueError("disk on fire")

    writer = CheckpointWriter()
    writer.submit(slow, 1)
    writer.submit(fail)
    writer.submit(slow, 3)
    with pytest.raises(ValueError, match="disk on fire"):
        writer.wait()
    assert done == [1]  # in order; what came after the failure (a link to its file, a removal) did not run
    writer.wait()  # the error was reported once
    writer.submit(done.append, 3)  # once reported, the writer runs again
    writer.close()
    writer.submit(done.append, 4)  # a closed writer starts a new thread
    writer.close()
    assert done == [1, 3, 4]


class KillsAWorker(Callback):
    """At batch 2, SIGKILLs one of the fit's DataLoader workers and waits, inside the hook, until it
    is dead (looked at, not reaped); ``finished``: the hook got to its end."""

    def __init__(self) -> None:
        self.finished = False
        self.before: set[int] = set()

    def on_fit_start(self, trainer, task):
        # children started before the loaders' workers (earlier tests' services) are not workers
        self.before = _children()

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        if batch_idx != 2:
            return
        workers = sorted(_children() - self.before)
        os.kill(workers[0], 9)
        os.waitid(os.P_PID, workers[0], os.WEXITED | os.WNOWAIT)
        self.finished = True


def _children() -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == os.getpid()}


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_a_dead_worker_is_raised_at_the_next_batch_not_inside_the_trainers_code(tmp_path):
    """Issue 47, row 7, deterministically: torch's SIGCHLD handler raised a worker's death at
    whatever instruction the trainer was running (here: inside a callback; inside
    multiprocessing.Queue.put it left the queue's lock taken and the iterator's cleanup deadlocked:
    tests/test_cluster.py, 20 trials). During a fit taskfit's handler only counts the signal: the
    hook finishes, and the DataLoader's own check raises the death at the next batch."""
    hook = KillsAWorker()
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), callbacks=[hook], **QUIET)
    dead = r"DataLoader worker \(pid\(s\) \d+\) exited unexpectedly"
    with pytest.raises(RuntimeError, match=dead):
        trainer.fit(RegressionTask(n=256, batch_size=8, num_workers=2))
    assert hook.finished
