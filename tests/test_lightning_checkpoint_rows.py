"""ModelCheckpoint and EarlyStopping rows of the Lightning compatibility issue: ``monitor="epoch"``/``"step"``, the
name class attributes, ``~`` in ``dirpath``, an assignable ``best_model_score``, ``last-v1.ckpt``, ``to_yaml`` and
``save_on_exception``.

The expected file names and values are those of Lightning 2.6's own tests (tests_pytorch/checkpointing/
test_model_checkpoint.py: test_model_checkpoint_topk_all, test_ckpt_version_after_rerun_new_trainer,
test_save_last_versioning, test_model_checkpoint_file_extension, test_model_checkpoint_save_last, test_expand_home,
test_model_checkpoint_to_yaml, test_model_checkpoint_on_exception_*), on the tiny ``Line`` task: 4 training batches
per epoch. ``save_last=False`` where Lightning's default (None) writes no ``last.ckpt``.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import yaml
from taskfit import MisconfigurationError, Trainer
from taskfit.callbacks import Callback, EarlyStopping, ModelCheckpoint
from taskfit.checkpoint import load_checkpoint
from test_lightning_callbacks import QUIET, Line, fit


def steps(folder) -> dict[str, int]:
    """{file name: global step of the state it holds}."""
    return {name: load_checkpoint(os.path.join(folder, name))["loop"]["state"]["global_step"]
            for name in sorted(os.listdir(folder))}


def run(folder, cb: ModelCheckpoint, task: Line | None = None, ckpt_path=None, **settings) -> Trainer:
    trainer = Trainer(default_root_dir=str(folder), callbacks=[cb], **{**QUIET, **settings})
    trainer.fit(task or Line(), ckpt_path=ckpt_path)
    return trainer


# ---- monitor="epoch" / "step" -------------------------------------------------------------------------------
def test_monitor_epoch_ranks_every_epoch(tmp_path):
    folder = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=folder, filename="{epoch}", monitor="epoch", mode="max", save_top_k=-1,
                         save_last=False)
    run(tmp_path, cb, max_epochs=3)
    assert cb.best_model_path == str(folder / "epoch=2.ckpt") and cb.best_model_score == 2
    assert set(cb.best_k_models) == {str(folder / f"epoch={i}.ckpt") for i in range(3)}
    assert cb.kth_best_model_path == str(folder / "epoch=0.ckpt")
    assert steps(folder) == {"epoch=0.ckpt": 4, "epoch=1.ckpt": 8, "epoch=2.ckpt": 12}


def test_monitor_step_keeps_the_two_latest(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="step", mode="max", save_top_k=2, every_n_train_steps=2,
                         save_last=False)
    run(tmp_path, cb, task=Line(n=20), max_steps=5, limit_val_batches=0)
    assert steps(cb.dirpath) == {"epoch=0-step=2.ckpt": 2, "epoch=0-step=4.ckpt": 4}
    assert os.path.basename(cb.best_model_path) == "epoch=0-step=4.ckpt" and cb.best_model_score == 4


def test_early_stopping_does_not_monitor_the_loop_counters_as_lightning():
    # Lightning's EarlyStopping reads trainer.callback_metrics only (no epoch/step there): "Early stopping
    # conditioned on metric `epoch` which is not available" unless the task logs it.
    with pytest.raises(MisconfigurationError, match=r"EarlyStopping monitors 'epoch', which was not logged"):
        fit(EarlyStopping(monitor="epoch"), max_epochs=2)


# ---- Lightning's name attributes ----------------------------------------------------------------------------
class PtCheckpoint(ModelCheckpoint):
    FILE_EXTENSION = ".pt"
    CHECKPOINT_NAME_LAST = "final"


def test_class_attributes_name_the_files(tmp_path):
    assert (ModelCheckpoint.FILE_EXTENSION, ModelCheckpoint.CHECKPOINT_NAME_LAST, ModelCheckpoint.CHECKPOINT_JOIN_CHAR,
            ModelCheckpoint.CHECKPOINT_EQUALS_CHAR, ModelCheckpoint.STARTING_VERSION) == (".ckpt", "last", "-", "=", 1)
    cb = PtCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    run(tmp_path, cb, max_epochs=1, limit_train_batches=1)
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["epoch=0-step=1.pt", "final.pt"]
    assert cb.last_model_path == str(tmp_path / "ckpts" / "final.pt")


def test_join_equals_and_starting_version_name_versions(tmp_path):
    class Named(ModelCheckpoint):
        CHECKPOINT_JOIN_CHAR, CHECKPOINT_EQUALS_CHAR, STARTING_VERSION = "_", ":", 9

    folder = tmp_path / "ckpts"
    cb = Named(dirpath=folder, filename="test-{epoch}", monitor="epoch", save_top_k=-1, save_last=False)
    run(tmp_path, cb, max_epochs=1)
    cb = Named(dirpath=folder, filename="test", monitor="epoch", save_top_k=-1, save_last=False)
    run(tmp_path, cb, max_epochs=3)  # Lightning: test.ckpt, then test-v9.ckpt, test-v10.ckpt (with "-")
    assert steps(folder) == {"test-epoch:0.ckpt": 4, "test.ckpt": 4, "test_v10.ckpt": 12, "test_v9.ckpt": 8}


def test_a_last_name_with_fields_keeps_one_last_file(tmp_path, monkeypatch):
    monkeypatch.setattr(ModelCheckpoint, "CHECKPOINT_NAME_LAST", "last-{epoch}")
    folder = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=folder, save_top_k=-1, save_last=True)
    run(tmp_path, cb, max_epochs=3)
    assert steps(folder) == {"epoch=0-step=4.ckpt": 4, "epoch=1-step=8.ckpt": 8, "epoch=2-step=12.ckpt": 12,
                             "last-epoch=2.ckpt": 12}
    assert cb.last_model_path == str(folder / "last-epoch=2.ckpt")


def test_dirpath_expands_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ModelCheckpoint(dirpath="~/checkpoints").dirpath == str(tmp_path / "checkpoints")


# ---- best_model_score, to_yaml ----------------------------------------------------------------------------
def test_best_model_score_can_be_assigned(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="val/acc", mode="max", save_top_k=2)
    cb.best_model_score = torch.tensor(0.5)  # before fit: a fresh fit ranks its own files
    fit(cb, Line(script=[0.5, 0.9, 0.7]), root=tmp_path / "logs", max_epochs=3)
    assert cb.best_model_score == pytest.approx(0.9) and os.path.basename(cb.best_model_path) == "epoch=1-step=8.ckpt"
    kept = dict(cb.best_k_models)
    cb.best_model_score = torch.tensor(0.25)
    assert cb.best_model_score == pytest.approx(0.25) and cb.best_k_models == kept
    assert cb.state_dict()["best_model_score"] == pytest.approx(0.25)
    cb.best_model_score = None
    assert cb.best_model_score is None and cb.best_model_path.endswith("epoch=1-step=8.ckpt")


def test_to_yaml_writes_best_k_models(tmp_path):
    with pytest.raises(MisconfigurationError, match=r"to_yaml\(\) has no file to write to"):
        ModelCheckpoint(monitor="val/acc").to_yaml()
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="val/acc", mode="max", save_top_k=2)
    fit(cb, Line(script=[0.5, 0.9, 0.7]), root=tmp_path, max_epochs=3)
    cb.to_yaml()
    with open(tmp_path / "ckpts" / "best_k_models.yaml") as fp:
        written = yaml.safe_load(fp)
    assert written == {p: s.item() for p, s in cb.best_k_models.items()}
    assert sorted(map(os.path.basename, written)) == ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
    cb.to_yaml(tmp_path / "other.yaml")
    assert yaml.safe_load((tmp_path / "other.yaml").read_text()) == written


# ---- last-v1.ckpt -------------------------------------------------------------------------------------------
def test_a_fresh_fit_keeps_an_earlier_last_and_a_resume_overwrites_its_own(tmp_path):
    folder = tmp_path / "ckpts"
    for _ in range(2):  # Lightning's test_save_last_versioning
        run(tmp_path, ModelCheckpoint(dirpath=folder, save_top_k=0), max_epochs=2, limit_train_batches=1,
            limit_val_batches=0)
    assert steps(folder) == {"last-v1.ckpt": 2, "last.ckpt": 2}
    cb = ModelCheckpoint(dirpath=folder, save_top_k=0)
    run(tmp_path, cb, ckpt_path=str(folder / "last-v1.ckpt"), max_epochs=3, limit_train_batches=1,
        limit_val_batches=0)
    assert steps(folder) == {"last-v1.ckpt": 3, "last.ckpt": 2}  # the resumed run continues its own file
    assert cb.last_model_path == str(folder / "last-v1.ckpt")
    trainer = Trainer(default_root_dir=str(tmp_path), max_epochs=4, limit_train_batches=1, limit_val_batches=0,
                      callbacks=[ModelCheckpoint(dirpath=folder, save_top_k=0)], **QUIET)
    trainer.fit(Line(), ckpt_path=str(folder / "last.ckpt"))  # a resume of the first run: its own last.ckpt
    assert steps(folder) == {"last-v1.ckpt": 3, "last.ckpt": 4}
    run(tmp_path, ModelCheckpoint(dirpath=folder, save_top_k=0), ckpt_path=str(folder / "last-v1.ckpt"),
        max_epochs=5, limit_train_batches=1, limit_val_batches=0)  # last-v1.ckpt is now the newer last file
    run(tmp_path, ModelCheckpoint(dirpath=folder, save_top_k=0), ckpt_path="last", max_epochs=6,
        limit_train_batches=1, limit_val_batches=0)  # "last": the newest of them, as Lightning picks
    assert steps(folder) == {"last-v1.ckpt": 6, "last.ckpt": 4}
    for epochs in (1, 2):  # a job's first start and its restart, the same command: the restart continues last.ckpt
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the first start's "no checkpoint to resume yet"
            run(tmp_path, ModelCheckpoint(dirpath=tmp_path / "job", save_top_k=0), ckpt_path="last",
                max_epochs=epochs, limit_train_batches=1, limit_val_batches=0)
    assert steps(tmp_path / "job") == {"last.ckpt": 2}


def test_a_rerun_versions_the_ranked_files_unless_the_counter_is_off(tmp_path):
    for i in range(2):  # Lightning's test_ckpt_version_after_rerun_new_trainer
        cb = ModelCheckpoint(dirpath=tmp_path / "on", save_top_k=-1, monitor="epoch", filename="{epoch}",
                             save_last=False)
        run(tmp_path, cb, max_epochs=2, limit_train_batches=1, limit_val_batches=1)
        assert sorted(map(os.path.basename, cb.best_k_models)) == (
            ["epoch=0-v1.ckpt", "epoch=1-v1.ckpt"] if i else ["epoch=0.ckpt", "epoch=1.ckpt"])
    assert sorted(os.listdir(tmp_path / "on")) == ["epoch=0-v1.ckpt", "epoch=0.ckpt", "epoch=1-v1.ckpt",
                                                   "epoch=1.ckpt"]
    for _ in range(2):  # test_ckpt_version_counter_disabled_after_rerun_new_trainer
        cb = ModelCheckpoint(dirpath=tmp_path / "off", save_top_k=-1, monitor="epoch", filename="{epoch}",
                             enable_version_counter=False)
        run(tmp_path, cb, max_epochs=2, limit_train_batches=1, limit_val_batches=1)
        assert os.path.basename(cb.last_model_path) == "last.ckpt"
    assert sorted(os.listdir(tmp_path / "off")) == ["epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"]


# ---- save_on_exception --------------------------------------------------------------------------------------
class Trouble(Callback):
    """Raises before the batch at global step ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, task, batch, batch_idx):
        if trainer.state.global_step == self.at:
            raise RuntimeError("Trouble!")


