"""Asynchronous saves (trainer/staging.py, CheckpointWriter.save, fsdp through DCP's async_save) and resumes that
map the file instead of reading it: each save holds the state of its own step although training goes on while
it is written, the staging buffers are one reused copy, a full disk and a kill still leave the previous
checkpoint whole, and a resumed run never depends on the file it came from. Timings: benchmarks/checkpoint_stall.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import taskfit.checkpoint.files
import torch
from taskfit import CheckpointError, Strategy, Trainer
from taskfit.callbacks import Callback, ModelCheckpoint
from taskfit.checkpoint import load_checkpoint
from taskfit.checkpoint.files import CheckpointWriter, load_file
from taskfit.checkpoint.sharded import load_skeleton, read_shards, save_sharded
from taskfit.checkpoint.staging import StagingBuffers
from tasks import RegressionTask, same_state, seeded_task
from torch import nn

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, num_sanity_val_steps=0)


def _held(writer: CheckpointWriter) -> threading.Event:
    """Hold ``writer``'s thread until the returned event is set: what is submitted next waits behind it."""
    release = threading.Event()
    writer.submit(release.wait)
    return release


def test_an_async_save_holds_the_state_of_its_step_while_training_changes_it(tmp_path, monkeypatch):
    writer = CheckpointWriter()
    weight, moments = torch.arange(6.0).view(2, 3), {"state": {0: {"exp_avg": torch.ones(4)}}, "lr": 0.1}
    release, write = threading.Event(), taskfit.checkpoint.files.write_file
    monkeypatch.setattr(taskfit.checkpoint.files, "write_file", lambda *args: release.wait() and write(*args))
    path = str(tmp_path / "a.ckpt")
    writer.save({"module": {"w": weight}, "optimizer": moments}, path)
    assert not os.path.exists(path)  # nothing written yet: the training thread only copied the tensors
    weight.add_(100)  # the next steps change the tensors in place
    moments["state"][0]["exp_avg"].mul_(0)
    moments["lr"] = 0.2
    release.set()
    writer.wait()
    saved = torch.load(path, weights_only=True)
    assert saved["module"]["w"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert same_state(saved["optimizer"], {"state": {0: {"exp_avg": torch.ones(4)}}, "lr": 0.1})
    assert writer.staged_bytes == 6 * 4 + 4 * 4
    writer.close()
    assert writer.staged_bytes == 0  # the buffers go with the writer's thread at the end of fit


def test_staging_buffers_are_one_reused_copy_that_keeps_shared_storages_shared():
    model = nn.Linear(8, 4)
    tied = {"module": model.state_dict(), "head": model.weight, "row": model.weight[1], "step": 3}
    staging = StagingBuffers()
    first = staging.stage(tied)
    assert staging.nbytes == (8 * 4 + 4) * 4  # the weight once, though three entries hold it
    ptr = first["module"]["weight"].untyped_storage().data_ptr()
    assert first["head"].untyped_storage().data_ptr() == first["row"].untyped_storage().data_ptr() == ptr
    assert first["module"]._metadata == model.state_dict()._metadata  # load_state_dict's version records
    with torch.no_grad():
        model.weight.add_(1)
    second = staging.stage({"module": model.state_dict(), "step": 4})
    assert second["module"]["weight"].untyped_storage().data_ptr() == ptr  # the same buffer, filled again
    assert torch.equal(second["module"]["weight"], model.weight) and second["step"] == 4
    assert first["module"]["weight"].data_ptr() == ptr  # (the previous copy is overwritten: the writer waited)
    smaller = staging.stage({"bias": model.bias})
    assert staging.nbytes == 4 * 4 and torch.equal(smaller["bias"], model.bias)  # the weight's buffer is let go


class Staged(Callback):
    order = 2000  # after ModelCheckpoint's save

    def __init__(self) -> None:
        self.bytes: dict[int, int] = {}

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        self.bytes[trainer.state.global_step] = trainer.checkpoint_writer.staged_bytes


def _storage_bytes(tree) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(tree)}.values())


def test_fit_keeps_one_copy_of_each_save_and_lets_it_go_at_the_end(tmp_path):
    staged = Staged()
    trainer = Trainer(max_steps=6, default_root_dir=str(tmp_path), seed=0, callbacks=[
        ModelCheckpoint(every_n_train_steps=2, every_n_epochs=None, save_top_k=-1), staged], **QUIET)
    trainer.fit(seeded_task(AdamTask, features=6))
    folder = tmp_path / "version_0" / "checkpoints"
    assert staged.bytes[1] == 0
    for step in (2, 4, 6):  # the buffers hold what the file holds, once: weights, Adam's moments, RNG states...
        ckpt = torch.load(folder / f"epoch=0-step={step}.ckpt", weights_only=True)
        assert ckpt["loop"]["state"]["global_step"] == step
        assert staged.bytes[step] == staged.bytes[step + 1 if step < 6 else step] == _storage_bytes(ckpt) > 6 * 4 * 3
    assert trainer.checkpoint_writer.staged_bytes == 0


