"""The core loop on one device: optimizers, schedulers, accumulation, precision, logging, metrics,
hooks."""
from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from taskfit import Trainer, seed_everything
from taskfit.callbacks import Callback, ProgressBar
from taskfit.data.loaders import batch_to_device
from tasks import ClassifierTask, RegressionTask, regression_data
from torch.utils.data import DataLoader


def params(task):
    return [p.detach().clone() for p in task.parameters()]


def test_digits_main_job_reaches_95_percent(quiet):
    from taskfit.examples.digits import DigitsTask

    seed_everything(0)
    trainer = Trainer(max_epochs=6, num_sanity_val_steps=0, **quiet)
    metrics = trainer.fit(DigitsTask())
    assert metrics["val/acc"] >= 0.95
    assert metrics["val/loss"] < metrics["train/loss_epoch"] * 10
    # 1,259 training images, batch 64
    assert trainer.state.epoch == 6 and trainer.state.global_step == 6 * 20


def test_fit_reduces_loss_and_counts_steps(quiet):
    task = RegressionTask(n=64, batch_size=8)
    trainer = Trainer(max_epochs=3, **quiet)
    first = trainer.validate(RegressionTask(n=64, val_n=64))[0]["val/loss"]
    metrics = trainer.fit(task)
    assert trainer.state.global_step == 3 * 8
    assert metrics["train/loss_epoch"] < first


def test_max_steps_stops_mid_epoch(quiet):
    trainer = Trainer(max_steps=5, **quiet)
    trainer.fit(RegressionTask())
    assert (
        trainer.state.global_step == 5
        and trainer.state.epoch == 0
        and trainer.state.batches_done == 5
    )


def test_gradient_accumulation_equals_large_batch(quiet):
    """k micro-batches of size b give the same update as one batch of k*b (mean losses, equal
    sizes)."""
    torch.manual_seed(0)
    small, large = RegressionTask(n=48, batch_size=4), RegressionTask(n=48, batch_size=12)
    large.load_state_dict(small.state_dict())
    Trainer(max_epochs=2, accumulate_grad_batches=3, **quiet).fit(small)
    Trainer(max_epochs=2, **quiet).fit(large)
    for a, b in zip(small.parameters(), large.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_last_short_accumulation_group_still_steps(quiet):
    # 10 batches, accumulate 4 -> groups of 4, 4, 2: three optimizer steps per epoch, the last over
    # 2 batches.
    torch.manual_seed(0)
    task = RegressionTask(n=40, batch_size=4)
    reference = RegressionTask(n=40, batch_size=16)  # batches of 16, 16, 8 = the same groups
    reference.load_state_dict(task.state_dict())
    trainer = Trainer(max_epochs=1, accumulate_grad_batches=4, **quiet)
    trainer.fit(task)
    Trainer(max_epochs=1, **quiet).fit(reference)
    assert trainer.state.global_step == 3
    for a, b in zip(task.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


class _Scheduled(RegressionTask):
    def __init__(self, form: str = "tuple", **kw):
        super().__init__(**kw)
        self.form = form

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        if self.form == "tuple":
            return opt, sched
        if self.form == "step":
            return {
                "optimizer": opt,
                "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 2},
            }
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val/loss"}}


def test_scheduler_epoch_interval(quiet):
    trainer = Trainer(max_epochs=3, **quiet)
    trainer.fit(_Scheduled("tuple", lr=1.0))
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.125)


def test_scheduler_step_interval_with_frequency(quiet):
    trainer = Trainer(max_steps=8, **quiet)
    trainer.fit(_Scheduled("step"))
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 ** 4)


def test_reduce_on_plateau_reads_monitor(quiet):
    task = _Scheduled("plateau", val_n=16, lr=1.0)
    trainer = Trainer(max_epochs=4, **quiet)
    # lr=1.0 on this data diverges: val/loss rises and the plateau scheduler cuts the lr
    trainer.fit(task)
    assert "val/loss" in trainer.state.metrics
    assert trainer.optimizer.param_groups[0]["lr"] < 1.0


def test_bf16_autocast_on_cpu(quiet):
    trainer = Trainer(max_epochs=1, precision="bf16-mixed", **quiet)
    metrics = trainer.fit(ClassifierTask())
    assert torch.isfinite(torch.tensor(metrics["train/loss_epoch"]))
    assert trainer.precision_plugin.scaler is None


class _GradNorms(Callback):
    def __init__(self):
        self.norms = []

    def on_before_optimizer_step(self, trainer, task, optimizer):
        self.norms.append(
            torch.norm(torch.stack([p.grad.norm() for p in task.parameters()])).item()
        )


