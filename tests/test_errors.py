"""Bad input: one clear error naming what is wrong and how to fix it, raised before any training
step."""
from __future__ import annotations

import pytest
import torch
from taskfit import MisconfigurationError, TaskModule, TaskModuleError, Trainer
from tasks import RegressionTask
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class NoLoss(TaskModule):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 1)

    def forward(self, inputs):
        return self.lin(inputs)


class NoForward(TaskModule):
    def loss(self, outputs, targets):
        return outputs.sum()


class NoData(NoLoss):
    def loss(self, outputs, targets):
        return outputs.sum()


class NoSuper(TaskModule):
    def __init__(self):
        self.x = 1

    def forward(self, inputs):
        return inputs

    def loss(self, outputs, targets):
        return outputs


@pytest.mark.parametrize(
    "task, match",
    [
        (
            NoLoss(),
            r"NoLoss does not define `loss`, which fit needs[\s\S]*HINT: add `def loss\(self, "
            r"outputs, targets\)",
        ),
        (
            NoForward(),
            r"NoForward does not define `forward`[\s\S]*HINT: add `def forward\(self, "
            r"inputs\):`",
        ),
        (
            NoData(),
            r"NoData does not define `train_dataloader`[\s\S]*HINT: add `def "
            r"train_dataloader\(self\)",
        ),
        (
            nn.Linear(2, 2),
            r"expects a TaskModule, got Linear[\s\S]*HINT: subclass `taskfit.TaskModule`",
        ),
    ],
)
def test_missing_methods(task, match, quiet):
    with pytest.raises((TaskModuleError,), match=match):
        Trainer(max_epochs=1, **quiet).fit(task)


def test_missing_super_init(quiet):
    with pytest.raises(TaskModuleError, match=r"NoSuper.__init__ did not call "
                                              r"super\(\).__init__\(\)"):
        Trainer(max_epochs=1, **quiet).fit(NoSuper())


class BadLoss(RegressionTask):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def loss(self, outputs, targets):
        value = super().loss(outputs, targets)
        return {
            "float": value.item(),
            "vector": (outputs - targets) ** 2,
            "detached": value.detach(),
        }[self.kind]


@pytest.mark.parametrize(
    "kind, match",
    [
        (
            "float",
            r"BadLoss.loss returned float, not a tensor[\s\S]*HINT: return a scalar torch.Tensor",
        ),
        (
            "vector",
            r"BadLoss.loss returned a tensor of shape \(8,\), not a scalar[\s\S]*HINT: reduce it",
        ),
        ("detached", r"does not require grad[\s\S]*HINT"),
    ],
)
def test_bad_loss(kind, match, quiet):
    task = BadLoss(kind)
    before = [p.clone() for p in task.parameters()]
    with pytest.raises(TaskModuleError, match=match):
        Trainer(max_epochs=1, **quiet).fit(task)
    assert all(torch.equal(a, b) for a, b in zip(before, task.parameters()))  # no step was taken


class BadOptim(RegressionTask):
    def __init__(self, result):
        super().__init__()
        self.result = result

    def configure_optimizers(self):
        return self.result(self)


@pytest.mark.parametrize("result, match", [
    (lambda t: "adam", r"configure_optimizers returned str \('adam'\)[\s\S]*HINT: return an "
                       r"optimizer, `\(optimizer, sch"),
    (lambda t: {"opt": 1}, r"returned a dict with keys \['opt'\], without 'optimizer'"),
    (lambda t: (torch.optim.SGD(t.parameters(), lr=1), 5), r"returned int as a scheduler"),
    (lambda t: {"optimizer": torch.optim.SGD(t.parameters(), lr=1),
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(
                    torch.optim.SGD(t.parameters(), lr=1), 1), "interval": "batch"}},
     r"Scheduler interval 'batch' is not valid[\s\S]*HINT: use interval=\"step\""),
])
def test_bad_configure_optimizers(result, match, quiet):
    with pytest.raises((TaskModuleError, MisconfigurationError), match=match):
        Trainer(max_epochs=1, **quiet).fit(BadOptim(result))


def test_no_optimizer_at_all(quiet):
    class NoOpt(RegressionTask):
        configure_optimizers = TaskModule.configure_optimizers

    with pytest.raises(TaskModuleError, match=r"NoOpt has no optimizer[\s\S]*HINT: define `def "
                                              r"configure_optimizers"):
        Trainer(max_epochs=1, **quiet).fit(NoOpt())


class Triples(RegressionTask):
    def train_dataloader(self):
        x, y = self.data.tensors
        return DataLoader(TensorDataset(x, y, y), batch_size=8)


def test_unsplittable_batch(quiet):
    with pytest.raises(TaskModuleError, match=r"Cannot split the batch[\s\S]*sequence of length "
                                              r"3[\s\S]*HINT: [\s\S]*split_batch"):
        Trainer(max_epochs=1, **quiet).fit(Triples())


