"""Where taskfit promises Lightning's meaning, the exact sequences PyTorch Lightning 2.6.6 produces.

The expected values were observed by running Lightning 2.6.6 on the same set-up (and match its
source: loops/training_epoch_loop.py, callbacks/model_checkpoint.py,
trainer/connectors/logger_connector/result.py); benchmarks/lightning_parity.py runs both side by
side where Lightning is installed. CI needs no Lightning.

The set-up, as in that run: a bias-free Linear(1, 1) starting at zero, SGD, x = 0..17 in batches of
2 (9 training batches per epoch, in order), validation on x = 100..103 in batches of 2. Where
taskfit deliberately differs (docs/migrating-lightning.md, "Where taskfit differs"), the test
asserts taskfit's documented behaviour and names Lightning's value beside it.
"""
from __future__ import annotations

import os

import pytest
import torch
from taskfit import MisconfigurationError, TaskModule, Trainer, seed_everything
from taskfit.callbacks import Callback, ModelCheckpoint
from tasks import Line, RegressionTask
from torch.utils.data import DataLoader, TensorDataset

QUIET = dict(
    enable_progress_bar=False, enable_model_summary=False, logger=False, num_sanity_val_steps=0
)


class Record(Callback):
    """The global steps of validations (with val/loss) and of scheduler steps (lr changes)."""

    def __init__(self):
        self.validations: list[tuple[int, float]] = []
        self.lr_changes: list[int] = []
        self._lr = None

    def on_validation_end(self, trainer, task):
        self.validations.append((trainer.state.global_step, trainer.state.metrics["val/loss"]))

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        lr = trainer.optimizer.param_groups[0]["lr"]
        if self._lr is not None and lr != self._lr:
            self.lr_changes.append(trainer.state.global_step)
        self._lr = lr

    @property
    def steps(self) -> list[int]:
        return [step for step, _ in self.validations]


def fit(task=None, **settings) -> tuple[Trainer, Record]:
    record = Record()
    settings.setdefault("enable_checkpointing", False)
    trainer = Trainer(
        **{**QUIET, **settings, "callbacks": [record, *settings.get("callbacks", [])]}
    )
    trainer.fit(task or Line())
    return trainer, record


# ---- val_check_interval and check_val_every_n_epoch: the same as Lightning -----------------------
@pytest.mark.parametrize("interval, steps", [
    # every int(9 * 0.25) = 2 batches of each epoch; nothing extra at b9
    (0.25, [2, 4, 6, 8, 11, 13, 15, 17]),
    (0.5, [4, 8, 13, 17]),
    (1.0, [9, 18]),
    (4, [4, 8, 13, 17]),  # an int: every 4 batches counted from each epoch's start
])
def test_val_check_interval_validates_after_the_same_batches_as_lightning(interval, steps):
    assert fit(max_epochs=2, val_check_interval=interval)[1].steps == steps


def test_a_fraction_of_ten_batches_ends_on_the_last_one():
    assert fit(Line(n=20), max_epochs=1, val_check_interval=0.25)[1].steps == [2, 4, 6, 8, 10]


def test_an_int_interval_longer_than_the_epoch_is_refused_before_training():
    with pytest.raises(MisconfigurationError, match=r"(?s)val_check_interval=20\) is longer than "
                                                    r"an epoch \(9 training "
                                                    r"batches\).*check_val_every_n_epoch=None"):
        fit(max_epochs=3, val_check_interval=20)


@pytest.mark.parametrize("interval, steps", [(20, [20]), (5, [5, 10, 15, 20, 25])])
def test_check_val_every_n_epoch_none_counts_batches_across_epochs(interval, steps):
    assert (
        fit(max_epochs=3, val_check_interval=interval, check_val_every_n_epoch=None)[1].steps
        == steps
    )


def test_a_fraction_with_check_val_every_n_epoch_none_is_refused_at_construction():
    with pytest.raises(MisconfigurationError, match=r"is a fraction of an epoch, but "
                                                    r"check_val_every_n_epoch=None"):
        Trainer(val_check_interval=0.5, check_val_every_n_epoch=None)


def test_check_val_every_n_epoch_two():
    assert fit(max_epochs=4, check_val_every_n_epoch=2)[1].steps == [18, 36]


