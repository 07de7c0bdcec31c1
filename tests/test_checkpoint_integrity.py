"""Checkpoint integrity, each fault repeated (issue 39): a write that fails anywhere in the background writer is one
CheckpointError naming the file, the cause and the intact checkpoint (never torch's zip error); a bit flipped in a
tensor of a single-file checkpoint is refused by name (its CRC-32 checksums) and ``ckpt_path="last"`` falls back
to the newest intact checkpoint; so does a missing, empty or unreadable ``last.ckpt``; and ``last.ckpt`` is a copy,
not a hard link, so damaging one file leaves the other whole. Tiny models, in-process (a tmpfs where root may mount
one). docs/checkpointing.md, "What survives which fault"."""
from __future__ import annotations

import errno
import os
import random
import re
import shutil
import struct
import threading
import warnings
import zipfile
from pathlib import Path

import pytest
import taskfit.checkpoint.files as files
import torch
from taskfit import CheckpointError, Trainer
from taskfit.callbacks import Callback, ModelCheckpoint
from taskfit.checkpoint import FORMAT_VERSION, load_checkpoint
from taskfit.checkpoint.files import CheckpointWriter, load_file
from tasks import RegressionTask

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, num_sanity_val_steps=0)
TRIALS = 24  # per fault


def _fit(root, steps, ckpt_path=None, **kwargs):
    trainer = Trainer(max_steps=steps, default_root_dir=str(root), **QUIET, **kwargs)
    trainer.fit(RegressionTask(n=64, lr=0.01), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run to damage copies of: a save every 2 steps, every file kept (step=2...8), and last.ckpt (step 8)."""
    root = tmp_path_factory.mktemp("run")
    _fit(root, 8, callbacks=[ModelCheckpoint(every_n_train_steps=2, every_n_epochs=None, save_top_k=-1)])
    folder = root / "version_0" / "checkpoints"
    assert sorted(os.listdir(folder)) == [f"epoch=0-step={s}.ckpt" for s in (2, 4, 6, 8)] + ["last.ckpt"]
    return folder


def _copy_run(folder: Path, root: Path) -> Path:
    """The run's checkpoints under a root of their own (modification times kept: "newest" is by them)."""
    dst = root / "version_0" / "checkpoints"
    shutil.copytree(folder, dst)
    return dst


def _tensor_records(path) -> list[tuple[str, int, int]]:
    """(record name, offset of its bytes in the file, size) of every non-empty tensor storage of a checkpoint."""
    out = []
    with zipfile.ZipFile(path) as archive, open(path, "rb") as fh:
        for info in archive.infolist():
            if re.search(r"/data/\d+$", info.filename) and info.file_size:
                fh.seek(info.header_offset)
                name_len, extra_len = struct.unpack("<HH", fh.read(30)[26:30])
                out.append((info.filename, info.header_offset + 30 + name_len + extra_len, info.file_size))
    return out


def _flip_a_tensor_bit(path, rng: random.Random) -> None:
    """One bit flipped inside one tensor's bytes: same size, still a valid zip (torch checks no CRC)."""
    _, offset, size = rng.choice(_tensor_records(path))
    with open(path, "r+b") as fh:
        fh.seek(offset + rng.randrange(size))
        byte = fh.read(1)[0]
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte ^ (1 << rng.randrange(8))]))


# ---- a failed background write: one CheckpointError, whatever the point of failure --------------------------------
class _FullAt:
    """``open`` for taskfit's checkpoint files whose temporary files fill up after ``limit`` bytes (then every write
    raises ``OSError(code)``, as a full disk does), from the ``nth`` temporary file written on."""

    def __init__(self, nth: int, limit: int, code: int) -> None:
        self.nth, self.limit, self.code, self.opened = nth, limit, code, 0

    def __call__(self, file, mode="r", *args, **kwargs):
        fh = open(file, mode, *args, **kwargs)
        if "w" in mode and str(file).endswith(".tmp"):
            self.opened += 1
            if self.opened >= self.nth:
                return _Filling(fh, self.limit, self.code)
        return fh


