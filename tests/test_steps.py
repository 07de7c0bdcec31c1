"""Beyond forward and loss (docs/steps.md): a task's own training/validation/test/predict steps, manual
optimization with several optimizers and schedulers, precision and ddp with them, and images to TensorBoard."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from step_tasks import DtypeProbe, ManualClassifier, OutputsProbe, StepClassifier
from taskfit import Trainer, seed_everything
from taskfit.callbacks import Callback
from taskfit.errors import MisconfigurationError, TaskModuleError
from tasks import ClassifierTask, one_process_of_ddp

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False)


def _fit(task_cls, **kwargs):
    seed_everything(0)
    task = task_cls(batch_size=kwargs.pop("batch_size", 16))
    trainer = Trainer(**{"max_epochs": 2, **QUIET, **kwargs})
    return task, trainer.fit(task), trainer


def test_own_steps_equal_the_default_steps_bitwise_and_callbacks_get_their_outputs():
    default, expected, _ = _fit(ClassifierTask)
    probe = OutputsProbe()
    own, metrics, trainer = _fit(StepClassifier, callbacks=[probe])
    for key, value in default.state_dict().items():
        assert torch.equal(own.state_dict()[key], value), key
    # a training_step of its own that logs (acc_batch): its keys only, as Lightning (no taskfit train/ or val/loss)
    assert metrics.keys() == expected.keys() - {"train/loss", "train/loss_epoch", "val/loss"}
    for key in ("train/acc_batch", "val/acc", "val/acc_batch"):
        assert metrics[key] == expected[key], key  # val/acc: stage_metrics updated inside validation_step
    assert len(probe.outputs) == trainer.state.global_step == 12 and probe.sizes[0] == 16
    first = probe.outputs[0]
    assert set(first) == {"loss", "logits"} and first["logits"].shape == (16, 3)
    assert not first["loss"].requires_grad and not first["logits"].requires_grad  # detached for the callbacks
    (tested,) = Trainer(**QUIET).test(own)
    (expected_test,) = Trainer(**QUIET).test(default)
    assert tested and tested == {k: v for k, v in expected_test.items() if k in tested}


def test_predict_step_returns_what_the_step_returns():
    class Predicting(StepClassifier):
        def predict_dataloader(self):
            return self.val_dataloader()

    task = Predicting()
    predictions = Trainer(**QUIET).predict(task)
    assert [p["index"] for p in predictions] == [0, 1, 2]
    assert torch.equal(torch.cat([p["classes"] for p in predictions]), task(task.val_data.tensors[0]).argmax(-1))


def test_a_training_step_that_returns_no_loss_is_one_clear_error():
    class NoLoss(ClassifierTask):
        def training_step(self, batch, batch_idx):
            return {"logits": self(batch[0])}

    with pytest.raises(TaskModuleError) as info:
        Trainer(max_epochs=1, **QUIET).fit(NoLoss())
    assert info.value.what == "NoLoss.training_step returned dict with keys ['logits'], not a loss."
    assert "'loss' key" in info.value.hint


def test_self_log_of_a_torchmetrics_object_is_computed_once_per_pass():
    import torchmetrics

    class MetricLogging(ClassifierTask):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)

        def validation_step(self, batch, batch_idx):
            logits = self(batch[0])
            self.val_acc.update(logits, batch[1])
            self.log("val/acc_obj", self.val_acc)

    task = MetricLogging()
    with pytest.warns(UserWarning, match=r"configure_metrics\(\)'s 'acc' was not updated by MetricLogging"):
        (metrics,) = Trainer(**QUIET).validate(task)
    twin = ClassifierTask()
    twin.load_state_dict(task.state_dict())
    (reference,) = Trainer(**QUIET).validate(twin)
    assert metrics["val/acc_obj"] == reference["val/acc"]
    assert "val/loss" not in metrics and "val/acc" not in metrics  # nothing made up from what the step did not do


def test_several_optimizers_need_manual_optimization():
    class Two(ClassifierTask):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]

    with pytest.raises(TaskModuleError) as info:
        Trainer(max_epochs=1, **QUIET).fit(Two())
    assert info.value.what == ("configure_optimizers returned 2 optimizers; with automatic optimization taskfit steps "
                               "one (as Lightning 2 does).")
    assert "automatic_optimization = False" in info.value.hint and "self.optimizers()" in info.value.hint


@pytest.mark.parametrize("setting", [dict(accumulate_grad_batches=2), dict(gradient_clip_val=1.0)])
def test_trainer_settings_that_manual_optimization_ignores_are_refused(setting):
    with pytest.raises(MisconfigurationError) as info:
        Trainer(max_epochs=1, **QUIET, **setting).fit(ManualClassifier())
    name = next(iter(setting))
    assert info.value.what == (f"Trainer({name}=...) does nothing for ManualClassifier, which sets "
                               "automatic_optimization = False.")


class StepCounter(Callback):
    def __init__(self):
        self.before_step = 0

    def on_before_optimizer_step(self, trainer, task, optimizer):
        self.before_step += 1


def test_manual_optimization_steps_two_optimizers_counts_steps_and_resumes_exactly(tmp_path):
    counter = StepCounter()
    task, metrics, trainer = _fit(ManualClassifier, max_epochs=3, callbacks=[counter], log_every_n_steps=4)
    assert trainer.state.global_step == 2 * 18 == counter.before_step  # global_step counts optimizer steps
    first, second = (s.scheduler for s in trainer.schedulers.configs)
    assert first.last_epoch == second.last_epoch == 18  # stepped by the task, once per batch, not by the Trainer
    # the step logs train/second_loss: its keys only, as Lightning (no taskfit train/loss beside it)
    assert {"train/second_loss", "val/acc"} <= metrics.keys() and "train/loss" not in metrics

    # stop after 2 epochs with a checkpoint, resume for the third: both optimizers and schedulers come back
    seed_everything(0)
    part = ManualClassifier()
    Trainer(max_epochs=2, **{**QUIET, "enable_checkpointing": True}, default_root_dir=str(tmp_path)).fit(part)
    saved = torch.load(tmp_path / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert isinstance(saved["optimizer"], list) and len(saved["optimizer"]) == 2
    assert saved["optimizer"][0]["state"] and saved["optimizer"][1]["state"]  # momentum and Adam moments
    resumed = ManualClassifier()
    trainer = Trainer(max_epochs=3, **QUIET, default_root_dir=str(tmp_path))
    trainer.fit(resumed, ckpt_path="last")
    assert trainer.state.global_step == 36
    for key, value in task.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_bf16_autocast_covers_a_tasks_own_step():
    task = DtypeProbe()
    Trainer(max_steps=2, precision="bf16-mixed", **QUIET).fit(task)
    assert task.seen == [torch.bfloat16, torch.bfloat16]


def test_16_mixed_manual_backward_scales_and_the_step_skips_overflowing_gradients():
    class Overflow(ManualClassifier):
        def training_step(self, batch, batch_idx):
            (opt, _), before = self.optimizers(), self.net[0].weight.detach().clone()
            loss = F.cross_entropy(self(batch[0]), batch[1])
            opt.zero_grad()
            self.manual_backward(loss * (float("inf") if batch_idx == 0 else 1.0))
            scale = self.trainer.precision_plugin.scaler.get_scale()
            self.results.append((opt.step(), scale, torch.equal(before, self.net[0].weight)))
            return loss

    task = Overflow()
    task.results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 16-mixed is slow on the CPU (warned once per process)
        Trainer(max_steps=2, precision="16-mixed", **QUIET).fit(task)
    (skipped, scale0, unchanged0), (stepped, scale1, unchanged1) = task.results[:2]
    assert scale0 == 65536.0 and not skipped and unchanged0  # the overflow: step skipped, weights untouched
    assert scale1 == 32768.0 and stepped and not unchanged1  # scale halved, the next step goes through


@pytest.mark.parametrize("task_cls", [StepClassifier, ManualClassifier])
def test_ddp_two_processes_equal_one_process_with_own_steps(task_cls, tmp_path):
    """2 ranks x batch 8 == 1 process x batch 16: the own training_step runs inside DDP's forward (automatic), or
    the optimizers average the gradients over ranks when they step (manual)."""
    # the reference trains on the order the ddp ranks see (DistributedSampler's)
    reference, expected, _ = _fit(one_process_of_ddp(task_cls), num_sanity_val_steps=0)
    seed_everything(0)
    task = task_cls(batch_size=8)
    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=2, num_sanity_val_steps=0, **QUIET,
                      default_root_dir=str(tmp_path))
    metrics = trainer.fit(task)
    for key, value in reference.state_dict().items():
        assert torch.allclose(task.state_dict()[key], value, atol=1e-6, rtol=0), key
    assert trainer.state.global_step == (24 if task_cls is ManualClassifier else 12)
    assert metrics.keys() == expected.keys() and "val/acc" in metrics
    for key in expected.keys() & {"val/acc", "val/loss", "train/loss_epoch"}:  # (step values: rank 0's)
        assert metrics[key] == pytest.approx(expected[key], abs=1e-6), key


def test_manual_optimization_whose_step_returns_nothing_logs_no_made_up_loss():
    class Silent(ManualClassifier):
        def training_step(self, batch, batch_idx):
            super().training_step(batch, batch_idx)  # steps both optimizers; its loss is not returned

    metrics = Trainer(max_epochs=1, **QUIET).fit(Silent())
    assert "train/loss" not in metrics and "train/loss_epoch" not in metrics  # not a constant 0.0
    assert "train/second_loss" in metrics  # a step value, published at the epoch's end (no interval fell in it)
