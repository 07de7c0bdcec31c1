"""The silent traps a newcomer hit, each now a clear message (or a curve where there was none)."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torchmetrics
from taskfit import MisconfigurationError, TaskModule, Trainer
from taskfit.loop.precision import Precision
from tasks import ClassifierTask, RegressionTask, regression_data
from torch.utils.data import DataLoader

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False)


def test_a_misspelt_trainer_argument_names_trainer_and_the_right_one():
    with pytest.raises(MisconfigurationError, match=r"(?s)^Trainer\(\) got an unknown argument 'max_epoch'\..*"
                                                    r"did you mean max_epochs\?"):
        Trainer(max_epoch=3)
    with pytest.raises(MisconfigurationError, match=r"Trainer\(\) takes keyword arguments only; got 1 positional"):
        Trainer(3)


class Misspelt(TaskModule):
    def __init__(self):
        super().__init__()
        self.net, self.data = torch.nn.Linear(4, 1), regression_data(32)

    def forward(self, inputs):
        return self.net(inputs).squeeze(-1)

    def loss(self, outputs, targets):
        return torch.nn.functional.mse_loss(outputs, targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=8)

    def val_dataloder(self):  # a typo: validation would be skipped without a word
        return DataLoader(self.data, batch_size=8)


def test_a_misspelt_hook_is_named_at_fit_start():
    with pytest.warns(UserWarning, match=r"Misspelt\.val_dataloder looks like a misspelling of val_dataloader; as "
                                         r"written, the Trainer never calls it\. HINT: rename it to val_dataloader"):
        Trainer(max_steps=1, **QUIET).fit(Misspelt())


def test_an_empty_validation_loader_says_validation_is_skipped():
    class Empty(RegressionTask):
        def val_dataloader(self):
            return DataLoader([], batch_size=4)

    with pytest.warns(UserWarning, match=r"val_dataloader\(\) yields no batches, so this fit does not validate"):
        trainer = Trainer(max_epochs=1, **QUIET)
        trainer.fit(Empty())
    assert not any(key.startswith("val/") for key in trainer.state.metrics)


def test_a_metric_and_a_logged_value_with_one_name_is_an_error_naming_both():
    class Clash(ClassifierTask):
        def configure_metrics(self):
            return {"acc": torchmetrics.Accuracy(task="multiclass", num_classes=3)}

        def loss(self, outputs, targets):
            if self.stage == "val":
                self.log("val/acc", (outputs.argmax(1) == targets).float().mean())
            return super().loss(outputs, targets)

    with pytest.raises(MisconfigurationError, match=r"'val/acc' is both the metric 'acc' of configure_metrics\(\) "
                                                    r"and a value logged with self\.log"):
        Trainer(max_epochs=1, **QUIET).fit(Clash())


def test_16_mixed_on_the_cpu_warns_once_with_the_measured_slowdown():
    import taskfit.loop.precision as precision

    precision._warned.clear()  # noqa: SLF001 - this process may have warned already (another test)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Precision("16-mixed", torch.device("cpu"))
        Precision("16-mixed", torch.device("cpu"))
        Precision("bf16-mixed", torch.device("cpu"))
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "13x slower" in messages[0] and 'use precision="bf16-mixed"' in messages[0]


def test_taskfit_without_scikit_learn_says_to_install_the_examples_extra(tmp_path):
    blocker = tmp_path / "blocked" / "sklearn"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('No module named sklearn (blocked by the test)')\n")
    env = dict(os.environ, PYTHONPATH=str(blocker.parent), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "taskfit", "trainer.max_epochs=1"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "scikit-learn is not installed" in result.stderr and "pip install 'taskfit[examples]'" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_short_taskfit_run_has_loss_and_learning_rate_curves(tmp_path):
    """2 epochs of the digits job (40 steps) with the default log_every_n_steps=50: every epoch's end logs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "taskfit", "trainer.max_epochs=2", "test=false",
                             "trainer.enable_model_summary=false"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    (events,) = Path(tmp_path, "logs").rglob("events.out.tfevents.*")
    run = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
    run.Reload()
    tags = run.Tags()["scalars"]
    # at Lightning's step: the batches that stepped before each epoch's last (19 and 39)
    assert [e.step for e in run.Scalars("train/loss")] == [19, 39]
    lr = next(tag for tag in tags if tag.startswith("vitals/lr/"))
    assert [e.step for e in run.Scalars(lr)] == [0, 20]  # its cosine steps per epoch: the rate each epoch starts with


class Cosine(RegressionTask):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=16)  # 2 epochs of 8 steps
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_extending_a_run_says_what_the_checkpointed_schedule_will_do(tmp_path):
    quiet = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, default_root_dir=str(tmp_path))
    Trainer(max_epochs=2, **quiet).fit(Cosine())
    with pytest.warns(UserWarning, match=r"(?s)with max_epochs 2 -> 4 .*schedulers continue from the checkpoint's "
                                         r"state.*CosineAnnealingLR: lr 0 now, 0\.1 at the end of this run .*16 more "
                                         r"steps.*Extending a run"):
        trainer = Trainer(max_epochs=4, **quiet)
        trainer.fit(Cosine(), ckpt_path="last")
    assert trainer.state.global_step == 32  # the run went on, as the message says