def test_16_mixed_unscales_before_clipping(quiet):
    # seeded: the shuffled order is drawn from the global RNG (as Lightning's), which earlier tests
    # moved
    torch.manual_seed(0)
    seen = _GradNorms()
    task = RegressionTask(lr=0.01)
    before = torch.cat([p.detach().flatten().clone() for p in task.parameters()])
    trainer = Trainer(
        max_steps=4, precision="16-mixed", gradient_clip_val=0.01, callbacks=[seen], **quiet
    )
    trainer.fit(task)
    after = torch.cat([p.detach().flatten() for p in task.parameters()])
    assert trainer.precision_plugin.scaler is not None
    # on_before_optimizer_step sees unscaled gradients: norms of a few units, not scaled by 2**16.
    # (The first steps overflow float16 at the initial scale and are skipped by the GradScaler:
    # inf/nan norms.)
    finite = [n for n in seen.norms if n == n and n != float("inf")]
    assert len(seen.norms) == 4 and finite and all(0.1 < n < 1e3 for n in finite)
    # SGD with clipped (norm <= 0.01) gradients moves the parameters by at most lr * 0.01 per step.
    assert 0 < (after - before).norm() <= 4 * 0.01 * 0.01 * (1 + 1e-3)


class _InfOnce(RegressionTask):
    def loss(self, outputs, targets):
        # small enough not to overflow float16 at scale 2**16
        loss = super().loss(outputs, targets) * 1e-3
        return loss * float("inf") if self._step == 0 else loss

    def forward(self, inputs):
        self._step = getattr(self, "_count", 0)
        self._count = self._step + 1
        return super().forward(inputs)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        return {
            "optimizer": opt,
            "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                "interval": "step",
            },
        }


def test_skipped_inf_step_does_not_advance_scheduler(quiet):
    trainer = Trainer(max_steps=3, precision="16-mixed", log_every_n_steps=100, **quiet)
    trainer.fit(_InfOnce())
    # 3 steps, the first skipped by the GradScaler: the scheduler stepped twice.
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.25)


def test_self_log_epoch_mean_and_prefix(quiet):
    seen = []

    class Recorder(Callback):
        def on_log(self, trainer, task, metrics):
            seen.append(dict(metrics))

    class Both(ClassifierTask):
        # per step and per epoch (Lightning's defaults: step only in training)
        def loss(self, outputs, targets):
            if self.stage == "train":
                self.log(
                    "acc_both",
                    (outputs.argmax(-1) == targets).float().mean(),
                    on_step=True,
                    on_epoch=True,
                )
            return super().loss(outputs, targets)

    trainer = Trainer(max_epochs=1, log_every_n_steps=1, callbacks=[Recorder()], **quiet)
    trainer.fit(Both(n=32, batch_size=8))
    steps = [m["train/acc_batch"] for m in seen if "train/acc_batch" in m]
    # the default: per step
    assert len(steps) == 4 and "train/acc_batch_epoch" not in trainer.state.metrics
    both = [m["acc_both_step"] for m in seen if "acc_both_step" in m]
    assert both == steps and trainer.state.metrics["acc_both_epoch"] == pytest.approx(
        sum(steps) / 4, abs=1e-6
    )
    # Lightning's alias
    assert trainer.state.metrics["acc_both"] == trainer.state.metrics["acc_both_epoch"]
    assert "acc_both" in trainer.state.metrics and not any(
        k.endswith("/acc_both") for k in trainer.state.metrics
    )
    # a name is published as logged: no stage prefix (Lightning's meaning)


def test_validation_metrics_match_manual_computation(quiet):
    task = ClassifierTask()
    trainer = Trainer(max_epochs=1, **quiet)
    trainer.fit(task)
    result = trainer.validate(task)[0]
    task.eval()
    x, y = task.val_data.tensors
    with torch.no_grad():
        out = task(x)
    assert result["val/acc"] == pytest.approx((out.argmax(-1) == y).float().mean().item(), abs=1e-6)
    # sample-weighted
    assert result["val/loss"] == pytest.approx(F.cross_entropy(out, y).item(), abs=1e-5)
    assert trainer.test(task)[0]["test/acc"] == pytest.approx(result["val/acc"])


def test_predict_returns_outputs(quiet):
    class Predicting(RegressionTask):
        def predict_dataloader(self):
            return DataLoader(regression_data(20).tensors[0], batch_size=8)

    task = Predicting()
    out = Trainer(**quiet).predict(task)
    assert [o.shape[0] for o in out] == [8, 8, 4]
    torch.testing.assert_close(torch.cat(out), task(regression_data(20).tensors[0]).detach())


def test_dict_batches_and_custom_split(quiet):
    class DictBatches(RegressionTask):
        def train_dataloader(self):
            x, y = self.data.tensors
            return DataLoader([{"inputs": a, "targets": b} for a, b in zip(x, y)], batch_size=8)

    trainer = Trainer(max_epochs=1, **quiet)
    trainer.fit(DictBatches())
    assert trainer.state.global_step == 8


def test_fast_dev_run_and_overfit_batches(quiet):
    trainer = Trainer(fast_dev_run=True, **quiet)
    trainer.fit(RegressionTask(val_n=16))
    assert trainer.state.global_step == 1 and trainer.max_epochs == 1
    trainer = Trainer(max_epochs=30, overfit_batches=2, num_sanity_val_steps=0, **quiet)
    trainer.fit(RegressionTask(lr=0.1, val_n=16))
    assert trainer.state.global_step == 60
    assert trainer.state.metrics["val/loss"] < 0.05  # validated on the same 2 training batches


