"""Lightning code using taskfit's callbacks: ModelCheckpoint, EarlyStopping, ModelSummary and the prediction writers
behave as PyTorch Lightning 2.6.6's, or differ where docs/migrating-lightning.md says so (issue 28).

Every expected value here was observed by running Lightning 2.6.6 on the same set-up (CI needs no Lightning): a
bias-free Linear(1, 1) from zero, SGD(lr=1e-4), x = 0..7 in batches of 2 (4 training batches per epoch, in order),
validation on x = 100..103 in batches of 2, no sanity check; scripted values are logged in validation. Lightning's
own tests (tests_pytorch/callbacks/test_early_stopping.py, test_model_checkpoint.py) fix the rest of the semantics.
"""
from __future__ import annotations

import datetime
import math
import os

import pytest
import torch
from taskfit import CheckpointError, MisconfigurationError, TaskModule, Trainer
from taskfit.callbacks import BasePredictionWriter, Callback, EarlyStopping, ModelCheckpoint, ModelSummary
from taskfit.callbacks.checkpoint.policy import format_filename
from taskfit.callbacks.early_stopping import EarlyStoppingReason
from taskfit.checkpoint import load_checkpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, num_sanity_val_steps=0)


def line_data(start: int, n: int) -> DataLoader:
    x = torch.arange(start, start + n, dtype=torch.float32).unsqueeze(1)
    return DataLoader(TensorDataset(x, x.clone()), batch_size=2)


