"""An error in the user's code keeps its own message and gains one line saying where (the task's method, the batch),
with a traceback of the user's and torch's frames, not taskfit's (TASKFIT_FULL_TRACEBACK=1 keeps them)."""
from __future__ import annotations

import os
import traceback

import pytest
import torch
from taskfit import Trainer
from torch import nn

from tasks import RegressionTask

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False)
TASKFIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class WrongShape(RegressionTask):
    """From batch 2 on, the batch is widened by a column: the linear layer refuses it, as a shape bug does."""

    def forward(self, inputs):
        if self.trainer.state.stage == "train" and self.trainer.state.batch_idx >= 2:
            inputs = torch.cat([inputs, inputs[:, :1]], dim=1)
        return self.net(inputs).squeeze(-1)


def _frames(exc: BaseException) -> list[tuple[str, str]]:
    return [(os.path.relpath(f.filename, TASKFIT), f.name) for f in traceback.extract_tb(exc.__traceback__)]


def test_a_shape_error_in_forward_names_the_method_and_batch_and_hides_taskfits_frames(monkeypatch):
    monkeypatch.delenv("TASKFIT_FULL_TRACEBACK", raising=False)
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied") as caught:
        Trainer(max_epochs=1, num_sanity_val_steps=0, **QUIET).fit(WrongShape())
    exc = caught.value
    assert exc.__notes__ == ["taskfit: raised in WrongShape.forward (test_user_errors.py:25), training batch 2 of "
                             "epoch 0 (fit). TASKFIT_FULL_TRACEBACK=1 shows taskfit's frames too."]
    frames = _frames(exc)
    ours = [name for path, name in frames if path.startswith(("trainer", "callbacks"))]
    assert ours == ["fit"]  # the entry point the user called, nothing of the loop
    assert ("tests/test_user_errors.py", "forward") in frames  # the user's own frame stays
    assert any("torch" in path for path, _ in frames)  # and torch's, down to where it raised


def test_the_full_traceback_on_request_and_validation_batches(monkeypatch):
    class BadValidation(RegressionTask):
        def validation_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise ValueError("a bug in my validation step")
            return self.loss(self(batch[0]), batch[1])

    monkeypatch.setenv("TASKFIT_FULL_TRACEBACK", "1")
    with pytest.raises(ValueError, match="a bug in my validation step") as caught:
        Trainer(max_epochs=1, num_sanity_val_steps=0, **QUIET).fit(BadValidation(val_n=32))
    assert "BadValidation.validation_step" in caught.value.__notes__[0]
    assert "validation batch 1 of epoch 0 (fit)" in caught.value.__notes__[0]
    assert "_train_step" in [name for _, name in _frames(caught.value)] or "_fit" in [
        name for _, name in _frames(caught.value)]  # taskfit's frames kept on request


def test_taskfits_own_errors_and_setup_errors_are_left_as_they_are():
    class NoOptimizer(RegressionTask):
        def configure_optimizers(self):
            raise KeyError("my config")

    with pytest.raises(KeyError) as caught:
        Trainer(max_epochs=1, **QUIET).fit(NoOptimizer())
    assert not getattr(caught.value, "__notes__", None)  # not during a pass over batches: nothing to add

    class Linear(RegressionTask):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)

    Trainer(max_epochs=1, limit_train_batches=1, **QUIET).fit(Linear())  # and a run without an error is untouched
