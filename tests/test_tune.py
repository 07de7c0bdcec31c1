"""The learning-rate finder (trainer/tune.py): a fit after lr_find is bit for bit the fit without
it, the suggestion is the steepest descent of the smoothed curve, the curve is in a PNG, TensorBoard
and JSON, ddp ranks (real gloo processes) agree and equal one process with the same global batch,
and `taskfit mode=lr_find` prints the override."""
from __future__ import annotations

import functools
import json
import math
import os
import re

import pytest
import torch
from taskfit import MisconfigurationError, Trainer, seed_everything
from taskfit.tools.lr_finder import LRFinder, lr_find
from tasks import ClassifierTask, RegressionTask, one_process_of_ddp, same_state
from test_cli import _env, read_events, taskfit

QUIET = dict(
    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False
)


class KeepsItsOptimizer(ClassifierTask):
    """Builds its optimizer and scheduler once and returns the same objects from every
    configure_optimizers call, with dropout (RNG in every step) and momentum (optimizer state)."""

    def __init__(self) -> None:
        super().__init__()
        self.net.insert(1, torch.nn.Dropout(0.3))
        self.opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 2, gamma=0.5)

    def configure_optimizers(self):
        return {
            "optimizer": self.opt,
            "lr_scheduler": {"scheduler": self.sched, "interval": "step"},
        }


@pytest.mark.parametrize("cls", [ClassifierTask, KeepsItsOptimizer])
def test_a_fit_after_lr_find_is_bitwise_the_fit_without_it(cls, tmp_path):
    """Unseeded Trainer: the fit draws from the global RNG (shuffle, dropout), which the finder must
    put back, with the weights and an optimizer/scheduler the task keeps between fits."""
    def fit(find: bool):
        seed_everything(0)
        task = cls()
        trainer = Trainer(max_epochs=2, default_root_dir=str(tmp_path), **QUIET)
        if find:
            finder = lr_find(trainer, task, num_training=12, early_stop_threshold=None)
            assert len(finder.results["lr"]) == 12 and not finder.stopped_early
        return task, trainer.fit(task), torch.rand(3)

    plain, found = fit(False), fit(True)
    assert same_state(plain[0].state_dict(), found[0].state_dict())
    assert plain[1] == found[1]  # every logged value
    assert torch.equal(plain[2], found[2])  # the global RNG after the fit
    # the finder wrote its curve only (these fits write nothing)
    assert os.listdir(tmp_path) == ["lr_find"]


def test_curve_png_tensorboard_and_json(tmp_path):
    seed_everything(0)
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    finder = lr_find(trainer, ClassifierTask(), min_lr=1e-4, max_lr=10, num_training=30)
    out = tmp_path / "lr_find" / "version_0"
    assert finder.output_dir == str(out) and finder.png_path == str(out / "lr_find.png")
    lrs = finder.results["lr"]
    # even on a log scale
    assert lrs[0] == pytest.approx(1e-4) and lrs[1] / lrs[0] == pytest.approx(10 ** (5 / 29))
    saved = json.loads((out / "lr_find.json").read_text())
    assert saved["suggestion"] == finder.suggestion() and saved["loss"] == finder.results["loss"]
    from PIL import Image

    with Image.open(out / "lr_find.png") as image:
        assert image.size == (720, 440)
        colors = image.convert("RGB").getcolors(maxcolors=2**16)
        red = sum(n for n, (r, g, b) in colors if r > 200 and g < 60 and b < 60)
        assert red > 50  # the suggestion's dot
    events = read_events(out)
    assert events.Tags()["images"] == ["lr_find/loss_vs_lr"]
    assert [e.value for e in events.Scalars("lr_find/lr")] == pytest.approx(lrs)
    assert [e.value for e in events.Scalars("lr_find/loss_smoothed")] == pytest.approx(
        finder.results["loss"]
    )