class _Filling:
    def __init__(self, fh, limit: int, code: int) -> None:
        self.fh, self.room, self.code = fh, limit, code

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) > self.room:  # what fits is written, then the disk is full
            self.fh.write(data[:self.room])
            self.room = 0
            raise OSError(self.code, os.strerror(self.code))
        self.room -= len(data)
        return self.fh.write(data)

    def __getattr__(self, name):
        return getattr(self.fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()


def _check_folder_after_a_failure(folder: Path, cb: ModelCheckpoint, message: str) -> None:
    """Every file left is a whole checkpoint that passes its checksums, the bookkeeping agrees with the folder,
    no temporary file is left, and the intact checkpoint the message names is there and loads."""
    names = sorted(os.listdir(folder))
    assert not [n for n in names if n.endswith(".tmp")], names
    for name in names:
        load_checkpoint(str(folder / name))
    assert set(cb.best_k_models) | ({cb.best_model_path} if cb.best_model_path else set()) <= \
        {str(folder / n) for n in names}
    named = re.search(r"The previous (\S+) is intact\.|the newest is (\S+)\.\n", message)
    assert named, message
    path = folder / named.group(1) if named.group(1) else Path(named.group(2))
    assert load_checkpoint(str(path))["loop"]["state"]["global_step"] >= 2


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_disk_that_fills_at_any_point_of_a_background_write_is_one_clear_error(tmp_path, monkeypatch, trial):
    """ENOSPC injected at a random byte of a random save's file (the ranked file or the last.ckpt copy): the run
    ends in taskfit's CheckpointError on the training thread (not torch's "unexpected pos"), which names the file,
    ENOSPC, the fix and the intact checkpoint; every file left loads and passes its checksums."""
    rng = random.Random(trial)
    size = 3000  # a checkpoint of this task is ~3 KB: the limit falls anywhere from its first byte to past its end
    monkeypatch.setattr(files, "open", _FullAt(nth=rng.randint(2, 6), limit=rng.randrange(size), code=errno.ENOSPC),
                        raising=False)
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, every_n_epochs=None, save_top_k=2)
    seen = []

    class Steps(Callback):
        def on_train_batch_start(self, trainer, task, batch, batch_idx):
            seen.append(trainer.state.global_step)

    with pytest.raises(CheckpointError) as info:
        _fit(tmp_path, 64, callbacks=[cb, Steps()])
    message = str(info.value)
    assert re.match(rf"Could not write the checkpoint {tmp_path}/ckpts/\S+\.ckpt: No space left on device \(ENOSPC\)"
                    r"\. ", message), message
    assert "\n  HINT: free space on that file system" in message and "unexpected pos" not in message
    assert info.value.__cause__ is None or isinstance(info.value.__cause__, OSError)
    assert max(seen) < 63  # raised during training, at a step soon after the failed save, not only at the end
    _check_folder_after_a_failure(tmp_path / "ckpts", cb, message)


@pytest.mark.parametrize("trigger", ["steps", "epochs"])
def test_a_failed_background_write_is_raised_at_the_next_step_or_log_interval(tmp_path, monkeypatch, trigger):
    """Once the writer's thread has failed, the training thread raises at its next step (a step-triggered
    ModelCheckpoint checks every step) or log interval (epoch saves), long before the next save."""
    monkeypatch.setattr(files, "open", _FullAt(nth=1, limit=500, code=errno.ENOSPC), raising=False)
    steps = dict(every_n_train_steps=20, every_n_epochs=None) if trigger == "steps" else dict(min_epoch_interval=0)
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpts", **steps)
    seen = []

    class WaitForTheWriter(Callback):
        def on_train_batch_start(self, trainer, task, batch, batch_idx):
            seen.append(trainer.state.global_step)
            if trainer.checkpoint_writer._pending:  # the failing save was submitted: let its thread fail first
                for _ in range(1000):
                    if trainer.checkpoint_writer._failed:
                        break
                    threading.Event().wait(0.01)

    with pytest.raises(CheckpointError, match=r"No space left on device \(ENOSPC\)\. No earlier checkpoint is in "
                                              r"its folder\."):
        _fit(tmp_path, 200, callbacks=[cb, WaitForTheWriter()], log_every_n_steps=5)
    # steps: saved at step 20, raised in the next step's batch end; epochs (8 steps each): saved at step 8, raised
    # at the log interval of step 10 (seen holds the global step at each batch's start)
    assert max(seen) == (20 if trigger == "steps" else 9), seen[-3:]


