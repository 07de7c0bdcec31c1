"""The Trainer's flags of issue 46, in real CPU fits, with Lightning 2.6's meaning (its tests
trainer/flags/test_{val_check_interval,limit_batches,check_val_every_n_epoch,fast_dev_run}.py and
tuner/test_lr_finder.py are the specification): ``val_check_interval`` as a duration, the lines for
limits passed as 1 / 1.0, ``trainer.limit_*_batches``, ``check_val_every_n_epoch=None`` without a
loader length, ``fast_dev_run=n``'s ``max_steps``, ``max_epochs=-1``,
``reload_dataloaders_every_n_epochs``, ``ProgressBar.total_val_batches`` and the
``LearningRateFinder`` callback."""
from __future__ import annotations

import datetime
import math
import os
import time

import pytest
import torch
from taskfit import Trainer, seed_everything
from taskfit.callbacks import (
    Callback,
    EarlyStopping,
    LearningRateFinder,
    ModelCheckpoint,
    ProgressBar,
)
from taskfit.errors import MisconfigurationError
from torch.utils.data import DataLoader, IterableDataset

from tasks import RegressionTask

QUIET = dict(
    enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False
)


class Validations(Callback):
    """The total batch count (across epochs) after which each validation ran, and the epochs."""

    def __init__(self) -> None:
        self.after, self.epochs = [], []

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        self.batches = getattr(self, "batches", 0) + 1

    def on_validation_end(self, trainer, task) -> None:
        if not trainer.sanity_checking:
            self.after.append(getattr(self, "batches", 0))
            self.epochs.append(trainer.current_epoch)


class FakeClock:
    """``time`` for loop/cadence.py: each training batch takes ``per_batch`` seconds (the task
    advances it)."""

    now = 0.0

    @classmethod
    def monotonic(cls) -> float:
        return cls.now


class TimedBatches(RegressionTask):
    """Each training batch advances the fake clock by one second."""

    def training_step(self, batch, batch_idx):
        FakeClock.now += 1.0
        return self.loss(self(batch[0]), batch[1])


# ---- val_check_interval as a duration ------------------------------------------------------------
@pytest.mark.parametrize("interval", ["00:00:00:03", {"seconds": 3}, datetime.timedelta(seconds=3)])
def test_a_duration_validates_after_that_much_training_time(monkeypatch, interval):
    monkeypatch.setattr("taskfit.loop.cadence.time", FakeClock)
    FakeClock.now = 0.0
    seen = Validations()
    # 8 batches an epoch, 2 epochs; a batch is 1 s: due after 3 s of training since the start or the
    # last validation
    trainer = Trainer(max_epochs=2, val_check_interval=interval, callbacks=[seen], **QUIET)
    trainer.fit(TimedBatches(n=64, batch_size=8, val_n=8))
    assert trainer.val_check_interval == datetime.timedelta(seconds=3)
    # no validation of its own at an epoch's end (Lightning's rule)
    assert seen.after == [3, 6, 9, 12, 15]


def test_a_duration_waits_for_the_epochs_check_val_every_n_epoch_names(monkeypatch):
    monkeypatch.setattr("taskfit.loop.cadence.time", FakeClock)
    FakeClock.now = 0.0
    seen = Validations()
    trainer = Trainer(
        max_epochs=4,
        val_check_interval="00:00:00:03",
        check_val_every_n_epoch=2,
        callbacks=[seen],
        **QUIET,
    )
    trainer.fit(TimedBatches(n=32, batch_size=8, val_n=8))  # 4 batches an epoch
    # the clock runs in every epoch; only epochs 1 and 3 ask it (Lightning's test: [0, 3, 0, 3, 0]
    # batches for 9 s epochs): at once in their first batch, 3 s later again
    assert seen.epochs == [1, 1, 3, 3] and seen.after == [5, 8, 13, 16]


