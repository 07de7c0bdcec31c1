"""Lightning's ModelCheckpoint where its own tests (checkpointing/test_model_checkpoint.py, run by
benchmarks/lightning_tests.py, issue 46) found taskfit lacking.

Each expected value was observed by running the same program with Lightning 2.6.6 (a
``BoringModel``-like task, ``lightning.pytorch``'s names in place of taskfit's); the observation is
recorded next to each assertion. (Kept apart from test_lightning_spec.py: one file per area.)
"""
from __future__ import annotations

import datetime
import inspect
import os
import pickle
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from taskfit import TaskModule, Trainer
from taskfit.callbacks import ModelCheckpoint
from taskfit.checkpoint import load_checkpoint
from taskfit.errors import MisconfigurationError

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


class Scored(TaskModule):
    """Lightning's BoringModel that logs ``abc`` = ``scores[epoch]`` at each validation's end."""

    def __init__(self, scores=(1.0,)) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)
        self.scores = list(scores)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self):
        self.log("abc", self.scores[self.current_epoch])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(torch.randn(8, 32), batch_size=4)

    def val_dataloader(self):
        return DataLoader(torch.randn(8, 32), batch_size=4)


def test_state_key_is_lightnings():
    # Lightning 2.6.6, ModelCheckpoint(...).state_key for each of these
    assert ModelCheckpoint(monitor="val_loss").state_key == (
        "ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min', 'every_n_train_steps': 0, "
        "'every_n_epochs': 1, 'train_time_interval': None}")
    assert ModelCheckpoint(every_n_train_steps=3).state_key == (
        "ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 3, "
        "'every_n_epochs': 0, 'train_time_interval': None}")
    every = ModelCheckpoint(train_time_interval=datetime.timedelta(seconds=90), mode="max")
    assert every.state_key == (
        "ModelCheckpoint{'monitor': None, 'mode': 'max', 'every_n_train_steps': 0, "
        "'every_n_epochs': 0, 'train_time_interval': datetime.timedelta(seconds=90)}")


def test_a_checkpoint_keys_the_state_as_lightning_and_an_old_key_still_resumes(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="abc", save_top_k=2, filename="{epoch}")
    trainer = Trainer(max_epochs=2, callbacks=[cb], logger=False, **QUIET)
    trainer.fit(Scored([3.0, 2.0, 1.0]))
    ckpt = torch.load(cb.last_model_path, weights_only=True)
    state = ckpt["callbacks"][cb.state_key]
    # Lightning 2.6.6's state_dict keys (taskfit adds "mode"; scores as plain floats)
    assert set(state) == {"monitor", "mode", "best_model_score", "best_model_path", "current_score",
                          "dirpath", "best_k_models", "kth_best_model_path", "kth_value",
                          "last_model_path"}
    assert state["current_score"] == 2.0 and state["kth_value"] == 3.0
    # a checkpoint written by taskfit before the key was Lightning's: its ranking continues
    ckpt["callbacks"] = {"ModelCheckpoint": ckpt["callbacks"].pop(cb.state_key)}
    # (written as by that taskfit: its checksums would name the edit as damage)
    del ckpt["checksums"]
    old = str(tmp_path / "old.ckpt")
    torch.save(ckpt, old)
    again = ModelCheckpoint(dirpath=tmp_path, monitor="abc", save_top_k=2, filename="{epoch}")
    Trainer(max_epochs=3, callbacks=[again], logger=False, **QUIET).fit(
        Scored([3.0, 2.0, 1.0]), ckpt_path=old)
    assert sorted(os.path.basename(p) for p in again.best_k_models) == ["epoch=1.ckpt",
                                                                        "epoch=2.ckpt"]


@pytest.mark.parametrize("mode, scores, best, kth", [
    # Lightning 2.6.6 (save_top_k=2): best tensor(5.), kth tensor(7.); the NaN file rotated out
    ("min", [float("nan"), 8.0, 7.0, 5.0], 5.0, 7.0),
    ("max", [float("nan"), 5.0, 7.0, 8.0], 8.0, 7.0),
    # Lightning 2.6.6: best_model_score, current_score and kth_value tensor(inf)
    ("min", [float("nan")], float("inf"), float("inf")),
    ("max", [float("nan")], float("-inf"), float("-inf")),
])
def test_a_nan_score_is_ranked_as_the_worst_value_of_its_mode(tmp_path, mode, scores, best, kth):
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="abc", mode=mode, save_top_k=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(max_epochs=len(scores), callbacks=[cb], logger=False, **QUIET).fit(Scored(scores))
    assert cb.best_model_score == best and cb.current_score == best and cb.kth_value == kth
    assert all(not torch.isnan(v) for v in cb.best_k_models.values())


@pytest.mark.parametrize("kwargs, phrase", [
    # Lightning 2.6.6's MisconfigurationException messages
    (dict(mode="best"), "`mode` can be min, max but got best"),
    (dict(save_top_k=-2), "Invalid value for save_top_k=-2. Must be >= -1"),
    (dict(every_n_epochs=-1), "Invalid value for every_n_epochs=-1. Must be >= 0"),
    (dict(every_n_train_steps=-3), "Invalid value for every_n_train_steps=-3. Must be >= 0"),
])
def test_bad_arguments_say_lightnings_phrase_and_taskfits_hint(kwargs, phrase):
    with pytest.raises(MisconfigurationError) as info:
        ModelCheckpoint(**kwargs)
    assert phrase in str(info.value) and "HINT: " in str(info.value)


