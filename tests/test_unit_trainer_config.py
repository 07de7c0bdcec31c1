"""The Trainer's configuration as one frozen object (trainer_config.py): built once from
``Trainer.__init__``'s arguments (the signature is the one source of names and defaults), replaced
rather than changed, read back under Lightning's names, and held by each run as ``run.config``."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from taskfit import TaskModule, Trainer
from taskfit.trainer_config import Limits, TrainerConfig
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
             logger=False)
# Trainer arguments that are not settings of a run: what they build (the strategy, the callbacks)
# is the Trainer's
BUILDS = {"accelerator", "devices", "strategy", "callbacks", "profiler", "enable_progress_bar",
          "enable_model_summary", "enable_checkpointing", "logger"}
# Fields whose name is not one argument's: the normalized form of several, or a clearer name
DERIVED = {"limits": {"limit_train_batches", "limit_val_batches", "limit_test_batches",
                      "limit_predict_batches"},
           "command_config": {"config"}}


class Line(TaskModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, targets)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=4)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_every_field_is_an_argument_of_the_trainer_and_has_no_default_of_its_own():
    arguments = set(inspect.signature(Trainer.__init__).parameters) - {"self"}
    fields = {f.name: f for f in dataclasses.fields(TrainerConfig)}
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in fields.values())
    covered = {name for name in fields if name in arguments} | set().union(*DERIVED.values())
    assert set(fields) - arguments == set(DERIVED)
    assert arguments - covered == BUILDS


def test_the_configuration_is_frozen_and_read_under_lightnings_names():
    trainer = Trainer(max_epochs=3, precision="bf16", accumulate_grad_batches=2,
                      limit_val_batches=0.5, **QUIET)
    config = trainer.trainer_config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_epochs = 4  # type: ignore[misc]
    assert (trainer.max_epochs, trainer.precision_name) == (3, "bf16-mixed")
    assert trainer.accumulate_grad_batches == 2
    assert trainer.limits == Limits(1.0, 0.5, 1.0, 1.0) and trainer.limits["val"] == 0.5
    assert trainer.config is None and config.command_config is None


def test_fast_dev_run_and_overfit_batches_replace_the_object():
    trainer = Trainer(fast_dev_run=2, overfit_batches=3, max_epochs=7, **QUIET)
    assert trainer.limits == Limits(train=3, val=3, test=2, predict=2)
    assert (trainer.max_epochs, trainer.num_sanity_val_steps) == (1, 0)
    assert trainer.log_every_n_steps == 1


def test_assigning_a_setting_gives_a_new_object_and_a_run_keeps_the_one_it_started_with():
    trainer = Trainer(max_epochs=1, **QUIET)
    first = trainer.trainer_config
    trainer.max_epochs = 2
    assert trainer.trainer_config is not first and first.max_epochs == 1 and trainer.max_epochs == 2
    trainer.fit(Line())
    assert trainer.run.config is trainer.trainer_config and trainer.current_epoch == 2
    trainer.max_epochs = 5
    assert trainer.run.config.max_epochs == 2