class AdamTask(RegressionTask):
    """An optimizer with state (SGD without momentum has none): what a resume keeps from the file."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def _maps(path: str) -> list[tuple[int, int]]:
    with open("/proc/self/maps") as fh:
        return [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in fh if line.rstrip().endswith(path)]


def _mapped(tensor: torch.Tensor, maps: list[tuple[int, int]]) -> bool:
    return any(lo <= tensor.data_ptr() < hi for lo, hi in maps)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
def test_a_resume_maps_the_weights_and_copies_what_the_run_keeps(tmp_path):
    trainer = Trainer(max_steps=4, default_root_dir=str(tmp_path), seed=0,
                      callbacks=[ModelCheckpoint(every_n_train_steps=2, every_n_epochs=None)], **QUIET)
    trainer.fit(seeded_task(AdamTask, features=6))
    path = os.path.realpath(trainer.checkpoint_callback.last_model_path)
    ckpt = load_checkpoint(path)
    maps = _maps(path)
    assert maps and all(_mapped(t, maps) for t in ckpt["module"].values())  # read from the page cache, not copied
    kept = [t for part in ("optimizer", "rng", "loop") for t in _tensors(ckpt[part])]
    assert kept and not any(_mapped(t, maps) for t in kept)  # what a resumed run goes on using is its own memory
    assert same_state(dict(load_file(path)), dict(torch.load(path, weights_only=True)))


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


TRUNCATED = """
import os, sys
sys.path.insert(0, {tests!r})
import torch
from tasks import seeded_task
from test_async_checkpoint import AdamTask
from taskfit import Trainer
from taskfit.callbacks import Callback, ModelCheckpoint

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, seed=0, num_sanity_val_steps=0)


class Overwrite(Callback):  # the file is rewritten in place after the restore (cp, another job): nothing may change
    def on_fit_start(self, trainer, task):
        with open({path!r}, "r+b") as fh:
            fh.truncate(0)


def fit(callbacks, ckpt_path=None, steps=8):
    task = seeded_task(AdamTask, features=6, lr=0.05)
    trainer = Trainer(max_steps=steps, default_root_dir={root!r}, callbacks=callbacks, **QUIET)
    trainer.fit(task, ckpt_path=ckpt_path)
    return task


cb = ModelCheckpoint(dirpath={folder!r}, every_n_train_steps=4, every_n_epochs=None)
fit([cb], steps=4)
torch.save(fit([ModelCheckpoint(dirpath={folder!r} + "2")], {path!r}).state_dict(), {out!r})
"""


def test_a_resumed_run_does_not_depend_on_its_checkpoint_file(tmp_path):
    """The run's optimizer state came from a mapped file: rewriting that file in place (a copy over it, a truncation)
    right after the restore must not change the run, nor crash it (a mapped page of a truncated file is SIGBUS)."""
    folder, out = tmp_path / "ckpts", tmp_path / "weights.pt"
    script = tmp_path / "run.py"
    script.write_text(TRUNCATED.format(tests=os.path.dirname(__file__), root=str(tmp_path), folder=str(folder),
                                       path=str(folder / "last.ckpt"), out=str(out)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = seeded_task(AdamTask, features=6, lr=0.05)
    Trainer(max_steps=8, default_root_dir=str(tmp_path / "ref"), seed=0, enable_checkpointing=False,
            **QUIET).fit(reference)
    assert same_state(torch.load(out, weights_only=True), reference.state_dict())


# ---- sharded checkpoints through DCP's async_save (one process here; tests/test_fsdp.py runs fsdp for real) ----
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process without a group
def test_an_async_sharded_save_holds_the_state_of_its_step_and_reuses_its_staging(tmp_path):
    writer, path = CheckpointWriter(), str(tmp_path / "last.ckpt")
    weight = torch.arange(8.0)
    for value in (1.0, 2.0):
        weight.fill_(value)
        release = _held(writer)
        save_sharded(Strategy("cpu"), {"module": {"w": weight}, "loop": {"value": value}}, path, writer)
        weight.fill_(-1)  # training goes on while the shards are written
        assert not os.path.exists(path) if value == 1.0 else load_skeleton(path)["loop"]["value"] == 1.0
        release.set()
        writer.wait()
        skeleton = load_skeleton(path)
        assert skeleton["loop"]["value"] == value
        assert read_shards(path, skeleton)["module"]["w"].tolist() == [value] * 8
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]  # no temporary directory left behind
    writer.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_full_disk_during_an_async_sharded_save_keeps_the_previous_checkpoint(tmpfs):
    point = tmpfs(1024)
    writer, path = CheckpointWriter(), str(point / "last.ckpt")
    save_sharded(Strategy("cpu"), {"module": {"w": torch.full((1000,), 1.0)}, "loop": {}}, path, writer)
    writer.wait()
    with pytest.raises(CheckpointError, match=r"Could not write the sharded checkpoint .*last\.ckpt: .*(No space "
                                              r"left on device|; \d+ bytes free on its file system).*\n  HINT: "
                                              r"check that its folder is writable"):
        save_sharded(Strategy("cpu"), {"module": {"w": torch.full((400_000,), 2.0)}, "loop": {}}, path, writer)
        writer.wait()
    assert read_shards(path, load_skeleton(path))["module"]["w"][0] == 1.0  # the previous one, whole
    assert sorted(os.listdir(point)) == ["last.ckpt"]  # the partial directory was removed
    writer.close()