def test_seed_everything_reproduces_and_deterministic_flag(quiet):
    seen = []

    class Probe(Callback):
        def on_fit_start(self, trainer, task):
            seen.append(torch.are_deterministic_algorithms_enabled())

    runs = []
    for _ in range(2):
        seed_everything(7)
        task = RegressionTask(shuffle=True, dropout=0.2)
        Trainer(max_epochs=2, deterministic=True, callbacks=[Probe()], **quiet).fit(task)
        runs.append(params(task))
    # restored after fit
    assert seen == [True, True] and not torch.are_deterministic_algorithms_enabled()
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_batch_to_device_nested():
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    batch = {"x": [torch.ones(2), (torch.zeros(1), "keep")], "p": Pair(torch.ones(1), 3)}
    moved = batch_to_device(batch, torch.device("cpu"))
    assert (
        isinstance(moved["p"], Pair)
        and moved["x"][1][1] == "keep"
        and torch.equal(moved["x"][0], torch.ones(2))
    )


def test_cpu_skips_batch_to_device_unless_a_strategy_overrides_it(quiet):
    from taskfit.strategies.base import Strategy

    class Halve(Strategy):  # a custom strategy that transforms batches: it must run even on the CPU
        def batch_to_device(self, batch):
            inputs, targets = super().batch_to_device(batch)
            self.calls = getattr(self, "calls", 0) + 1
            return inputs * 0, targets

    plain = Trainer(max_steps=2, **quiet)
    plain.fit(RegressionTask())
    assert not plain.strategy.moves_batches  # the built-in strategy: no call per step on the CPU
    halve = Halve("cpu", "auto")
    trainer = Trainer(max_steps=2, strategy=halve, **quiet)
    trainer.fit(RegressionTask())
    assert halve.calls == 2


def test_progress_bar_non_terminal_prints_one_line_per_epoch():
    stream = io.StringIO()
    trainer = Trainer(
        max_epochs=3,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[ProgressBar(stream=stream)],
        log_every_n_steps=2,
    )
    trainer.fit(RegressionTask())
    lines = stream.getvalue().strip().splitlines()
    assert (
        len(lines) == 3
        and lines[0].startswith("Epoch 0/2")
        and "8/8" in lines[0]
        and "loss=" in lines[0]
    )


def test_model_summary_printed(capsys):
    Trainer(max_steps=1, enable_progress_bar=False, enable_checkpointing=False, logger=False).fit(
        ClassifierTask()
    )
    out = capsys.readouterr().out
    assert "net   Sequential  195" in out and "195 trainable params" in out


def test_nonfinite_loss_raises_with_step_and_epoch(quiet):
    from taskfit import NonFiniteLossError

    class Exploding(RegressionTask):
        def loss(self, outputs, targets):
            return super().loss(outputs, targets) * (float("nan") if self.stage == "train" and
                                                     self._calls() == 5 else 1.0)

        def _calls(self):
            self.__dict__["n"] = self.__dict__.get("n", 0) + 1
            return self.__dict__["n"]

    with pytest.raises(NonFiniteLossError, match=r"loss is nan at epoch 0, batch 4 \(global step "
                                                 r"4\)"):
        Trainer(max_epochs=2, log_every_n_steps=3, **quiet).fit(Exploding())
    trainer = Trainer(max_epochs=1, nonfinite_loss="skip", **quiet)
    task = Exploding()
    trainer.fit(task)
    assert trainer.state.skipped_steps == 1 and trainer.state.global_step == 7
    assert all(torch.isfinite(p).all() for p in task.parameters())


def test_huge_finite_losses_are_not_reported_as_nonfinite(quiet):
    """The NaN/Inf check reads the interval's sum; finite losses whose sum overflows float32 are not
    an error."""

    class Huge(RegressionTask):
        def loss(self, outputs, targets):  # 3e38: finite in float32, but two of them sum to inf
            return super().loss(outputs, targets) * 0 + 3e38

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    trainer = Trainer(max_epochs=1, log_every_n_steps=3, **quiet)
    trainer.fit(Huge())
    assert trainer.state.metrics["train/loss"] == pytest.approx(3e38, rel=1e-6)


class LogInForward(ClassifierTask):
    def forward(self, inputs):
        outputs = super().forward(inputs)
        # inside the compiled graph's code: a graph break, run eagerly
        self.log("mean_logit", outputs.mean())
        return outputs


def test_compile_on_the_cpu_runs_self_log_eagerly_with_the_same_metrics(quiet):
    runs = []
    for compile in (False, True):
        seed_everything(0)
        runs.append(Trainer(max_epochs=2, compile=compile, **quiet).fit(LogInForward()))
    assert "mean_logit" in runs[1] and runs[0].keys() == runs[1].keys()
    assert runs[1] == pytest.approx(runs[0], abs=1e-6)
