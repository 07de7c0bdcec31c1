"""Lightning's overrides of the automatic step are called (optimizer_step, optimizer_zero_grad, backward,
configure_gradient_clipping, lr_scheduler_step), and its hooks are methods of Callback, TaskModule and DataModule.

The reference for each is what Lightning 2.6 does: its LightningModule calls ``optimizer_step(epoch, batch_idx,
optimizer, optimizer_closure)`` once per optimizer step, ``optimizer_zero_grad(epoch, batch_idx, optimizer)`` at a
group's first batch, ``backward(loss)`` per batch, ``configure_gradient_clipping(optimizer, gradient_clip_val,
gradient_clip_algorithm)`` before every step, ``lr_scheduler_step(scheduler, metric)`` for every scheduler step.
"""
from __future__ import annotations

import pytest
import torch
from taskfit import DataModule, MisconfigurationError, TaskModule, Trainer, seed_everything
from taskfit.callbacks import Callback, EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader

from tasks import RegressionTask, regression_data

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False,
             num_sanity_val_steps=0)
WARMUP = 6


class Warmup(RegressionTask):
    """Lightning's documented warm-up: the learning rate scaled up over the first steps in optimizer_step."""

    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.lrs: list[float] = []

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        if self.trainer.global_step < WARMUP:
            scale = min(1.0, float(self.trainer.global_step + 1) / WARMUP)
            for group in optimizer.param_groups:
                group["lr"] = scale * self.lr
        self.lrs.append(optimizer.param_groups[0]["lr"])


def hand_warmup() -> torch.nn.Module:
    """The same warm-up, written by hand: the reference for the Trainer's weights."""
    seed_everything(0)
    task = RegressionTask(lr=0.05)
    optimizer = torch.optim.SGD(task.parameters(), lr=0.05)
    step = 0
    for _ in range(2):
        for x, y in DataLoader(regression_data(64, 4), batch_size=8):
            optimizer.zero_grad(set_to_none=True)
            task.loss(task(x), y).backward()
            optimizer.step()
            if step < WARMUP:
                for group in optimizer.param_groups:
                    group["lr"] = min(1.0, float(step + 1) / WARMUP) * 0.05
            step += 1
    return task


def test_optimizer_step_override_warms_up_the_learning_rate_as_written_by_hand():
    seed_everything(0)
    task = Warmup()
    Trainer(max_epochs=2, seed=0, **QUIET).fit(task)
    assert task.lrs[:WARMUP] == pytest.approx([0.05 * (i + 1) / WARMUP for i in range(WARMUP)])
    assert task.lrs[WARMUP:] == [0.05] * (16 - WARMUP)  # 8 batches per epoch, 2 epochs
    reference = hand_warmup()
    for mine, theirs in zip(task.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)


def test_optimizer_step_that_never_runs_the_closure_is_refused():
    class Skips(RegressionTask):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            pass

    with pytest.raises(MisconfigurationError, match=r"Skips.optimizer_step did not run the optimizer closure"):
        Trainer(max_epochs=1, **QUIET).fit(Skips())


def test_optimizer_step_closure_returns_the_loss_and_a_skipped_step_leaves_the_weights():
    class EveryOther(RegressionTask):
        def __init__(self) -> None:
            super().__init__()
            self.losses: list[float] = []

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            if batch_idx % 2:
                self.losses.append(float(optimizer_closure()))  # the closure run, the step skipped
            else:
                optimizer.step(closure=optimizer_closure)

    task = EveryOther()
    before = [p.detach().clone() for p in task.parameters()]
    trainer = Trainer(max_epochs=1, limit_train_batches=2, **QUIET)
    trainer.fit(task)
    assert len(task.losses) == 1 and task.losses[0] > 0
    assert trainer.global_step == 2  # one optimizer_step call per step, as Lightning counts them
    assert any(not torch.equal(a, b) for a, b in zip(before, task.parameters()))


