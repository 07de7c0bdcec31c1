"""The batch size finder (callbacks/batch_size_finder.py, taskfit.tools.Tuner): real fits on the CPU
whose model runs out of memory above a batch size (its forward raises torch's "CUDA out of memory."
message there), the size found for each mode, the task, its optimizer and scheduler and the RNGs put
back after the search (a fit after ``scale_batch_size`` is bit for bit the fit at that size without
it), the callback searching at the start of each entry point, and each bad input's one error.
Lightning's expected values come from its own tests
(tests_pytorch/tuner/test_scale_batch_size.py)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from taskfit import DataModule, MisconfigurationError, Trainer, seed_everything
from taskfit.callbacks import BatchSizeFinder, Callback
from taskfit.callbacks.batch_size_finder import is_oom_error, search
from taskfit.tools import Tuner
from tasks import ClassifierTask, classification_data, same_state
from test_cli import _env, taskfit

QUIET = dict(
    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False
)


class Bounded(ClassifierTask):
    """A classifier whose memory holds at most ``limit`` samples per batch: a larger batch raises
    what torch raises when CUDA runs out of memory. Counts the batch sizes its forward saw."""

    def __init__(self, limit: int = 40, batch_size: int = 4, n: int = 256) -> None:
        super().__init__(n=n, val_n=96, batch_size=batch_size)
        self.limit, self.seen = limit, []

    def forward(self, inputs):
        self.seen.append(inputs.shape[0])
        if inputs.shape[0] > self.limit:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB "
                               "total capacity)")
        return super().forward(inputs)

    def predict_dataloader(self):
        return DataLoader(self.val_data, batch_size=self.batch_size)


def test_search_doubles_then_bisects_below_the_bound():
    tried = []

    def trial(size):
        tried.append(size)
        return size <= 20

    said = []
    common = dict(init_val=2, max_trials=25, max_val=8192, data_length=None, say=said.append)
    assert search(trial, mode="power", margin=0.0, **common) == 16
    assert tried == [2, 4, 8, 16, 32]
    tried.clear()
    # bisects between 16 (ran) and 32 (failed) down to 20, then 5% below it
    assert search(trial, mode="binsearch", margin=0.05, **common) == 19
    assert tried == [2, 4, 8, 16, 32, 24, 20, 22, 21]
    assert said[-1] == "Applying margin of 5.0%, reducing batch size from 20 to 19"


@pytest.mark.parametrize(("mode", "expected"), [("power", 62), ("binsearch", 95)])
def test_search_from_above_the_bound_matches_lightning(mode, expected):
    """Lightning's test_dataloader_batch_size_updated_on_failure: from 500, everything above 100
    fails."""
    assert (
        search(
            lambda size: size <= 100,
            mode=mode,
            init_val=500,
            max_trials=10,
            max_val=8192,
            margin=0.05,
            data_length=1000,
            say=lambda _: None,
        )
        == expected
    )


@pytest.mark.parametrize(("kwargs", "expected"), [
    (dict(mode="power", max_trials=3), 8), (dict(mode="binsearch", max_trials=3), 7),
    (dict(mode="power", max_trials=0), 2), (dict(mode="power", max_trials=25, max_val=8), 8),
    (dict(mode="power", max_trials=25, data_length=64), 64)])
def test_search_limits(kwargs, expected):
    """max_trials counts the trials that ran; no size passes max_val nor grows past the dataset's
    length."""
    kwargs = {"init_val": 2, "max_val": 8192, "margin": 0.05, "data_length": None, **kwargs}
    assert search(lambda size: True, say=lambda _: None, **kwargs) == expected


def test_is_oom_error_knows_the_messages():
    assert is_oom_error(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert is_oom_error(RuntimeError("CUDA error: out of memory"))
    assert is_oom_error(RuntimeError("[enforce fail at alloc_cpu.cpp:83] DefaultCPUAllocator: "
                                     "can't allocate memory"))
    assert is_oom_error(torch.cuda.OutOfMemoryError("CUDA out of memory."))
    assert not is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_oom_error(ValueError("out of memory"))


@pytest.mark.parametrize(("mode", "expected"), [("power", 32), ("binsearch", 38)])
def test_tuner_finds_the_largest_size_that_fits(mode, expected, tmp_path, capsys):
    task = Bounded(limit=40)
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    found = Tuner(trainer).scale_batch_size(task, mode=mode, steps_per_trial=2)
    assert found == expected == task.batch_size == task.hparams.batch_size
    assert trainer.train_dataloader.batch_size == trainer.val_dataloaders.batch_size == expected
    assert max(task.seen) > 40  # a trial did run out of memory
    assert trainer.global_step == 0 and trainer.current_epoch == 0
    assert not list(tmp_path.iterdir())  # nothing written
    assert "Batch size 32 succeeded, trying batch size 64" in capsys.readouterr().out
    # the Trainer fits at that size afterwards
    task.seen.clear()
    trainer.fit(task)
    assert set(task.seen) == {expected, 256 % expected, 96 % expected} - {0}
    assert trainer.global_step == -(-256 // expected)


@pytest.mark.parametrize("fn", ["fit", "validate", "test", "predict"])
def test_the_tuner_leaves_the_trainer_as_it_was(fn, tmp_path):
    """Lightning's test_trainer_reset_correctly and test_tuner_with_evaluation_methods through the
    public API: the callbacks, loggers, limits and counters as before, the weights too, nothing
    written; 4 trials: 2 ** 4."""
    task = Bounded(limit=1000)
    trainer = Trainer(
        max_epochs=1, max_steps=50, limit_val_batches=0.5, default_root_dir=str(tmp_path)
    )
    names = [
        "callbacks",
        "loggers",
        "global_step",
        "current_epoch",
        "max_steps",
        "max_epochs",
        "limit_train_batches",
        "limit_val_batches",
        "limit_test_batches",
        "limit_predict_batches",
    ]
    before, weights = (
        {n: copy.copy(getattr(trainer, n)) for n in names},
        copy.deepcopy(task.state_dict()),
    )
    assert Tuner(trainer).scale_batch_size(task, max_trials=4, method=fn) == task.batch_size == 16
    assert {n: getattr(trainer, n) for n in names} == before
    assert same_state(weights, task.state_dict())
    assert not list(tmp_path.iterdir())


class KeepsItsOptimizer(Bounded):
    """Builds its optimizer and scheduler once (momentum: optimizer state), with dropout (RNG in
    every step)."""

    def __init__(self) -> None:
        super().__init__(limit=40)
        self.net.insert(1, torch.nn.Dropout(0.3))
        self.opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 2, gamma=0.5)

    def configure_optimizers(self):
        return {
            "optimizer": self.opt,
            "lr_scheduler": {"scheduler": self.sched, "interval": "step"},
        }


@pytest.mark.parametrize("cls", [Bounded, KeepsItsOptimizer])
def test_a_fit_after_the_search_is_bitwise_the_fit_at_that_size(cls, tmp_path):
    """Unseeded Trainer: shuffling and dropout draw from the global RNG, which the search must put
    back, with the weights, the modules' modes and an optimizer/scheduler the task keeps between
    fits."""
    def fit(find: bool):
        seed_everything(0)
        task = cls()
        trainer = Trainer(max_epochs=2, default_root_dir=str(tmp_path), **QUIET)
        if find:
            before = copy.deepcopy(task.state_dict())
            assert Tuner(trainer).scale_batch_size(task, mode="binsearch", steps_per_trial=2) == 38
            assert same_state(before, task.state_dict()) and task.training
        else:
            task.batch_size = 38
        return task, trainer.fit(task), torch.rand(3)

    plain, found = fit(False), fit(True)
    assert same_state(plain[0].state_dict(), found[0].state_dict())
    assert plain[1] == found[1]  # every logged value
    assert torch.equal(plain[2], found[2])  # the global RNG after the fit
    if cls is KeepsItsOptimizer:
        assert same_state(plain[0].opt.state_dict(), found[0].opt.state_dict())
        assert plain[0].sched.state_dict() == found[0].sched.state_dict()


def test_the_callback_searches_at_fit_start_then_fits_at_that_size(tmp_path):
    task = Bounded(limit=40)
    finder = BatchSizeFinder(max_trials=10, steps_per_trial=1)
    trainer = Trainer(max_epochs=2, default_root_dir=str(tmp_path), callbacks=[finder], **QUIET)
    trainer.fit(task)
    assert finder.optimal_batch_size == task.batch_size == 32
    # the fit's counters are the fit's alone: 2 epochs of ceil(256 / 32) steps
    assert trainer.global_step == 16 and trainer.current_epoch == 2
    # 96 / 32: the validation loader is rebuilt too, with its limit
    assert trainer.num_val_batches == [3]


class SearchEachEpoch(BatchSizeFinder):
    """Lightning's documented variant: search at every epoch's start instead of the fit's (e.g.
    after unfreezing a backbone); records each training batch's size by epoch."""

    def on_fit_start(self, trainer, task):
        self.sizes = {}

    def on_train_epoch_start(self, trainer, task):
        self.scale_batch_size(trainer, task)

    def on_train_batch_start(self, trainer, task, batch, batch_idx):
        self.sizes.setdefault(trainer.current_epoch, []).append(batch[0].shape[0])