class Line(TaskModule):
    """y = w * x from w = 0. ``script``: the value logged as ``val/<key>`` at the k-th validation of fit."""

    def __init__(self, n: int = 8, script: list[float] | None = None, key: str = "acc") -> None:
        super().__init__()
        self.n, self.script, self.key, self.validations = n, script, key, 0
        self.net = nn.Linear(1, 1, bias=False)
        nn.init.zeros_(self.net.weight)

    def forward(self, x):
        return self.net(x)

    def loss(self, outputs, targets):
        if self.stage == "val" and self.script is not None and self.trainer.state.fn == "fit":
            self.log(f"val/{self.key}", float(self.script[self.validations]))
        return ((outputs - targets) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return line_data(0, self.n)

    def val_dataloader(self):
        return line_data(100, 4)

    def test_dataloader(self):
        return line_data(100, 4)


class CountValidations(Callback):
    order = 2000  # after every other callback has seen this validation

    def on_validation_end(self, trainer, task):
        if trainer.state.fn == "fit":
            task.validations += 1


class Record(Callback):
    """val/loss at every validation of fit, rounded."""

    def __init__(self):
        self.scores = []

    def on_validation_end(self, trainer, task):
        if trainer.state.fn == "fit":
            self.scores.append(round(trainer.state.metrics["val/loss"], 2))


def fit(callback: Callback, task: Line | None = None, root=None, callbacks_extra=(), **settings
        ) -> tuple[Trainer, Line]:
    task = task or Line()
    settings.setdefault("enable_checkpointing", isinstance(callback, ModelCheckpoint))
    trainer = Trainer(default_root_dir=str(root) if root else None,
                      callbacks=[callback, CountValidations(), *callbacks_extra], **{**QUIET, **settings})
    trainer.fit(task)
    return trainer, task


def files(cb: ModelCheckpoint) -> dict[str, int]:
    """{file name: global step of the state it holds} in the callback's folder."""
    return {name: load_checkpoint(os.path.join(cb.dirpath, name))["loop"]["state"]["global_step"]
            for name in sorted(os.listdir(cb.dirpath))}


def names(paths) -> list[str]:
    return sorted(os.path.basename(p) for p in paths)


# ---- ModelCheckpoint: when it saves ----------------------------------------------------------------------------
def test_a_step_trigger_replaces_the_epoch_saves(tmp_path):
    # Lightning: epoch=0-step=3.ckpt, epoch=1-step=6.ckpt (no epoch-end saves at steps 4, 8); without a monitor
    # best_k_models == {} and best_model_score is None, best_model_path the newest file.
    cb = ModelCheckpoint(every_n_train_steps=3, save_top_k=-1, save_last=False)
    fit(cb, root=tmp_path, max_epochs=2)
    assert files(cb) == {"epoch=0-step=3.ckpt": 3, "epoch=1-step=6.ckpt": 6}
    assert cb.best_k_models == {} and cb.best_model_score is None and cb.every_n_epochs == 0
    assert os.path.basename(cb.best_model_path) == "epoch=1-step=6.ckpt" and cb.kth_best_model_path == ""


def test_save_last_defaults_to_true_and_holds_the_final_state(tmp_path):
    # A documented difference: Lightning's save_last=None writes no last.ckpt (and with save_last=True its last.ckpt
    # holds step 6, the last ranked save); taskfit keeps last.ckpt, the resume point, at the final step.
    cb = ModelCheckpoint(every_n_train_steps=3, save_top_k=-1)
    fit(cb, root=tmp_path, max_epochs=2)
    assert files(cb) == {"epoch=0-step=3.ckpt": 3, "epoch=1-step=6.ckpt": 6, "last.ckpt": 8}
    for lightning_none in (None, False):
        assert ModelCheckpoint(save_last=lightning_none).save_last is False
    assert ModelCheckpoint(save_last="link").save_last is True  # taskfit's last.ckpt is a hard link already


@pytest.mark.parametrize("kwargs, expected", [
    (dict(), {"epoch=2-step=12.ckpt": 12}),  # every_n_epochs=None and no other trigger: every epoch
    (dict(save_top_k=-1), {"epoch=0-step=4.ckpt": 4, "epoch=1-step=8.ckpt": 8, "epoch=2-step=12.ckpt": 12}),
    (dict(save_top_k=0, save_last=True), {"last.ckpt": 12}),
    (dict(every_n_epochs=2, save_top_k=-1), {"epoch=1-step=8.ckpt": 8}),
    (dict(every_n_epochs=0, save_last=True), {"last.ckpt": 12}),  # only fit's end
])
def test_epoch_saves_without_a_monitor(tmp_path, kwargs, expected):
    cb = ModelCheckpoint(**{"save_last": False, "min_epoch_interval": 0, **kwargs})
    fit(cb, root=tmp_path, max_epochs=3)
    assert files(cb) == expected
    assert cb.best_k_models == {} and cb.best_model_score is None


def test_train_time_interval_replaces_the_epoch_saves(tmp_path):
    # Lightning accepts timedelta(0): a save at every step, and none at the epoch's end.
    cb = ModelCheckpoint(train_time_interval=datetime.timedelta(0), save_top_k=-1, save_last=False)
    fit(cb, root=tmp_path, max_epochs=1)
    assert files(cb) == {f"epoch=0-step={s}.ckpt": s for s in (1, 2, 3, 4)}


def test_a_step_and_an_epoch_trigger_together_are_taskfits_extension(tmp_path):
    # Lightning raises "should be mutually exclusive"; taskfit saves at both when both are given explicitly.
    cb = ModelCheckpoint(every_n_train_steps=3, every_n_epochs=1, save_top_k=-1, save_last=False,
                         filename="{step}")
    fit(cb, root=tmp_path, max_epochs=2)
    assert files(cb) == {"step=3.ckpt": 3, "step=4.ckpt": 4, "step=6.ckpt": 6, "step=8.ckpt": 8}


def test_monitored_step_saves_are_ranked_by_their_own_score(tmp_path):
    # 9 batches per epoch, validation every 2nd epoch (steps 18, 36), a step save every 5 steps. Lightning defers
    # the saves until val/loss exists, then ranks the states of steps 20, 25, 30, 35 by step 18's score:
    # epoch=1-step=18, epoch=2-step=20, epoch=2-step=25, epoch=3-step=30, epoch=3-step=35, all 4978.2119.
    # taskfit writes last.ckpt at those steps and ranks the next state whose score is its own (documented).
    cb = ModelCheckpoint(monitor="val/loss", save_top_k=-1, every_n_train_steps=5, save_last=False)
    with pytest.warns(UserWarning, match=r"monitor='val/loss'\) has not been logged yet, so the state of step 5 has "
                                         r"no score of its own"):
        fit(cb, Line(n=18), root=tmp_path, max_epochs=4, check_val_every_n_epoch=2)
    assert files(cb) == {"epoch=1-step=18.ckpt": 18, "epoch=3-step=36.ckpt": 36}
    scores = {k: round(float(v), 4) for k, v in cb.best_k_models.items()}
    assert scores[os.path.join(cb.dirpath, "epoch=1-step=18.ckpt")] == 4978.2119  # Lightning's value at step 18


def test_step_saves_at_steps_that_validate_get_that_validations_score(tmp_path, recwarn):
    # Lightning: the same four files; its step-6 file gets step 4's score (10018.09: its batch-end save runs before
    # that step's validation, only an epoch's last batch waits for it); taskfit ranks every file by its own state.
    cb = ModelCheckpoint(monitor="val/loss", every_n_train_steps=2, save_top_k=-1, save_last=False)
    record = Record()
    fit(cb, root=tmp_path, max_epochs=2, val_check_interval=2, callbacks_extra=[record])
    assert files(cb) == {"epoch=0-step=2.ckpt": 2, "epoch=0-step=4.ckpt": 4, "epoch=1-step=6.ckpt": 6,
                         "epoch=1-step=8.ckpt": 8}
    assert {os.path.basename(p): round(float(v), 2) for p, v in cb.best_k_models.items()} == {
        "epoch=0-step=2.ckpt": 10274.67, "epoch=0-step=4.ckpt": 10018.09, "epoch=1-step=6.ckpt": 9990.06,
        "epoch=1-step=8.ckpt": 9740.58}  # Lightning: 10274.67, 10018.09, 10018.09, 9740.58
    assert record.scores == [10274.67, 10018.09, 9990.06, 9740.58]  # each validation's val/loss
    assert not [w for w in recwarn if "ModelCheckpoint" in str(w.message)]


# ---- ModelCheckpoint: the lightning-hydra-template configuration ----------------------------------------------
TEMPLATE = {  # configs/callbacks/model_checkpoint.yaml with default.yaml's overrides
    "_target_": "taskfit.callbacks.ModelCheckpoint", "dirpath": None, "filename": "epoch_{epoch:03d}",
    "monitor": "val/acc", "verbose": False, "save_last": True, "save_top_k": 1, "mode": "max",
    "auto_insert_metric_name": False, "save_weights_only": False, "every_n_train_steps": None,
    "train_time_interval": None, "every_n_epochs": None, "save_on_train_epoch_end": None}


def test_the_lightning_hydra_template_checkpoint_end_to_end(tmp_path, capsys):
    from hydra.utils import instantiate

    cb = instantiate({**TEMPLATE, "dirpath": str(tmp_path / "checkpoints"), "verbose": True})
    trainer, task = fit(cb, Line(script=[0.5, 0.9, 0.7]), max_epochs=3)
    # Lightning: epoch_001.ckpt (val/acc 0.9, step 8) and last.ckpt; best_model_path set; test loads the best.
    # (Lightning's last.ckpt holds step 8, its last ranked save; taskfit's the newest state, step 12.)
    assert files(cb) == {"epoch_001.ckpt": 8, "last.ckpt": 12}
    assert cb.best_model_path == str(tmp_path / "checkpoints" / "epoch_001.ckpt")
    assert cb.best_model_score == pytest.approx(0.9) and isinstance(cb.best_model_score, torch.Tensor)
    assert names(cb.best_k_models) == ["epoch_001.ckpt"] and cb.kth_best_model_path == cb.best_model_path
    out = capsys.readouterr().out  # verbose: Lightning's lines, word for word
    folder = tmp_path / "checkpoints"
    assert out.splitlines() == [
        f"Epoch 0, global step 4: 'val/acc' reached 0.50000 (best 0.50000), saving model to "
        f"'{folder / 'epoch_000.ckpt'}' as top 1",
        f"Epoch 1, global step 8: 'val/acc' reached 0.90000 (best 0.90000), saving model to "
        f"'{folder / 'epoch_001.ckpt'}' as top 1",
        "Epoch 2, global step 12: 'val/acc' was not in top 1"]
    [result] = trainer.test(task, ckpt_path="best")
    assert result["test/loss"] == 9740.5849609375  # Lightning's test on the same file gives this loss
    assert task.net.weight.item() == load_checkpoint(cb.best_model_path)["module"]["net.weight"].item()


def test_the_template_base_config_nulls(tmp_path):
    # The template's base file has filename: null and save_last: null (Lightning's defaults).
    from hydra.utils import instantiate

    cb = instantiate({**TEMPLATE, "dirpath": str(tmp_path), "filename": None, "save_last": None,
                      "auto_insert_metric_name": True})
    fit(cb, Line(script=[0.5, 0.9]), max_epochs=2)
    assert files(cb) == {"epoch=1-step=8.ckpt": 8}  # no last.ckpt: save_last=None is Lightning's "no"


# ---- ModelCheckpoint: file names ------------------------------------------------------------------------------
@pytest.mark.parametrize("filename, auto, expected", [  # Lightning 2.6.6's file after epoch 0 (step 4)
    ("{epoch:03d}", True, "epoch=000.ckpt"),
    ("epoch_{epoch:03d}", True, "epoch_epoch=000.ckpt"),  # the "epoch_epoch=009.ckpt": Lightning's too
    ("epoch={epoch}-val_loss={val/loss:.2f}", False, "epoch=0-val_loss=10018.09.ckpt"),
    ("{step:05d}-{epoch}", False, "00004-0.ckpt"),
    ("a.b-{epoch}", True, "a.b-epoch=0.ckpt"),
    # Lightning writes "epoch=0-val/loss=10018.09.ckpt", i.e. a folder "epoch=0-val" (documented difference)
    ("{epoch}-{val/loss:.2f}", True, "epoch=0-val_loss=10018.09.ckpt"),
])
def test_filename_templates_as_lightning_writes_them(tmp_path, filename, auto, expected):
    cb = ModelCheckpoint(filename=filename, auto_insert_metric_name=auto, save_top_k=-1, save_last=False)
    fit(cb, root=tmp_path, max_epochs=1)
    assert list(files(cb)) == [expected]


def test_format_filename():
    assert format_filename("{epoch}-{val_loss:.2f}", {"epoch": 2, "val_loss": 0.123456}) == "epoch=2-val_loss=0.12"
    assert format_filename("{epoch:03d}", {"epoch": 5}) == "epoch=005"
    assert format_filename("epoch={epoch}-validation_loss={val_loss:.2f}", {"epoch": 2, "val_loss": 0.123456},
                           auto_insert_metric_name=False) == "epoch=2-validation_loss=0.12"
    assert format_filename("{val/acc:.3f}", {"val/acc": 0.91234}) == "val_acc=0.912"
    assert format_filename("my@model {epoch}", {"epoch": 1}) == "my@model epoch=1"  # literal text as written


@pytest.mark.parametrize("counter, expected, ranked", [
    (True, {"epoch=0-v1.ckpt": 4, "epoch=0.ckpt": 2, "epoch=1-v1.ckpt": 8, "epoch=1.ckpt": 6}, 4),
    (False, {"epoch=0.ckpt": 4, "epoch=1.ckpt": 8}, 2),  # the second save of an epoch overwrites the first
])
def test_the_version_counter(tmp_path, counter, expected, ranked):
    cb = ModelCheckpoint(filename="{epoch}", monitor="val/loss", save_top_k=-1, save_last=False,
                         enable_version_counter=counter)
    fit(cb, root=tmp_path, max_epochs=2, val_check_interval=0.5)  # two validations (and saves) per epoch
    assert files(cb) == expected and len(cb.best_k_models) == ranked
    assert os.path.basename(cb.best_model_path) == ("epoch=1-v1.ckpt" if counter else "epoch=1.ckpt")


def test_without_a_monitor_a_repeated_name_replaces_the_newest_file(tmp_path):
    # Lightning: epoch=0.ckpt holding step 4 (each step's save replaced the previous one of the same name)
    cb = ModelCheckpoint(filename="{epoch}", every_n_train_steps=1, save_top_k=-1, save_last=False)
    fit(cb, root=tmp_path, max_epochs=1)
    assert files(cb) == {"epoch=0.ckpt": 4}


# ---- ModelCheckpoint: the other arguments ---------------------------------------------------------------------
def test_save_weights_only(tmp_path):
    cb = ModelCheckpoint(monitor="val/loss", save_weights_only=True)
    trainer, _ = fit(cb, root=tmp_path, max_epochs=2)
    ckpt = torch.load(cb.best_model_path, weights_only=True)
    assert "module" in ckpt and not {"optimizer", "rng", "callbacks"} & set(ckpt)
    assert os.path.getsize(cb.last_model_path) == os.path.getsize(cb.best_model_path)  # weights only too
    assert Line.load_from_checkpoint(cb.best_model_path).net.weight.item() == ckpt["module"]["net.weight"].item()
    assert trainer.validate(Line(), ckpt_path="best")[0]["val/loss"] == pytest.approx(9740.5849609375)
    with pytest.raises(CheckpointError, match=r"holds only weights \(ModelCheckpoint\(save_weights_only=True\)\), "
                                              r"not a training state to resume"):
        Trainer(max_epochs=3, **QUIET).fit(Line(), ckpt_path=cb.best_model_path)


def test_lightnings_positional_order_and_refused_values():
    cb = ModelCheckpoint("ckpts", "{epoch}", "val/acc", True)  # dirpath, filename, monitor, verbose
    assert (os.path.basename(cb.dirpath), cb.filename, cb.monitor, cb.verbose) == ("ckpts", "{epoch}", "val/acc", True)
    with pytest.raises(MisconfigurationError, match=r"ModelCheckpoint\(\) got an unknown argument 'every_n_val_epochs'"
                                                    r"\.\n  HINT: did you mean every_n_epochs\?"):
        ModelCheckpoint(every_n_val_epochs=1)  # Lightning 1.x's name
    with pytest.raises(MisconfigurationError, match=r"save_last='yes'\) is not valid"):
        ModelCheckpoint(save_last="yes")
    with pytest.raises(MisconfigurationError, match=r"train_time_interval=-1\) is not valid\.\n  HINT: pass a number "
                                                    r"of seconds >= 0 \(0: save at every step\)"):
        ModelCheckpoint(train_time_interval=-1)


def test_a_resumed_run_keeps_ranking_and_every_n_epochs_none_survives(tmp_path):
    script = [0.5, 0.9, 0.95, 0.1]
    cb = ModelCheckpoint(monitor="val/acc", mode="max", every_n_epochs=None, filename="{epoch}")
    fit(cb, Line(script=script), root=tmp_path, max_epochs=2)
    again = ModelCheckpoint(monitor="val/acc", mode="max", every_n_epochs=None, filename="{epoch}")
    trainer = Trainer(default_root_dir=str(tmp_path), max_epochs=4, callbacks=[again, CountValidations()], **QUIET)
    task = Line(script=script)
    task.validations = 2
    trainer.fit(task, ckpt_path="last")
    assert os.path.basename(again.best_model_path) == "epoch=2.ckpt" and float(again.best_model_score) == \
        pytest.approx(0.95)


# ---- EarlyStopping ---------------------------------------------------------------------------------------------
def stop_run(stopper: EarlyStopping, script, **settings) -> tuple[Trainer, list[tuple[int, float]]]:
    """Fit with ``stopper`` on a scripted ``val/score``; returns the trainer and the (step, value) of every check."""
    checks, evaluate = [], stopper._evaluate

    def spy(value):
        checks.append((trainer.state.global_step, value))
        return evaluate(value)

    stopper._evaluate = spy
    trainer = Trainer(callbacks=[stopper, CountValidations()], enable_checkpointing=False, **{**QUIET, **settings})
    trainer.fit(Line(script=script, key="score"))
    return trainer, checks


def test_early_stopping_patience_and_min_delta_as_lightning(capsys):
    stopper = EarlyStopping("val/score", min_delta=0.1, patience=3, verbose=True)  # Lightning's positional order
    trainer, checks = stop_run(stopper, [1.0, 0.8, 0.75, 0.79, 0.85, 0.5, 0.4, 0.3], max_epochs=8)
    assert [step for step, _ in checks] == [4, 8, 12, 16, 20]  # one check per epoch, at its end
    assert (stopper.stopped_epoch, stopper.wait_count, trainer.state.epoch) == (4, 3, 5)
    assert stopper.best_score == pytest.approx(0.8) and isinstance(stopper.best_score, torch.Tensor)
    assert stopper.stopping_reason is EarlyStoppingReason.PATIENCE_EXHAUSTED
    message = ("Monitored metric val/score did not improve in the last 3 records. Best score: 0.800. Signaling "
               "Trainer to stop.")
    assert stopper.stopping_reason_message == message and trainer.state.stop_reason == f"EarlyStopping: {message}"
    assert capsys.readouterr().out.splitlines() == [  # verbose: Lightning's messages
        "Metric val/score improved. New best score: 1.000",
        "Metric val/score improved by 0.200 >= min_delta = 0.1. New best score: 0.800", message]


@pytest.mark.parametrize("kwargs, settings, script, steps, stopped", [
    # val_check_interval=0.5: Lightning checks after every validation (steps 2, 4, 6, 8) and stops in epoch 1
    (dict(patience=2), dict(val_check_interval=0.5), [1.0, 0.9, 0.95, 0.96, 0.5, 0.4, 0.3, 0.2], [2, 4, 6, 8], 1),
    # check_on_train_epoch_end=True: only at epoch ends, with the epoch's last validation (0.9, 0.96, 0.98)
    (dict(patience=2, check_on_train_epoch_end=True), dict(val_check_interval=0.5),
     [1.0, 0.9, 0.95, 0.96, 0.97, 0.98, 0.99, 1.0], [4, 8, 12], 2),
    # check_val_every_n_epoch=2: after each validation (epochs 1, 3, 5)
    (dict(patience=1), dict(check_val_every_n_epoch=2), [1.0, 1.0, 1.0], [8, 16], 3),
    (dict(patience=0), dict(), [1.0, 0.8, 0.9, 0.7], [4, 8, 12], 2),  # patience 0: the first miss stops
])
def test_when_early_stopping_checks(kwargs, settings, script, steps, stopped):
    stopper = EarlyStopping("val/score", **kwargs)
    trainer, checks = stop_run(stopper, script, max_epochs=8, **settings)
    assert [step for step, _ in checks] == steps and stopper.stopped_epoch == stopped
    assert trainer.state.epoch == stopped + 1


@pytest.mark.parametrize("kwargs, script, stopped, reason, message", [  # Lightning's reasons and messages
    (dict(mode="max", stopping_threshold=0.9), [0.5, 0.7, 0.9, 0.95, 0.99], 3, EarlyStoppingReason.STOPPING_THRESHOLD,
     "Stopping threshold reached: val/score = 0.949999988079071 > 0.9. Signaling Trainer to stop."),  # 0.9: not yet
    (dict(), [1.0, 0.9, math.nan, 0.1], 2, EarlyStoppingReason.NON_FINITE_METRIC,
     "Monitored metric val/score = nan is not finite. Previous best value was 0.900. Signaling Trainer to stop."),
    (dict(), [1.0, 0.9, math.inf, 0.1], 2, EarlyStoppingReason.NON_FINITE_METRIC,
     "Monitored metric val/score = inf is not finite. Previous best value was 0.900. Signaling Trainer to stop."),
    # Lightning writes "4.0 < 3.0" here (the sign of mode="min"); taskfit the true comparison
    (dict(divergence_threshold=3.0), [1.0, 0.9, 4.0, 0.1], 2, EarlyStoppingReason.DIVERGENCE_THRESHOLD,
     "Divergence threshold reached: val/score = 4.0 > 3.0. Signaling Trainer to stop."),
    (dict(mode="max"), [0.1, 0.2, 0.3], 0, EarlyStoppingReason.NOT_STOPPED, None),
])
def test_early_stopping_reasons(kwargs, script, stopped, reason, message):
    stopper = EarlyStopping("val/score", **kwargs)
    trainer, _ = stop_run(stopper, script, max_epochs=len(script))
    assert (stopper.stopped_epoch, stopper.stopping_reason, stopper.stopping_reason_message) == (
        stopped, reason, message)
    assert stopper.best_score == pytest.approx(0.9 if reason is not EarlyStoppingReason.NOT_STOPPED else 0.3)
    assert trainer.state.should_stop == (message is not None)


def test_strict_and_a_missing_monitor():
    # Lightning: strict raises at the first check ("Early stopping conditioned on metric `val/missing` which is not
    # available"); strict=False skips every check (taskfit: with one warning).
    with pytest.raises(MisconfigurationError, match=r"monitors 'val/missing', which was not logged \(Lightning's "
                                                    r"words: Early stopping conditioned on metric `val/missing` "
                                                    r"which is not available\)\. Logged keys: train/loss, train/loss_epoch, val/loss, val/score\."):
        stop_run(EarlyStopping("val/missing"), [1.0, 0.9], max_epochs=2)
    lenient = EarlyStopping("val/missing", strict=False)
    with pytest.warns(UserWarning, match=r"EarlyStopping\(strict=False\) skips the check") as record:
        trainer, checks = stop_run(lenient, [1.0, 0.9], max_epochs=2)
    assert not checks and trainer.state.epoch == 2
    assert len([w for w in record if "EarlyStopping" in str(w.message)]) == 1  # once, not at every check
    with pytest.warns(UserWarning, match=r"has no validation data, so it would never be checked"):
        stop_run(EarlyStopping("val/score", strict=False), [1.0, 0.9], max_epochs=2, limit_val_batches=0)


def test_a_training_key_checked_after_validation_is_missing_at_the_first_validation():
    # Lightning (check_on_train_epoch_end=False, val_check_interval=0.5): RuntimeError at the first validation
    with pytest.raises(MisconfigurationError, match=r"monitors 'train/loss_epoch', which was not logged"):
        stop_run(EarlyStopping("train/loss_epoch", check_on_train_epoch_end=False), [1.0] * 4, max_epochs=2,
                 val_check_interval=0.5)


def test_early_stopping_state_and_older_checkpoints():
    stopper = EarlyStopping("val/score", patience=4)
    stop_run(stopper, [1.0, 1.1, 1.2], max_epochs=3)
    state = stopper.state_dict()
    assert state == {"best_score": 1.0, "wait_count": 2, "stopped_epoch": 0, "stopping_reason": 0,
                     "stopping_reason_message": None, "monitor": "val/score", "mode": "min"}
    again = EarlyStopping("val/score", patience=4)
    again.load_state_dict({"best": 0.5, "wait": 1, "stopped_epoch": None, "monitor": "val/score", "mode": "min"})
    assert (float(again.best_score), again.wait_count, again.stopped_epoch) == (0.5, 1, 0)  # taskfit <= round 2


def test_early_stopping_arguments():
    with pytest.raises(MisconfigurationError, match=r"EarlyStopping\(\) got an unknown argument 'patient'\.\n  HINT: "
                                                    r"did you mean patience\?"):
        EarlyStopping("val/loss", patient=3)
    es = EarlyStopping("val/loss", 0.5, 7, True, "max", False, False, 1.0, 2.0, True, True)  # Lightning's order
    assert (es.min_delta, es.patience, es.verbose, es.mode, es.strict, es.check_finite, es.stopping_threshold,
            es.divergence_threshold, es.check_on_train_epoch_end, es.log_rank_zero_only) == (
        0.5, 7, True, "max", False, False, 1.0, 2.0, True, True)


def test_verbose_lines_under_ddp_name_their_rank(capfd):
    # Lightning's test_early_stopping_log_info: "[rank: 0] bar", "[rank: 1] bar"; log_rank_zero_only: rank 0's only
    every = EarlyStopping("val/score", verbose=True)
    zero = EarlyStopping("val/loss", verbose=True, log_rank_zero_only=True)
    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=1, enable_checkpointing=False,
                      callbacks=[every, zero, CountValidations()], **QUIET)
    capfd.readouterr()
    trainer.fit(Line(script=[1.0], key="score"))
    lines = capfd.readouterr().out.splitlines()  # the workers write to this process's stdout
    assert sorted(line for line in lines if "val/score" in line) == [
        "[rank: 0] Metric val/score improved. New best score: 1.000",
        "[rank: 1] Metric val/score improved. New best score: 1.000"]
    [loss_line] = [line for line in lines if "val/loss" in line]
    assert loss_line.startswith("[rank: 0] Metric val/loss improved. New best score: ")