def test_ranking_attributes_are_assignable_as_in_lightning(tmp_path):
    # Lightning's are plain attributes: state_dict() gives back what was assigned
    cb = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    cb.best_model_path = "epoch=10-step=1436.ckpt"
    cb.best_model_score = torch.tensor(2.5)
    cb.best_k_models = {"epoch=10-step=1436.ckpt": torch.tensor(2.5)}
    cb.kth_best_model_path, cb.kth_value = "epoch=10-step=1436.ckpt", torch.tensor(2.5)
    state = cb.state_dict()
    assert state["best_k_models"] == {"epoch=10-step=1436.ckpt": 2.5}
    assert (state["best_model_score"], state["kth_value"]) == (2.5, 2.5)
    assert state["kth_best_model_path"] == "epoch=10-step=1436.ckpt"


def test_a_state_of_another_dirpath_gives_back_only_best_model_path(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path / "b")
    state = {"dirpath": str(tmp_path / "a"), "best_model_path": "x.ckpt", "monitor": None,
             "best_model_score": torch.tensor(1.0), "best_k_models": {"x.ckpt": torch.tensor(1.0)},
             "last_model_path": "l.ckpt"}
    # Lightning 2.6.6: this warning; then best_model_path 'x.ckpt', best_k_models {},
    # last_model_path ''
    with pytest.warns(UserWarning, match="The dirpath has changed from .* Only `best_model_path` "
                                         "will be reloaded") as seen:
        cb.load_state_dict(state)
    assert "HINT: " in str(seen[0].message)
    assert (cb.best_model_path, cb.best_k_models, cb.last_model_path) == ("x.ckpt", {}, "")


def test_the_signature_has_real_types_and_the_callback_pickles(tmp_path):
    # jsonargparse (Lightning's CLI) reads the annotation: a type, not a string
    annotation = inspect.signature(ModelCheckpoint).parameters["save_last"].annotation
    assert not isinstance(annotation, str)
    cb = ModelCheckpoint(dirpath=tmp_path)
    assert vars(pickle.loads(pickle.dumps(cb))) == vars(cb)


def test_load_checkpoint_reads_the_state_under_lightnings_key(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="abc")
    Trainer(max_epochs=1, callbacks=[cb], logger=False, **QUIET).fit(Scored())
    assert load_checkpoint(cb.best_model_path)["callbacks"][cb.state_key]["best_model_score"] == 1.0


def test_enable_checkpointing_false_with_a_model_checkpoint_is_refused(tmp_path):
    # Lightning 2.6.6: MisconfigurationException "Trainer was configured with
    # `enable_checkpointing=False` but found `ModelCheckpoint` in callbacks list."
    for callbacks in ([ModelCheckpoint()], ModelCheckpoint()):
        with pytest.raises(MisconfigurationError, match="`enable_checkpointing=False` but found "
                                                        "`ModelCheckpoint`") as info:
            Trainer(enable_checkpointing=False, callbacks=callbacks, default_root_dir=tmp_path)
        assert "HINT: remove the ModelCheckpoint" in str(info.value)
    # fast_dev_run turns checkpointing off by itself: not the user's contradiction
    Trainer(fast_dev_run=1, callbacks=[ModelCheckpoint()], default_root_dir=tmp_path)


class Steps(Scored):
    """Ten batches an epoch, no validation."""

    def train_dataloader(self):
        return DataLoader(torch.randn(10, 32), batch_size=1)

    def val_dataloader(self):
        return None


def test_the_checkpoint_a_fit_resumed_from_is_never_rotated_out(tmp_path):
    def fit(max_steps, ckpt_path=None):
        cb = ModelCheckpoint(dirpath=tmp_path, monitor="step", mode="max", save_top_k=2,
                             every_n_train_steps=2, save_last=False)
        trainer = Trainer(max_steps=max_steps, callbacks=[cb], logger=False, **QUIET)
        trainer.fit(Steps(), ckpt_path=ckpt_path)

    fit(5)
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    fit(8, str(tmp_path / "epoch=0-step=4.ckpt"))
    # Lightning 2.6.6 (test_resume_and_old_checkpoint_files_remain): the same three files; the
    # file resumed from is kept although step 4 left the top 2
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt",
                                            "epoch=0-step=8.ckpt"]


def test_two_model_checkpoints_with_one_state_key_are_refused(tmp_path):
    # Lightning 2.6.6: RuntimeError "Found more than one stateful callback of type
    # `ModelCheckpoint`. ... HINT: The `callback.state_key` must be unique among all callbacks in
    # the Trainer." (two ModelCheckpoint(monitor="x") with different dirpaths)
    same = [ModelCheckpoint(dirpath=tmp_path / "a", monitor="x"),
            ModelCheckpoint(dirpath=tmp_path / "b", monitor="x")]
    with pytest.raises(MisconfigurationError, match="more than one stateful callback of type "
                                                    "`ModelCheckpoint`") as info:
        Trainer(callbacks=same, logger=False)
    assert "state_key` must be unique" in str(info.value) and "HINT: " in str(info.value)
    # their own triggers: two keys, both kept
    Trainer(callbacks=[ModelCheckpoint(monitor="x"), ModelCheckpoint(every_n_train_steps=5)],
            logger=False)


def test_a_url_dirpath_is_refused_and_a_file_url_is_its_path(tmp_path):
    # Lightning 2.6.6 keeps 'memory://x/y' and writes through fsspec; taskfit would have written a
    # local folder named "memory:" (Lightning's test_model_checkpoint_save_last_as_link_not_local)
    for url in ("s3://bucket/ckpts", "memory://not-local-test-path"):
        with pytest.raises(MisconfigurationError, match="is a URL: taskfit writes checkpoints to a "
                                                        "local or mounted folder") as info:
            ModelCheckpoint(dirpath=url, save_last="link")
        assert "HINT: mount the storage" in str(info.value)
    assert ModelCheckpoint(dirpath=f"file://{tmp_path}").dirpath == str(tmp_path)