def test_a_search_at_each_epoch_start_changes_that_epochs_batches(tmp_path):
    class Shrink(Callback):
        def on_train_epoch_end(self, trainer, task):
            # the next epoch needs more memory per sample (the trials run no callback)
            task.limit = 20

    finder = SearchEachEpoch(steps_per_trial=1)
    trainer = Trainer(
        max_epochs=2, default_root_dir=str(tmp_path), callbacks=[finder, Shrink()], **QUIET
    )
    trainer.fit(Bounded(limit=40))
    assert finder.sizes == {0: [32] * 8, 1: [16] * 16}
    assert trainer.global_step == 24


@pytest.mark.parametrize("fn", ["validate", "test", "predict"])
def test_the_callback_searches_before_an_evaluation(fn, tmp_path):
    task = Bounded(limit=40)
    finder = BatchSizeFinder(mode="binsearch", margin=0.0, steps_per_trial=1)
    trainer = Trainer(default_root_dir=str(tmp_path), callbacks=[finder], **QUIET)
    task.seen.clear()
    result = getattr(trainer, fn)(task)
    assert finder.optimal_batch_size == task.batch_size == 40
    loader = getattr(trainer, {"validate": "val_dataloaders"}.get(fn, f"{fn}_dataloaders"))
    assert loader.batch_size == 40
    if fn == "predict":
        assert [len(p) for p in result] == [40, 40, 16]
    else:
        assert result[0]  # the pass ran, at the size found
    assert task.seen[-3:] == [40, 40, 16]


