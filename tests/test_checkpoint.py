"""Checkpoint contents, safe loading, clear errors, ModelCheckpoint bookkeeping, preemption (in-process, fast).

Killed processes and the exactness contract under real signals: tests/test_resume.py.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import pickle
import re
import threading

import pytest
import torch
from taskfit import CheckpointError, MisconfigurationError
from taskfit.callbacks import Callback, ModelCheckpoint
from taskfit.callbacks.checkpoint.model_checkpoint import format_filename
from taskfit.checkpoint import FORMAT_VERSION, last_checkpoint, load_checkpoint
from taskfit.loop.checkpointer import Checkpointer
from tasks import ClassifierTask, RegressionTask, same_state
from tasks import checkpointing_trainer as _trainer
from tasks import seeded_task as _task


def _digest(folder) -> dict[str, str]:
    """Name -> sha256 of every file under ``folder`` (to prove an error touched nothing)."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                out[os.path.relpath(os.path.join(dirpath, name), folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


class Values(Callback):
    """Records ``trainer.state.metrics[key]`` at every epoch end."""

    def __init__(self, key: str) -> None:
        self.key, self.values = key, []

    def on_train_epoch_end(self, trainer, task) -> None:
        self.values.append(trainer.state.metrics[self.key])


# ---- what a checkpoint holds ------------------------------------------------------------------------------
def test_checkpoint_holds_everything_and_loads_with_weights_only(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=2, callbacks=[ModelCheckpoint(min_epoch_interval=0)])  # an epoch-end file
    task = _task(shuffle=True, dropout=0.1, val_n=16)
    trainer.fit(task)
    path = trainer.checkpoint_callback.last_model_path
    assert path == str(tmp_path / "version_0" / "checkpoints" / "last.ckpt")
    ckpt = torch.load(path, weights_only=True)  # the contract: nothing but tensors, containers, primitives
    assert ckpt["format_version"] == FORMAT_VERSION and set(ckpt["versions"]) == {"taskfit", "torch"}
    assert ckpt["module"].keys() == task.state_dict().keys()
    assert all(torch.equal(ckpt["module"][k], v) for k, v in task.state_dict().items())
    assert ckpt["optimizer"]["param_groups"][0]["lr"] == 0.05
    state = ckpt["loop"]["state"]
    assert (state["epoch"], state["global_step"], state["epoch_done"]) == (1, 16, True)
    rng = ckpt["rng"][0]
    assert isinstance(rng["python"]["state"], torch.Tensor) and rng["python"]["state"].numel() == 625
    assert isinstance(rng["numpy"]["keys"], torch.Tensor) and rng["torch"].dtype == torch.uint8
    # the epoch's order, drawn as RandomSampler's
    assert isinstance(ckpt["data"].pop("order_seed"), int)
    assert ckpt["data"] == {"seed": 0, "epoch": 1, "batches_done": 8, "batch_size": 8, "world_size": 1,
                            "accumulate_grad_batches": 1, "num_train_batches": 8, "max_epochs": 2, "max_steps": None,
                            "loader": None}
    # Lightning's key (issue 46), so that states of Lightning checkpoints restore
    assert ckpt["callbacks"][trainer.checkpoint_callback.state_key]["last_model_path"] == path
    assert ckpt["task"]["hparams"]["shuffle"] is True and ckpt["hparams"]["dropout"] == 0.1
    names = os.listdir(os.path.dirname(path))
    assert not [n for n in names if n.endswith(".tmp")]
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class NumpyState(Callback):
    def state_dict(self):
        import numpy as np

        return {"counts": np.zeros(3)}


def test_state_that_would_need_pickle_is_refused_at_save(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=1, callbacks=[NumpyState()])
    with pytest.raises(CheckpointError, match=r"Cannot save a checkpoint: checkpoint\['callbacks'\]\['NumpyState'\]"
                                              r"\['counts'\] is a numpy.ndarray"):
        trainer.fit(_task())
    assert not [n for _, _, names in os.walk(tmp_path) for n in names]  # not even a temporary file is left