def trouble(folder, cb: ModelCheckpoint, at: int, **settings) -> None:
    trainer = Trainer(default_root_dir=str(folder), callbacks=[cb, Trouble(at)], **{**QUIET, **settings})
    with pytest.raises(RuntimeError, match="Trouble!"):
        trainer.fit(Line())


def test_save_on_exception_saves_the_state_it_stopped_in(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path / "named", filename="exception", save_on_exception=True, every_n_epochs=7)
    trouble(tmp_path, cb, at=5, max_epochs=4)
    assert steps(tmp_path / "named") == {"exception.ckpt": 5, "last.ckpt": 5}
    cb = ModelCheckpoint(dirpath=tmp_path / "default", save_on_exception=True, save_last=False, min_epoch_interval=0)
    trouble(tmp_path, cb, at=6, max_epochs=4)  # the filename template, with the epoch and step it stopped in
    assert steps(tmp_path / "default") == {"epoch=0-step=4.ckpt": 4, "epoch=1-step=6.ckpt": 6}
    assert os.path.basename(cb.best_model_path) == "epoch=0-step=4.ckpt"  # the exception's file is not ranked
    cb = ModelCheckpoint(dirpath=tmp_path / "off", every_n_epochs=7)  # save_on_exception=False: Lightning's default
    trouble(tmp_path, cb, at=5, max_epochs=4)
    assert not os.listdir(tmp_path / "off")