class SizedData(DataModule):
    """A data module holding the batch size in its hparams (Lightning's save_hyperparameters
    route)."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()

    def train_dataloader(self):
        return DataLoader(classification_data(128), batch_size=self.hparams.batch_size)

    def val_dataloader(self):
        return DataLoader(classification_data(32, seed=1), batch_size=self.hparams.batch_size)


def test_a_datamodule_holds_the_size(tmp_path):
    class NoSize(Bounded):
        def __init__(self):
            super().__init__(limit=24)
            del self.batch_size

    task, data = NoSize(), SizedData()
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    assert Tuner(trainer).scale_batch_size(task, datamodule=data, max_trials=3) == 8
    assert (
        data.hparams.batch_size == 8
        and trainer.datamodule is data
        and trainer.train_dataloader.batch_size == 8
    )
    assert Tuner(trainer).scale_batch_size(task, datamodule=data) == 16  # 32 ran out of memory


def test_the_trials_run_none_of_the_tasks_callbacks(tmp_path):
    """configure_callbacks() joins the real run only (a ModelCheckpoint there would write in every
    trial)."""
    starts = []

    class Spy(Callback):
        def on_fit_start(self, trainer, task):
            starts.append(trainer.global_step)

    class WithCallbacks(Bounded):
        def configure_callbacks(self):
            return [Spy()]

    trainer = Trainer(
        max_epochs=1,
        default_root_dir=str(tmp_path),
        callbacks=[BatchSizeFinder(max_trials=3)],
        **QUIET,
    )
    trainer.fit(WithCallbacks())
    assert starts == [0] and trainer.global_step == 256 // 8


def test_an_error_that_is_not_out_of_memory_is_raised_and_the_size_put_back(tmp_path):
    class Broken(Bounded):
        def forward(self, inputs):
            if inputs.shape[0] >= 8:
                raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
            return super().forward(inputs)

    task = Broken()
    trainer = Trainer(
        max_epochs=1, default_root_dir=str(tmp_path), callbacks=[BatchSizeFinder()], **QUIET
    )
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        trainer.fit(task)
    assert task.batch_size == 4 and task.trainer is None


def test_fast_dev_run_skips_the_search(tmp_path):
    trainer = Trainer(fast_dev_run=True, default_root_dir=str(tmp_path), **QUIET)
    with pytest.warns(UserWarning, match="Skipping batch size scaler since `fast_dev_run` is "
                                         "enabled"):
        assert Tuner(trainer).scale_batch_size(Bounded()) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(mode="linear"), r"`mode` should be either of \('power', 'binsearch'\)"),
        (
            dict(steps_per_trial=0),
            r"BatchSizeFinder\(steps_per_trial=0\) is not valid.\n  HINT: pass "
            r"an integer >= 1",
        ),
        (dict(init_val=2.5), r"BatchSizeFinder\(init_val=2.5\) is not valid"),
        (
            dict(margin=1.0),
            r"`margin` should be between 0 and 1.\n  HINT: pass a fraction in \[0, 1\)",
        ),
        (dict(batch_arg_name=""), r"batch_arg_name=''\) is not valid"),
        (
            dict(method="prediction"),
            r"method 'prediction' is invalid. Should be one of \('fit', "
            r"'validate'",
        ),
        (
            dict(method="validate", train_dataloaders=[1]),
            "please consider setting `dataloaders` instead",
        ),
        (
            dict(dataloaders=[1]),
            "please consider setting `train_dataloaders` and `val_dataloaders` instead",
        ),
    ],
)
def test_bad_arguments_fail_before_any_work(kwargs, message, tmp_path):
    task = Bounded()
    with pytest.raises(MisconfigurationError, match=message):
        Tuner(Trainer(default_root_dir=str(tmp_path), **QUIET)).scale_batch_size(task, **kwargs)
    assert task.seen == []


def test_what_the_finder_cannot_search_says_so(tmp_path):
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    task = Bounded()
    with pytest.raises(MisconfigurationError, match=r"cannot be used with dataloaders passed "
                                                    r"directly to `.fit\(\)`: their batch size is "
                                                    r"fixed"):
        Tuner(trainer).scale_batch_size(task, train_dataloaders=task.train_dataloader())
    with pytest.raises(MisconfigurationError, match=r"Field bs not found in `model`, `datamodule`, "
                                                    r"nor their `hparams` attributes.*\n  HINT: "
                                                    r"give the task"):
        Tuner(trainer).scale_batch_size(task, batch_arg_name="bs")

    class TwoValLoaders(Bounded):
        def val_dataloader(self):
            return [super().val_dataloader(), super().val_dataloader()]

    with pytest.raises(MisconfigurationError, match="cannot be used with multiple val dataloaders: "
                                                    "2 loaders"):
        Tuner(trainer).scale_batch_size(TwoValLoaders(), method="validate")
    with pytest.raises(MisconfigurationError, match="Trainer is already configured with a "
                                                    "`BatchSizeFinder`"):
        Tuner(Trainer(callbacks=[BatchSizeFinder()], **QUIET)).scale_batch_size(task)
    with pytest.raises(MisconfigurationError, match="not supported with distributed strategies"):
        BatchSizeFinder().setup(
            Trainer(devices=2, strategy="ddp", accelerator="cpu", **QUIET), task
        )
    with pytest.raises(MisconfigurationError, match="even batch size 1 ran out of memory"):
        Tuner(trainer).scale_batch_size(Bounded(limit=0))
    assert trainer.callbacks == []  # the Tuner's finder left with the run


def test_an_attribute_and_hparams_that_disagree_warn(tmp_path):
    task = Bounded(batch_size=4)
    task.batch_size = 8  # hparams still say 4
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    with pytest.warns(UserWarning, match=r"`model.batch_size` and `model.hparams.batch_size` are "
                                         r"mutually exclusive! They differ here \(8 and 4\)"):
        assert Tuner(trainer).scale_batch_size(task, max_trials=2) == 4
    assert task.batch_size == task.hparams.batch_size == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Tuner(trainer).scale_batch_size(task, max_trials=1)  # they agree now: no warning


def test_reload_dataloaders_outside_a_run_or_mid_epoch_says_so(tmp_path):
    with pytest.raises(MisconfigurationError, match=r"reload_dataloaders\(\) was called outside a "
                                                    r"run"):
        Trainer(**QUIET).reload_dataloaders()

    class SearchMidEpoch(BatchSizeFinder):
        def on_fit_start(self, trainer, task):
            pass

        def on_train_batch_start(self, trainer, task, batch, batch_idx):
            if batch_idx == 2:
                self.scale_batch_size(trainer, task)

    class ReloadMidEpoch(Callback):
        def on_train_batch_start(self, trainer, task, batch, batch_idx):
            if batch_idx == 3:
                trainer.reload_dataloaders()

    task = Bounded()
    trainer = Trainer(
        max_epochs=1,
        default_root_dir=str(tmp_path),
        callbacks=[SearchMidEpoch(max_trials=2)],
        **QUIET,
    )
    with pytest.raises(MisconfigurationError, match=r"BatchSizeFinder cannot search in the middle "
                                                    r"of a training epoch \(after its batch 1, "):
        trainer.fit(task)
    assert not [size for size in task.seen if size != 4]  # no trial ran
    trainer = Trainer(
        max_epochs=1, default_root_dir=str(tmp_path), callbacks=[ReloadMidEpoch()], **QUIET
    )
    with pytest.raises(MisconfigurationError, match=r"reload_dataloaders\(\) was called in the "
                                                    r"middle of a training epoch \(after its batch "
                                                    r"2, "):
        trainer.fit(task)


def test_the_command_prints_the_size_and_the_override(tmp_path):
    result = taskfit(
        "mode=scale_batch_size",
        "scale_batch_size.max_trials=3",
        "scale_batch_size.mode=binsearch",
        f"paths.log_dir={tmp_path}",
        "trainer.enable_progress_bar=false",
        cwd=tmp_path,
        env=_env(),
    )
    out = result.stdout
    assert "Batch size 4 succeeded, trying batch size 8" in out
    assert "batch size:      7\n" in out and "use it:          taskfit task.batch_size=7" in out, (
        out
    )
    run_dir = next((tmp_path / "digits" / "runs").iterdir())
    # no training run was started
    assert not any(p.name.startswith("version_") for p in run_dir.iterdir())