# ---- ModelSummary ----------------------------------------------------------------------------------------------
class Nested(Line):
    def __init__(self):
        super().__init__()
        block = nn.Module()
        block.fc, block.act, block.bn = nn.Linear(4, 4), nn.ReLU(), nn.BatchNorm1d(4)
        self.encoder = nn.Sequential(nn.Linear(8, 4), block)
        self.head = nn.Linear(4, 2).eval()
        self.frozen = nn.Linear(2, 2).requires_grad_(False)


def summary_rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    return [line.split() for line in lines[2:lines.index(lines[1], 2)]]


@pytest.mark.parametrize("depth, rows", [  # Lightning 2.6.6's Name and Mode columns for this module
    (1, ["net train", "encoder train", "head eval", "frozen train"]),
    (-1, ["net train", "encoder train", "encoder.0 train", "encoder.1 train", "encoder.1.fc train",
          "encoder.1.act train", "encoder.1.bn train", "head eval", "frozen train"]),
])
def test_model_summary_depth(capsys, depth, rows):
    Trainer(max_steps=1, callbacks=[ModelSummary(max_depth=depth)], **{**QUIET, "enable_model_summary": True}
            ).fit(Nested())
    out = capsys.readouterr().out
    assert [f"{row[1]} {row[-1]}" for row in summary_rows(out)] == rows
    # Lightning, without Line's net (1 weight): 74 trainable, 6 non-trainable, 80 total, 7 train and 1 eval modules
    assert "75 trainable params\n6 non-trainable params\n81 total params" in out
    assert "8 modules in train mode\n1 modules in eval mode" in out