@pytest.mark.parametrize("code", [errno.EDQUOT, errno.EIO])
def test_other_write_errors_are_named_with_their_fix(tmp_path, monkeypatch, code):
    monkeypatch.setattr(files, "open", _FullAt(nth=3, limit=1000, code=code), raising=False)
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, every_n_epochs=None)
    with pytest.raises(CheckpointError, match=rf"Could not write the checkpoint .*: .* \({errno.errorcode[code]}\)\. "
                                              r"(The previous|The checkpoints written before)") as info:
        _fit(tmp_path, 16, callbacks=[cb])
    assert ("quota" if code == errno.EDQUOT else "I/O error") in str(info.value)
    _check_folder_after_a_failure(tmp_path / "ckpts", cb, str(info.value))


def test_a_failed_fsync_or_copy_of_last_is_one_clear_error(tmp_path, monkeypatch):
    def no_room(fin, fout):
        fout.write(fin.read(100))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files, "_copy_bytes", no_room)  # the copy of the new ranked file to last.ckpt
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, every_n_epochs=None)
    with pytest.raises(CheckpointError, match=r"last\.ckpt: No space left on device \(ENOSPC\)\. The checkpoints "
                                              r"written before are intact; the newest is .*step=2\.ckpt\."):
        _fit(tmp_path, 16, callbacks=[cb])
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["epoch=0-step=2.ckpt"]
    monkeypatch.undo()
    calls = []

    def failing_fsync(fd):
        calls.append(fd)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    writer = CheckpointWriter()
    files.write_file({"w": torch.ones(3)}, str(tmp_path / "a.ckpt"))
    monkeypatch.setattr(files.os, "fsync", failing_fsync)
    writer.save({"w": torch.zeros(3)}, str(tmp_path / "a.ckpt"))
    with pytest.raises(CheckpointError, match=r"a\.ckpt: Input/output error \(EIO\)\. The previous a\.ckpt is intact"):
        writer.wait()
    monkeypatch.undo()
    assert calls and torch.equal(load_file(str(tmp_path / "a.ckpt"))["w"], torch.ones(3))
    writer.close()


def test_a_folder_removed_during_training_is_recreated_or_named(tmp_path, monkeypatch):
    """The folder is recreated by the next save; if it vanishes between that and the write, ENOENT is named."""
    folder = tmp_path / "ckpts"
    writer = CheckpointWriter()
    files.atomic_save({"w": torch.ones(3)}, str(folder / "a.ckpt"), writer)
    writer.wait()
    shutil.rmtree(folder)
    files.atomic_save({"w": torch.ones(3)}, str(folder / "b.ckpt"), writer)  # recreated
    writer.wait()
    shutil.rmtree(folder)
    with pytest.raises(CheckpointError, match=r"b\.ckpt: No such file or directory \(ENOENT\)\. No earlier checkpoint "
                                              r"is in its folder\.\n  HINT: its folder was removed"):
        files.write_file({"w": torch.ones(3)}, str(folder / "b.ckpt"))
    writer.close()


@pytest.mark.parametrize("free_kb", [0, 8, 40, 72, 104])
def test_a_real_full_tmpfs_during_a_background_write(tmp_path, tmpfs, free_kb):
    """A small tmpfs filled after the step-4 save so that only ``free_kb`` are left: the step-6 save (a ~120 KB
    ranked file, then its last.ckpt copy) fails at a different point each time; always one clear CheckpointError."""
    point = tmpfs(1024)
    class Fill(Callback):
        order = 2000  # after ModelCheckpoint's save

        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
            if trainer.state.global_step == 4:
                trainer.checkpoint_writer.wait()
                with open(point / "filler", "wb", buffering=0) as fh:
                    try:
                        while fh.write(b"\0" * 4096):
                            pass
                    except OSError:
                        pass
                    fh.truncate(max(0, fh.tell() - free_kb * 1024))

    cb = ModelCheckpoint(dirpath=point / "ckpts", every_n_train_steps=2, every_n_epochs=None, save_top_k=1)
    trainer = Trainer(max_steps=8, default_root_dir=str(tmp_path), callbacks=[cb, Fill()], **QUIET)
    with pytest.raises(CheckpointError, match=r"Could not write the checkpoint .*\.ckpt: No space left on device "
                                              r"\(ENOSPC\)\. ") as info:
        trainer.fit(RegressionTask(features=30_000, n=32, batch_size=8, lr=1e-6))
    assert "unexpected pos" not in str(info.value)
    _check_folder_after_a_failure(point / "ckpts", cb, str(info.value))
    assert load_checkpoint(str(point / "ckpts" / "last.ckpt"))["loop"]["state"]["global_step"] >= 4