def test_a_real_duration_validates_a_sleeping_task_several_times():
    class Sleeps(RegressionTask):
        def training_step(self, batch, batch_idx):
            time.sleep(0.01)
            return self.loss(self(batch[0]), batch[1])

    seen = Validations()
    trainer = Trainer(max_epochs=3, val_check_interval={"seconds": 0.05}, callbacks=[seen], **QUIET)
    trainer.fit(Sleeps(n=64, batch_size=8, val_n=8))  # 24 batches of at least 10 ms each
    assert 2 <= len(seen.after) <= 24 and seen.after == sorted(set(seen.after))


@pytest.mark.parametrize("value, message", [
    ("00:03", r"Invalid time format for `val_check_interval`: '00:03'. Expected 'DD:HH:MM:SS'."),
    ("aa:00:00:03", r"Non-integer component in `val_check_interval` string"),
    ({"secs": 3}, r"Trainer\(val_check_interval=\{'secs': 3\}\) is not valid"),
    ("abc", r"Invalid time format"),
    (1.5, r"expected an int >= 0 \(number of batches\), a float in \[0.0, 1.0\] \(fraction of the "
          r"epoch\) or a duration"),
])
def test_a_malformed_interval_is_refused_when_the_trainer_is_built(value, message):
    with pytest.raises(MisconfigurationError, match=message):
        Trainer(val_check_interval=value, **QUIET)


def test_a_fraction_with_check_val_every_n_epoch_none_is_refused_with_lightnings_words():
    with pytest.raises(MisconfigurationError) as info:
        Trainer(val_check_interval=0.5, check_val_every_n_epoch=None)
    assert ("`val_check_interval` should be an integer or a time-based duration (str "
            "'DD:HH:MM:SS', datetime.timedelta, or dict kwargs for timedelta) when "
            "`check_val_every_n_epoch=None`.") in str(info.value)
    assert "HINT" in str(info.value)


def test_an_interval_longer_than_the_epoch_has_lightnings_words():
    with pytest.raises(ValueError, match="must be less than or equal to the number of the training "
                                         "batches"):
        Trainer(max_epochs=1, val_check_interval=100, **QUIET).fit(RegressionTask(n=32, val_n=8))


# ---- check_val_every_n_epoch=None without a loader length ----------------------------------------
class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.data = RegressionTask(n=n).data

    def __iter__(self):
        yield from self.data


@pytest.mark.parametrize("accumulate", [1, 2])
def test_batches_are_counted_across_epochs_without_a_loader_length(accumulate):
    """Lightning's test_validation_check_interval_exceed_data_length_correct[...-True]: validations
    after the run's batches 3, 6, 9 and 12."""
    class Streamed(RegressionTask):
        def train_dataloader(self):
            return DataLoader(Stream(112))

    seen = Validations()
    trainer = Trainer(
        max_steps=12 // accumulate,
        val_check_interval=3,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        accumulate_grad_batches=accumulate,
        callbacks=[seen],
        **{**QUIET, "enable_progress_bar": False},
    )
    trainer.fit(Streamed(val_n=8))
    assert seen.after == [3, 6, 9, 12] and trainer.global_step == 12 // accumulate


# ---- the limits: lines, attributes, fast_dev_run -------------------------------------------------
@pytest.mark.parametrize("argument, value, line", [
    ("limit_train_batches", 1, "`Trainer(limit_train_batches=1)` was configured so 1 batch per "
                               "epoch will be used."),
    ("limit_train_batches", 1.0, "`Trainer(limit_train_batches=1.0)` was configured so 100% of the "
                                 "batches per epoch will be used."),
    ("limit_val_batches", 1, "`Trainer(limit_val_batches=1)` was configured so 1 batch will be "
                             "used."),
    ("limit_predict_batches", 1.0, "`Trainer(limit_predict_batches=1.0)` was configured so 100% of "
                                   "the batches will be used."),
    ("overfit_batches", 1, "`Trainer(overfit_batches=1)` was configured so 1 batch will be used."),
    ("val_check_interval", 1, "`Trainer(val_check_interval=1)` was configured so validation will "
                              "run after every batch."),
    ("val_check_interval", 1.0, "`Trainer(val_check_interval=1.0)` was configured so validation "
                                "will run at the end of the training epoch."),
])
def test_a_limit_passed_as_one_says_which_one_it_is(capsys, argument, value, line):
    Trainer(**{argument: value})
    assert capsys.readouterr().out == line + "\n"
    # any other value, or the default: nothing
    Trainer(**{argument: 2 if isinstance(value, int) else 0.5})
    Trainer()
    assert capsys.readouterr().out == ""