# ---- ModelCheckpoint: which files, ranked by the score of the state they hold --------------------
def _files(trainer) -> dict[str, float]:
    cb = trainer.checkpoint_callback
    return {os.path.basename(path): score for path, score in cb.best_k_models.items()}


@pytest.mark.parametrize(
    "settings, names",
    [
        (
            dict(max_epochs=4, check_val_every_n_epoch=2),
            ["epoch=1-step=18.ckpt", "epoch=3-step=36.ckpt"],
        ),
        (
            dict(max_epochs=2, val_check_interval=0.5),
            [
                "epoch=0-step=4.ckpt",
                "epoch=0-step=8.ckpt",
                "epoch=1-step=13.ckpt",
                "epoch=1-step=17.ckpt",
            ],
        ),
        (dict(max_epochs=2), ["epoch=0-step=9.ckpt", "epoch=1-step=18.ckpt"]),
    ],
)
def test_model_checkpoint_saves_what_lightning_saves_with_each_files_own_score(
    tmp_path, settings, names
):
    cb = ModelCheckpoint(monitor="val/loss", save_top_k=-1)
    trainer, record = fit(
        default_root_dir=str(tmp_path), enable_checkpointing=True, callbacks=[cb], **settings
    )
    files = _files(trainer)
    assert sorted(files) == names
    # every file's score is the validation of the very step it holds
    scores = dict(record.validations)
    for name, score in files.items():
        assert score == scores[int(name.split("step=")[1].split(".")[0])]
    assert os.path.isfile(cb.best_model_path) and cb.best_model_score == min(files.values())


def test_top_k_never_ranks_an_epoch_that_did_not_validate(tmp_path):
    cb = ModelCheckpoint(monitor="val/loss", save_top_k=1, every_n_train_steps=5)
    with pytest.warns(UserWarning, match="has no score of its own"):
        trainer, record = fit(
            default_root_dir=str(tmp_path),
            enable_checkpointing=True,
            callbacks=[cb],
            max_epochs=4,
            check_val_every_n_epoch=2,
        )
    # step-triggered saves between validations are not ranked, only last.ckpt
    (name,) = _files(trainer)
    assert name in ("epoch=1-step=18.ckpt", "epoch=3-step=36.ckpt")


def test_a_monitor_that_is_never_logged_fails_after_the_first_validation(tmp_path):
    cb = ModelCheckpoint(monitor="val_loss")  # Lightning's spelling of val/loss
    with pytest.raises(MisconfigurationError, match=r"(?s)monitor='val_loss'\) is not a logged "
                                                    r"key.*did you mean 'val/loss'\?"):
        fit(default_root_dir=str(tmp_path), enable_checkpointing=True, callbacks=[cb], max_epochs=3)
    # nothing ranked under a wrong name
    assert not list((tmp_path / "version_0" / "checkpoints").glob("*.ckpt"))


# ---- epoch means: weighted by batch size, as Lightning -------------------------------------------
class LogsY(Line):
    def loss(self, outputs, targets):
        # train_y_step, train_y_epoch; val_y
        self.log(f"{self.stage}_y", targets.mean(), on_epoch=True)
        return super().loss(outputs, targets)


def test_training_epoch_means_are_weighted_by_batch_size():
    # x = 0..9 in batches of 4, 4, 2 (means 1.5, 5.5, 8.5): Lightning's epoch value is 4.5, not
    # 5.1667
    trainer, _ = fit(LogsY(n=10, batch_size=4), max_epochs=1)
    assert trainer.state.metrics["train_y_epoch"] == pytest.approx(4.5)
    # evaluation means were weighted already
    assert trainer.state.metrics["val_y"] == pytest.approx(101.5)


# ---- deliberate differences (docs/migrating-lightning.md) ----------------------------------------
def test_step_schedulers_count_optimizer_steps_over_the_run():
    # Lightning counts batch_idx + 1 within each epoch: 12 steps at 2, 4, 6, 8, 11, 13, ..., 26 over
    # 3 epochs. taskfit counts optimizer steps over the run (the same cadence across epochs and with
    # accumulation): 13.
    _, record = fit(Line(lr=1.0, scheduler={"interval": "step", "frequency": 2}), max_epochs=3)
    assert record.lr_changes == list(range(2, 27, 2))