# ---- checksums: a flipped bit is refused by name; "last" falls back ---------------------------------------------
def test_checkpoints_record_checksums_and_older_files_without_them_still_load(run, tmp_path):
    ckpt = torch.load(run / "last.ckpt", weights_only=True)
    assert ckpt["format_version"] == FORMAT_VERSION == 1  # an additive entry: older taskfit reads the new files
    assert ckpt["checksums"]["algorithm"] == "crc32"
    assert "checkpoint['module']['net.1.weight']" in ckpt["checksums"]["tensors"]
    del ckpt["checksums"]  # as an older taskfit wrote it
    older = _copy_run(run, tmp_path)
    torch.save(ckpt, older / "last.ckpt")
    assert load_checkpoint(str(older / "last.ckpt"))["loop"]["state"]["global_step"] == 8
    resumed = _fit(tmp_path, 9, ckpt_path="last", enable_checkpointing=False)
    assert resumed.state.resumed and resumed.state.global_step == 9


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_flipped_bit_in_a_tensor_of_last_is_refused_and_last_falls_back(run, tmp_path, trial):
    rng = random.Random(1000 + trial)
    folder = _copy_run(run, tmp_path)
    _flip_a_tensor_bit(folder / "last.ckpt", rng)
    assert os.path.getsize(folder / "last.ckpt") == os.path.getsize(run / "last.ckpt")
    with pytest.raises(CheckpointError, match=rf"Checkpoint {folder}/last\.ckpt is damaged: the bytes of tensor "
                                              r"checkpoint\[.*\] do not match the checksum recorded"):
        load_checkpoint(str(folder / "last.ckpt"))
    newest = folder / "epoch=0-step=8.ckpt"  # the newest intact one (the same state: last.ckpt was its copy)
    with pytest.warns(UserWarning, match=rf"Skipped {folder}/last\.ckpt: Checkpoint .* is damaged: the bytes of "
                                         rf"tensor .*; resuming from {newest}, the newest intact checkpoint"):
        resumed = _fit(tmp_path, 9, ckpt_path="last", enable_checkpointing=False)
    assert resumed.state.resumed and resumed.state.global_step == 9


def test_a_flipped_bit_is_refused_by_every_loading_path(run, tmp_path):
    folder = _copy_run(run, tmp_path)
    damaged = folder / "epoch=0-step=4.ckpt"
    _flip_a_tensor_bit(damaged, random.Random(0))
    message = rf"Checkpoint {damaged} is damaged: .*\n  HINT: the file changed after taskfit wrote it"
    for load in (lambda: _fit(tmp_path, 9, ckpt_path=str(damaged), enable_checkpointing=False),
                 lambda: RegressionTask.load_from_checkpoint(str(damaged)),
                 lambda: Trainer(**QUIET).validate(RegressionTask(val_n=8), ckpt_path=str(damaged))):
        with pytest.raises(CheckpointError, match=message):
            load()


def test_last_with_every_checkpoint_damaged_is_an_error_not_a_fresh_start(run, tmp_path):
    folder = _copy_run(run, tmp_path)
    for path in folder.iterdir():
        _flip_a_tensor_bit(path, random.Random(path.name))
    with pytest.raises(CheckpointError, match=rf"Checkpoint {folder}/last\.ckpt is damaged"):
        _fit(tmp_path, 9, ckpt_path="last", enable_checkpointing=False)