def test_the_limits_are_attributes_and_assigning_one_changes_the_next_run():
    trainer = Trainer(max_epochs=1, limit_train_batches=3, limit_val_batches=0.5, **QUIET)
    assert (trainer.limit_train_batches, trainer.limit_val_batches, trainer.limit_test_batches,
            trainer.limit_predict_batches) == (3, 0.5, 1.0, 1.0)
    trainer.limit_train_batches = 2
    trainer.fit(RegressionTask(n=64, val_n=32))
    assert (
        trainer.num_training_batches == 2
        and trainer.num_val_batches == [2]
        and trainer.limits["train"] == 2
    )


@pytest.mark.parametrize("n", [1, 3])
def test_fast_dev_run_n_sets_max_steps_and_writes_no_checkpoint_folder(tmp_path, n):
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"))
    trainer = Trainer(fast_dev_run=n, default_root_dir=str(tmp_path), callbacks=[checkpoint],
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(RegressionTask(n=64, val_n=16))
    assert (trainer.max_steps, trainer.max_epochs, trainer.num_sanity_val_steps) == (n, 1, 0)
    assert trainer.global_step == n and not os.path.exists(tmp_path / "ckpts")


# ---- max_epochs=-1 -------------------------------------------------------------------------------
class StopAfter(Callback):
    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def on_train_epoch_end(self, trainer, task) -> None:
        if trainer.current_epoch + 1 == self.epochs:
            trainer.should_stop = True


def test_max_epochs_minus_one_trains_until_something_stops_it_and_says_so(capsys):
    trainer = Trainer(max_epochs=-1, callbacks=[StopAfter(7)], **QUIET)
    trainer.fit(RegressionTask(n=16, batch_size=8))
    assert trainer.max_epochs == -1 and trainer.current_epoch == 7 and trainer.global_step == 14
    assert trainer.estimated_stepping_batches == math.inf
    out = capsys.readouterr().out
    assert ("Trainer(max_epochs=-1) without max_steps: this fit has no epoch or step limit and "
            "trains until a callback sets trainer.should_stop = True, or it is interrupted") in out


def test_max_epochs_minus_one_names_the_early_stopping_that_ends_it(capsys):
    class Flat(RegressionTask):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", 1.0)

    trainer = Trainer(
        max_epochs=-1, callbacks=[EarlyStopping(monitor="val_loss", patience=2)], **QUIET
    )
    trainer.fit(Flat(n=16, batch_size=8, val_n=8))
    assert trainer.current_epoch == 3  # the first value, then 2 epochs without improvement
    assert "trains until its EarlyStopping stops it" in capsys.readouterr().out


def test_max_epochs_minus_one_with_max_steps_says_nothing(capsys):
    trainer = Trainer(max_epochs=-1, max_steps=11, **QUIET)
    trainer.fit(RegressionTask(n=16, batch_size=8))
    assert trainer.global_step == 11 and capsys.readouterr().out == ""


def test_max_epochs_below_minus_one_is_refused():
    with pytest.raises(MisconfigurationError, match=r"expected an integer >= 0, -1 \(no epoch "
                                                    r"limit\) or None"):
        Trainer(max_epochs=-3)


# ---- reload_dataloaders_every_n_epochs -----------------------------------------------------------
class Growing(RegressionTask):
    """A training set one batch longer each time it is asked for; records when it is asked."""

    def __init__(self) -> None:
        super().__init__(n=64, batch_size=8, val_n=8)
        self.asked = []

    def train_dataloader(self):
        self.asked.append(("train", self.trainer.current_epoch))
        size = 8 * (2 + len([a for a in self.asked if a[0] == "train"]))
        return DataLoader(torch.utils.data.Subset(self.data, range(size)), batch_size=8)

    def val_dataloader(self):
        self.asked.append(("val", self.trainer.current_epoch))
        return super().val_dataloader()


class EpochBatches(Callback):
    def __init__(self) -> None:
        self.seen = []

    def on_train_epoch_start(self, trainer, task) -> None:
        self.seen.append(trainer.num_training_batches)


def test_reload_dataloaders_every_n_epochs_asks_for_the_loaders_again():
    task, batches = Growing(), EpochBatches()
    trainer = Trainer(max_epochs=5, reload_dataloaders_every_n_epochs=2, num_sanity_val_steps=0,
                      callbacks=[batches], **QUIET)
    trainer.fit(task)
    assert [a for a in task.asked if a[0] == "train"] == [("train", 0), ("train", 2), ("train", 4)]
    assert [a for a in task.asked if a[0] == "val"] == [("val", 0), ("val", 2), ("val", 4)]
    assert batches.seen == [3, 3, 4, 4, 5]  # each epoch trains on the loader it was given
    assert trainer.global_step == 3 + 3 + 4 + 4 + 5


def test_reload_dataloaders_every_n_epochs_is_checked():
    with pytest.raises(MisconfigurationError, match=r"reload_dataloaders_every_n_epochs=-1\) is "
                                                    r"not valid"):
        Trainer(reload_dataloaders_every_n_epochs=-1)


# ---- ProgressBar's counts ------------------------------------------------------------------------
def test_total_val_batches_is_zero_in_an_epoch_that_does_not_validate():
    """Lightning's test_check_val_every_n_epoch: [0, 2, 0, 2]."""
    class Totals(Callback):
        def __init__(self) -> None:
            self.val, self.train = [], []

        def on_train_epoch_end(self, trainer, task) -> None:
            self.val.append(trainer.progress_bar_callback.total_val_batches)
            self.train.append(trainer.progress_bar_callback.total_train_batches)

    totals = Totals()
    trainer = Trainer(
        max_epochs=4,
        limit_val_batches=2,
        check_val_every_n_epoch=2,
        num_sanity_val_steps=0,
        callbacks=[totals, ProgressBar()],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(RegressionTask(n=32, batch_size=8, val_n=32))
    assert totals.val == [0, 2, 0, 2] and totals.train == [4, 4, 4, 4]


# ---- the LearningRateFinder callback -------------------------------------------------------------
def test_the_lr_finder_callback_trains_the_fit_with_its_suggestion():
    seed_everything(0)
    finder = LearningRateFinder(num_training_steps=30)
    task = RegressionTask(n=256, batch_size=8, lr=1e-5)
    trainer = Trainer(max_epochs=1, callbacks=[finder], **QUIET)
    trainer.fit(task)
    lr = finder.optimal_lr.suggestion()
    assert lr is not None and len(finder.optimal_lr.results["lr"]) <= 30
    assert task.lr == lr and trainer.optimizer.param_groups[0]["lr"] == lr
    # the fit's own steps; the task given back
    assert trainer.global_step == 32 and task.trainer is None


def test_the_lr_finder_callback_leaves_the_fit_as_a_fit_without_it_when_it_updates_nothing():
    seed_everything(0)
    reference = RegressionTask(n=64, batch_size=8, shuffle=True)
    Trainer(max_epochs=2, seed=3, **QUIET).fit(reference)
    seed_everything(0)
    task = RegressionTask(n=64, batch_size=8, shuffle=True)
    Trainer(
        max_epochs=2,
        seed=3,
        callbacks=[LearningRateFinder(num_training_steps=12, update_attr=False)],
        **QUIET,
    ).fit(task)
    assert all(
        torch.equal(a, b)
        for a, b in zip(task.state_dict().values(), reference.state_dict().values())
    )


def test_a_training_step_returning_none_is_a_nan_point_and_the_test_still_ends():
    """Lightning's test_lr_finder_training_step_none_output: 20 points, NaN where the step returned
    None."""
    class SkipsSome(RegressionTask):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step in (5, 12, 17):
                return None
            return self.loss(self(batch[0]), batch[1])

    seed_everything(1)
    finder = LearningRateFinder(num_training_steps=20, early_stop_threshold=None, update_attr=False)
    Trainer(max_epochs=1, callbacks=[finder], **QUIET).fit(SkipsSome(n=256, batch_size=8))
    losses = finder.optimal_lr.results["loss"]
    assert len(losses) == len(finder.optimal_lr.results["lr"]) == 20
    assert [i for i, v in enumerate(losses) if math.isnan(v)] == [5, 12, 17]
    assert math.isfinite(finder.optimal_lr.suggestion())


def test_the_lr_finder_callback_refuses_a_task_without_an_lr_with_lightnings_words():
    class NoLr(RegressionTask):
        def __init__(self):
            super().__init__()
            del self.lr

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(AttributeError, match="should have one of these fields"):
        Trainer(max_epochs=1, callbacks=[LearningRateFinder()], **QUIET).fit(NoLr())


def test_the_lr_finder_callback_checks_its_arguments_when_built():
    with pytest.raises(MisconfigurationError, match=r"lr_find\(mode='log'\) is not valid"):
        LearningRateFinder(mode="log")
    with pytest.raises(MisconfigurationError, match=r"lr_find\(num_training=0\) is not valid"):
        LearningRateFinder(num_training_steps=0)


# ---- under ddp (two gloo processes) --------------------------------------------------------------
class CountValidations(Callback):
    def __init__(self, out: str) -> None:
        self.out, self.count = out, 0

    def on_validation_end(self, trainer, task) -> None:
        if not trainer.sanity_checking:
            self.count += 1

    def on_fit_end(self, trainer, task) -> None:
        with open(os.path.join(self.out, f"rank{trainer.global_rank}"), "w") as fh:
            fh.write(str(self.count))


class SleepyStep(RegressionTask):
    def training_step(self, batch, batch_idx):
        time.sleep(0.01)
        return self.loss(self(batch[0]), batch[1])


def test_a_duration_under_ddp_validates_on_every_rank_alike(tmp_path):
    trainer = Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        log_every_n_steps=2,
        val_check_interval={"seconds": 0.03},
        callbacks=[CountValidations(str(tmp_path))],
        **QUIET,
    )
    trainer.fit(SleepyStep(n=64, batch_size=4, val_n=16))  # 8 batches per rank and epoch
    counts = [int((tmp_path / f"rank{r}").read_text()) for r in (0, 1)]
    assert counts[0] == counts[1] and 1 <= counts[0] <= 8  # rank 0 decides, every 2 batches


def test_a_resumed_fit_reloads_at_the_epochs_the_uninterrupted_one_does(tmp_path):
    first = Growing()
    Trainer(
        max_epochs=3,
        reload_dataloaders_every_n_epochs=2,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    ).fit(first)
    resumed = Growing()
    trainer = Trainer(
        max_epochs=5,
        reload_dataloaders_every_n_epochs=2,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(resumed, ckpt_path="last")
    # built when the fit starts (its epoch counter is restored after), then again at epoch 4, as
    # epochs 0, 2, 4
    assert [a for a in resumed.asked if a[0] == "train"] == [("train", 0), ("train", 4)]
    assert trainer.current_epoch == 5


def test_the_lr_finder_callback_under_ddp_says_to_run_lr_find_before_fit():
    trainer = Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        callbacks=[LearningRateFinder()],
        **QUIET,
    )
    with pytest.raises(MisconfigurationError, match=r"LearningRateFinder runs its range test in "
                                                    r"one process; this fit has 2[\s\S]*HINT: call "
                                                    r"taskfit.tools.lr_find"):
        trainer.fit(RegressionTask(n=32))