def test_model_summary_depth_zero_prints_nothing(capsys):
    Trainer(max_steps=1, callbacks=[ModelSummary(max_depth=0)], **{**QUIET, "enable_model_summary": True}
            ).fit(Nested())
    assert "total params" not in capsys.readouterr().out
    with pytest.raises(MisconfigurationError, match=r"ModelSummary\(max_depth=-2\) is not valid"):
        ModelSummary(max_depth=-2)


# ---- BasePredictionWriter: Lightning's subclass, as written for Lightning ---------------------------------------
class Predicts(TaskModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(1, 1)

    def forward(self, x):
        return self.net(x)

    def predict_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(5.0).unsqueeze(1)), batch_size=2, shuffle=True)

    def predict_step(self, batch, batch_idx):
        return batch[0] * 10  # a sample's prediction is 10 x its dataset index


class Recorder(BasePredictionWriter):
    def __init__(self, write_interval):
        super().__init__(write_interval)
        self.calls = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.calls.append(("batch", prediction.flatten().tolist(), batch_indices, batch_idx, dataloader_idx))

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.calls.append(("epoch", [p.flatten().tolist() for p in predictions], batch_indices))


@pytest.mark.parametrize("interval, kinds", [("batch", ["batch"] * 3), ("epoch", ["epoch"]),
                                             ("batch_and_epoch", ["batch"] * 3 + ["epoch"])])