def test_a_short_accumulation_group_is_divided_by_its_own_size():
    # Lightning divides every micro-batch by accumulate_grad_batches (3), the short last group
    # included.
    grads = []

    class Grad(Callback):
        def on_before_optimizer_step(self, trainer, task, optimizer):
            grads.append(float(task.net.weight.grad))

    class Probe(Line):
        def loss(self, outputs, targets):  # d(loss)/dw = 1 for every micro-batch
            return self.net.weight.sum()

    fit(Probe(n=8, batch_size=2), max_epochs=1, accumulate_grad_batches=3, callbacks=[Grad()])
    # 3 * (1/3), then 1 * (1/1); Lightning: 1.0, 0.3333
    assert grads == [pytest.approx(1.0), pytest.approx(1.0)]


def test_the_step_s_gradients_are_there_at_batch_end_and_zeroed_before_the_next_forward():
    # Lightning zeroes the gradients before a group's forward (its closure), not after
    # optimizer.step(): on_train_batch_end sees the gradients of the step that just ran; the next
    # batch's start from zero.
    seen = []

    class Grads(Callback):
        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
            seen.append(float(task.net.weight.grad))

    class Probe(Line):
        # d(loss)/dw = batch_idx + 1, so stale gradients would show
        def loss(self, outputs, targets):
            return self.net.weight.sum() * (float(targets[0]) // 2 + 1)

    fit(Probe(n=8, batch_size=2, lr=0.0), max_epochs=1, callbacks=[Grads()])
    assert seen == [1.0, 2.0, 3.0, 4.0]


def test_overfit_batches_validates_on_the_training_batches():
    # Lightning validates on the first overfit_batches of the validation loader (x = 100..103 here).
    seen = []

    class Seen(Line):
        def loss(self, outputs, targets):
            if not torch.is_grad_enabled():
                seen.append(float(targets.max()))
            return super().loss(outputs, targets)

    fit(Seen(), max_epochs=1, overfit_batches=2)
    assert seen == [1.0, 3.0]


def test_max_steps_mid_epoch_stays_in_that_epoch():
    # Lightning: current_epoch 1 and epoch=0-step=7.ckpt; taskfit keeps the epoch open (an exact
    # mid-epoch resume)
    trainer, _ = fit(max_steps=7, max_epochs=5)
    assert (trainer.state.epoch, trainer.state.batches_done, trainer.state.global_step) == (0, 7, 7)


# ---- randomness as Lightning leaves it -----------------------------------------------------------
def test_seed_everything_without_a_seed_reuses_the_exported_one_as_lightning(monkeypatch):
    monkeypatch.delenv("TASKFIT_SEED", raising=False)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    assert seed_everything() == 0  # nothing exported yet: Lightning's 0
    assert seed_everything(42, workers=True) == 42
    first = torch.rand(3)
    assert seed_everything() == 42 and os.environ["PL_GLOBAL_SEED"] == "42"
    assert torch.equal(torch.rand(3), first)


def test_the_sanity_check_does_not_shift_the_random_numbers_of_training():
    class Draws(RegressionTask):
        def __init__(self) -> None:
            super().__init__(val_n=16)
            self.first: torch.Tensor | None = None

        def validation_step(self, batch, batch_idx):
            torch.rand(100)  # a step that draws from the global generator (dropout, sampling...)
            return self.loss(self(batch[0]), batch[1])

        def on_train_start(self) -> None:
            self.first = torch.rand(4)

    drawn = []
    for sanity in (0, 2):
        task = Draws()
        Trainer(
            max_epochs=1,
            limit_train_batches=1,
            num_sanity_val_steps=sanity,
            seed=3,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            logger=False,
        ).fit(task)
        drawn.append(task.first)
    assert torch.equal(drawn[0], drawn[1])


def test_test_and_validate_print_their_results_only_when_verbose(capsys):
    task = RegressionTask(val_n=16)
    task.test_dataloader = task.val_dataloader
    trainer = Trainer(
        max_epochs=1,
        limit_train_batches=1,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(task)
    capsys.readouterr()
    quiet = trainer.test(task, verbose=False)
    assert "Test results" not in capsys.readouterr().out
    loud = trainer.test(task)
    assert "Test results" in capsys.readouterr().out and loud == quiet
    trainer.validate(task, verbose=False)
    assert "Validation results" not in capsys.readouterr().out


def test_lightning_names_for_callbacks_data_modules_and_reductions():
    from taskfit import DataModule
    from taskfit.callbacks import EarlyStopping, ModelCheckpoint, ProgressBar
    from tasks import regression_data

    # (the program logs "peak": its keys only, as Lightning's; no taskfit train/loss_epoch beside
    # them)
    trainer = Trainer(max_epochs=2, callbacks=[EarlyStopping(monitor="peak", patience=5)],
                      enable_model_summary=False, logger=False, num_sanity_val_steps=0)
    assert [type(cb) for cb in trainer.checkpoint_callbacks] == [ModelCheckpoint]
    assert isinstance(trainer.early_stopping_callback, EarlyStopping)
    assert isinstance(trainer.progress_bar_callback, ProgressBar)

    class Peak(RegressionTask):
        def training_step(self, batch, batch_idx):
            loss = self.loss(self(batch[0]), batch[1])
            # Python's max, as Lightning
            self.log("peak", loss, on_step=False, on_epoch=True, reduce_fx=max)
            return loss

    data = DataModule.from_datasets(
        regression_data(32, 4), val_dataset=regression_data(16, 4, seed=1), batch_size=8
    )
    assert len(data.train_dataloader()) == 4 and len(data.val_dataloader()) == 2
    task = Peak()
    trainer.fit(task, datamodule=data)
    assert "peak" in trainer.state.metrics and not task.on_gpu


# ---- names as logged: Lightning's keys everywhere ------------------------------------------------
class LightningNamed(RegressionTask):
    """Written as a Lightning user writes it: names without a stage, a scheduler config's ``name``,
    and the top-level ``"monitor"`` of ``configure_optimizers``' dict (its scheduler is not a
    dict)."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        # constant: ReduceLROnPlateau(patience=0) cuts the rate at every later epoch
        self.log("val_loss", 1.0)
        self.log("val_acc", 0.5)

    def test_step(self, batch, batch_idx):
        self.log("test_acc", 0.25)

    def test_dataloader(self):
        return self.val_dataloader()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.1)
        return {"optimizer": optimizer, "lr_scheduler": plateau, "monitor": "val_loss"}


def test_names_stay_as_logged_in_monitors_metrics_results_and_file_names(tmp_path):
    from taskfit.callbacks import CSVLogger, EarlyStopping, LearningRateMonitor

    checkpoint = ModelCheckpoint(
        monitor="val_loss", filename="{epoch}-{val_loss:.2f}", save_top_k=1
    )
    lr_monitor = LearningRateMonitor()
    trainer = Trainer(
        max_epochs=3,
        default_root_dir=str(tmp_path),
        log_every_n_steps=1,
        callbacks=[
            checkpoint,
            EarlyStopping(monitor="val_acc", mode="max", patience=5),
            lr_monitor,
        ],
        **{**QUIET, "logger": CSVLogger()},
    )
    task = LightningNamed(n=16, batch_size=8, val_n=8)
    trainer.fit(task)
    # the top-level monitor named val_loss (not val/loss, which this task never logs): two cuts
    # after epochs 2, 3
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.001)
    assert {"train_loss", "val_loss", "val_acc", "lr-SGD"} <= set(trainer.callback_metrics)
    # nothing renamed
    assert not any(key.startswith(("val/", "test/")) for key in trainer.callback_metrics)
    assert os.path.basename(checkpoint.best_model_path) == "epoch=0-val_loss=1.00.ckpt"
    assert lr_monitor.lrs["lr-SGD"][0] == pytest.approx(0.1)
    # Lightning 2.6.6: [{'test_acc': 0.25}]
    assert trainer.test(task, verbose=False) == [{"test_acc": 0.25}]


def test_a_training_step_returning_none_skips_the_batch_and_validation_step_none_turns_validation_off():
    class SkipsOdd(RegressionTask):
        def training_step(self, batch, batch_idx):
            if batch_idx % 2:
                # Lightning: no backward for this batch (the optimizer steps on no gradient)
                return None
            return self.loss(self(batch[0]), batch[1])

    task = SkipsOdd(n=32, batch_size=8, val_n=8)
    task.validation_step = None  # Lightning's way to turn validation off
    trainer = Trainer(max_epochs=2, **{**QUIET, "num_sanity_val_steps": 2})
    trainer.fit(task)
    # Lightning 2.6.6 gives 8: a skipped batch still counts its (gradient-free) optimizer step, so a
    # step-bounded loop such as lr_find's ends
    assert trainer.state.global_step == 8
    assert trainer.num_val_batches == [] and not any(
        key.startswith("val/") for key in trainer.callback_metrics
    )


class SkipsSome(TaskModule):
    """A Linear(4, 1) on 8 batches of 4, SGD(lr=0.1) halved by StepLR every step; ``training_step``
    returns None for the batches in ``skip``."""

    def __init__(self, skip: tuple[int, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.skip = torch.nn.Linear(4, 1), skip

    def training_step(self, batch, batch_idx):
        if batch_idx in self.skip:
            return None
        return torch.nn.functional.mse_loss(self.net(batch[0]).squeeze(-1), batch[1])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(
            torch.randn(32, 4, generator=generator), torch.randn(32, generator=generator)
        )
        return DataLoader(data, batch_size=4)


# Lightning 2.6.6 on SkipsSome (a LightningModule of the same code; `pip install lightning==2.6.6`,
# one epoch, Trainer(accumulate_grad_batches=k)): (k, skipped batches) -> global_step, the final
# rate, weight and bias. A batch whose training_step returns None has no backward but counts toward
# its accumulation group: the group's last batch steps the optimizer with the gradients the group
# has (none: no weight changes) and the scheduler, and the step counts (k=1 included).
NONE_STEPS = [
    (
        1,
        (),
        8,
        0.000390625,
        [-0.0695619136095047, 0.03545308858156204, -0.30139395594596863, -0.03182391822338104],
        -0.15611332654953003,
    ),
    (
        1,
        (3,),
        8,
        0.000390625,
        [-0.05940042436122894, 0.03703375533223152, -0.3157360255718231, -0.03988027200102806],
        -0.16201573610305786,
    ),
    (
        2,
        (),
        4,
        0.00625,
        [-0.073252834379673, 0.008587642572820187, -0.29520362615585327, -0.06290535628795624],
        -0.11019720137119293,
    ),
    (
        2,
        (2,),
        4,
        0.00625,
        [-0.06301424652338028, 0.06446249037981033, -0.33587557077407837, -0.10651960968971252],
        -0.08321693539619446,
    ),
    (
        2,
        (3,),
        4,
        0.00625,
        [-0.050580330193042755, 0.008814655244350433, -0.3318178951740265, -0.09438016265630722],
        -0.12591451406478882,
    ),
    (
        2,
        (2, 3),
        4,
        0.00625,
        [-0.04034174606204033, 0.064689502120018, -0.3724898099899292, -0.1379944235086441],
        -0.09893424063920975,
    ),
    (
        3,
        (6, 7),
        3,
        0.0125,
        [-0.07516131550073624, 0.019263090565800667, -0.2805812954902649, -0.10296396166086197],
        -0.1520356386899948,
    ),
]


@pytest.mark.parametrize(
    "k, skip, steps, lr, weight, bias",
    NONE_STEPS,
    ids=[f"k{k}-skip{'-'.join(map(str, skip)) or 'none'}" for k, skip, *_ in NONE_STEPS],
)
def test_a_training_step_returning_none_counts_toward_accumulation_as_lightning(
    k, skip, steps, lr, weight, bias
):
    task = SkipsSome(skip)
    trainer = Trainer(max_epochs=1, accumulate_grad_batches=k, **QUIET)
    trainer.fit(task)
    assert trainer.state.global_step == steps
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(lr)
    assert task.net.weight.flatten().tolist() == pytest.approx(weight, abs=1e-7)
    assert task.net.bias.item() == pytest.approx(bias, abs=1e-7)


def test_a_16_mixed_group_ending_in_none_counts_its_step_without_stepping_the_optimizer():
    """Lightning's MixedPrecision.optimizer_step (read in its source: 16-mixed is refused on the
    CPU, where these tests run) neither unscales nor steps after a stepping batch whose
    training_step returned None, even when the group's earlier batches have gradients: the group [2,
    3] with batch 3 skipped changes no weight, as with both skipped; the step counts and the
    scheduler steps."""
    def fit(skip):
        task = SkipsSome(skip)
        trainer = Trainer(max_epochs=1, accumulate_grad_batches=2, precision="16-mixed", **QUIET)
        trainer.fit(task)
        return trainer, torch.cat([p.detach().flatten() for p in task.parameters()])

    (trainer, last_skipped), (_, both_skipped), (unskipped, _) = fit((3,)), fit((2, 3)), fit(())
    assert torch.equal(last_skipped, both_skipped)
    # as many steps and scheduler steps as without a skip (the GradScaler's overflow skips aside)
    assert trainer.state.global_step == unskipped.state.global_step == 4
    rate = unskipped.optimizers[0].param_groups[0]["lr"]
    assert trainer.optimizers[0].param_groups[0]["lr"] == rate < 0.1


def test_callback_metrics_after_test_hold_the_tests_values_only():
    trainer = Trainer(max_epochs=1, **QUIET)
    task = RegressionTask(n=16, batch_size=8, val_n=8)
    trainer.fit(task)
    assert "train/loss_epoch" in trainer.callback_metrics
    trainer.test(task, dataloaders=task.val_dataloader(), verbose=False)
    assert set(trainer.callback_metrics) == {"test/loss"}  # Lightning: the stage's values only


def test_several_evaluation_loaders_run_in_turn_with_dataloader_idx_as_lightning():
    """Two validation, test and predict loaders (x = 0..7 and 100..107 in batches of 4); the values
    Lightning 2.6.6 gave for the same program are in the asserts."""
    from torch.utils.data import DataLoader, TensorDataset

    def loader(start):
        x = torch.arange(start, start + 8, dtype=torch.float32).unsqueeze(1)
        return DataLoader(TensorDataset(x, x * 2), batch_size=4)

    seen = []

    class Two(Line):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            seen.append((batch_idx, dataloader_idx))
            self.log("val_x", batch[0].mean())

        def test_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("test_x", batch[0].mean())

        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            return batch[0].sum() + 100 * dataloader_idx

        def val_dataloader(self):
            return [loader(0), loader(100)]

    trainer = Trainer(max_epochs=1, **{**QUIET, "num_sanity_val_steps": 1, "limit_val_batches": 1})
    task = Two()
    trainer.fit(task)
    # the sanity check's batch of each, then the validation's
    assert seen == [(0, 0), (0, 1), (0, 0), (0, 1)]
    assert trainer.num_val_batches == [1, 1]
    assert {k: v for k, v in trainer.state.metrics.items() if "dataloader_idx" in k} == {
        "val_x/dataloader_idx_0": 1.5, "val_x/dataloader_idx_1": 101.5}
    assert trainer.validate(task, verbose=False) == [
        {"val_x/dataloader_idx_0": 1.5},
        {"val_x/dataloader_idx_1": 101.5},
    ]
    assert trainer.test(task, dataloaders=[loader(0), loader(100)], verbose=False) == [
        {"test_x/dataloader_idx_0": 3.5}, {"test_x/dataloader_idx_1": 103.5}]
    predictions = trainer.predict(task, dataloaders={"a": loader(0), "b": loader(100)})
    assert [[float(x) for x in part] for part in predictions] == [[6.0, 22.0], [506.0, 522.0]]


def test_fast_dev_run_gives_a_logger_that_takes_every_call_and_writes_nothing(tmp_path):
    from taskfit.callbacks import LearningRateMonitor

    class Images(RegressionTask):
        def training_step(self, batch, batch_idx):
            # Lightning code
            self.logger.experiment.add_image("x", torch.zeros(1, 2, 2), self.global_step)
            return self.loss(self(batch[0]), batch[1])

    trainer = Trainer(
        fast_dev_run=2,
        default_root_dir=str(tmp_path),
        callbacks=[LearningRateMonitor()],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Images(n=16, batch_size=4, val_n=8))
    assert trainer.state.global_step == 2 and type(trainer.logger).__name__ == "DummyLogger"
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_lightning_1_training_step_with_optimizer_idx_is_explained_before_training():
    from taskfit import TaskModuleError

    class Old(RegressionTask):
        def training_step(self, batch, batch_idx, optimizer_idx):
            return self.loss(self(batch[0]), batch[1])

    with pytest.raises(TaskModuleError, match=r"training_step takes `optimizer_idx`: Lightning "
                                              r"1\.x's way(?s:.*)automatic_optimization = False"):
        Trainer(max_epochs=1, **QUIET).fit(Old(n=16))


def test_save_hyperparameters_takes_a_namespace():
    import argparse

    class FromArgs(RegressionTask):
        def __init__(self, args: argparse.Namespace) -> None:
            super().__init__()
            self.save_hyperparameters(args)

    assert dict(FromArgs(argparse.Namespace(lr=0.3, depth=2)).hparams) == {"lr": 0.3, "depth": 2}


def test_submodules_in_eval_mode_stay_so_through_fit_validation_and_predict():
    seen = []

    class Frozen(RegressionTask):
        def training_step(self, batch, batch_idx):
            seen.append((self.net[0].training, self.net[1].training))
            return self.loss(self(batch[0]), batch[1])

    task = Frozen(n=16, batch_size=8, val_n=8)
    task.net[0].eval()  # e.g. a frozen BatchNorm or Dropout while fine-tuning
    with pytest.warns(UserWarning, match=r"1 submodule\(s\) of Frozen are in eval mode at the "
                                         r"start of training \(net\.0\); they stay in eval mode "
                                         r"through fit, as in Lightning 2\.6"):
        trainer = Trainer(max_epochs=2, **{**QUIET, "num_sanity_val_steps": 1})
        trainer.fit(task)
    assert seen == [(False, True)] * 4  # after the sanity check and each validation too
    trainer.predict(task, dataloaders=task.val_dataloader())
    assert (task.net[0].training, task.net[1].training, task.training) == (False, True, True)

    # all of it, as load_from_checkpoint returns a task: trained in train mode, with a warning
    task.eval()
    seen.clear()
    with pytest.warns(UserWarning, match=r"Frozen was in eval mode \(task.eval\(\), or "
                                         r"load_from_checkpoint\) when fit started, so fit put it "
                                         r"in train mode"):
        Trainer(max_epochs=1, **QUIET).fit(task)
    assert seen == [(True, True)] * 2


def test_a_key_logged_in_training_step_and_again_in_an_epoch_hook_is_two_values_as_lightning():
    class Twice(RegressionTask):
        def training_step(self, batch, batch_idx):
            loss = self.loss(self(batch[0]), batch[1])
            self.log("k", 2.0)  # per step (training's default)
            return loss

        def on_train_epoch_end(self):
            self.log("k", 7.0)  # an epoch value under the same name: Lightning keys them by hook

    trainer = Trainer(max_epochs=1, log_every_n_steps=1, **QUIET)
    trainer.fit(Twice(n=16, batch_size=8))
    assert trainer.callback_metrics["k"] == 7.0  # the later one, as Lightning's callback_metrics


def test_state_status_finished_and_interrupted_as_lightning():
    trainer = Trainer(max_epochs=1, **QUIET)
    assert trainer.state.status == "initializing" and not trainer.state.finished
    trainer.fit(RegressionTask(n=16))
    assert trainer.state.finished and not trainer.interrupted

    class Fails(RegressionTask):
        def training_step(self, batch, batch_idx):
            raise ValueError("boom")

    # (this Trainer's epoch is done: its next fit would train nothing)
    trainer = Trainer(max_epochs=1, **QUIET)
    with pytest.raises(ValueError, match="boom"):
        trainer.fit(Fails(n=16))
    assert (
        trainer.state.status == "interrupted" and trainer.interrupted and not trainer.state.finished
    )


class StopOnce(Callback):
    """should_stop at the end of the first epoch of the first fit only (an EarlyStopping that
    fired)."""

    def __init__(self):
        self.armed = True

    def on_train_epoch_end(self, trainer, task):
        if self.armed:
            trainer.should_stop, self.armed = True, False


# Lightning 2.6.6, one Trainer fitted three times (9 batches per epoch; between the 2nd and 3rd fit
# the limit is raised to max_epochs=4 / max_steps=12): (global_step, current_epoch) after each fit.
# Its fit loop keeps its progress: a fit with nothing left returns at once ("`Trainer.fit` stopped:
# `max_epochs=3` reached.") with callback_metrics emptied, one after should_stop continues where it
# stopped.
LIGHTNING_FITS_AGAIN = {
    "max_epochs": [(27, 3), (27, 3), (36, 4)],
    "should_stop": [(9, 1), (27, 3), (36, 4)],
    "max_steps": [(7, 1), (7, 1), (12, 2)],
}


@pytest.mark.parametrize("case", sorted(LIGHTNING_FITS_AGAIN))
def test_a_second_fit_continues_the_trainers_counters_and_returns_at_once_when_done(case, capsys):
    limits = {"max_steps": 7} if case == "max_steps" else {"max_epochs": 3}
    trainer = Trainer(**QUIET, **limits, callbacks=[StopOnce()] if case == "should_stop" else [])
    task, seen = Line(), []
    for fit_number in range(3):
        if fit_number == 2:
            trainer.max_epochs, trainer.max_steps = (4, None) if case != "max_steps" else (None, 12)
        before = task.net.weight.detach().clone()
        trainer.fit(task)
        seen.append((trainer.global_step, trainer.current_epoch))
        # nothing left to train: Lightning's early return
        if fit_number == 1 and case != "should_stop":
            assert torch.equal(before, task.net.weight) and trainer.callback_metrics == {}
            assert (
                f"`Trainer.fit` stopped: `{case}={limits[case]}` reached."
                in capsys.readouterr().out
            )
    expected = LIGHTNING_FITS_AGAIN[case]
    # a mid-epoch stop keeps its epoch in taskfit (the guide's table): 0, 0, 1
    if case == "max_steps":
        expected = [(step, epoch - 1) for step, epoch in expected]
    assert seen == expected


def test_a_second_fit_with_nothing_left_writes_no_new_run_folder(tmp_path):
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.fit(RegressionTask(n=16))
    first = trainer.log_dir
    trainer.fit(RegressionTask(n=16))  # a new task too: the Trainer's fit is over, as Lightning's
    assert trainer.log_dir == first and sorted(os.listdir(tmp_path)) == ["version_0"]


def test_lightnings_bug_report_template_runs_with_its_imports_changed(tmp_path):
    """Lightning's BoringModel bug-report program, only the imports changed; Lightning 2.6.6 on the
    same seed returned [{'test_loss': 2.1341631412506104}] and callback_metrics ['test_loss']."""
    from taskfit import TaskModule as LightningModule
    from torch.utils.data import DataLoader, Dataset

    class RandomDataset(Dataset):
        def __init__(self, size, length):
            self.len = length
            self.data = torch.randn(length, size)

        def __getitem__(self, index):
            return self.data[index]

        def __len__(self):
            return self.len

    class BoringModel(LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(32, 2)

        def forward(self, x):
            return self.layer(x)

        def training_step(self, batch, batch_idx):
            loss = self(batch).sum()
            self.log("train_loss", loss)
            return {"loss": loss}

        def validation_step(self, batch, batch_idx):
            loss = self(batch).sum()
            self.log("valid_loss", loss)

        def test_step(self, batch, batch_idx):
            loss = self(batch).sum()
            self.log("test_loss", loss)

        def configure_optimizers(self):
            return torch.optim.SGD(self.layer.parameters(), lr=0.1)

    torch.manual_seed(0)
    train_data = DataLoader(RandomDataset(32, 64), batch_size=2)
    val_data = DataLoader(RandomDataset(32, 64), batch_size=2)
    test_data = DataLoader(RandomDataset(32, 64), batch_size=2)
    model = BoringModel()
    trainer = Trainer(
        default_root_dir=str(tmp_path),
        limit_train_batches=1,
        limit_val_batches=1,
        limit_test_batches=1,
        num_sanity_val_steps=0,
        max_epochs=1,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, train_dataloaders=train_data, val_dataloaders=val_data)
    assert trainer.test(model, dataloaders=test_data, verbose=False) == [
        {"test_loss": pytest.approx(2.1341631412506104, abs=1e-6)}
    ]
    assert sorted(trainer.callback_metrics) == ["test_loss"]