# ---- safe loading and clear errors --------------------------------------------------------------------------
class Payload:
    """Unpickling this creates ``path``: what a malicious checkpoint would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
def test_malicious_checkpoint_is_refused_and_never_runs(tmp_path, writer):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.ckpt"
    payload = {"module": Payload(str(marker)), "format": "taskfit.checkpoint", "format_version": 1}
    if writer == "torch.save":
        torch.save(payload, evil)
    else:
        with open(evil, "wb") as f:
            pickle.dump(payload, f, protocol=4)
        with open(evil, "rb") as f:
            pickle.load(f)  # the payload is live: an unsafe load creates the file
        assert marker.exists()
        marker.unlink()
    trainer = _trainer(tmp_path / "runs", max_epochs=1, enable_checkpointing=False)
    with pytest.raises(CheckpointError, match=r"Refused to load .*evil\.ckpt.* Nothing in it was executed"):
        trainer.fit(_task(), ckpt_path=str(evil))
    with pytest.raises(CheckpointError, match="Refused to load"):
        RegressionTask.load_from_checkpoint(str(evil))
    with pytest.raises(CheckpointError, match="Refused to load"):
        trainer.validate(_task(val_n=8), ckpt_path=str(evil))
    assert not marker.exists()


def test_torch_saved_payload_names_the_global(tmp_path):
    torch.save({"x": Payload(str(tmp_path / "pwned"))}, tmp_path / "evil.ckpt")
    with pytest.raises(CheckpointError, match=r"needs to import and call `(io|builtins)\.open`"):
        load_checkpoint(str(tmp_path / "evil.ckpt"))


def test_truncated_and_corrupt_files_give_one_clear_error_and_touch_nothing(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(_task())
    good = trainer.checkpoint_callback.last_model_path
    data = open(good, "rb").read()
    (tmp_path / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty.ckpt").write_bytes(b"")
    corrupt = bytearray(data)
    corrupt[-200:-100] = os.urandom(100)
    (tmp_path / "corrupt.ckpt").write_bytes(bytes(corrupt))
    (tmp_path / "notes.ckpt").write_bytes(b"some notes, not a checkpoint\n" * 50)
    (tmp_path / "json.ckpt").write_bytes(b'{"weights": [1, 2, 3]}')
    before = _digest(tmp_path)
    for name in ("truncated", "empty", "corrupt", "notes"):
        with pytest.raises(CheckpointError, match=rf"Cannot read checkpoint .*{name}\.ckpt \(\d+ bytes\): the file is "
                                                  r"truncated or corrupt"):
            _trainer(tmp_path, max_epochs=2).fit(_task(), ckpt_path=str(tmp_path / f"{name}.ckpt"))
    with pytest.raises(CheckpointError, match=r"json\.ckpt: it is not a PyTorch checkpoint of tensors \(Unsupported "
                                              r"operand 123\)"):
        _trainer(tmp_path, max_epochs=2).fit(_task(), ckpt_path=str(tmp_path / "json.ckpt"))
    after = _digest(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing saved so far was touched


def test_missing_path_and_last_or_best_with_nothing_saved(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=1)
    with pytest.raises(CheckpointError, match=r"Checkpoint .*nope\.ckpt does not exist"):
        trainer.fit(_task(), ckpt_path=str(tmp_path / "nope.ckpt"))
    with pytest.raises(CheckpointError, match=r'ckpt_path="last" but no checkpoint has been saved yet'):
        trainer.validate(_task(val_n=8), ckpt_path="last")  # nothing to evaluate (fit starts fresh instead)
    with pytest.raises(CheckpointError, match=r'ckpt_path="best" but no best checkpoint is known'):
        trainer.validate(_task(val_n=8), ckpt_path="best")
    with pytest.raises(CheckpointError, match="is not a path"):
        trainer.fit(_task(), ckpt_path=3)
    assert not os.path.exists(tmp_path / "version_0" / "checkpoints")


def test_checkpoint_of_another_model_lists_keys_and_shapes(tmp_path):
    trainer = _trainer(tmp_path / "a", max_epochs=1)
    trainer.fit(_task(features=4))
    path = trainer.checkpoint_callback.last_model_path
    with pytest.raises(CheckpointError, match=r"does not fit RegressionTask: missing keys none; unexpected keys "
                                              r"none; shape mismatches \[net\.1\.weight: checkpoint \(1, 4\), "
                                              r"model \(1, 6\)\]"):
        _trainer(tmp_path / "b", max_epochs=2).fit(_task(features=6), ckpt_path=path)
    with pytest.raises(CheckpointError, match=r"does not fit ClassifierTask: missing keys \[net\.0\.weight, "
                                              r"net\.0\.bias, net\.2\.weight, net\.2\.bias\]; unexpected keys "
                                              r"\[net\.1\.weight, net\.1\.bias\]"):
        _trainer(tmp_path / "b", max_epochs=1).validate(_task(ClassifierTask), ckpt_path=path)


def test_newer_format_version_is_refused(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(_task())
    ckpt = torch.load(trainer.checkpoint_callback.last_model_path, weights_only=True)
    ckpt["format_version"] = FORMAT_VERSION + 1
    torch.save(ckpt, tmp_path / "future.ckpt")
    with pytest.raises(CheckpointError, match=rf"has checkpoint format version {FORMAT_VERSION + 1} \(written by "
                                              rf"taskfit .*\); this taskfit reads versions up to {FORMAT_VERSION}"):
        _trainer(tmp_path, max_epochs=2).fit(_task(), ckpt_path=str(tmp_path / "future.ckpt"))


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_plain_state_dicts_with_wrapper_prefixes_load_for_inference_not_for_resume(tmp_path, prefix):
    trained = _task(features=4, val_n=16)
    with torch.no_grad():
        trained.net[1].weight.fill_(0.5)
    torch.save({prefix + k: v for k, v in trained.state_dict().items()}, tmp_path / "weights.pt")
    loaded = RegressionTask.load_from_checkpoint(str(tmp_path / "weights.pt"), val_n=16)
    assert torch.equal(loaded.net[1].weight, trained.net[1].weight) and not loaded.training
    evaluate = _trainer(tmp_path, enable_checkpointing=False).validate
    assert evaluate(_task(val_n=16), ckpt_path=str(tmp_path / "weights.pt")) == evaluate(trained)
    with pytest.raises(CheckpointError, match=r"holds only weights \(a state dict\), not a taskfit training "):
        _trainer(tmp_path, max_epochs=1).fit(_task(), ckpt_path=str(tmp_path / "weights.pt"))


# ---- ModelCheckpoint --------------------------------------------------------------------------------------------
def test_top_k_rotation_and_best_last_bookkeeping(tmp_path, monkeypatch):
    removed = []
    real_remove = os.remove

    def observe(path):  # rotation must delete an old file only once its replacement is in place
        removed.append((os.path.basename(path), sorted(os.listdir(os.path.dirname(path)))))
        real_remove(path)

    monkeypatch.setattr(os, "remove", observe)
    values = Values("val/loss")
    cb = ModelCheckpoint(monitor="val/loss", save_top_k=2, filename="{epoch}-{val/loss:.4f}")
    trainer = _trainer(tmp_path, max_epochs=6, callbacks=[cb, values])
    trainer.fit(_task(ClassifierTask, lr=0.5))
    folder = tmp_path / "version_0" / "checkpoints"
    ranked = sorted(values.values)[:2]
    assert sorted(cb.best_k_models.values()) == ranked
    assert cb.best_model_score == min(values.values)
    best_epoch = values.values.index(min(values.values))
    assert os.path.basename(cb.best_model_path) == f"epoch={best_epoch}-val_loss={min(values.values):.4f}.ckpt"
    assert sorted(os.listdir(folder)) == sorted([os.path.basename(p) for p in cb.best_k_models] + ["last.ckpt"])
    assert load_checkpoint(cb.best_model_path)["loop"]["state"]["epoch"] == best_epoch
    assert cb.last_model_path == str(folder / "last.ckpt")
    assert load_checkpoint(cb.last_model_path)["loop"]["state"]["global_step"] == trainer.state.global_step
    assert len(removed) == 6 - 2 - sum(  # every file that fell out of the top 2 was deleted...
        1 for i, v in enumerate(values.values) if i >= 2 and v >= sorted(values.values[:i])[1])
    for name, present in removed:  # ...after the file that replaced it was written
        assert len([n for n in present if n != "last.ckpt"]) == 3, (name, present)


def test_without_monitor_the_newest_k_are_kept(tmp_path):
    cb = ModelCheckpoint(save_top_k=2, every_n_train_steps=3, every_n_epochs=None, filename="{step}")
    _trainer(tmp_path, max_steps=14, callbacks=[cb]).fit(_task())
    names = sorted(os.listdir(tmp_path / "version_0" / "checkpoints"))
    assert names == ["last.ckpt", "step=12.ckpt", "step=9.ckpt"]
    assert cb.best_model_path.endswith("step=12.ckpt")
    assert load_checkpoint(cb.last_model_path)["loop"]["state"]["global_step"] == 14  # the final last at fit end


def test_every_n_train_steps_counts_optimizer_steps_with_accumulation(tmp_path):
    cb = ModelCheckpoint(save_top_k=-1, every_n_train_steps=2, every_n_epochs=None, filename="{step}", save_last=False)
    trainer = _trainer(tmp_path, max_epochs=1, accumulate_grad_batches=3, callbacks=[cb])
    trainer.fit(_task(n=64, batch_size=4))  # 16 batches: 6 optimizer steps (the last group is short)
    names = sorted(os.listdir(tmp_path / "version_0" / "checkpoints"))
    assert names == ["step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]
    state = load_checkpoint(str(tmp_path / "version_0" / "checkpoints" / "step=2.ckpt"))["loop"]["state"]
    assert (state["global_step"], state["batches_done"]) == (2, 6)  # saved after the step, never mid-group


def test_train_time_interval(tmp_path):
    cb = ModelCheckpoint(save_top_k=-1, train_time_interval=1e-9, every_n_epochs=None, filename="{step}")
    _trainer(tmp_path, max_steps=3, callbacks=[cb]).fit(_task())
    assert sorted(os.listdir(tmp_path / "version_0" / "checkpoints")) == [
        "last.ckpt", "step=1.ckpt", "step=2.ckpt", "step=3.ckpt"]


# ---- min_epoch_interval: short epochs do not pay a save each -------------------------------------------------
def _count_saves(trainer, monkeypatch) -> list[str]:
    """The paths ``trainer``'s checkpoint manager saves to (every save goes through its
    ``save``)."""
    paths, real = [], Checkpointer.save

    def spy(manager, path, *args, **kwargs):
        if manager.run.trainer is trainer:
            paths.append(os.path.basename(path))
        return real(manager, path, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "save", spy)
    return paths


def _step(path) -> int:
    return torch.load(path, weights_only=True)["loop"]["state"]["global_step"]


SKIPPED = re.compile(r"ModelCheckpoint: (\d+) of (\d+) epoch-end saves skipped \(epochs shorter than "
                     r"min_epoch_interval=1\.0 s\); the final state is in last\.ckpt\. "
                     r"ModelCheckpoint\(min_epoch_interval=0\) saves every epoch, as Lightning does\.")


def test_short_epochs_skip_saves_and_fit_end_saves_the_final_state(tmp_path, monkeypatch, capsys):
    trainer = _trainer(tmp_path, max_epochs=5)  # the default ModelCheckpoint; epochs of a few ms
    saves = _count_saves(trainer, monkeypatch)
    trainer.fit(_task())
    cb, out = trainer.checkpoint_callback, capsys.readouterr().out
    [(skipped, due)] = SKIPPED.findall(out)  # one line
    assert due == "5" and int(skipped) >= 1 and len(saves) == 5 - int(skipped) + 1  # the skipped ones + fit end
    folder = tmp_path / "version_0" / "checkpoints"
    assert sorted(os.listdir(folder)) == ["epoch=4-step=40.ckpt", "last.ckpt"]  # named after its epoch
    assert cb.best_model_path == str(folder / "epoch=4-step=40.ckpt") and cb.best_model_score is None  # no monitor
    assert _step(cb.last_model_path) == _step(cb.best_model_path) == trainer.state.global_step == 40


class Clock:
    """A fake ``time`` for ModelCheckpoint: each epoch start advances it by ``epoch_s`` seconds."""

    def __init__(self, epoch_s: float) -> None:
        self.now, self.epoch_s = 0.0, epoch_s

    def monotonic(self) -> float:
        return self.now


class Tick(Callback):
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def on_train_epoch_start(self, trainer, task) -> None:
        self.clock.now += self.clock.epoch_s


def test_an_epoch_save_is_skipped_only_within_min_epoch_interval_of_the_last(tmp_path, monkeypatch, capsys):
    clock = Clock(epoch_s=0.6)  # saves are due at 0.6, 1.2, 1.8, 2.4, 3.0 s: only 1.2 and 2.4 are 1 s after one
    monkeypatch.setattr("taskfit.loop.checkpointer.time", clock)
    trainer = _trainer(tmp_path, max_epochs=5, callbacks=[ModelCheckpoint(), Tick(clock)])
    saves = _count_saves(trainer, monkeypatch)
    trainer.fit(_task())
    assert saves == ["epoch=1-step=16.ckpt", "epoch=3-step=32.ckpt", "epoch=4-step=40.ckpt"]  # the last: fit end
    assert SKIPPED.findall(capsys.readouterr().out) == [("3", "5")]


def test_min_epoch_interval_0_saves_every_epoch(tmp_path, monkeypatch, capsys):
    trainer = _trainer(tmp_path, max_epochs=5, callbacks=[ModelCheckpoint(min_epoch_interval=0)])
    saves = _count_saves(trainer, monkeypatch)
    trainer.fit(_task())
    assert saves == [f"epoch={e}-step={8 * (e + 1)}.ckpt" for e in range(5)]
    assert "ModelCheckpoint:" not in capsys.readouterr().out


def test_every_epoch_file_is_written_when_more_than_the_newest_are_kept(tmp_path, capsys):
    _trainer(tmp_path, max_epochs=5, callbacks=[ModelCheckpoint(save_top_k=-1, filename="{epoch}")]).fit(_task())
    assert sorted(os.listdir(tmp_path / "version_0" / "checkpoints")) == [f"epoch={e}.ckpt" for e in range(5)] + [
        "last.ckpt"]
    assert "ModelCheckpoint:" not in capsys.readouterr().out


def test_a_monitored_epoch_save_is_never_skipped(tmp_path, monkeypatch, capsys):
    values = Values("val/loss")
    cb = ModelCheckpoint(monitor="val/loss", filename="{epoch}")
    trainer = _trainer(tmp_path, max_epochs=5, callbacks=[cb, values])
    saves = _count_saves(trainer, monkeypatch)
    trainer.fit(_task(val_n=16))
    assert len(saves) == 5  # every epoch: a ranked file when it is the best so far, else last.ckpt
    best = values.values.index(min(values.values))
    assert cb.best_model_path.endswith(f"epoch={best}.ckpt") and cb.best_model_score == min(values.values)
    assert "ModelCheckpoint:" not in capsys.readouterr().out


def test_min_epoch_interval_values():
    assert ModelCheckpoint(min_epoch_interval=datetime.timedelta(seconds=2)).min_epoch_interval == 2.0
    for bad in (-1, "x", None, float("nan")):
        message = rf"ModelCheckpoint\(min_epoch_interval={re.escape(repr(bad))}\) is not valid\.\n  HINT: pass a " \
                  r"number of seconds >= 0 \(0: save every epoch, as Lightning does\) or a datetime\.timedelta\."
        with pytest.raises(MisconfigurationError, match=message):
            ModelCheckpoint(min_epoch_interval=bad)


def test_resume_after_skipped_epoch_saves_is_bitwise_exact(tmp_path, capsys):
    reference = _task(shuffle=True, dropout=0.2)
    _trainer(tmp_path / "ref", max_epochs=5, enable_checkpointing=False).fit(reference)
    _trainer(tmp_path / "run", max_epochs=3).fit(_task(shuffle=True, dropout=0.2))
    assert SKIPPED.search(capsys.readouterr().out)  # the run's epoch saves were skipped: fit end saved
    resumed = _trainer(tmp_path / "run", max_epochs=5)
    task = _task(shuffle=True, dropout=0.2)
    resumed.fit(task, ckpt_path="last")
    assert resumed.state.global_step == 40
    assert same_state(task.state_dict(), reference.state_dict())


class Threads(Callback):
    """Records the names of the live threads at every epoch end (after ModelCheckpoint)."""

    order = 2000

    def __init__(self) -> None:
        self.names: list[set[str]] = []

    def on_train_epoch_end(self, trainer, task) -> None:
        self.names.append({t.name.split("_")[0] for t in threading.enumerate()})


def test_files_are_written_on_a_background_thread_and_in_place_when_fit_returns(tmp_path):
    threads = Threads()
    cb = ModelCheckpoint(save_top_k=-1, filename="{epoch}")
    _trainer(tmp_path, max_epochs=3, callbacks=[cb, threads]).fit(_task())
    assert all("taskfit-checkpoint" in names for names in threads.names)  # the loop did not wait for the disk
    assert not any(t.name.startswith("taskfit-checkpoint") for t in threading.enumerate())  # joined by fit
    folder = tmp_path / "version_0" / "checkpoints"
    assert sorted(os.listdir(folder)) == ["epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt", "last.ckpt"]
    states = [load_checkpoint(str(folder / f"epoch={e}.ckpt"))["loop"]["state"] for e in range(3)]
    assert [(s["epoch"], s["epoch_done"]) for s in states] == [(0, True), (1, True), (2, True)]


def test_a_failed_background_write_is_reported_and_the_previous_file_is_intact(tmp_path):
    folder = tmp_path / "ckpts"
    (folder / "last.ckpt").mkdir(parents=True)  # something else sits at the name: the rename must fail
    (folder / "last.ckpt" / "notes.txt").write_text("not a checkpoint")  # (an empty folder would be replaced)
    cb = ModelCheckpoint(dirpath=folder, save_top_k=-1, every_n_train_steps=2, every_n_epochs=None, filename="{step}")
    with pytest.raises(CheckpointError, match=r"Could not write the checkpoint .*last\.ckpt: Is a directory \(EISDIR\)"
                                              r"\. The checkpoints written before are intact; the newest is "
                                              r".*step=2\.ckpt\.\n  HINT: move away the folder"):
        _trainer(tmp_path, max_steps=6, callbacks=[cb]).fit(_task())
    assert sorted(os.listdir(folder)) == ["last.ckpt", "step=2.ckpt"]  # no temporary file left behind
    assert load_checkpoint(str(folder / "step=2.ckpt"))["loop"]["state"]["global_step"] == 2


def test_filenames_and_invalid_arguments():
    assert format_filename("{epoch}-{step}", {"epoch": 3, "step": 120}) == "epoch=3-step=120"
    assert format_filename("{epoch:02d}-{val/acc:.3f}", {"epoch": 3, "val/acc": 0.91234}) == "epoch=03-val_acc=0.912"
    with pytest.raises(MisconfigurationError, match=r"ModelCheckpoint\(mode='best'\) is not valid"):
        ModelCheckpoint(mode="best")
    with pytest.raises(MisconfigurationError, match=r"ModelCheckpoint\(save_top_k=-2\) is not valid"):
        ModelCheckpoint(save_top_k=-2)
    with pytest.raises(MisconfigurationError, match=r"ModelCheckpoint\(every_n_train_steps=1.5\) is not valid"):
        ModelCheckpoint(every_n_train_steps=1.5)
    with pytest.raises(MisconfigurationError, match=r"ModelCheckpoint\(train_time_interval=-1\) is not valid"):
        ModelCheckpoint(train_time_interval=-1)
    with pytest.raises(MisconfigurationError, match=r"ModelCheckpoint\(filename='last'\) is not valid"):
        ModelCheckpoint(filename="last")


def test_unknown_monitor_and_filename_keys(tmp_path):
    with pytest.raises(MisconfigurationError, match=r"(?s)ModelCheckpoint\(monitor='val/los'\) is not a logged key; "
                                                    r"logged: \[.*'val/loss'.*\].*did you mean 'val/loss'\?"):
        _trainer(tmp_path, max_epochs=1, callbacks=[ModelCheckpoint(monitor="val/los")]).fit(_task(val_n=8))
    with pytest.raises(MisconfigurationError, match=r"uses 'val/acc', which is not logged"):
        _trainer(tmp_path, max_epochs=1, callbacks=[ModelCheckpoint(filename="{val/acc}")]).fit(_task(val_n=8))
    with pytest.warns(UserWarning, match=r"monitor='val/loss'\) has not been logged yet, so the state of step 2"):
        _trainer(tmp_path, max_epochs=1, check_val_every_n_epoch=2,
                 callbacks=[ModelCheckpoint(monitor="val/loss", every_n_train_steps=2)]).fit(_task(val_n=8))


# ---- resolving "last" and "best", loading for inference -----------------------------------------------------------
def test_best_and_last_resolve_from_the_run_directories(tmp_path):
    cb = ModelCheckpoint(monitor="val/loss", mode="max", save_top_k=1)  # "best" = highest loss: the first epoch
    _trainer(tmp_path, max_epochs=3, callbacks=[cb]).fit(_task(val_n=16))
    best, last = load_checkpoint(cb.best_model_path), load_checkpoint(cb.last_model_path)
    assert best["loop"]["state"]["epoch"] == 0 and last["loop"]["state"]["epoch"] == 2
    fresh = _trainer(tmp_path, enable_checkpointing=False)  # a new Trainer finds them in the run directories
    assert last_checkpoint(tmp_path) == cb.last_model_path
    for which, ckpt in (("best", best), ("last", last)):
        task = _task(val_n=16)
        fresh.validate(task, ckpt_path=which)
        assert all(torch.equal(task.state_dict()[k], v) for k, v in ckpt["module"].items()), which


def test_load_from_checkpoint_rebuilds_with_recorded_arguments(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=1)
    trained = _task(features=6, dropout=0.3, lr=0.01)
    trainer.fit(trained)
    loaded = RegressionTask.load_from_checkpoint(trainer.checkpoint_callback.last_model_path)
    assert loaded.hparams["features"] == 6 and loaded.hparams["dropout"] == 0.3 and not loaded.training
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), trained.parameters()))
    x = torch.randn(5, 6)
    assert torch.equal(loaded(x), trained.eval()(x))
    override = RegressionTask.load_from_checkpoint(trainer.checkpoint_callback.last_model_path, dropout=0.0)
    assert override.hparams["dropout"] == 0.0
    with pytest.raises(CheckpointError, match=r"does not fit RegressionTask"):
        RegressionTask.load_from_checkpoint(trainer.checkpoint_callback.last_model_path, features=3)


def test_trainer_save_checkpoint_after_fit_resumes(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=1, enable_checkpointing=False)
    trainer.fit(_task())
    trainer.save_checkpoint(tmp_path / "manual.ckpt")
    state = load_checkpoint(str(tmp_path / "manual.ckpt"))["loop"]["state"]
    assert (state["epoch"], state["global_step"]) == (1, 8)


def test_save_checkpoint_needs_a_fit(tmp_path):
    trainer = _trainer(tmp_path, enable_checkpointing=False)
    trainer.validate(_task(val_n=8))
    with pytest.raises(CheckpointError, match=r"Cannot save a checkpoint to .*x\.ckpt: this Trainer has not run fit"):
        trainer.save_checkpoint(tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()