def test_base_prediction_writer_calls_as_lightning(interval, kinds):
    # Lightning 2.6.6, the same loader: ('batch', [10.0, 30.0], [1, 3], 0, 0), ... then
    # ('epoch', [[10.0, 30.0], [20.0, 0.0], [40.0]], [[[1, 3], [2, 0], [4]]]): per-batch predictions on the CPU
    # and, per dataloader, each batch's dataset indices (the shuffled order differs: another seed).
    writer = Recorder(interval)
    assert Trainer(callbacks=[writer], **QUIET).predict(Predicts(), return_predictions=False) is None
    assert [c[0] for c in writer.calls] == kinds
    batches = [c for c in writer.calls if c[0] == "batch"]
    for _, prediction, indices, batch_idx, dataloader_idx in batches:
        assert prediction == [10.0 * i for i in indices] and dataloader_idx == 0
    assert [c[3] for c in batches] == list(range(len(batches)))
    for _, predictions, [per_batch] in (c for c in writer.calls if c[0] == "epoch"):
        assert [len(p) for p in per_batch] == [2, 2, 1] and sorted(sum(per_batch, [])) == [0, 1, 2, 3, 4]
        assert predictions == [[10.0 * i for i in p] for p in per_batch]


def test_a_writer_without_its_write_method_is_refused_before_predicting():
    class EpochOnly(BasePredictionWriter):
        def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
            pass

    with pytest.raises(MisconfigurationError, match=r"EpochOnly\(write_interval='batch'\) does not define "
                                                    r"write_on_batch_end, so nothing would be written"):
        Trainer(callbacks=[EpochOnly()], **QUIET).predict(Predicts())
    with pytest.raises(MisconfigurationError, match=r"EpochOnly\(write_interval='step'\) is not valid"):
        EpochOnly("step")