def test_save_on_exception_skips_a_saved_step_and_fast_dev_run(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path / "saved", filename="already_saved", save_on_exception=True,
                         every_n_train_steps=1, save_top_k=0)
    trouble(tmp_path, cb, at=1, max_epochs=2)  # step 1 was saved (to last.ckpt): nothing more
    assert steps(tmp_path / "saved") == {"last.ckpt": 1}
    cb = ModelCheckpoint(dirpath=tmp_path / "dev", filename="fast_dev_run", save_on_exception=True)
    trouble(tmp_path, cb, at=1, fast_dev_run=2)
    # not even the folder (Lightning's test_callbacks_and_logger_not_called_with_fastdevrun)
    assert not os.path.exists(tmp_path / "dev")


class TroubleAtFitEnd(Line):
    def on_fit_end(self):
        raise RuntimeError("Trouble!")


@pytest.mark.parametrize("save_last, files", [
    # Lightning 2.6.6 (every_n_epochs=7, 4 epochs: no epoch save): save_last=None ->
    # ['exception.ckpt']; save_last=True -> ['last.ckpt'] (the end of training saved that step)
    (False, {"exception.ckpt": 16}),
    (True, {"last.ckpt": 16}),
])
def test_save_on_exception_saves_an_error_in_on_fit_end(tmp_path, save_last, files):
    cb = ModelCheckpoint(dirpath=tmp_path / "f", filename="exception", save_on_exception=True,
                         every_n_epochs=7, save_last=save_last)
    trainer = Trainer(default_root_dir=str(tmp_path), callbacks=[cb], **{**QUIET, "max_epochs": 4})
    with pytest.raises(RuntimeError, match="Trouble!"):
        trainer.fit(TroubleAtFitEnd())
    assert steps(tmp_path / "f") == files