# ---- a missing, empty or unreadable last.ckpt: "last" resumes the newest intact checkpoint ----------------------
def _break_last(last: Path, how: str) -> str:
    """Damage ``last`` as ``how`` says; the reason the warning gives."""
    if how == "deleted":
        last.unlink()
        return "missing"
    if how == "empty folder":
        last.unlink()
        last.mkdir()
        return "a folder, not a checkpoint"
    if how == "empty file":
        last.write_bytes(b"")
        return r"Cannot read checkpoint .* \(0 bytes\): the file is truncated or corrupt"
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2])  # truncated: a copy cut short
    return r"Cannot read checkpoint .*: the file is truncated or corrupt"


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_missing_or_unreadable_last_falls_back_to_the_newest_intact_checkpoint(run, tmp_path, trial):
    how = ["deleted", "empty folder", "empty file", "truncated"][trial % 4]
    folder = _copy_run(run, tmp_path)
    rng = random.Random(2000 + trial)
    if trial >= 8:  # also lose the newest ranked files, as a cleanup script might: the newest left is used
        for step in [8, 6, 4][: rng.randint(1, 2)]:
            (folder / f"epoch=0-step={step}.ckpt").unlink()
    newest = max((p for p in folder.glob("epoch=*.ckpt")), key=lambda p: int(p.stem.split("=")[-1]))
    step = int(newest.stem.split("=")[-1])
    why = _break_last(folder / "last.ckpt", how)
    with pytest.warns(UserWarning, match=rf"Skipped {folder}/last\.ckpt: {why}.*; resuming from {newest}, the newest "
                                         r"intact checkpoint") as record:
        resumed = _fit(tmp_path, step + 1, ckpt_path="last", enable_checkpointing=False)
    assert len([w for w in record if "Skipped" in str(w.message)]) == 1  # one warning naming both files
    assert resumed.state.resumed and resumed.state.global_step == step + 1
    if trial % 6 == 0:  # validate("last") finds it too
        task = RegressionTask(val_n=8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Trainer(default_root_dir=str(tmp_path), **QUIET).validate(task, ckpt_path="last")
        expected = load_checkpoint(str(newest))["module"]
        assert all(torch.equal(task.state_dict()[k], v) for k, v in expected.items())


def test_an_empty_folder_named_last_is_replaced_by_the_next_save(tmp_path):
    folder = tmp_path / "ckpts"
    (folder / "last.ckpt").mkdir(parents=True)
    _fit(tmp_path, 4, callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=2, every_n_epochs=None)])
    assert load_checkpoint(str(folder / "last.ckpt"))["loop"]["state"]["global_step"] == 4


def test_last_is_a_copy_so_damaging_the_ranked_file_in_place_leaves_it_whole(run, tmp_path):
    folder = _copy_run(run, tmp_path)
    for name in ("last.ckpt", "epoch=0-step=8.ckpt"):
        assert os.stat(run / name).st_nlink == 1  # as written, not hard links of each other
    assert not os.path.samefile(run / "last.ckpt", run / "epoch=0-step=8.ckpt")
    with open(folder / "epoch=0-step=8.ckpt", "r+b") as fh:  # a tool writes into the ranked file
        fh.write(b"\0" * 4096)
    assert load_checkpoint(str(folder / "last.ckpt"))["loop"]["state"]["global_step"] == 8


def test_a_checkpoint_read_back_and_written_again_gets_fresh_checksums(run, tmp_path):
    """(taskfit.consolidate and a user's own re-save do this: the old entry must not be checked against itself)"""
    ckpt = dict(load_checkpoint(str(run / "last.ckpt")))
    ckpt["loop"] = {**ckpt["loop"], "note": "changed"}
    files.write_file(ckpt, str(tmp_path / "again.ckpt"))
    assert load_checkpoint(str(tmp_path / "again.ckpt"))["loop"]["note"] == "changed"


def test_the_copy_falls_back_to_reading_where_sendfile_cannot(tmp_path, monkeypatch):
    src = tmp_path / "a.ckpt"
    src.write_bytes(os.urandom(3 << 20))
    files.atomic_copy(str(src), str(tmp_path / "b.ckpt"))
    assert (tmp_path / "b.ckpt").read_bytes() == src.read_bytes() and not os.path.samefile(src, tmp_path / "b.ckpt")

    def no_sendfile(*args):
        raise OSError(errno.EINVAL, "not here")

    monkeypatch.setattr(files.os, "sendfile", no_sendfile)
    files.atomic_copy(str(src), str(tmp_path / "c.ckpt"))
    assert (tmp_path / "c.ckpt").read_bytes() == src.read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "b.ckpt", "c.ckpt"]


def test_an_empty_folder_named_last_and_nothing_else_starts_fresh_saying_so(tmp_path):
    (tmp_path / "version_0" / "checkpoints" / "last.ckpt").mkdir(parents=True)
    with pytest.warns(UserWarning, match=r"Skipped .*last\.ckpt: a folder, not a checkpoint; there is no intact "
                                         r"checkpoint to resume from"):
        trainer = _fit(tmp_path, 2, ckpt_path="last", enable_checkpointing=False)
    assert not trainer.state.resumed