def test_zero_grad_backward_and_clipping_overrides_are_called_with_lightnings_arguments():
    calls: list[tuple] = []

    class Own(RegressionTask):
        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            calls.append(("zero_grad", epoch, batch_idx, optimizer is self.trainer.optimizer))
            optimizer.zero_grad()

        def backward(self, loss, *args, **kwargs):
            calls.append(("backward", loss.requires_grad))
            super().backward(loss, *args, **kwargs)

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            calls.append(("clip", gradient_clip_val, gradient_clip_algorithm))
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters()])
            calls.append(("norm", float(norm) <= gradient_clip_val + 1e-6))

    Trainer(max_epochs=1, limit_train_batches=4, accumulate_grad_batches=2, gradient_clip_val=0.01,
            gradient_clip_algorithm="norm", **QUIET).fit(Own())
    assert [c for c in calls if c[0] == "zero_grad"] == [("zero_grad", 0, 0, True), ("zero_grad", 0, 2, True)]
    assert calls.count(("backward", True)) == 4
    assert calls.count(("clip", 0.01, "norm")) == 2 and calls.count(("norm", True)) == 2


def test_lr_scheduler_step_override_gets_each_scheduler_and_its_metric():
    seen: list[tuple] = []

    class Plateau(RegressionTask):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
            step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
            return [optimizer], [{"scheduler": plateau, "monitor": "train/loss_epoch"}, step]

        def lr_scheduler_step(self, scheduler, metric):
            seen.append((type(scheduler).__name__, metric is None or isinstance(metric, float)))
            super().lr_scheduler_step(scheduler, metric)

    Trainer(max_epochs=2, **QUIET).fit(Plateau())
    assert seen == [("ReduceLROnPlateau", True), ("StepLR", True)] * 2


def test_a_task_that_overrides_nothing_gets_the_plain_calls():
    trainer = Trainer(max_epochs=1, limit_train_batches=1, **QUIET)
    trainer.fit(RegressionTask())
    run = trainer.run
    assert run.task_optimizer_step is None and run.zero_grad == trainer.optimizer.zero_grad
    assert run.backward is torch.Tensor.backward and run.optimizer_step == trainer.optimizer.step
    assert run.schedulers.lr_scheduler_step is None


def test_manual_optimization_names_the_automatic_overrides_it_does_not_call():
    class Manual(RegressionTask):
        automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            loss = self.loss(self(batch[0]), batch[1])
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            return loss

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            raise AssertionError("not called with manual optimization")

    with pytest.warns(UserWarning, match=r"`Manual.optimizer_step`.*automatic_optimization = False"):
        Trainer(max_epochs=1, limit_train_batches=2, **QUIET).fit(Manual())


# ---- hooks are methods: super() works, and a hook nobody overrides costs nothing ---------------------------------
def test_super_calls_of_lightnings_hooks_work_on_callbacks_tasks_and_data_modules():
    order: list[str] = []

    class Mine(Callback):
        def setup(self, trainer, pl_module, stage):
            super().setup(trainer, pl_module, stage)
            order.append(f"callback setup {stage}")

        def on_train_start(self, trainer, pl_module):
            super().on_train_start(trainer, pl_module)
            order.append("callback on_train_start")

        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    class Task(RegressionTask):
        def setup(self, stage):
            super().setup(stage)
            order.append(f"task setup {stage}")

        def on_train_epoch_end(self):
            super().on_train_epoch_end()
            order.append("task on_train_epoch_end")

    class Data(DataModule):
        def setup(self, stage):
            super().setup(stage)
            order.append(f"data setup {stage}")

        def train_dataloader(self):
            return DataLoader(regression_data(16, 4), batch_size=8)

    Trainer(max_epochs=1, callbacks=[Mine()], **QUIET).fit(Task(), datamodule=Data())
    assert order == ["data setup fit", "callback setup fit", "task setup fit", "callback on_train_start",
                     "task on_train_epoch_end"]


def test_the_built_in_callbacks_answer_every_lightning_hook():
    """Subclasses of ModelCheckpoint and EarlyStopping call super() on hooks the parent does not use."""
    trainer = Trainer(max_epochs=1, **QUIET)
    for callback in (ModelCheckpoint(), EarlyStopping(monitor="val/loss")):
        callback.setup(trainer, RegressionTask(), "fit")
        callback.on_train_start(trainer, RegressionTask())
        callback.on_before_backward(trainer, RegressionTask(), torch.tensor(1.0))


def test_hooks_kept_from_the_base_classes_are_not_in_the_table():
    trainer = Trainer(max_epochs=1, limit_train_batches=1, callbacks=[Callback()], **QUIET)
    trainer.fit(RegressionTask())
    for hook in ("setup", "on_train_start", "on_before_backward", "on_validation_batch_end", "on_load_checkpoint"):
        assert trainer.hooks[hook] == [], hook
    assert TaskModule.optimizer_step.default_hook and TaskModule.on_train_start.default_hook