def test_suggestion_is_the_steepest_descent_on_the_lr_scale_of_the_range():
    lrs = [10 ** (-6 + i / 4) for i in range(25)]  # 1e-6 .. 1
    losses = (
        [2.0 - 0.001 * i for i in range(12)]
        + [1.9, 1.6, 1.2, 1.0, 0.9, 0.85]
        + [0.84, 1.0, 2, 4, 8, 16, 30]
    )
    finder = LRFinder(
        "exponential",
        1e-6,
        1,
        25,
        {"lr": lrs, "loss": losses, "raw": losses, "stopped_early": False},
    )
    assert finder.suggestion() == lrs[13]  # 1.9 -> 1.6 -> 1.2: the steepest fall per decade
    assert finder.suggestion(skip_begin=0) == lrs[13]
    over_lr = torch.gradient(torch.tensor(losses[:-1], dtype=torch.float64),
                             spacing=[torch.tensor(lrs[:-1], dtype=torch.float64)])[0]
    # over lr itself (Lightning 2.6) the 0.001 steps at 1e-6 would win
    assert int(torch.argmin(over_lr)) == 0
    assert finder.suggestion(skip_begin=24) is None  # fewer than 2 points
    nan = losses[:5] + [math.nan] * 20
    assert (
        LRFinder(
            "linear", 0, 1, 25, {"lr": lrs, "loss": nan, "raw": nan, "stopped_early": True}
        ).suggestion()
        is None
    )


def test_update_attr_sets_the_task_attribute_and_the_optimizer_factory(tmp_path):
    seed_everything(0)
    task = ClassifierTask()
    task.optimizer_factory = None
    object.__setattr__(task, "optimizer_factory", functools.partial(torch.optim.AdamW, lr=3e-3))
    task.configure_optimizers = lambda: task.optimizer_factory(task.parameters())
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    finder = lr_find(trainer, task, num_training=15, update_attr=True)
    assert task.lr == finder.suggestion() == task.optimizer_factory.keywords["lr"]
    with pytest.raises(MisconfigurationError, match=r"lr_find\(attr_name='rate'\): ClassifierTask "
                                                    r"has no such"):
        lr_find(trainer, task, update_attr=True, attr_name="rate")


def test_lr_find_takes_a_datamodule_and_updates_a_learning_rate_kept_in_hparams(tmp_path):
    """Lightning's Tuner.lr_find(model, datamodule=dm): the data from the module, the suggestion
    into self.hparams.lr, which configure_optimizers reads (lightning_setattr)."""
    from taskfit import DataModule

    class FromHparams(RegressionTask):
        def __init__(self, lr: float = 0.5) -> None:
            # RegressionTask's own self.lr is not what configure_optimizers reads here
            super().__init__()
            self.save_hyperparameters()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

        def train_dataloader(self):
            raise AssertionError("the data module's loader is used")

    source = RegressionTask()
    data = DataModule.from_datasets(source.data, batch_size=8)
    task = FromHparams()
    finder = lr_find(
        Trainer(default_root_dir=str(tmp_path), **QUIET),
        task,
        num_training=40,
        update_attr=True,
        datamodule=data,
    )
    assert task.hparams.lr == finder.suggestion() != 0.5


def test_a_loss_that_diverges_to_inf_ends_the_test_without_an_error(tmp_path):
    seed_everything(0)
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    finder = lr_find(
        trainer,
        RegressionTask(),
        min_lr=1e-3,
        max_lr=1e8,
        num_training=40,
        early_stop_threshold=None,
    )
    assert (
        finder.stopped_early
        and not math.isfinite(finder.raw_losses[-1])
        and len(finder.raw_losses) < 40
    )
    assert finder.suggestion() is not None