def test_max_epochs_below_minus_one_is_refused(quiet):
    """Lightning's max_epochs=-1 is "no epoch limit" (tests/test_flags.py fits with it); below it,
    an error."""
    with pytest.raises(MisconfigurationError, match=r"Trainer\(max_epochs=-2\) is not valid: "
                                                    r"expected an integer >= 0, -1 \(no epoch "
                                                    r"limit\) or None"):
        Trainer(max_epochs=-2, **quiet)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_epochs": -2}, r"Trainer\(max_epochs=-2\) is not valid: expected an integer >= 0"),
    ({"max_steps": 2.5}, r"Trainer\(max_steps=2.5\) is not valid"),
    ({"accumulate_grad_batches": 0}, r"accumulate_grad_batches=0\) is not valid: expected an "
                                     r"integer >= 1"),
    ({"limit_train_batches": 1.5}, r"limit_train_batches=1.5\) is not valid[\s\S]*float in \[0.0, "
                                   r"1.0\]"),
    ({"precision": "fp8"}, r"Unknown precision 'fp8'[\s\S]*HINT: use one of \"32\""),
    ({"accelerator": "tpu"}, r"Unknown accelerator 'tpu'[\s\S]*HINT: use one of 'auto', 'cpu', "
                             r"'cuda', 'mps'"),
    ({"strategy": "deepspeed"}, r"Unknown strategy 'deepspeed'"),
    ({"gradient_clip_algorithm": "max"}, r"gradient_clip_algorithm='max'\) is not "
                                         r"valid[\s\S]*'norm', 'value'"),
    ({"gradient_clip_val": -1}, r"gradient_clip_val=-1\) is not valid[\s\S]*HINT: pass a positive "
                                r"number"),
    ({"nonfinite_loss": "ignore"}, r"nonfinite_loss='ignore'\) is not valid"),
    ({"callbacks": [object()]}, r"got object, not a Callback[\s\S]*HINT: subclass "
                                r"`taskfit.callbacks.Callback`"),
])
def test_bad_trainer_arguments(kwargs, match):
    with pytest.raises(MisconfigurationError, match=match):
        Trainer(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_without_cuda():
    with pytest.raises(MisconfigurationError, match=r'accelerator="cuda" was requested but CUDA is '
                                                    r'not available[\s\S]*HINT'):
        Trainer(accelerator="cuda")


def test_empty_train_dataloader(quiet):
    class Empty(RegressionTask):
        def train_dataloader(self):
            return DataLoader(self.data, batch_size=100, drop_last=True)

    with pytest.raises(MisconfigurationError, match=r"yields no batches \(dataset of 64 samples, "
                                                    r"batch_size=100, drop_last=True\)[\s\S]*HINT"):
        Trainer(max_epochs=1, **quiet).fit(Empty())


def test_missing_eval_data_and_log_outside(quiet):
    with pytest.raises(TaskModuleError, match=r"Trainer.test needs data, but "
                                              r"RegressionTask.test_dataloader\(\) returned "
                                              r"None[\s\S]*HINT: define `def test_dataloader"):
        Trainer(**quiet).test(RegressionTask())
    with pytest.raises(MisconfigurationError, match=r"self.log\('x', ...\) was called outside a "
                                                    r"Trainer run"):
        RegressionTask().log("x", 1.0)


def test_bad_log_value(quiet):
    class LogsVector(RegressionTask):
        def loss(self, outputs, targets):
            self.log("vec", outputs)
            return super().loss(outputs, targets)

    with pytest.raises(MisconfigurationError, match=r"got a tensor of shape \(8,\); only scalars "
                                                    r"can be logged"):
        Trainer(max_epochs=1, **quiet).fit(LogsVector())


def test_bad_metrics_and_plateau_monitor(quiet):
    class BadMetrics(RegressionTask):
        def configure_metrics(self):
            return ["acc"]

    with pytest.raises(TaskModuleError, match=r"configure_metrics returned list[\s\S]*HINT: return "
                                              r"a dict"):
        Trainer(max_epochs=1, **quiet).fit(BadMetrics())

    class Plateau(RegressionTask):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt), "monitor": "val/acc"}}

    with pytest.raises(MisconfigurationError, match=r"ReduceLROnPlateau monitors 'val/acc', which "
                                                    r"has not been logged"):
        Trainer(max_epochs=1, **quiet).fit(Plateau())


def test_two_optimizers_are_refused(quiet):
    class TwoOpt(RegressionTask):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), lr=1), torch.optim.Adam(self.parameters())]

    with pytest.raises(TaskModuleError, match=r"returned 2 optimizers; with automatic optimization "
                                              r"taskfit steps one[\s\S]*HINT: set "
                                              r"`automatic_optimization = False`"):
        Trainer(max_epochs=1, **quiet).fit(TwoOpt())