@pytest.mark.parametrize("kwargs,message", [
    (dict(mode="log"), r"lr_find\(mode='log'\) is not valid"),
    # Lightning takes min_lr > max_lr (a sweep downwards) and num_training=1 (one point, no
    # suggestion)
    (dict(min_lr=0.1, max_lr=0.1), r"lr_find\(min_lr=0.1, max_lr=0.1\) is not a range"),
    (dict(min_lr=0.0, max_lr=0.1), r"lr_find\(min_lr=0.0, max_lr=0.1\) is not a range"),
    (dict(num_training=0), r"lr_find\(num_training=0\) is not valid"),
    (dict(early_stop_threshold=0.5), r"lr_find\(early_stop_threshold=0.5\) is not valid"),
])
def test_bad_arguments_fail_before_any_work(kwargs, message):
    with pytest.raises(MisconfigurationError, match=message):
        lr_find(Trainer(max_epochs=1, **QUIET), ClassifierTask(), **kwargs)


def test_ddp_ranks_agree_and_equal_one_process_with_the_same_global_batch(tmp_path):
    seed_everything(0)
    single = lr_find(Trainer(max_epochs=1, default_root_dir=str(tmp_path / "a"), **QUIET),
                     one_process_of_ddp(ClassifierTask)(batch_size=16),  # ddp's data order, whole
                     num_training=15, early_stop_threshold=None)
    seed_everything(0)
    task = ClassifierTask(batch_size=8)
    before = {k: v.clone() for k, v in task.state_dict().items()}
    ddp = lr_find(Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=1,
                          default_root_dir=str(tmp_path / "b"), **QUIET), task, num_training=15,
                  early_stop_threshold=None)
    assert same_state(task.state_dict(), before)  # the parent's task is untouched
    assert ddp.results["lr"] == single.results["lr"]
    # the mean over ranks = the global batch's
    assert ddp.raw_losses == pytest.approx(single.raw_losses, abs=1e-5)
    assert ddp.suggestion() == single.suggestion()


def test_the_command_prints_the_suggestion_and_the_override(tmp_path):
    result = taskfit(
        "mode=lr_find",
        "lr_find.num_training=30",
        "trainer.max_epochs=1",
        f"paths.log_dir={tmp_path}",
        "trainer.enable_progress_bar=false",
        cwd=tmp_path,
        env=_env(),
    )
    out = result.stdout
    assert "taskfit: lr_find in" in out and "suggestion:      lr=" in out, out
    lr = out.split("suggestion:      lr=")[1].split()[0]
    assert f"use it:          taskfit task.optimizer.lr={lr}" in out
    run_dir = next((tmp_path / "digits" / "runs").iterdir())
    assert (run_dir / "lr_find" / "lr_find.png").is_file()
    assert json.loads((run_dir / "lr_find" / "lr_find.json").read_text())["num_training"] == 30
    # no training run was started
    assert not any(p.name.startswith("version_") for p in run_dir.iterdir())


def test_on_a_terminal_the_command_shows_one_bar_of_its_own_then_the_suggestion(tmp_path):
    """`taskfit mode=lr_find` on a terminal: the range test's own bar (its steps, the current lr
    and smoothed loss), no epoch bars of the fit it runs underneath, then the suggestion and the
    override."""
    from test_console import on_a_terminal

    args = ["mode=lr_find", "lr_find.num_training=30", f"paths.log_dir={tmp_path}"]
    redraws = on_a_terminal(f"from taskfit.cli import main; main({args!r})", tmp_path)
    bar = (r"lr_find(?: \(stopped: the loss diverged\))?: +\d+%\|.*\| *(\d+)/30 "
           r"\[.*lr=([\d.e+-]+), loss=")
    bars = [m for line in redraws if (m := re.match(bar, line))]
    run_dir = next((tmp_path / "digits" / "runs").iterdir())
    curve = json.loads((run_dir / "lr_find" / "lr_find.json").read_text())
    assert bars and int(bars[-1].group(1)) == len(curve["lr"]), redraws  # the last bar: every step
    # the last step's lr
    assert float(bars[-1].group(2)) == pytest.approx(curve["lr"][-1], rel=1e-2)
    assert not [line for line in redraws if "Epoch" in line], redraws
    tail = redraws[redraws.index(bars[-1].string) + 1:]
    assert tail[0].startswith("taskfit: lr_find in")
    assert "use it:          taskfit task.optimizer.lr=" in tail[-1]
